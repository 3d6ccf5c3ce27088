"""`molt-compile catalog` and `molt-compile init`: the model and GPU catalog, and a starting recipe.

Added to the group at the end of `molt_compile.cli` (kept apart from the compile plumbing there). Nothing here
imports torch, ray, vllm or transformers.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import click

from molt_compile.cli_output import catalog_tables, console, print_diagnostics

_JSON_TEXT = click.Choice(["text", "json"])


def _dump(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=False) + "\n")


# ------------------------------------------------------------------------------------------------ catalog
@click.command()
@click.argument("which", type=click.Choice(["models", "gpus"]), required=False)
@click.option("--format", "fmt", type=_JSON_TEXT, default="text", show_default=True, help="Output format.")
def catalog(which: str | None, fmt: str) -> None:
    """The model and GPU catalogs: the keys `model.arch` and `cluster.gpu` take (both when WHICH is omitted)."""
    from schemas.catalog import GPUS, MODELS

    wanted = ("models", "gpus") if which is None else (which,)
    if fmt == "json":
        rows: dict[str, dict[str, Any]] = {"models": MODELS, "gpus": GPUS}
        _dump({w: [dataclasses.asdict(v) for v in rows[w].values()] for w in wanted})
        return
    models, gpus = catalog_tables()
    out = console(pipe_width=100)
    for name, table in (("models", models), ("gpus", gpus)):
        if name in wanted:
            out.print(table)


# ------------------------------------------------------------------------------------------------ init
_STARTER_AGENT = '''"""Starter agent written by `molt-compile init`: one turn, reward 1 when the answer equals the label.

Replace `step` with your task's grader (see recipes/agents/ for more).
"""

from runtime.agents import Env, Result, StepEnvRunner


class ExactMatchEnv(Env):
    async def step(self, state: dict) -> Result:
        answer = state["action_text"].replace("<|im_end|>", "").strip()
        correct = answer == str(state["label"]).strip()
        return Result(reward=float(correct), score=float(correct), terminated=True)


AgentRunner = StepEnvRunner(ExactMatchEnv)
'''


def _largest_divisor(n: int, limit: int) -> int:
    return max(d for d in range(1, limit + 1) if n % d == 0)


def _ep(spec: Any, per_node: int) -> str:
    """` mesh: {ep: N},` for an MoE model: the largest expert count divisor that fits one node's actor GPUs."""
    return f" mesh: {{ep: {_largest_divisor(spec.experts, per_node)}}}," if spec.is_moe else ""


def starter_recipe(
    name: str,
    kind: str,
    arch: str,
    model_path: str,
    gpu: str,
    nodes: int,
    gpus_per_node: int,
    data: str,
    agent: str,
    schema: str,
) -> str:
    """A small, complete recipe text: every GPU used, meshes that divide the model's heads."""
    from schemas.catalog import MODELS

    spec = MODELS[arch]
    head = [
        f"# yaml-language-server: $schema={schema}",
        f"# Written by `molt-compile init`; check it with `molt-compile {name}.yaml`, see every value with",
        "# `molt-compile explain`. The keys: schemas/recipe.schema.json (hover in an editor) or the README.",
        "version: 1",
        f"name: {name}",
        f"kind: {kind}",
        f"cluster: {{nodes: {nodes}, gpus_per_node: {gpus_per_node}, gpu: {gpu}}}",
        f"model: {{path: {model_path}, arch: {arch}, backend: {'automodel' if spec.is_moe else 'hf'}, attn: sdpa,"
        f" param_dtype: bf16{', moe_dispatcher: torch' if spec.is_moe else ''}}}",
    ]
    # MoE needs expert parallelism, which only the AutoModel backend has (MOE001, MOE005), with the torch token
    # dispatcher, which runs on any device and across nodes (DeepEP needs its CUDA package: rl-automodel-dispatcher).
    if kind == "sft":
        return "\n".join(
            [
                *head,
                f"actor: {{nodes: {nodes}, gpus_per_node: {gpus_per_node},{_ep(spec, gpus_per_node)} optimizer: "
                "{lr: 1.0e-5}}",
                f"data: {{dataset: {data}, input_key: prompt, output_key: response, max_len: 4096}}",
                f"train: {{batch_size: {8 * nodes * gpus_per_node}, micro_batch_size: 1, max_epochs: 1}}",
                f"ckpt: {{dir: ckpt/{name}/state, hf_dir: ckpt/{name}/hf, every: 100}}",
                "",
            ]
        )
    total = nodes * gpus_per_node
    actor_gpus = max(total // 2, 1) if total > 1 else 1
    actor_nodes, actor_per_node = (nodes // 2, gpus_per_node) if nodes > 1 else (1, actor_gpus)
    rollout_gpus = total - actor_nodes * actor_per_node
    limit = min(rollout_gpus, gpus_per_node, 8)
    # vLLM splits the attention heads; KV heads are split or, below tp, replicated (tp a multiple of them).
    fits = [
        d for d in range(1, limit + 1) if spec.heads % d == 0 and (spec.kv_heads % d == 0 or d % spec.kv_heads == 0)
    ]
    tp = max((d for d in fits if rollout_gpus % d == 0), default=1)
    engines = max(rollout_gpus // tp, 1)
    return "\n".join(
        [
            *head,
            f"actor: {{nodes: {actor_nodes}, gpus_per_node: {actor_per_node},{_ep(spec, actor_per_node)} optimizer: "
            "{lr: 1.0e-6}}",
            f"rollout: {{engine: vllm, engines: {engines}, mesh: {{tp: {tp}}}, batch_size: 16, n_samples_per_prompt: 8,"
            " max_new_tokens: 1024}",
            f"agent: {{path: {agent}}}",
            "algo: {estimator: grpo, is_correction: {level: token}}   # the queue makes batches one step stale",
            "train: {batch_size: 128, micro_batch_size: 1, async: {queue_size: 1}}",
            f"data: {{prompts: {data}, input_key: prompt, label_key: label, max_len: 4096}}",
            f"ckpt: {{dir: ckpt/{name}/state, hf_dir: ckpt/{name}/hf, every: 20}}",
            "",
        ]
    )


@click.command()
@click.argument("output", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--name", help="Job name, [a-z0-9][a-z0-9-]* (default: the file's stem).")
@click.option("--kind", type=click.Choice(["rl", "sft"]), default="rl", show_default=True)
@click.option("--arch", help="Model catalog key (`molt-compile catalog models`).")
@click.option("--model-path", help="Checkpoint directory (default: /path/to/<checkpoint>).")
@click.option("--gpu", help="GPU catalog key or `cpu` (`molt-compile catalog gpus`).")
@click.option(
    "--nodes", type=click.IntRange(1), help="Nodes of the job (default: the fewest that pass the memory checks)."
)
@click.option("--gpus-per-node", type=click.IntRange(1), help="Default: the catalog's GPUs per node.")
@click.option("--data", help="Prompts (rl) or dataset (sft): a JSONL file or a save_to_disk directory.")
@click.option("--force", is_flag=True, help="Overwrite OUTPUT if it exists.")
def init(
    output: Path,
    name: str | None,
    kind: str,
    arch: str | None,
    model_path: str | None,
    gpu: str | None,
    nodes: int | None,
    gpus_per_node: int | None,
    data: str | None,
    force: bool,
) -> None:
    """Write a starting recipe to OUTPUT from a few flags (asked for on a terminal when not given), with a starter
    agent beside it for RL, and check it. Every GPU is used; the vLLM tensor parallelism divides the model's heads."""
    import re

    from molt_compile.compile import compile_recipe
    from schemas.catalog import GPUS, MODELS

    if output.exists() and not force:
        raise click.UsageError(f"{output} exists (--force overwrites it)")
    ask = sys.stdin.isatty()

    def pick(value: Any, prompt: str, default: Any, choices: list[str] | None = None, type_: Any = str) -> Any:
        if value is not None:
            return value
        if not ask:
            return default
        return click.prompt(prompt, default=default, type=click.Choice(choices) if choices else type_)

    name = name or re.sub(r"[^a-z0-9-]+", "-", output.stem.lower()).strip("-") or "my-recipe"
    arch = pick(arch, "model (catalog key)", "qwen3-4b", sorted(MODELS))
    if arch not in MODELS:
        raise click.BadParameter(
            f"unknown model `{arch}`; `molt-compile catalog models` lists them", param_hint="--arch"
        )
    gpu = pick(gpu, "GPU (catalog key or cpu)", "h100-80gb", [*sorted(GPUS), "cpu"])
    if gpu != "cpu" and gpu not in GPUS:
        raise click.BadParameter(f"unknown GPU `{gpu}`; `molt-compile catalog gpus` lists them", param_hint="--gpu")
    # cpu: device slots, two (an actor and an engine), four for MoE (an actor of two: expert parallelism)
    per_node_default = GPUS[gpu].gpus_per_node or (4 if MODELS[arch].is_moe else 2)
    gpus_per_node = pick(gpus_per_node, "GPUs per node", per_node_default, type_=click.IntRange(1))
    nodes = pick(nodes, "nodes", _nodes_that_fit(kind, arch, gpu, gpus_per_node), type_=click.IntRange(1))
    data = pick(
        data, "data (JSONL file or save_to_disk dir)", "data/sft_train.jsonl" if kind == "sft" else "data/train.jsonl"
    )
    model_path = model_path or f"/path/to/{MODELS[arch].hf_name.split('/')[-1]}"
    agent = f"agents/{name.replace('-', '_')}.py"
    schema = (
        Path(__file__).resolve().parent.parent
        / "schemas"
        / ("recipe_sft.schema.json" if kind == "sft" else "recipe.schema.json")
    )
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(
        starter_recipe(
            name, kind, arch, model_path, gpu, nodes, gpus_per_node, data, agent, _relative(schema, output.parent)
        )
    )
    click.echo(f"recipe written to {output}")
    agent_file = output.parent / agent
    if kind == "rl" and not agent_file.exists():
        agent_file.parent.mkdir(parents=True, exist_ok=True)
        agent_file.write_text(_STARTER_AGENT)
        click.echo(f"starter agent written to {agent_file}")
    data_file = output.parent / data
    if not data_file.exists() and data_file.suffix == ".jsonl":
        data_file.parent.mkdir(parents=True, exist_ok=True)
        data_file.write_text(_sample_rows(kind))
        click.echo(f"sample data (replace it) written to {data_file}")
    result = compile_recipe(output)

    shown = [d for d in result.diagnostics if d.severity != "info"]
    if shown:
        print_diagnostics(shown, result, "text")
    errors = sum(d.severity == "error" for d in result.diagnostics)
    click.echo(f"{output}: {errors} errors; next: edit model.path and data, then `molt-compile {output} --smoke`")
    sys.exit(1 if errors else 0)


def _nodes_that_fit(kind: str, arch: str, gpu: str, gpus_per_node: int) -> int:
    """The fewest nodes on which the starter recipe passes the memory checks (MEM001, MEM003): from an estimate
    (16 bytes a parameter for weights, gradients and Adam), the first of the next few that compiles without them."""
    import math
    import tempfile

    from molt_compile.compile import compile_recipe
    from schemas.catalog import GPUS, MODELS

    if gpu not in GPUS or not GPUS[gpu].memory_gib:
        return 1
    needed = math.ceil(MODELS[arch].params_total * 16 / (GPUS[gpu].memory_gib * 2**30 * 0.8))
    actor_nodes = math.ceil(needed / gpus_per_node)
    first = 1 if kind == "rl" and needed <= gpus_per_node // 2 or kind == "sft" and actor_nodes == 1 else actor_nodes
    first = 2 * first if kind == "rl" and first > 1 else first
    with tempfile.TemporaryDirectory() as tmp:
        recipe = Path(tmp) / "fit.yaml"
        for nodes in range(first, first + 12):
            text = starter_recipe("fit", kind, arch, "/m", gpu, nodes, gpus_per_node, "d.jsonl", "a.py", "x")
            recipe.write_text(text)
            codes = {d.code for d in compile_recipe(recipe, lower=False).diagnostics if d.severity == "error"}
            if not codes & {"MEM001", "MEM003"}:
                return nodes
    return first


def _sample_rows(kind: str) -> str:
    rows = [
        {"prompt": f"{a}+{b}=", ("response" if kind == "sft" else "label"): str(a + b)}
        for a in range(16)
        for b in range(16)
    ]
    return "".join(json.dumps(r) + "\n" for r in rows)


def _relative(target: Path, start: Path) -> str:
    import os

    return os.path.relpath(target, start.resolve())
