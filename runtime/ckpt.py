"""Checkpoints: torch DCP for the resumable state, an HF directory for the final export.

Layout under the plan's `ckpt.dir`:

    step_000010/            one DCP checkpoint per save (every rank writes its shards: model + optimizer)
      scheduler.pt          LR scheduler state (identical on every rank; rank 0 writes it)
      critic/               the critic's DCP checkpoint and scheduler.pt, laid out the same (gae only)
      trainer_state.json    written last by the driver: step, KL coefficient, the prompt books (positions done)

    best/                   with `ckpt.best_metric_key` (RL): the same layout, for the eval round with the highest
                            value of that metric so far; its trainer_state.json adds `best_metric_key`, `best_metric`.
                            Never pruned (Molt protects `best_*`, M5); replaced when an eval improves on it.

A save is written into `step_000010.tmp/` and renamed into place once its state file and, last, its completion
marker `complete.json` (every file of the save with its size, flushed to disk) are in: a kill at any point of a save
leaves the previous checkpoint the newest complete one. `latest(root)` returns the newest complete save (else a
complete `best/`), skipping with a reason any whose state file is not JSON or whose files do not match the marker
(a truncated or missing shard); `prune` removes leftovers of interrupted saves. `check_dir` runs at start: a
checkpoint directory that cannot be written, or has less room than the last save took, stops the run before it
trains; `disk_trouble` turns a failed save into "no space left on <dir>" / "<dir> is read-only".
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from runtime import nemotron_omni

STATE_FILE = "trainer_state.json"
COMPLETE_FILE = "complete.json"
"""Written last into a save: `{"files": {relative path: bytes}}`; a save whose files differ is not resumed from."""
HF_SNAPSHOTS = "_hf"
"""With `ckpt.save_hf`, each save also writes an HF snapshot to `<ckpt.dir>/_hf/step_NNNNNN` (Molt's
`ckpt.path/_hf/<tag>`), pruned to `ckpt.keep`."""
CRITIC_DIR = "critic"
BEST_DIR = "best"

logger = logging.getLogger(__name__)


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step_{step:06d}"


def _saves(root: str | Path) -> list[Path]:
    """Published save directories, oldest first (`step_NNNNNN`; temporary `.tmp` ones left out)."""
    return sorted(p for p in Path(root).glob("step_*") if p.is_dir() and p.name[5:].isdigit())


def begin_save(root: str | Path, step: int) -> Path:
    """A fresh temporary directory for the save of `step` (a leftover of an interrupted save is removed)."""
    tmp = step_dir(root, step).with_name(step_dir(root, step).name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def publish(tmp: Path) -> Path:
    """Rename a complete temporary save into place (replacing an older save of the same step)."""
    final = tmp.with_name(tmp.name.removesuffix(".tmp"))
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    return final


# --------------------------------------------------------------------------------------------------- on every rank
def save_sharded(path: str, model, optimizer, scheduler) -> None:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    if dist.get_rank() == 0:
        torch.save(scheduler.state_dict(), Path(path) / "scheduler.pt")
    dist.barrier()


def load_sharded(path: str, model, optimizer, scheduler) -> None:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    scheduler.load_state_dict(torch.load(Path(path) / "scheduler.pt", weights_only=False))


def export_hf(out_dir: str, model, hf_weights: Callable[[Any], list], model_path: str, rank: int) -> str | None:
    """Write an HF directory loadable by from_pretrained and vLLM (collective; rank 0 writes, and returns it): the
    weights streamed out of their shards file by file (`runtime/hf_export.py`; `hf_weights`, the model backend's,
    names and lays them out as transformers does), the checkpoint's config, generation config and tokenizer.
    Under LoRA: a PEFT adapter directory instead (Molt 0.2.1), loadable by `PeftModel.from_pretrained`."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

    from runtime import hf_export

    if getattr(model, "molt_lora", None) is not None:
        from runtime import lora

        return lora.export_adapter(out_dir, model, model_path, rank)

    if nemotron_omni.is_omni(model):
        return _export_omni(out_dir, model, model_path, rank)
    config = AutoConfig.from_pretrained(model_path)
    vlm = getattr(config, "vision_config", None) is not None
    meta_model = None
    if rank == 0:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        with torch.device("meta"):  # its on-disk conversions and generation config, no weights
            meta_model = (AutoModelForImageTextToText if vlm else AutoModelForCausalLM).from_config(
                config, dtype=torch.float32)
    # the collective's device: NCCL moves CUDA tensors (the shards may sit on the host under actor.offload: full)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    hf_export.write(out_dir, hf_weights(model), meta_model, rank, device)
    if rank != 0:
        return None
    assert meta_model is not None
    meta_model.config.save_pretrained(out_dir)
    if meta_model.can_generate() and meta_model.generation_config is not None:
        meta_model.generation_config.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(model_path).save_pretrained(out_dir)
    if vlm:
        _copy_processor(model_path, out_dir)
    return str(out_dir)


def _copy_processor(model_path: str, out_dir: str) -> None:
    """The processor's files travel as they are (a torchvision-less processor cannot save itself whole)."""
    for name in ("preprocessor_config.json", "processor_config.json", "chat_template.jinja"):
        if (Path(model_path) / name).is_file():
            shutil.copy(Path(model_path) / name, Path(out_dir) / name)


def _export_omni(out_dir: str, model, model_path: str, rank: int) -> str | None:
    """Nemotron-Omni's export: its adapter's checkpoint layout (`nemotron_omni.export_weights`), the checkpoint's
    config (its own model_type; transformers has no model class of it to make a meta model of), generation config,
    tokenizer and processor files."""
    from transformers import AutoConfig, AutoTokenizer

    from runtime import hf_export

    if rank == 0:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
    nemotron_omni.export_weights(model, out_dir, rank, hf_export.FILE_BYTES)
    if rank != 0:
        return None
    nemotron_omni.register()
    AutoConfig.from_pretrained(model_path).save_pretrained(out_dir)
    if (Path(model_path) / "generation_config.json").is_file():
        shutil.copy(Path(model_path) / "generation_config.json", Path(out_dir) / "generation_config.json")
    AutoTokenizer.from_pretrained(model_path).save_pretrained(out_dir)
    _copy_processor(model_path, out_dir)
    return str(out_dir)


# --------------------------------------------------------------------------------------------------- on the driver
def write_state(path: Path, state: dict) -> None:
    """The state file, then the completion marker (the save's files and sizes), each flushed before its rename."""
    _write_durably(path / STATE_FILE, json.dumps(state, indent=2, sort_keys=True))
    files = {str(f.relative_to(path)): f.stat().st_size for f in sorted(Path(path).rglob("*"))
             if f.is_file() and f.name != COMPLETE_FILE}
    _write_durably(path / COMPLETE_FILE, json.dumps({"files": files}, indent=1, sort_keys=True))


def _write_durably(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    tmp.rename(path)


def problem(path: Path) -> str | None:
    """Why the save at `path` cannot be resumed from (None: it can). A save written before completion markers
    existed counts when its state file reads."""
    state = path / STATE_FILE
    if not state.is_file():
        return f"no {STATE_FILE} (an interrupted save)"
    try:
        json.loads(state.read_text())
    except (OSError, ValueError) as exc:
        return f"{state} is truncated or not JSON ({exc})"
    marker = path / COMPLETE_FILE
    if not marker.is_file():
        return None
    try:
        files = json.loads(marker.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"{marker} is truncated or not JSON ({exc})"
    for rel, size in files.items():
        f = path / rel
        if not f.is_file():
            return f"{f} is missing"
        if f.stat().st_size != size:
            return f"{f} is {f.stat().st_size} bytes, the save wrote {size} (truncated)"
    return None


def latest(root: str | Path, skipped: list[str] | None = None) -> tuple[Path, dict] | None:
    """Newest complete save under `root` (`problem` finds none), with its state; without one, the best checkpoint
    when it is complete (Molt's load order, M4: the newest regular checkpoint, then best). Each newer save passed
    over is appended to `skipped` as "<dir>: <why>"."""
    for p in [*reversed(_saves(root)), Path(root) / BEST_DIR]:
        if not p.is_dir():
            continue
        why = problem(p)
        if why is None:
            return p, json.loads((p / STATE_FILE).read_text())
        if skipped is not None:
            skipped.append(f"{p}: {why}")
    return None


def check_dir(root: str | Path) -> None:
    """At start: `root` exists (created), can be written and has room for a save as large as the newest one in
    it; raises OSError naming the directory otherwise (hours before the first save would find out)."""
    root = Path(root)
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".write-probe-{os.getpid()}"
        probe.write_bytes(b"\0" * 4096)
        probe.unlink()
    except OSError as exc:
        raise disk_trouble(root, exc) or OSError(exc.errno, f"cannot write the checkpoint directory {root}: "
                                                            f"{exc.strerror or exc}") from None
    saves = [p for p in _saves(root) if (p / STATE_FILE).is_file()]
    need = dir_bytes(saves[-1]) if saves else 0
    free = shutil.disk_usage(root).free
    if need > free:
        raise OSError(errno.ENOSPC, f"no space left on {root}: {free / 1e9:.3g} GB free, the last save "
                                    f"({saves[-1].name}) took {need / 1e9:.3g} GB")


def disk_trouble(root: str | Path, exc: BaseException | None = None) -> OSError | None:
    """After a failed write under `root`: an OSError that says what is wrong with the directory (no space left,
    read-only, not writable), or None when the directory looks fine (the failure is something else). Torch's own
    text for a full disk is "enforce fail at inline_container.cc"; this probes the directory itself."""
    root = Path(root)
    code = getattr(exc, "errno", None)
    if code is None:
        try:
            probe = root / f".write-probe-{os.getpid()}"
            with open(probe, "wb") as f:
                f.write(b"\0" * (1 << 20))
                f.flush()
                os.fsync(f.fileno())
            probe.unlink()
        except OSError as probe_exc:
            code = probe_exc.errno
            (root / f".write-probe-{os.getpid()}").unlink(missing_ok=True)
    if code == errno.ENOSPC or (code is None and shutil.disk_usage(root).free < (1 << 20)):
        return OSError(errno.ENOSPC, f"no space left on {root} ({shutil.disk_usage(root).free} bytes free)")
    if code == errno.EROFS:
        return OSError(errno.EROFS, f"the checkpoint directory {root} is on a read-only file system")
    if code in (errno.EACCES, errno.EPERM):
        return OSError(code, f"the checkpoint directory {root} cannot be written (permission denied)")
    return None


def prune(root: str | Path, keep: int, max_disk_gb: float | None = None) -> None:
    """Keep the newest `keep` complete saves (keep <= 0: all); incomplete ones older than the newest go too, and
    leftovers of interrupted saves. With `max_disk_gb`, the oldest complete saves then go until the rest fit (the
    newest is always kept, with a warning when it alone is over the budget). "Complete" is what `latest` would
    resume from (`problem` finds nothing): a newest save with a torn shard or state file never counts towards
    `keep`, so the save resume falls back to is never the one removed."""
    for tmp in Path(root).glob("step_*.tmp"):
        shutil.rmtree(tmp, ignore_errors=True)
    saves = _saves(root)
    complete = [p for p in saves if problem(p) is None]
    kept = set(complete[-keep:]) if keep > 0 else set(complete)
    newest = complete[-1] if complete else None
    for p in saves:
        if p not in kept and (newest is None or p < newest or p in complete):
            shutil.rmtree(p, ignore_errors=True)
    if max_disk_gb is None:
        return
    remaining = [p for p in complete if p in kept]
    sizes = {p: dir_bytes(p) for p in remaining}
    while len(remaining) > 1 and sum(sizes[p] for p in remaining) > max_disk_gb * 1e9:
        shutil.rmtree(remaining.pop(0), ignore_errors=True)
    if remaining and sizes[remaining[-1]] > max_disk_gb * 1e9:
        logger.warning("checkpoint %s alone is %.2f GB, over ckpt.max_disk_gb=%g", remaining[-1],
                       sizes[remaining[-1]] / 1e9, max_disk_gb)


def prune_snapshots(root: str | Path, keep: int) -> None:
    """HF snapshots (`step_NNNNNN` directories under `root`): the newest `keep` stay (keep <= 0: all)."""
    if keep > 0:
        for p in _saves(root)[:-keep]:
            shutil.rmtree(p, ignore_errors=True)


def best_record(root: str | Path) -> dict | None:
    """The state of the best checkpoint under `root` (step, metric key and value), None when there is none."""
    best = Path(root) / BEST_DIR
    return json.loads((best / STATE_FILE).read_text()) if best.is_dir() and problem(best) is None else None


def improves(metrics: dict[str, float], key: str, best: float | None) -> bool:
    """Molt's `save_best_checkpoint`: higher is better, the first eval with the metric saves, ties keep the older."""
    return key in metrics and (best is None or metrics[key] > best)


def save_best(trainer, critic, root: str | Path, state: dict) -> Path:
    """Write `<root>/best` like a regular save (ranks into `best.tmp`, the state last, one rename), replacing the
    previous best; `state` is the trainer state plus `best_metric_key` and `best_metric`."""
    tmp = Path(root) / (BEST_DIR + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    trainer.save_checkpoint(str(tmp))
    if critic is not None:
        critic.save_checkpoint(str(tmp / CRITIC_DIR))
    write_state(tmp, state)
    return publish(tmp)


def keep_best(best: float | None, metrics: dict[str, float], plan, trainer, critic, sup, state: dict) -> float | None:
    """After an eval round (driver): save `<plan.dir>/best` when `plan.best_metric_key` improved on `best`, in the
    supervisor's phase; returns the best value so far."""
    key = plan.best_metric_key
    if key is None or not improves(metrics, key, best):
        return best
    t0 = time.perf_counter()
    with sup.phase("best checkpoint save", "actor", "ckpt.best_metric_key"):
        path = save_best(trainer, critic, plan.dir, {**state, "best_metric_key": key, "best_metric": metrics[key]})
    print(f"best checkpoint: {key}={metrics[key]:.4f} at step {state['step']} -> {path} "
          f"({time.perf_counter() - t0:.1f} s)", flush=True)
    return metrics[key]


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())
