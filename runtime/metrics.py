"""Every metric the runtime logs (RL and SFT), documented in one table, and the sinks: metrics.jsonl, TensorBoard,
a live display.

`METRICS` maps each key (or key pattern with `<reason>` / `<name>`) to its definition; `is_documented(key)` is what
the test uses to assert that every logged key is in the table. Times are seconds of wall clock.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import time
from pathlib import Path

METRICS: dict[str, str] = {
    # ── step ──
    "step": "trainer step (1-based) this record belongs to",
    "policy_version": "weights version (trainer step) current when the generator completed the batch; groups "
    "carried over from earlier windows and partial rollouts may be older (rollout/policy_version_min)",
    "staleness": "step - 1 - policy_version: how far the batch's completion lags the weights it trains (0 = "
    "on-policy); the oldest token's lag is rollout/policy_version_lag_max",
    # ── rollout: the trained batch (after filters) ──
    "rollout/reward_mean": "mean episode reward over the trained rollouts",
    "rollout/reward_std": "standard deviation of the episode reward over the trained rollouts",
    "rollout/score_mean": "mean score (last step's; dynamic filtering uses it) over the trained rollouts",
    "rollout/pass1": "fraction of trained rollouts with score > 0",
    "rollout/num_rollouts": "rollouts in the trained batch",
    "rollout/num_samples": "training samples in the batch (a chat rollout whose history was rewritten gives several)",
    "rollout/num_prompt_groups": "prompt groups in the trained batch",
    "rollout/response_length_mean": "mean generated (action) tokens per trained rollout",
    "rollout/truncated_rate": "fraction of trained rollouts cut by the token budget or the env",
    "rollout/group_reward_std": "mean over groups of the within-group reward standard deviation",
    # ── rollout: policy versions per generated token (runtime/experience.py partial_rollout_metrics) ──
    "rollout/partial_samples_frac": "fraction of trained samples whose generated tokens came from more than one "
                                    "weights version: a weight sync paused them mid-generation (partial rollout)",
    "rollout/partial_tokens_frac": "fraction of trained action tokens sampled by an older version than their "
                                   "sample's newest (the part generated before the sync it crossed)",
    "rollout/policy_version_min": "oldest weights version (trainer step; 0 = the initial checkpoint) that sampled "
                                  "a trained action token",
    "rollout/policy_version_max": "newest weights version that sampled a trained action token",
    "rollout/policy_version_lag_mean": "token-mean of (weights the batch trains, step - 1) - (version that sampled "
                                       "the token); the per-token IS correction covers this off-policyness",
    "rollout/policy_version_lag_max": "max over trained action tokens of that lag",
    "rollout/tokens_at_lag/<name>": "trained action tokens whose sampling version lags the trained weights by "
                                    "<name> steps",
    # ── rollout: everything finished since the previous batch (before filters) ──
    "rollout/dropped/<reason>": "rollouts dropped since the previous batch, per reason (agent_error, "
                                "engine_error, step_timeout, episode_timeout, aborted, empty_tokens, no_action_tokens, "
                                "logprob_misalign; VLM: vlm_truncation, too_many_images, image_token_generated)",
    "rollout/dropped/total": "sum of rollout/dropped/<reason>",
    "rollout/cut/<what>": "agent outputs the runner cut since the previous batch: observation (a step's text past "
                          "the context left, cut before tokenizing; the rollout is marked truncated), info "
                          "(Result.info entries past 64, or neither numbers nor strings of at most 1024 chars)",
    "rollout/images": "VLM: images in the trained batch",
    "rollout/image_tokens": "VLM: image placeholder tokens in the trained batch (each row checked equal to its image features)",
    "rollout/image_features": "VLM: the features their images give (sum of prod(grid_thw) / merge²)",
    "rollout/pre_filter_mean_score": "mean score of every rollout that finished, before group filters",
    "rollout/group_all_pass_rate": "fraction of finished groups whose rollouts all scored > 0",
    "rollout/group_all_fail_rate": "fraction of finished groups whose rollouts all scored <= 0",
    "rollout/dynamic_filtering_pass_rate": "groups that passed the filters / groups finished since the previous batch (<= 1; a batch may also "
                                           "take groups that passed in an earlier window)",
    "rollout/runner_failures": "group dispatches that failed because a runner died or stopped answering (cumulative)",
    "rollout/runner_restarts": "dead runners that Ray restarted and that answer again (cumulative)",
    "rollout/info/<name>": "mean over finished rollouts of a numeric Result.info value of the agent",
    # ── prompts: the no-prompt-lost ledger (cumulative) ──
    "prompts/consumed": "prompts dispatched to the runners since the start (= trained + dropped)",
    "prompts/trained": "prompts whose group went into a trained batch",
    "prompts/dropped/<reason>": "prompts dropped, per reason (all_rollouts_dropped, incomplete_group, "
                                "dynamic_filter, agent_crash, episode_timeout, engine_lost, run_ended)",
    # ── train ──
    "train/policy_loss": "token-mean policy surrogate loss (plain mean, for logging)",
    "train/clip_ratio": "fraction of action tokens where the clipped surrogate was active",
    "train/policy_kl": "token-mean log π_old - log π over the update (how far the step moved the policy)",
    "train/ratio_mean": "token-mean PPO ratio π/π_old (exactly 1 when π_old is the training forward: force_on_policy "
                        "with KL off)",
    "train/kl": "token-mean KL estimate between π_old and π_ref (0 without a reference model)",
    "train/kl_loss": "token-mean KL term when KL is a loss",
    "train/kl_coef": "KL coefficient used this step (adaptive controllers change it)",
    "train/entropy": "token-mean entropy of the policy (only when entropy_coef != 0)",
    "train/is_filter_ratio": "fraction of IS units (tokens or sequences) outside the IS band",
    "train/vllm_kl": "token-mean log π_rollout - log π_old: engine/trainer mismatch on the trained tokens",
    "train/mismatch/bitwise_frac": "fraction of trained action tokens whose trainer fp32 log-prob differs bitwise "
                                   "from the engine's (runtime/algo/mismatch.py)",
    "train/mismatch/abs_diff_mean": "token-mean |log π_train - log π_rollout| on the trained tokens",
    "train/mismatch/k3_kl": "token-mean k3 estimate of KL(rollout || train) on the trained tokens",
    "train/score_centering_sampler_head_mass": "token-mean Σ_H q: the sampler's probability mass on the top-k ids "
                                               "it returned (score centering; 1 - its tail)",
    "train/score_centering_policy_head_mass": "token-mean Σ_H p: the policy's mass on the same ids during the update",
    "train/logprob_diff_max": "max |log π_rollout - log π_old| over the batch's action tokens (absent without an "
                              "old-logprob pass)",
    "train/overlong_penalty": "DAPO overlong penalty: mean over the batch's rollouts of R' − R (shaped minus "
                              "merged reward, before the clip)",
    "train/stop_properly_penalty": "ProRL stop-properly penalty: mean over the batch's rollouts of R' − R on "
                                   "truncated rollouts (0 elsewhere), before the clip",
    "train/advantage_mean": "token-mean advantage",
    "train/advantage_abs_mean": "token-mean |advantage|",
    "train/grad_norm": "gradient norm before clipping (mean over the step's optimizer steps)",
    "train/lr": "learning rate after the step",
    "train/optimizer_steps": "optimizer steps taken this RL step",
    "train/tokens": "tokens that carried the loss in this step's updates, summed over all ranks and passes (RL: "
                    "action tokens, once per epoch of actor.max_epochs; SFT: reply tokens of the optimizer step)",
    "train/loss": "SFT: global token-mean reply NLL of the optimizer step (all ranks)",
    "train/epoch": "SFT: epoch (0-based) of the optimizer step",
    "train/actor_frozen": "1 while the policy is frozen for the critic's warm-up (actor.freezing_steps), else 0",
    # ── critic (gae) ──
    "critic/value_loss": "token-mean clipped value loss 0.5·max((V − R)², (V_clipped − R)²) over the critic's passes",
    "critic/value_clip_frac": "fraction of action tokens where |V − V_old| exceeded critic.value_clip",
    "critic/explained_variance": "1 − Var(R − V_old) / Var(R) over the action tokens, at collection (1: perfect)",
    "critic/values_mean": "token-mean V_old, the critic's values at collection",
    "critic/returns_mean": "token-mean GAE return R = A + V_old (the value target)",
    "critic/returns_std": "token standard deviation of R over the action tokens (a head predicting 0 scores 0.5·(mean² + std²))",
    "critic/grad_norm": "critic gradient norm before clipping (mean over the step's optimizer steps)",
    "critic/lr": "critic learning rate after the step",
    "critic/optimizer_steps": "critic optimizer steps taken this RL step",
    # ── weight sync ──
    "weight_sync/logprob_diff_max": "max |engine logprob - trainer logprob| on the fixed probe sequence after the sync",
    "weight_sync/logprob_diff_mean": "mean |engine logprob - trainer logprob| on the probe sequence",
    "weight_sync/unassigned_params": "with train.check_weight_update_equal: the most parameters any engine's sync "
                                     "left unassigned (0 = every engine parameter was refreshed; a warning names them)",
    "weight_sync/bytes": "bytes broadcast to the engines this sync (engine dtype)",
    "weight_sync/buckets": "buckets broadcast this sync",
    "weight_sync/gb_per_s": "weight_sync/bytes / timing/weight_sync, in GB/s",
    # ── queue ──
    "queue/size": "rollout queue depth (plan)",
    "queue/depth": "batches waiting in the rollout queue right after this one was taken",
    # ── timing ──
    "timing/generation": "generator wall time to produce this batch (slot taken -> batch enqueued)",
    "timing/vllm_idle_wait": "time the generator waited for a slot before this batch (rollout capacity idle)",
    "timing/actor_idle_wait": "time the trainer waited on the rollout queue for this batch (trainer idle)",
    "timing/engine_lock_wait": "train.async.colocated_gpus alternate: time the step waited for the engine lock "
                               "(a batch or eval round being generated) before pausing the engines for its turn",
    "timing/engine_pause": "train.async.colocated_gpus alternate: pausing the engines once the lock is held (each "
                           "finishes the decode steps it has queued: its groups carried between batches keep "
                           "generating until then)",
    "timing/make_experience": "the batch fetched, π_old/π_ref log-prob forwards, V_old (gae), KL, rewards, "
                              "advantages and returns",
    "timing/policy_train": "policy update on the FSDP group (absent while the policy is frozen)",
    "timing/critic_train": "critic update on its FSDP group (gae)",
    "timing/weight_sync": "the streamed weight sync: every trainer rank gathers, rank 0 broadcasts buckets, every "
                          "engine loads them (they overlap, so the parts below add up to more)",
    "timing/weight_sync_gather": "trainer rank 0: filling the buckets from the shards in the engine dtype (its own "
                                 "rows cast in, the other ranks' rows received in place)",
    "timing/weight_sync_transfer": "longest time a group member waited on a bucket broadcast",
    "timing/weight_sync_load": "longest engine time spent loading received buckets into its model",
    "timing/weight_sync_lock_wait": "time waiting for the engine lock before the weight sync",
    "timing/weight_sync_total": "lock wait + pause + timing/weight_sync + resume",
    "timing/probe": "post-sync probe, under the engine lock: engine score and trainer forward at once",
    "timing/ckpt": "checkpoint save",
    "timing/step_total": "wall time of the whole step, from the previous step's end",
    "timing/eval": "wall time of an eval round",
    "timing/step": "SFT: wall time of one optimizer step (its forwards, backwards and the update)",
    # ── eval ──
    "eval/reward_mean": "mean reward over the eval set",
    "eval/pass1": "fraction of eval rollouts with score > 0",
    "eval/response_length_mean": "mean generated tokens per eval rollout",
    "eval/truncated_rate": "fraction of eval rollouts cut by the token budget",
    "eval/num_samples": "eval rollouts",
    "eval/loss": "SFT: reply-token NLL of the eval set (token mean over all ranks)",
    "eval/tokens": "SFT: reply tokens of the eval set",
    "eval/pass@<name>": "mean over eval prompts of the unbiased pass@k (Chen et al. 2021) from n_samples_per_prompt "
                        "samples; a dropped sample counts as failed",
}

_PATTERNS = [re.compile("^" + re.escape(k).replace(re.escape("<reason>"), r"[a-z0-9_]+")
                        .replace(re.escape("<name>"), r"[A-Za-z0-9_.\-]+") + "$") for k in METRICS]


def is_documented(key: str) -> bool:
    return any(p.match(key) for p in _PATTERNS)


LINE_WIDTH = 120
"""The widest line a run prints per step (a 120-column terminal shows each on one line)."""
LIVE_STATUS_WIDTH = 60
"""The live bar's status text: with `step N/T`, the bar and the elapsed time it stays under LINE_WIDTH."""


class MetricsSink:
    """metrics.jsonl (one JSON object per record, always), TensorBoard and W&B (when configured), and what the
    terminal shows: one line per finished step or eval round (a history that stays on screen and in any log), and
    on a terminal (`live`) a short progress bar under them with the run's current status."""

    def __init__(self, out_dir: Path, tensorboard_dir: Path | None, total_steps: int, live: bool, append: bool,
                 wandb: dict | None, config: dict, engine: str | None = None, console=None):
        out_dir.mkdir(parents=True, exist_ok=True)
        self.path = out_dir / "metrics.jsonl"
        self._file = open(self.path, "a" if append else "w")  # a resumed run continues its record
        self._tb = None
        if tensorboard_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(tensorboard_dir))
        self._wandb = WandbRun(wandb, out_dir, config, resume=append) if wandb is not None else None
        self._progress = None
        if live:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._progress = Progress(TextColumn("[bold]step"), MofNCompleteColumn(), BarColumn(bar_width=20),
                                      TimeElapsedColumn(), TextColumn("{task.fields[line]}", markup=False),
                                      console=console)
            self._task = self._progress.add_task("train", total=total_steps, line="starting engines and trainer...")
            self._progress.start()
        self._status = StatusLine(total_steps, engine)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, "time": time.time(), **metrics}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for k, v in metrics.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(step, metrics)
        line = self._status.update(step, metrics)
        if line:  # one line per record that has something to say, above the live bar (or plain: a Ray job's log)
            self._print(f"{'step' if 'timing/step_total' in metrics else 'eval at step'} {step}/{self._status.total}"
                        f"  {line}")
        if self._progress is not None:
            self._progress.update(self._task, completed=self._status.step, line=self._status.eta_text)

    def _print(self, text: str) -> None:
        if self._progress is not None:
            self._progress.console.print(text, markup=False, highlight=False, soft_wrap=True)
        else:
            print(text, flush=True)

    def status(self, line: str) -> None:
        if self._progress is not None:
            self._progress.update(self._task, line=clip(line, LIVE_STATUS_WIDTH))

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
        summary = self._status.summary()
        if summary:
            print(summary, flush=True)
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.close()
        self._file.close()


def clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


class WandbRun:
    """One W&B run through the real `wandb` client, its files under `<out_dir>/wandb/`.

    The API key is only ever a `${env:NAME}` reference in the plan, resolved here from this process's environment.
    `logging.wandb.mode` decides; its `auto`: online with a key, offline (`wandb sync <run dir>` uploads it later)
    without one, or whatever `WANDB_MODE` says. A resumed run continues the same run id (kept in `<out_dir>/wandb-run-id`).
    """

    def __init__(self, settings: dict, out_dir: Path, config: dict, resume: bool):
        import wandb

        key = resolve_env_ref(settings["key"])
        mode = settings["mode"] if settings["mode"] != "auto" else os.environ.get("WANDB_MODE") or (
            "online" if key else "offline")
        id_file = out_dir / "wandb-run-id"
        run_id = id_file.read_text().strip() if resume and id_file.is_file() else secrets.token_hex(4)
        id_file.write_text(run_id)
        self.run = wandb.init(
            project=settings["project"], entity=settings["entity"], group=settings["group"],
            name=settings["run_name"], id=run_id, resume="allow" if resume else None, dir=str(out_dir), mode=mode,
            config=config, settings=wandb.Settings(api_key=key, console="off", x_disable_stats=True,
                                                   silent=True),
        )
        if mode == "offline":
            print(f"wandb: offline run in {self.run.dir.removesuffix('/files')} (upload later with `wandb sync`)",
                  flush=True)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        import wandb

        self.run.finish()
        # finish() returns before wandb-core has flushed the run's transaction log; teardown waits for the service
        # to exit, so the files are complete when the sink is closed (one run per process here).
        wandb.teardown()


def resolve_env_ref(ref: str) -> str | None:
    """`${env:NAME}` -> the value of NAME here (None when unset or empty)."""
    m = re.fullmatch(r"\$\{env:([A-Za-z_][A-Za-z0-9_]*)\}", ref)
    if m is None:
        raise ValueError(f"logging.wandb.key must be an ${{env:NAME}} reference, got a literal of {len(ref)} characters")
    return os.environ.get(m.group(1)) or None


class StatusLine:
    """The one line per step a run shows: reward, pass@1, eval pass@1 (last round), KL, step time, ETA, and which side
    of the pipeline waited (rollout = the engines idled for a queue slot, trainer = it idled for a batch)."""

    def __init__(self, total_steps: int, engine: str | None = None):
        self.total = total_steps
        self.engine = engine
        """The rollout engine's kind (vllm, hf): names the engine/trainer KL (train/vllm_kl, whatever the engine)."""
        self.eta_text = ""
        self.started = time.time()
        self.first_step: int | None = None
        self.step = 0
        self.first: dict[str, float] = {}
        self.last: dict[str, float] = {}

    def update(self, step: int, m: dict[str, float]) -> str:
        for k, v in m.items():
            self.first.setdefault(k, v)
            self.last[k] = v
        if "timing/step_total" not in m:  # an eval round
            return "  ".join(f"{label} {m[key]:.3f}" for key, label in (("eval/reward_mean", "eval reward"),
                                                                        ("eval/pass1", "eval pass@1")) if key in m)
        if self.first_step is None:
            self.first_step, self.started = step, time.time() - m["timing/step_total"]
        self.step = max(self.step, step)
        # KL to the reference; without one (train/kl stays 0) the engine/trainer mismatch on the trained tokens
        # KL to the reference; without one (train/kl stays 0) the engine/trainer mismatch on the trained tokens.
        # The last eval round is on its own line ("eval at step ..."), so that this one fits LINE_WIDTH.
        kl = ("train/kl", "kl") if self.last.get("train/kl") else ("train/vllm_kl", f"{self.engine or 'engine'} kl")
        parts = [f"{label} {fmt.format(m[key])}" for key, label, fmt in (
            ("rollout/reward_mean", "reward", "{:.3f}"), ("rollout/pass1", "pass@1", "{:.2f}"), (*kl, "{:.1e}"))
            if key in m]
        done = step - self.first_step + 1
        eta = (time.time() - self.started) / max(done, 1) * max(self.total - step, 0)
        self.eta_text = f"eta {_duration(eta)}"
        rollout_idle, trainer_idle = m.get("timing/vllm_idle_wait", 0.0), m.get("timing/actor_idle_wait", 0.0)
        side, idle = ("rollout", rollout_idle) if rollout_idle >= trainer_idle else ("trainer", trainer_idle)
        parts += [f"time {_secs(m['timing/step_total'])}", self.eta_text, f"idle: {side} {_secs(idle)}"]
        return "  ".join(parts)

    def summary(self) -> str:
        """Where the run started and ended, for the last lines of its log."""
        if self.first_step is None:
            return ""
        lines = [f"summary: {self.step} of {self.total} steps in {_duration(time.time() - self.started)}"]
        for key in ("rollout/reward_mean", "rollout/pass1", "eval/pass1", "eval/reward_mean", "train/kl"):
            if key in self.first:
                lines.append(f"  {key}: {self.first[key]:.3f} -> {self.last[key]:.3f}")
        return "\n".join(lines)


def _secs(seconds: float) -> str:
    """`2.05s`, `42.1s`, `812s`: at most 6 characters below 100000 s."""
    return f"{seconds:.2f}s" if seconds < 10 else f"{seconds:.1f}s" if seconds < 100 else f"{seconds:.0f}s"


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


def drop_records_after(path: Path, step: int) -> None:
    """Keep the records of `path` (JSON lines with a `step`) up to `step`: a resumed run logs the later ones again.
    A line that is not JSON (the torn last write of a killed run) is dropped, with a line that names it."""
    if not path.is_file():
        return
    kept = []
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            print(f"resume: {path} line {number} is not a whole JSON record (a torn write); dropped", flush=True)
            continue
        if not isinstance(record, dict) or record.get("step", 0) <= step:
            kept.append(line)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    tmp.replace(path)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
