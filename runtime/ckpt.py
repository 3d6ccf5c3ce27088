"""Checkpoints: torch DCP for the resumable state, an HF directory for the final export.

Layout under the plan's `ckpt.dir`:

    step_000010/            one DCP checkpoint per save (every rank writes its shards: model + optimizer)
      scheduler.pt          LR scheduler state (identical on every rank; rank 0 writes it)
      critic/               the critic's DCP checkpoint and scheduler.pt, laid out the same (gae only)
      trainer_state.json    written last by the driver: step, prompts consumed, ...; its presence marks the save complete

`latest(root)` returns the newest complete save, so a run killed mid-save resumes from the previous one.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

STATE_FILE = "trainer_state.json"
CRITIC_DIR = "critic"


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step_{step:06d}"


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


def export_hf(out_dir: str, model, model_path: str, rank: int) -> str | None:
    """Gather full weights (collective) and, on rank 0, write an HF directory loadable by from_pretrained and vLLM.
    Under LoRA: a PEFT adapter directory instead (Molt 0.2.1), loadable by `PeftModel.from_pretrained`."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

    if getattr(model, "molt_lora", None) is not None:
        from runtime import lora

        return lora.export_adapter(out_dir, model, model_path, rank)

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank != 0:
        return None
    config = AutoConfig.from_pretrained(model_path)
    vlm = getattr(config, "vision_config", None) is not None
    with torch.device("meta"):
        hf_model = (AutoModelForImageTextToText if vlm else AutoModelForCausalLM).from_config(config,
                                                                                              dtype=torch.float32)
    hf_model.load_state_dict(sd, strict=False, assign=True)
    hf_model.tie_weights()
    hf_model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(model_path).save_pretrained(out_dir)
    if vlm:  # the processor's files travel as they are (a torchvision-less processor cannot save itself whole)
        for name in ("preprocessor_config.json", "processor_config.json", "chat_template.jinja"):
            if (Path(model_path) / name).is_file():
                shutil.copy(Path(model_path) / name, Path(out_dir) / name)
    return str(out_dir)


# --------------------------------------------------------------------------------------------------- on the driver
def write_state(path: Path, state: dict) -> None:
    tmp = path / (STATE_FILE + ".tmp")
    tmp.write_text(json.dumps(state, indent=2, sort_keys=True))
    tmp.rename(path / STATE_FILE)


def latest(root: str | Path) -> tuple[Path, dict] | None:
    """Newest complete save under `root` (one whose trainer_state.json exists), with its state."""
    saves = sorted(p for p in Path(root).glob("step_*") if (p / STATE_FILE).is_file())
    if not saves:
        return None
    return saves[-1], json.loads((saves[-1] / STATE_FILE).read_text())


def prune(root: str | Path, keep: int) -> None:
    """Keep the newest `keep` complete saves (keep <= 0: all); incomplete ones older than the newest go too."""
    if keep <= 0:
        return
    saves = sorted(Path(root).glob("step_*"))
    complete = [p for p in saves if (p / STATE_FILE).is_file()]
    kept = set(complete[-keep:])
    newest = complete[-1] if complete else None
    for p in saves:
        if p not in kept and (newest is None or p < newest or p in complete):
            shutil.rmtree(p, ignore_errors=True)
