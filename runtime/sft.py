"""Supervised fine-tuning of a compiled `kind: sft` plan: one process per rank under torchrun, no Ray, no engines.

    torchrun --nnodes N --nproc-per-node P ... -m runtime.sft PLAN.json     (the plan's `sft.command`)

`run_sft` is the whole job, top to bottom, identical on every rank: process group (the plan's backend) -> tokenizer
and JSONL data (chat template, loss mask on assistant replies only) -> FSDP2 model, AdamW + scheduler (the FSDP core
shared with the RL trainer, `runtime/fsdp.py`) -> epochs of optimizer steps, each `grad_accum` micro-batches of
`micro_batch_size` rows per rank, packed into one row each with `actor.packing` -> eval, DCP checkpoints, metrics ->
HF export.

Every number comes from the plan's `sft` slice (batch sizes, accumulation, steps, cadences, optimizer); nothing is
re-derived. The loss is Molt's global token mean (`runtime.algo.losses.sft_loss`): every rank divides its summed
reply-token NLL by the reply-token count of the whole optimizer step (all micro-batches, all ranks), times dp,
because FSDP averages gradients over ranks.

Data (Molt `datasets/sft_dataset.py`): `input_key` holds a string (one user turn) or chat messages; `output_key`
a string (the assistant reply), one message dict, or messages; without `output_key` the assistant turns come from
the input messages. Only assistant replies (their text and the end-of-turn marker the template puts after them)
count in the loss; with `train_on_last_turn_only` only the last one. Rows are cut to `max_len` tokens. Rows with no
assistant turn, or whose replies lie wholly beyond `max_len`, are dropped and counted (Molt keeps all-zero-mask
rows with a warning; they train nothing, so dropping them changes no gradient).

Not supported here (a clear error at start): VLM (`image_key`), tp/cp/ep/pp > 1, dataset interleave
probabilities, non-JSONL sources. SIGTERM (torchrun forwards it) stops after the current optimizer step, saves a
DCP checkpoint when the plan has a checkpoint cadence, and exits 130. With an eval set, the last step is
evaluated too (when the cadence does not land on it), so every run ends with an eval loss.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from runtime import fsdp, models
from runtime.datasource import DataError, open_rows
from runtime.logprobs import token_logprobs
from schemas.plan import Plan


class SftError(Exception):
    """A problem the user can fix (unsupported plan setting, unreadable data); printed as one line."""


# --------------------------------------------------------------------------------------------------- data
@dataclass
class Example:
    input_ids: list[int]
    loss_mask: list[int]   # 1 where the token is part of a supervised assistant reply


@dataclass
class LoadedData:
    examples: list[Example]
    rows: int = 0
    dropped: dict[str, int] = field(default_factory=dict)


def _as_messages(value, role: str) -> list[dict] | None:
    """A string -> one `role` turn; a message dict -> [it]; a list of messages -> it; None/empty -> None."""
    if value is None or value == "" or value == []:
        return None
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, dict):
        if "role" in value and "content" in value:
            return [value]
        return None
    if isinstance(value, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in value):
        return list(value)
    return None


def encode_conversation(tokenizer, messages: list[dict], max_len: int, last_turn_only: bool) -> Example | None:
    """Token ids and the reply-token mask of one conversation; None when no reply token is left.

    The mask is found on the rendered text, not on token counts: for every assistant turn i, the template rendered
    up to turn i with the generation prompt must be a prefix of the rendering through turn i; the characters in
    between (reply text + end-of-turn marker) are the reply. Tokens whose character span starts inside a reply are
    supervised. This stays right whatever the BPE merges do at the boundaries.
    """
    replies = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if last_turn_only:
        replies = replies[-1:]
    if not replies:
        return None
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = []
    for i in replies:
        before = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True) if i else ""
        through = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        if not (through.startswith(before) and full.startswith(through)):
            raise SftError("the chat template does not render conversations prefix by prefix, so the assistant "
                           "reply cannot be located (Molt H15: no detectable assistant-reply opener); "
                           "set data.chat_template to a template that does")
        spans.append((len(before), len(through)))
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = enc["input_ids"][:max_len]
    mask = [int(any(a <= start < b for a, b in spans)) for start, _ in enc["offset_mapping"][:max_len]]
    if not any(mask):
        return None
    return Example(ids, mask)


def load_examples(paths: list[str], tokenizer, *, input_key: str, output_key: str | None, max_len: int,
                  max_samples: int, last_turn_only: bool, split: str) -> LoadedData:
    """Tokenized examples of every source (any format runtime/datasource.py reads), at most `max_samples` rows."""
    out = LoadedData([])
    for path in paths:
        try:
            rows = open_rows(path, split, max_samples - out.rows, [k for k in (input_key, output_key) if k])
        except DataError as exc:
            raise SftError(str(exc)) from None
        for i, row in enumerate(rows):
            out.rows += 1
            if input_key not in row or row[input_key] is None:
                raise SftError(f"{rows.where(i)}: no column {input_key!r} (data.input_key); "
                               f"the row has {sorted(k for k, v in row.items() if v is not None)}")
            prompt = _as_messages(row[input_key], "user") or []
            reply = _as_messages(row.get(output_key), "assistant") if output_key else []
            messages = prompt + (reply or [])
            if not any(m["role"] == "assistant" for m in messages):
                out.dropped["no_reply"] = out.dropped.get("no_reply", 0) + 1
                continue
            ex = encode_conversation(tokenizer, messages, max_len, last_turn_only)
            if ex is None:
                out.dropped["reply_beyond_max_len"] = out.dropped.get("reply_beyond_max_len", 0) + 1
                continue
            out.examples.append(ex)
        if out.rows >= max_samples:
            break
    return out


def collate(examples: list[Example], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (ids, attention_mask, loss_mask), each (B, T)."""
    width = max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(examples), width), dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.float32)
    for i, e in enumerate(examples):
        n = len(e.input_ids)
        ids[i, :n] = torch.tensor(e.input_ids)
        attn[i, :n] = 1
        mask[i, :n] = torch.tensor(e.loss_mask, dtype=torch.float32)
    return ids, attn, mask


def reply_logprobs(model, ids: torch.Tensor, attn: torch.Tensor, packed: bool = False) -> torch.Tensor:
    """(B, T-1) log p(ids[:, t+1] | ids[:, :t+1]); the lm_head runs in chunks (`runtime/logprobs.py`), and with
    `packed` the rows run as one packed row (no padding computed; 0 past each row's end)."""
    return token_logprobs(model, ids, attn.bool(), 1.0, packed=packed)[0]


# --------------------------------------------------------------------------------------------------- the loop
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
    from transformers import AutoTokenizer

    from runtime import ckpt as ck
    from runtime.algo.losses import sft_loss

    s = plan.sft
    t, d, sched, opt = s.trainer, s.data, s.schedule, s.trainer.optimizer
    # ---- signals: a flag, acted on between optimizer steps (all ranks agree through an all-reduce)
    stop_requested = [False]

    def _on_signal(signum, frame):
        stop_requested[0] = True

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)

    # ---- process group
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if s.device == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group(s.dist_backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != t.world:
        raise SftError(f"torchrun started {world} ranks but the plan's SFT world is {t.world} "
                       f"(nnodes {s.nnodes} x nproc-per-node {s.nproc_per_node})")
    torch.manual_seed(t.seed)
    if t.full_determinism:
        from transformers import enable_full_determinism

        enable_full_determinism(t.seed)
    backend = models.backend(s.model.backend)
    mesh = backend.device_mesh(s.device, world)

    def log(msg: str) -> None:
        if rank == 0:
            print(f"[sft] {msg}", flush=True)

    # ---- tokenizer and data
    tok = AutoTokenizer.from_pretrained(s.model.path, use_fast=not s.model.disable_fast_tokenizer)
    if d.chat_template:
        tok.chat_template = Path(d.chat_template).read_text() if d.chat_template.endswith(".jinja") else d.chat_template
    if tok.chat_template is None:
        raise SftError(f"the tokenizer at {s.model.path} has no chat template; set data.chat_template")
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    data_kw = dict(input_key=d.input_key, output_key=d.output_key, max_len=d.max_len,
                   last_turn_only=d.train_on_last_turn_only)
    train = load_examples(d.dataset, tok, max_samples=d.max_samples, split=d.split, **data_kw)
    evals = (load_examples([s.eval_dataset], tok, max_samples=d.max_samples, split=s.eval_split, **data_kw)
             if s.eval_dataset else None)
    log(f"data: {train.rows} rows, {len(train.examples)} trained, dropped {train.dropped or 'none'}"
        + (f"; eval {len(evals.examples)} rows" if evals else ""))
    if evals is not None and not evals.examples:
        log(f"note: no evaluable rows in {s.eval_dataset} (dropped: {evals.dropped}); eval is off")
        evals = None
    if not train.examples:
        raise SftError(f"no trainable rows in {d.dataset} (dropped: {train.dropped})")

    window = t.micro_batch_size * t.grad_accum          # rows per rank per optimizer step
    sampler = torch.utils.data.DistributedSampler(range(len(train.examples)), num_replicas=world, rank=rank,
                                                  shuffle=True, seed=t.seed, drop_last=True)
    windows_per_epoch = len(sampler) // window
    if windows_per_epoch < sched.steps_per_epoch:
        log(f"note: {len(train.examples)} trainable rows give {windows_per_epoch} optimizer steps per epoch; the "
            f"plan counted {sched.steps_per_epoch} from the raw rows (dropped rows shorten each epoch)")
    steps_per_epoch = min(windows_per_epoch, sched.steps_per_epoch)
    total_steps = min(sched.total_steps, steps_per_epoch * t.max_epochs)
    if total_steps <= 0:
        raise SftError(f"{len(train.examples)} trainable rows make no full optimizer step of "
                       f"{window} rows per rank x {world} ranks")

    # ---- model, optimizer, scheduler
    model = backend.build(s.model, s.model.path, mesh, device, lora=t.lora)
    optimizer, scheduler = fsdp.build_optimizer(opt, model)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model {s.model.path}: {n_params:,} parameters, FSDP2 over {world} ranks ({s.dist_backend}, {s.device}, "
        f"{s.model.dtype}); micro-batch {t.micro_batch_size} x accumulation {t.grad_accum} x dp {t.dp} = "
        f"{window * world} rows per step; {total_steps} steps ({steps_per_epoch} per epoch)")

    # ---- resume
    step = 0
    last_ckpt = None
    if s.ckpt.resume:
        found = ck.latest(s.ckpt.dir)
        if found is not None:
            path, state = found
            ck.load_sharded(str(path), model, optimizer, scheduler)
            step, last_ckpt = int(state["step"]), str(path)
            log(f"resumed from {path} at step {step}")
        else:
            log(f"no checkpoint under {s.ckpt.dir}; starting fresh")

    sink = None
    if rank == 0:
        from runtime.metrics import MetricsSink

        sink = MetricsSink(Path(s.logging.out_dir),
                           Path(s.logging.tensorboard_dir) if s.logging.tensorboard_dir else None,
                           total_steps, live=False, append=step > 0, wandb=s.logging.wandb, config=plan.recipe)

    def all_sum(values: list[float]) -> list[float]:
        buf = torch.tensor(values, dtype=torch.float64, device=device)
        dist.all_reduce(buf)
        return buf.tolist()

    @torch.no_grad()
    def evaluate() -> tuple[float, float]:
        model.eval()
        mine = evals.examples[rank::world]
        nll, tokens = 0.0, 0.0
        # Every rank runs the same number of forwards: FSDP2's all-gathers are collectives.
        n_batches = math.ceil(math.ceil(len(evals.examples) / world) / t.micro_batch_size)
        for b in range(n_batches):
            part = mine[b * t.micro_batch_size:(b + 1) * t.micro_batch_size] or evals.examples[:1]
            ids, attn, mask = (x.to(device) for x in collate(part, pad_id))
            lp = reply_logprobs(model, ids, attn, packed=t.packing)
            weight = 1.0 if mine[b * t.micro_batch_size:(b + 1) * t.micro_batch_size] else 0.0
            nll += weight * float((-lp * mask[:, 1:]).sum())
            tokens += weight * float(mask[:, 1:].sum())
        nll, tokens = all_sum([nll, tokens])
        model.train()
        return nll / max(tokens, 1.0), tokens

    def save(at_step: int, epoch: int) -> str:
        path = ck.step_dir(s.ckpt.dir, at_step)
        ck.save_sharded(str(path), model, optimizer, scheduler)
        if rank == 0:
            ck.write_state(path, {"step": at_step, "epoch": epoch, "kind": "sft", "plan": plan.fingerprint})
            ck.prune(s.ckpt.dir, s.ckpt.dcp_keep)
        dist.barrier()
        log(f"checkpoint {path}")
        return str(path)

    # ---- train
    model.train()
    first_loss = last_loss = eval_loss = None
    step_times: list[float] = []
    status = "finished"
    start_epoch, skip = divmod(step, steps_per_epoch)
    for epoch in range(start_epoch, t.max_epochs):
        if step >= total_steps:
            break
        sampler.set_epoch(epoch)
        order = list(sampler)
        for w in range(skip if epoch == start_epoch else 0, steps_per_epoch):
            if step >= total_steps:
                break
            t0 = time.perf_counter()
            rows = [train.examples[i] for i in order[w * window:(w + 1) * window]]
            micro = [collate(rows[m:m + t.micro_batch_size], pad_id)
                     for m in range(0, window, t.micro_batch_size)]
            (global_tokens,) = all_sum([sum(float(mask[:, 1:].sum()) for _, _, mask in micro)])
            loss_sum = 0.0
            for ids, attn, mask in micro:
                ids, attn, mask = ids.to(device), attn.to(device), mask.to(device)
                lp = reply_logprobs(model, ids, attn, packed=t.packing)
                loss = sft_loss(lp, mask[:, 1:], global_num_tokens=global_tokens, dp_size=world)
                loss.backward()
                loss_sum += float(loss.detach()) / world
            lr = scheduler.get_last_lr()[0]
            grad_norm = fsdp.clipped_step(model, optimizer, scheduler, opt.max_norm)
            step += 1
            (step_loss, stop_votes) = all_sum([loss_sum, float(stop_requested[0])])
            step_times.append(time.perf_counter() - t0)
            first_loss = step_loss if first_loss is None else first_loss
            last_loss = step_loss
            record = {"train/loss": step_loss, "train/tokens": global_tokens, "train/grad_norm": float(grad_norm),
                      "train/lr": lr, "train/epoch": epoch, "timing/step": step_times[-1]}
            if evals is not None and sched.eval_every and (step % sched.eval_every == 0 or step == total_steps):
                eval_loss, eval_tokens = evaluate()
                record.update({"eval/loss": eval_loss, "eval/tokens": eval_tokens})
                log(f"step {step}: eval loss {eval_loss:.4f}")
            if sink is not None and (step % sched.log_every == 0 or "eval/loss" in record or step == total_steps):
                sink.log(step, record)
                log(f"step {step}/{total_steps} epoch {epoch}: loss {step_loss:.4f} lr {lr:.2e} "
                    f"grad_norm {float(grad_norm):.3f} ({step_times[-1]:.2f} s)")
            stopping = stop_votes > 0
            if sched.ckpt_every and (step % sched.ckpt_every == 0 or (stopping and step < total_steps)):
                last_ckpt = save(step, epoch)
            if stopping:
                status = "stopped"
                break
        if status == "stopped":
            break

    # ---- export and summary
    hf_dir = None
    if status == "finished" and s.ckpt.final_save:
        hf_dir = ck.export_hf(s.ckpt.hf_dir, model, s.model.path, rank)
        if rank == 0 and d.chat_template:
            tok.save_pretrained(s.ckpt.hf_dir)  # the template the model was trained with
        dist.barrier()
    metrics_path = plot_path = None
    if sink is not None:
        sink.close()
        metrics_path = str(sink.path)
        plot_path = str(plot_loss(sink.path, Path(s.logging.out_dir) / "loss.png", plan.name))
    dist.barrier()
    dist.destroy_process_group()
    mean_step = sum(step_times[1:]) / len(step_times[1:]) if len(step_times) > 1 else (step_times or [None])[0]
    return SftResult(status, step, first_loss, last_loss, eval_loss, mean_step, last_ckpt, hf_dir, metrics_path,
                     plot_path, train.rows, train.dropped)


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
    path = Path(args[0])
    try:
        plan = Plan.from_json(path.read_text())
    except (OSError, ValueError) as exc:
        print(f"{path}: cannot use this plan: {exc}", file=sys.stderr)
        return 2
    if plan.kind != "sft" or plan.sft is None:
        print(f"{path}: a kind {plan.kind!r} plan; runtime.sft runs kind 'sft' plans", file=sys.stderr)
        return 2
    os.environ.update(plan.env)
    rank0 = os.environ.get("RANK", "0") == "0"
    try:
        result = run_sft(plan)
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
