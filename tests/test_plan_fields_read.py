"""Every field of the plan is read by the runtime, refused by a capability row, or on the justified list below
(issue 13.7: keys that were accepted and read nowhere).

"Read by the runtime": the field's name is accessed as an attribute somewhere under runtime/ or in schemas/schedule.py
(which the job runs at its start) (an AST walk; a
coarse test by name, which is what makes a field that nothing reads stand out). "Refused": a row of
schemas/capabilities.py whose `asks` reads it (a plan asking for it does not compile: CAP001).
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import typing
from pathlib import Path

from pydantic import BaseModel

from schemas import capabilities
from schemas.plan import Plan

ROOT = Path(__file__).resolve().parents[1]

NOT_FOR_THE_RUNTIME = {
    # read by the launchers (molt_compile/submit.py, the Slurm template, runtime/preflight's cluster check) and by
    # `explain`; the runtime gets the same facts through node_resources and each role's ray_options
    "schema_version": "checked when the plan is parsed (Plan.from_json), not by the loop",
    "cluster.gpus_per_node": "launchers and explain; roles carry ray_options",
    "cluster.gpu": "launchers and explain (catalog key)",
    "cluster.device_resource": "launchers: the resource name the roles' ray_options already use",
    "cluster.cpus_per_node": "launchers: `ray start --num-cpus`",
    "cluster.total_gpus": "explain",
    "cluster.used_gpus": "explain",
    "derived": "explain: every derived number with its reason; the runtime reads the sections they were lowered into",
    "derived.reason": "explain",
    "derived.inputs": "explain",
    "placement_groups.bundle_nodes": "Slurm and explain: Ray places the bundles itself",
    "roles": "read through Plan.role(name)",
    "roles.actor_class": "explain and the GPU map: the runtime knows the class of each role",
    "roles.instances.node": "GPU map and Slurm: Ray assigns nodes through the placement groups",
    "roles.instances.devices": "GPU map: Ray assigns devices within a bundle",
    "gpu_map": "explain and the rendered plan",
    "runtime_env": "the Ray Jobs submission (molt_compile/submit.py)",
    "sft.command": "the torchrun launchers (molt_compile/local_cluster.py, the Slurm template)",
    # derived facts the compiler used; the runtime reads what they were lowered into
    "rl.model.arch": "the compiler's memory estimate and rules; the runtime reads config.json",
    "sft.model.arch": "the compiler's memory estimate and rules",
    "rl.engines.gpus_per_engine": "placement rules; the engine role's ray_options carry the GPUs",
    "rl.agent.max_turns": "lowered into agent.env as MAX_AGENT_TURNS, which the runners export",
    "rl.data.prompt_count": "the step schedule (schedule.total_steps is lowered from it)",
    "sft.data.sample_count": "the step schedule (schedule.total_steps is lowered from it)",
    "rl.schedule.steps_per_episode": "explain; total_steps bounds the run",
    "rl.trainer.shuffle_microbatches": "Molt's G11 fact, for explain; the runtime reads what it was realized as, "
    "micro_batches_by_length (derived from it and packing: a shuffled grouping's least-padding draw)",
    # settings whose non-default values need a feature that a capability row refuses, or that a rule rejects
    "rl.trainer.mesh.cp": "refused by rl-trainer-cp (the row reads the axis by name)",
    "rl.trainer.mesh.ep": "read by the automodel backend's device_mesh; refused by rl-trainer-ep-layout/-cuda",
    "sft.trainer.mesh.cp": "refused by sft-trainer-cp",
    "sft.trainer.mesh.ep": "read by the automodel backend's device_mesh; refused by sft-trainer-ep-layout/-cuda",
    "rl.trainer.optimizer.muon": "Muon settings: refused by rl-muon",
    "rl.critic.optimizer.muon": "the critic is refused by rl-critic",
    "sft.trainer.optimizer.muon": "Muon settings: refused by sft-muon",
    "rl.critic.value_clip": "the critic is refused by rl-critic",
    "rl.critic.freeze_moe_router": "the critic is refused by rl-critic",
    "rl.trainer.freezing_steps": "actor freezing steps exist only with a critic (DEAD002), refused by rl-critic",
    # MoE and VLM knobs: the compiler warns when they are set on a model without such modules (DEAD005, DEAD008);
    # MoE models train through nemo-automodel (issue 16)
    "rl.trainer.loss.aux_loss_coef": "MoE aux loss: MoE training is issue 16 (DEAD005 on dense models)",
    "rl.trainer.freeze_moe_router": "MoE: issue 16 (DEAD005 on dense models)",
    # performance knobs without an effect in this runtime (known gaps, not silent correctness changes)
    "rl.engines.router_balance_abs": "known gap: cache_aware is served as consistent_hash (runtime/engines/router.py)",
    "rl.engines.router_balance_rel": "known gap: cache_aware is served as consistent_hash (runtime/engines/router.py)",
    "rl.eval.sampling.top_logprobs": "always 0: eval never asks for top-k (molt_compile/lower/rl.py)",
    "rl.data.dataloader_num_workers": "the generator reads the prompt rows once, in-process: no loader workers",
    "sft.data.dataloader_num_workers": "the SFT rows are read in-process: no loader workers",
    # SFT checkpoint retention extras (issue 13 implemented them for RL)
    "sft.ckpt.save_hf": "known gap: SFT writes its HF export at the end only",
    "sft.ckpt.best_metric_key": "RL-only in Molt (the SFT recipe has no such key; lowered for a common section)",
    "sft.ckpt.warm_resume_rollouts": "RL-only in Molt (no rollouts in SFT)",
}


def _runtime_attribute_names() -> set[str]:
    names: set[str] = set()
    # schemas/schedule.py runs in the job (runtime/datasource.derive_at_start): the values the compiler deferred
    for path in [*(ROOT / "runtime").rglob("*.py"), ROOT / "schemas" / "schedule.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute):
                names.add(node.attr)
    return names


def _refused_names() -> set[str]:
    """Attribute names the capability rows' predicates read."""
    names: set[str] = set()
    for cap in capabilities.CAPABILITIES:
        for node in ast.walk(_parse_predicate(inspect.getsource(cap.asks))):
            if isinstance(node, ast.Attribute):
                names.add(node.attr)
    return names


def _parse_predicate(src: str) -> ast.AST:
    """A predicate's source: a nested `def` (parsed dedented), or the lines of a call holding a lambda (the lambda
    is cut out: the longest prefix from `lambda` that parses)."""
    src = textwrap.dedent(src)
    if src.startswith("def "):
        return ast.parse(src)
    text = src[src.find("lambda"):]
    for end in range(len(text), 0, -1):
        try:
            return ast.parse(text[:end], mode="eval")
        except SyntaxError:
            continue
    raise AssertionError(f"cannot parse the predicate {src!r}")


def _models(tp) -> list[type[BaseModel]]:
    out = []
    for arg in typing.get_args(tp) or (tp,):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            out.append(arg)
        elif typing.get_args(arg):
            out.extend(_models(arg))
    return out


def _field_paths(model: type[BaseModel], prefix: str = "") -> list[str]:
    paths = []
    for name, info in model.model_fields.items():
        path = f"{prefix}.{name}" if prefix else name
        paths.append(path)
        for sub in _models(info.annotation):
            paths.extend(_field_paths(sub, path))
    return paths


def test_every_plan_field_is_read_refused_or_justified():
    read, refused = _runtime_attribute_names(), _refused_names()
    unread = [p for p in _field_paths(Plan) if p.rsplit(".", 1)[-1] not in read | refused
              and p not in NOT_FOR_THE_RUNTIME]
    assert unread == [], f"plan fields nothing reads (read them, refuse them in schemas/capabilities.py, or justify " \
                         f"them here): {unread}"


def test_the_justified_list_names_real_fields():
    paths = set(_field_paths(Plan))
    assert [p for p in NOT_FOR_THE_RUNTIME if p not in paths] == []           # renamed or removed fields
