"""Supervised fine-tuning of a compiled `kind: sft` plan: one process per rank under torchrun, no Ray, no engines.

    torchrun --nnodes N --nproc-per-node P ... -m runtime.sft PLAN.json     (the plan's `sft.command`)

`run_sft` is the whole job, identical on every rank, as the stages of `SftJob` (torchtune's recipe shape):
setup (process group of the plan's backend; tokenizer and data, `runtime/sft_data.py`: chat template, loss mask on
assistant replies only; FSDP2 model, AdamW + scheduler from the FSDP core shared with the RL trainer,
`runtime/fsdp.py`; resume; metrics) -> train (epochs of optimizer steps, each `grad_accum` micro-batches of
`micro_batch_size` rows per rank, packed into one row each with `actor.packing`; evaluate and save on their
cadences) -> export (HF) -> cleanup.

The model comes from the plan's backend (`runtime/models/`: transformers' under FSDP2, or nemo-automodel's own
class on the same mesh), routers frozen with `freeze_moe_router`; a MoE model adds `aux_loss_coef` x its
load-balancing loss per micro-batch / micro-batches (Molt B32, as the RL trainer does; `train/loss` stays the NLL).

Every number comes from the plan's `sft` slice (batch sizes, accumulation, steps, cadences, optimizer); nothing is
re-derived. The loss is Molt's global token mean (`runtime.algo.losses.sft_loss`): every rank divides its summed
reply-token NLL by the reply-token count of the whole optimizer step (all micro-batches, all ranks), times dp,
because FSDP averages gradients over the data-parallel ranks (under HSDP over its replicas and shards alike). Under
context parallelism the cp ranks of a data-parallel rank take its rows and split each micro-batch's sequences, the
log-probs put back in row order (`runtime/context_parallel.py`); under tensor parallelism its tp ranks take the same
rows whole (HSDP too: tests/runtime/test_sft_tensor_parallel.py). Either way the sampler, the token count and the dp
factor are the data-parallel ranks' (the plan's dp: dp_replicate x dp_shard).

Data (`runtime/sft_data.py`, Molt `datasets/sft_dataset.py`): `input_key` holds a string (one user turn) or chat messages; `output_key`
a string (the assistant reply), one message dict, or messages; without `output_key` the assistant turns come from
the input messages. Only assistant replies (their text and the end-of-turn marker the template puts after them)
count in the loss; with `train_on_last_turn_only` only the last one. Rows are cut to `max_len` tokens. Rows with no
assistant turn, or whose replies lie wholly beyond `max_len`, are dropped and counted (Molt keeps all-zero-mask
rows with a warning; they train nothing, so dropping them changes no gradient).

Several datasets are read one after the other, or with `data.dataset_probs` interleaved as Molt blends them
(`datasets.interleave_datasets`, all_exhausted, seeded with `train.seed`; the compiler counted the same rows).
Rows with images (`data.image_key`, VLM SFT: `runtime/sft_vlm.py`) carry their pixel values and grids into the
VLM forward; they are never packed (the compiler refuses packing on them, DATA002).
What this job does not do (Muon, mesh axes it does not shard over, the automodel rows `sft-automodel-*`)
the compiler refuses (CAP001, the `sft-*` rows of schemas/capabilities.py) and `runtime.plan_file` checks again at
start. SIGTERM (torchrun forwards it) stops after the current optimizer step, saves a
DCP checkpoint when the plan has a checkpoint cadence, and exits 130. With an eval set, the last step is
evaluated too (when the cadence does not land on it), so every run ends with an eval loss.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from runtime import context_parallel, fsdp, models, moe, vlm
from runtime.sft_data import SftError, collate, load_examples, reply_logprobs
from schemas.plan import Plan


@dataclass
class SftResult:
    status: str            # finished | stopped
    step: int
    first_loss: float | None
    last_loss: float | None
    eval_loss: float | None
    step_time: float | None
    last_checkpoint: str | None
    hf_dir: str | None
    metrics_path: str | None
    plot_path: str | None
    rows: int
    dropped: dict[str, int]


def run_sft(plan: Plan) -> SftResult:
    """The SFT job on this rank (torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT)."""
    recipe = SftJob(plan)
    recipe.setup()
    recipe.train()
    recipe.export()
    return recipe.cleanup()


class SftJob:
    """One rank's SFT job in stages; each reads the plan's `sft` slice as it is."""

    def __init__(self, plan: Plan):
        self.plan, self.s = plan, plan.sft
        self.stop_requested = False
        self.step, self.last_ckpt, self.status = 0, None, "finished"
        self.first_loss = self.last_loss = self.eval_loss = None
        self.step_times: list[float] = []
        self.hf_dir = None
        self.image_token_id: int | None = None  # VLM rows: the checkpoint's image placeholder id (`setup`)

    # ----------------------------------------------------------------------------------------------- setup
    def setup(self) -> None:
        """Signals, process group, tokenizer and data, model and optimizer, resume, metrics sink."""
        s, t = self.s, self.s.trainer
        # A signal only sets a flag, acted on between optimizer steps (all ranks agree through an all-reduce).
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        self._init_process_group()
        self.backend = models.backend(s.model)
        meshes = self.backend.device_mesh(s.device, self.world, t.mesh)
        # the cp x tp ranks of one data-parallel rank take its rows, each cp rank its cut of their positions, which
        # its tp ranks share (consecutive ranks: tp is nemo-automodel's innermost axis, cp the next;
        # runtime/context_parallel.py)
        self.cp_mesh, self.dp = meshes.cp, t.dp
        self.cp = 1 if meshes.cp is None else meshes.cp.size()
        self.dp_rank = context_parallel.dp_rank(self.rank, meshes.cp, meshes.tp)
        self.tp_world = None if meshes.tp is None else meshes.fsdp
        self.replicas = self.cp * (1 if meshes.tp is None else meshes.tp.size())
        torch.manual_seed(t.seed)
        if t.full_determinism:
            from transformers import enable_full_determinism

            enable_full_determinism(t.seed)
        self._load_data()
        self.model = self.backend.build(s.model, s.model.path, meshes, self.device, freeze_router=t.freeze_moe_router,
                                        lora=t.lora, freeze_visual_encoder=t.freeze_visual_encoder, offload=t.offload,
                                        sequence_parallel=t.sequence_parallel)
        # VLM rows: the image placeholder id marks the backbone's image tokens (a fact of the checkpoint)
        self.image_token_id = self.model.config.image_token_id if s.data.image_key else None
        self.optimizer, self.scheduler = fsdp.build_optimizer(t.optimizer, self.model, t.offload)
        n_params = sum(p.numel() for p in self.model.parameters())
        self.log(f"model {s.model.path}: {n_params:,} parameters, FSDP2 over {self.world} ranks ({s.dist_backend}, "
                 f"{s.device}, {s.model.dtype}); micro-batch {t.micro_batch_size} x accumulation {t.grad_accum} x "
                 f"dp {t.dp} = {self.window * self.dp} rows per step; {self.total_steps} steps "
                 f"({self.steps_per_epoch} per epoch)")
        self._resume()
        self.sink = None
        if self.rank == 0:
            from runtime.metrics import MetricsSink

            lg = s.logging
            self.sink = MetricsSink(Path(lg.out_dir), Path(lg.tensorboard_dir) if lg.tensorboard_dir else None,
                                    self.total_steps, live=False, append=self.step > 0, wandb=lg.wandb,
                                    config=self.plan.recipe)

    def _on_signal(self, signum, frame) -> None:
        self.stop_requested = True

    def _init_process_group(self) -> None:
        s = self.s
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if s.device == "cuda":
            torch.cuda.set_device(local_rank)
            self.device = torch.device("cuda", local_rank)
        else:
            self.device = torch.device("cpu")
        dist.init_process_group(s.dist_backend)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if self.world != s.trainer.world:
            raise SftError(f"torchrun started {self.world} ranks but the plan's SFT world is {s.trainer.world} "
                           f"(nnodes {s.nnodes} x nproc-per-node {s.nproc_per_node})")

    def _load_data(self) -> None:
        """Tokenizer, train and eval examples, this rank's sampler and the step counts the data allows."""
        from transformers import AutoTokenizer

        s, t, d, sched = self.s, self.s.trainer, self.s.data, self.s.schedule
        # a VLM run tokenizes with its processor's tokenizer: the processor expands the image placeholders
        self.processor = vlm.load_processor(s.model.path) if d.image_key else None
        tok = (self.processor.tokenizer if self.processor is not None
               else AutoTokenizer.from_pretrained(s.model.path, use_fast=not s.model.disable_fast_tokenizer))
        if d.chat_template:
            tok.chat_template = (Path(d.chat_template).read_text() if d.chat_template.endswith(".jinja")
                                 else d.chat_template)
        if tok.chat_template is None:
            raise SftError(f"the tokenizer at {s.model.path} has no chat template; set data.chat_template")
        self.tokenizer = tok
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        data_kw = dict(input_key=d.input_key, output_key=d.output_key, max_len=d.max_len,
                       last_turn_only=d.train_on_last_turn_only,
                       images=(d.image_key, d.max_images_per_prompt, self.processor) if d.image_key else None)
        self.data = load_examples(d.dataset, tok, max_samples=d.max_samples, split=d.split, probs=d.probs,
                                  seed=t.seed, **data_kw)
        evals = (load_examples([s.eval_dataset], tok, max_samples=d.max_samples, split=s.eval_split, **data_kw)
                 if s.eval_dataset else None)
        self.log(f"data: {self.data.rows} rows, {len(self.data.examples)} trained, dropped "
                 f"{self.data.dropped or 'none'}" + (f"; eval {len(evals.examples)} rows" if evals else ""))
        if evals is not None and not evals.examples:
            self.log(f"note: no evaluable rows in {s.eval_dataset} (dropped: {evals.dropped}); eval is off")
            evals = None
        self.evals = evals
        if not self.data.examples:
            raise SftError(f"no trainable rows in {d.dataset} (dropped: {self.data.dropped})")
        self.window = t.micro_batch_size * t.grad_accum          # rows per rank per optimizer step
        self.sampler = torch.utils.data.DistributedSampler(range(len(self.data.examples)), num_replicas=self.dp,
                                                           rank=self.dp_rank, shuffle=True, seed=t.seed,
                                                           drop_last=True)
        # The plan counted steps from the raw rows; rows dropped in tokenization (known only now) shorten an epoch.
        windows_per_epoch = len(self.sampler) // self.window
        if windows_per_epoch < sched.steps_per_epoch:
            self.log(f"note: {len(self.data.examples)} trainable rows give {windows_per_epoch} optimizer steps per "
                     f"epoch; the plan counted {sched.steps_per_epoch} from the raw rows (dropped rows shorten each "
                     f"epoch)")
        self.steps_per_epoch = min(windows_per_epoch, sched.steps_per_epoch)
        self.total_steps = min(sched.total_steps, self.steps_per_epoch * t.max_epochs)
        if self.total_steps <= 0:
            raise SftError(f"{len(self.data.examples)} trainable rows make no full optimizer step of "
                           f"{self.window} rows per rank x {self.dp} data-parallel ranks")

    def _resume(self) -> None:
        from runtime import ckpt as ck

        s = self.s
        if not s.ckpt.resume:
            return
        skipped: list[str] = []
        found = ck.latest(s.ckpt.dir, skipped)
        for line in skipped:
            self.log(f"resume: skipped checkpoint {line}")
        if found is None:
            self.log(f"no checkpoint under {s.ckpt.dir}; starting fresh")
            return
        path, state = found
        ck.load_sharded(str(path), self.model, self.optimizer, self.scheduler)
        self.step, self.last_ckpt = int(state["step"]), str(path)
        self.log(f"resumed from {path} at step {self.step}")

    # ----------------------------------------------------------------------------------------------- train
    def train(self) -> None:
        """Epochs of optimizer steps from the resumed step; evaluate and save on the plan's cadences; a signal
        stops after the current step (saved when the plan checkpoints)."""
        t, sched = self.s.trainer, self.s.schedule
        self.model.train()
        start_epoch, skip = divmod(self.step, self.steps_per_epoch)
        for epoch in range(start_epoch, t.max_epochs):
            if self.step >= self.total_steps:
                break
            self.sampler.set_epoch(epoch)
            order = list(self.sampler)
            for w in range(skip if epoch == start_epoch else 0, self.steps_per_epoch):
                if self.step >= self.total_steps:
                    break
                rows = [self.data.examples[i] for i in order[w * self.window:(w + 1) * self.window]]
                record, stopping = self.train_step(rows, epoch)
                if self.evals is not None and sched.eval_every and (
                        self.step % sched.eval_every == 0 or self.step == self.total_steps):
                    self.eval_loss, eval_tokens = self.evaluate()
                    record.update({"eval/loss": self.eval_loss, "eval/tokens": eval_tokens})
                    self.log(f"step {self.step}: eval loss {self.eval_loss:.4f}")
                self._log_step(record, epoch)
                if sched.ckpt_every and (self.step % sched.ckpt_every == 0 or (stopping and self.step < self.total_steps)):
                    self.last_ckpt = self.save(self.step, epoch)
                if stopping:
                    self.status = "stopped"
                    return

    def train_step(self, rows: list, epoch: int) -> tuple[dict, bool]:
        """One optimizer step over this rank's `rows` (its micro-batches); returns the step's record and whether
        any rank asked to stop."""
        from runtime.algo.losses import sft_loss

        t = self.s.trainer
        t0 = time.perf_counter()
        chunks = [rows[m:m + t.micro_batch_size] for m in range(0, self.window, t.micro_batch_size)]
        micro = [collate(chunk, self.pad_id, t.width_multiple) for chunk in chunks]
        (global_tokens,) = self.all_sum([sum(float(mask[:, 1:].sum()) for _, _, mask in micro)])
        global_tokens /= self.replicas  # the cp x tp ranks of a data-parallel rank hold the same rows
        loss_sum = 0.0
        top_k = moe.shape_of(self.model)[1]  # 0: a dense model, no aux loss
        aux = t.aux_loss_coef > 1e-8 and top_k > 0  # Molt B32: the MoE aux loss is on above 1e-8
        for (ids, attn, mask), chunk in zip(micro, chunks, strict=True):
            ids, attn, mask = ids.to(self.device), attn.to(self.device), mask.to(self.device)
            with self._cp_rows(ids, attn) as cp:  # the forward and the backward of a context-parallel shard
                with moe.collect_logits(self.model) if aux else contextlib.nullcontext() as router:
                    lp = reply_logprobs(self.model, ids, attn, packed=t.packing, vision=self._vision(chunk, ids),
                                        cp=cp)
                loss = sft_loss(lp, mask[:, 1:], global_num_tokens=global_tokens, dp_size=self.dp)
                # train/loss: the reply-token NLL, without the aux term (summed over all dp x cp ranks)
                loss_sum += float(loss.detach()) / self.world
                if aux:  # each micro-batch adds coef x its load-balancing loss / micro-batches (Molt B32, as in RL)
                    logits = router.logits if cp is None else cp.gather_router_logits(router.logits)
                    real = attn.reshape(-1) if not t.packing else torch.ones(logits[0].shape[0], device=self.device)
                    loss = loss + t.aux_loss_coef * moe.load_balancing_loss(logits, top_k, real) / len(micro)
                loss.backward()
        lr = self.scheduler.get_last_lr()[0]
        fsdp.sync_tp_replicas(self.model, self.tp_world)
        grad_norm = fsdp.clipped_step(self.model, self.optimizer, self.scheduler, t.optimizer.max_norm)
        self.step += 1
        (step_loss, stop_votes) = self.all_sum([loss_sum, float(self.stop_requested)])
        self.step_times.append(time.perf_counter() - t0)
        self.first_loss = step_loss if self.first_loss is None else self.first_loss
        self.last_loss = step_loss
        return {"train/loss": step_loss, "train/tokens": global_tokens, "train/grad_norm": float(grad_norm),
                "train/lr": lr, "train/epoch": epoch, "timing/step": self.step_times[-1]}, stop_votes > 0

    def _cp_rows(self, ids: torch.Tensor, attn: torch.Tensor):
        """The block a micro-batch's forward (and backward) runs in: its context-parallel shard, or None (packed:
        one packed row cut by the model's own CP)."""
        if self.cp_mesh is None:
            return contextlib.nullcontext()
        return context_parallel.sharded_rows(self.cp_mesh, ids, attn, self.model, self.s.trainer.packing)

    def _vision(self, rows: list, ids: torch.Tensor) -> dict | None:
        """The VLM forward's image inputs of a micro-batch's rows (None: a text run)."""
        if self.image_token_id is None:
            return None
        from runtime.logprobs import vision_inputs

        return vision_inputs([e.mm for e in rows], ids, self.image_token_id, self.device)

    def _log_step(self, record: dict, epoch: int) -> None:
        if self.sink is None:
            return
        if self.step % self.s.schedule.log_every == 0 or "eval/loss" in record or self.step == self.total_steps:
            self.sink.log(self.step, record)
            self.log(f"step {self.step}/{self.total_steps} epoch {epoch}: loss {record['train/loss']:.4f} "
                     f"lr {record['train/lr']:.2e} grad_norm {record['train/grad_norm']:.3f} "
                     f"({record['timing/step']:.2f} s)")

    # ----------------------------------------------------------------------------------------------- evaluate
    @torch.no_grad()
    def evaluate(self) -> tuple[float, float]:
        """Reply-token NLL of the eval set over every rank, and its token count."""
        t, evals = self.s.trainer, self.evals
        self.model.eval()
        mine = evals.examples[self.dp_rank::self.dp]
        nll, tokens = 0.0, 0.0
        # Every rank runs the same number of forwards: FSDP2's all-gathers are collectives.
        n_batches = math.ceil(math.ceil(len(evals.examples) / self.dp) / t.micro_batch_size)
        for b in range(n_batches):
            part = mine[b * t.micro_batch_size:(b + 1) * t.micro_batch_size] or evals.examples[:1]
            ids, attn, mask = (x.to(self.device) for x in collate(part, self.pad_id, t.width_multiple))
            with self._cp_rows(ids, attn) as cp:
                lp = reply_logprobs(self.model, ids, attn, packed=t.packing, vision=self._vision(part, ids), cp=cp)
            weight = 1.0 if mine[b * t.micro_batch_size:(b + 1) * t.micro_batch_size] else 0.0
            nll += weight * float((-lp * mask[:, 1:]).sum())
            tokens += weight * float(mask[:, 1:].sum())
        nll, tokens = (v / self.replicas for v in self.all_sum([nll, tokens]))  # cp x tp ranks: the same rows
        self.model.train()
        return nll / max(tokens, 1.0), tokens

    # ----------------------------------------------------------------------------------------------- save
    def save(self, at_step: int, epoch: int) -> str:
        """A sharded DCP checkpoint of model, optimizer and scheduler (pruned to the plan's keep and disk cap)."""
        from runtime import ckpt as ck

        s = self.s
        path = ck.step_dir(s.ckpt.dir, at_step)
        ck.save_sharded(str(path), self.model, self.optimizer, self.scheduler)
        if self.rank == 0:
            ck.write_state(path, {"step": at_step, "epoch": epoch, "kind": "sft", "plan": self.plan.fingerprint})
            ck.prune(s.ckpt.dir, s.ckpt.dcp_keep, s.ckpt.max_disk_gb)
        dist.barrier()
        self.log(f"checkpoint {path}")
        return str(path)

    def export(self) -> None:
        """The HF export of a finished run (with the chat template it was trained with)."""
        from runtime import ckpt as ck

        s = self.s
        if self.status != "finished" or not s.ckpt.final_save:
            return
        self.hf_dir = ck.export_hf(s.ckpt.hf_dir, self.model, self.backend.hf_weights, s.model.path, self.rank)
        if self.rank == 0 and s.data.chat_template:
            self.tokenizer.save_pretrained(s.ckpt.hf_dir)
        dist.barrier()

    # ----------------------------------------------------------------------------------------------- cleanup
    def cleanup(self) -> SftResult:
        """Close the metrics (and draw the loss plot), leave the process group; the job's summary."""
        metrics_path = plot_path = None
        if self.sink is not None:
            self.sink.close()
            metrics_path = str(self.sink.path)
            plot_path = str(plot_loss(self.sink.path, Path(self.s.logging.out_dir) / "loss.png", self.plan.name))
        dist.barrier()
        dist.destroy_process_group()
        times = self.step_times
        mean_step = sum(times[1:]) / len(times[1:]) if len(times) > 1 else (times or [None])[0]
        return SftResult(self.status, self.step, self.first_loss, self.last_loss, self.eval_loss, mean_step,
                         self.last_ckpt, self.hf_dir, metrics_path, plot_path, self.data.rows, self.data.dropped)

    def all_sum(self, values: list[float]) -> list[float]:
        buf = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(buf)
        return buf.tolist()

    def log(self, msg: str) -> None:
        if self.rank == 0:
            print(f"[sft] {msg}", flush=True)


def plot_loss(metrics_path: Path, out_png: Path, title: str) -> Path:
    """Train loss per step (and its running mean) and eval loss, from metrics.jsonl."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from runtime.metrics import read_jsonl
    from runtime.plot import _smooth

    records = read_jsonl(metrics_path)
    train = [r for r in records if "train/loss" in r]
    evals = [r for r in records if "eval/loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    if train:
        steps = [r["step"] for r in train]
        ax.plot(steps, [r["train/loss"] for r in train], color="C0", alpha=0.5, label="train loss")
        ax.plot(steps, _smooth([r["train/loss"] for r in train]), color="C0", lw=2, label="train loss (smoothed)")
    if evals:
        ax.plot([r["step"] for r in evals], [r["eval/loss"] for r in evals], "o-", color="C3", label="eval loss")
    ax.set(xlabel="optimizer step", ylabel="reply-token NLL", title=title)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right")
    fig.tight_layout()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png


def main(argv: list[str] | None = None) -> int:
    """Exit status: 0 finished, 1 the run failed, 130 stopped by a signal, 2 unusable plan file."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0] in ("-h", "--help"):
        print("usage: torchrun ... -m runtime.sft PLAN.json", file=sys.stderr)
        return 2
    from runtime.plan_file import PlanUnusable, read_plan

    path = Path(args[0])
    try:  # `${env:NAME}`: the launcher (the Slurm script, --submit) resolved them; never the plan's literal text
        plan, env = read_plan(path)
    except PlanUnusable as exc:
        print(exc, file=sys.stderr)
        return 2
    if plan.kind != "sft" or plan.sft is None:
        print(f"{path}: a kind {plan.kind!r} plan; runtime.sft runs kind 'sft' plans", file=sys.stderr)
        return 2
    os.environ.update(env)
    rank0 = os.environ.get("RANK", "0") == "0"
    try:
        from runtime.datasource import derive_at_start

        result = run_sft(derive_at_start(plan, quiet=not rank0))
    except SftError as exc:
        if rank0:
            print(f"sft failed: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # one clear line per rank; the traceback would repeat on every rank
        print(f"sft failed on rank {os.environ.get('RANK', '0')}: {type(exc).__name__}: {exc}", file=sys.stderr)
        if os.environ.get("MOLT_DEBUG"):
            raise
        return 1
    if rank0:
        fmt = lambda v: "n/a" if v is None else f"{v:.4f}"  # noqa: E731
        print(f"sft {result.status} at step {result.step}: train loss {fmt(result.first_loss)} -> "
              f"{fmt(result.last_loss)}, eval loss {fmt(result.eval_loss)}, "
              f"{fmt(result.step_time)} s/step; rows {result.rows} (dropped {result.dropped or 'none'})")
        print(f"last checkpoint: {result.last_checkpoint or 'none'}")
        print(f"hf export: {result.hf_dir or 'none'}")
        print(f"metrics: {result.metrics_path}")
        print(f"plot: {result.plot_path}")
    return 0 if result.status == "finished" else 130


if __name__ == "__main__":
    raise SystemExit(main())
