"""Data sources and the agent file (molt_rules.md §2.L, A3, B5, H7).

Data and model paths are checked only as warnings, and only when they are relative (they ship with the recipe):
an absolute path such as /lustre/... is usually visible only on the cluster. The agent file always ships with the
recipe, so problems with it are errors.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

from molt_compile.agent_check import inspect_agent
from molt_compile.derive import Derived
from molt_compile.diagnostics import Diagnostic
from molt_compile.model_facts import model_facts
from molt_compile.paths import path_base
from molt_compile.rules._base import diag
from molt_compile.source import SourceMap
from schemas.recipe import RlRecipe, SftData, SftRecipe

DATA_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet", ".arrow", ".txt")


def _sources(spec: str) -> list[str]:
    return [s.strip().split("@", 1)[0] for s in spec.split(",") if s.strip()]


def prompt_probs_count_mismatch(
    recipe: RlRecipe | SftRecipe, derived: Derived, source: SourceMap
) -> Iterator[Diagnostic]:
    """## What it checks
    The number of interleave probabilities (`data.prompt_probs`, SFT `data.dataset_probs`) equals the number of
    comma-separated sources.

    ## Why it matters
    Molt asserts it when the generator (or SFT trainer) loads the datasets, after the cluster is up.

    ## Example
    ```yaml
    data: {prompts: "data/prompts.jsonl,data/prompts.jsonl", prompt_probs: [0.5, 0.3, 0.2]}
    ```

    ## Use instead
    ```yaml
    data: {prompts: "data/prompts.jsonl,data/prompts.jsonl", prompt_probs: [0.5, 0.5]}
    ```

    ## References
    molt_rules.md L3
    """
    probs, key, n = _mix(recipe)
    if probs is not None and len(probs) != n:
        yield diag(
            source,
            key,
            f"{key} has {len(probs)} probabilities for {n} source(s)",
            f"give exactly {n} probabilities",
            [key.replace("_probs", "s" if recipe.kind == "rl" else "")],
        )


def interleave_probs_not_a_distribution(
    recipe: RlRecipe | SftRecipe, derived: Derived, source: SourceMap
) -> Iterator[Diagnostic]:
    """## What it checks
    The interleave probabilities (`data.prompt_probs`, SFT `data.dataset_probs`) are each > 0 and sum to 1 (to
    1e-8), when there is one per source (DATA001 checks that).

    ## Why it matters
    Molt interleaves with `datasets.interleave_datasets(..., stopping_strategy="all_exhausted")`: numpy refuses
    probabilities that do not sum to 1, and datasets refuses a source that is never drawn (it could never be
    exhausted), when the job loads the data, after the cluster is up. The compiler counts the mix with the same draws
    (`schemas.schedule.interleaved_rows`) and needs a distribution too.

    ## Example
    ```yaml
    data: {prompts: "data/prompts.jsonl,data/prompts.jsonl", prompt_probs: [0.6, 0.6]}
    ```

    ## Use instead
    ```yaml
    data: {prompts: "data/prompts.jsonl,data/prompts.jsonl", prompt_probs: [0.5, 0.5]}
    ```

    ## References
    molt_rules.md §1.1 (`--data.prompt_probs`), L3
    """
    from schemas.schedule import probs_problem

    probs, key, n = _mix(recipe)
    if probs is not None and len(probs) == n and (problem := probs_problem(n, probs)):
        yield diag(source, key, f"{key}: {problem}", "give one probability > 0 per source, summing to 1")


def packing_with_vlm(recipe: RlRecipe | SftRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    `actor.packing: true` on a VLM run (RL: `data.max_images_per_prompt > 0`; SFT: `data.image_key` set).

    ## Why it matters
    Packing is text-only. Molt's SFT CLI raises; its RL CLI prints a warning and silently turns packing off. The
    compiler never rewrites a value silently, so both are errors with the same fix.

    ## Example
    ```yaml
    model: {path: Qwen/Qwen3.6-35B-A3B, arch: qwen3.6-35b-a3b}
    actor: {packing: true, mesh: {ep: 4}}
    data: {max_images_per_prompt: 1}
    ```

    ## Use instead
    ```yaml
    model: {path: Qwen/Qwen3.6-35B-A3B, arch: qwen3.6-35b-a3b}
    actor: {packing: false, mesh: {ep: 4}}
    data: {max_images_per_prompt: 1}
    ```

    ## References
    molt_rules.md B5, H7
    """
    if not recipe.actor.packing:
        return
    if recipe.kind == "sft" and recipe.data.image_key:
        yield diag(
            source,
            "actor.packing",
            f"packing is text-only, but data.image_key {recipe.data.image_key!r} makes this a VLM SFT run",
            "set actor.packing: false (use actor.mesh.cp for long sequences)",
            ["data.image_key"],
        )
    elif recipe.kind == "rl" and recipe.data.max_images_per_prompt > 0:
        yield diag(
            source,
            "actor.packing",
            f"packing is text-only, but data.max_images_per_prompt "
            f"{recipe.data.max_images_per_prompt} makes this a VLM run (Molt would turn packing off)",
            "set actor.packing: false",
            ["data.max_images_per_prompt"],
        )


def local_data_file_missing(recipe: RlRecipe | SftRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    Relative data files (prompts, SFT dataset, eval dataset) with a data-file suffix exist next to the recipe.

    ## Why it matters
    A relative path ships with the recipe, so a missing file is most likely a typo; the run would fail when the
    generator loads it. Absolute paths and hub names are not checked (they may exist only on the cluster).

    ## Example
    ```yaml
    data: {prompts: data/promts.jsonl}
    ```

    ## Use instead
    ```yaml
    data: {prompts: data/prompts.jsonl}
    ```

    ## References
    molt_rules.md A4, L3
    """
    keys = ["data.dataset" if recipe.kind == "sft" else "data.prompts", "eval.dataset"]
    for key in keys:
        base = path_base(source, key)
        if base is None:
            return
        section, field = key.split(".")
        spec = getattr(getattr(recipe, section), field)
        for src in _sources(spec or ""):
            p = Path(src)
            if not p.is_absolute() and p.suffix.lower() in DATA_SUFFIXES and not (base / p).exists():
                yield diag(
                    source,
                    key,
                    f"{key}: {src} does not exist (relative to {base})",
                    "fix the path; a relative path is resolved against the file that sets it (the project root for --set)",
                )


def images_on_text_model(recipe: RlRecipe | SftRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    Images enabled (`data.max_images_per_prompt > 0`, SFT `data.image_key`) for a model that has no vision encoder.

    ## Why it matters
    vLLM rejects `limit_mm_per_prompt` for a text-only model at engine start, and the trainer has no vision tower.

    ## Example
    ```yaml
    model: {path: Qwen/Qwen3-8B, arch: qwen3-8b}
    data: {max_images_per_prompt: 1}
    ```

    ## Use instead
    ```yaml
    model: {path: Qwen/Qwen3-8B, arch: qwen3-8b}
    data: {max_images_per_prompt: 0}
    ```

    ## References
    molt_rules.md B16, H15
    """
    facts = model_facts(recipe, source)
    if facts is None or facts.is_vlm:
        return
    if recipe.kind == "rl" and recipe.data.max_images_per_prompt > 0:
        yield diag(
            source,
            "data.max_images_per_prompt",
            f"data.max_images_per_prompt {recipe.data.max_images_per_prompt} but {facts.key} is a text-only model",
            "set data.max_images_per_prompt: 0, or use a VLM",
            ["model.arch"],
        )
    elif recipe.kind == "sft" and recipe.data.image_key:
        yield diag(
            source,
            "data.image_key",
            f"data.image_key set but {facts.key} is a text-only model",
            "remove data.image_key, or use a VLM",
            ["model.arch"],
        )


def local_model_path_missing(recipe: RlRecipe | SftRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    A local `model.path` (or `ref.path` / `critic.path`) exists and holds weights (`*.safetensors`, `*.bin`,
    `*.pt`/`*.pth`, or their index files). Local: relative and starting with `./` or `../` or with more than two
    path parts, or absolute on a file system visible here (its first directory exists on this machine).

    ## Why it matters
    Such a path cannot be a hub name (`org/name`), so a missing directory, or one without weights (a tokenizer or
    config copied alone), fails when every actor loads the checkpoint, after the cluster is up. Absolute paths on
    file systems this machine does not mount are not checked.

    ## Example
    ```yaml
    model: {path: ./models/tiny-qwen3-typo, arch: tiny-qwen3}
    ```

    ## Use instead
    ```yaml
    model: {path: Qwen/Qwen3-8B, arch: qwen3-8b}
    ```

    ## References
    molt_rules.md A1, B9
    """
    keys = ["model.path"] + [f"{r}.path" for r in ("ref", "critic") if getattr(recipe, r, None) is not None]
    for key in keys:
        base = path_base(source, key)
        if base is None:
            return
        section, field = key.split(".")
        value = getattr(getattr(recipe, section), field)
        if not value:
            continue
        p = Path(value)
        if p.is_absolute():
            visible = len(p.parts) > 2 and _is_dir(Path(*p.parts[:2]))  # /lustre on a laptop: not checkable
            if visible and not _exists(p):
                yield diag(source, key, f"{key}: {value} does not exist", "fix the path (or use a hub name)")
                continue
            local, where = visible, p
        else:
            local, where = value.startswith(("./", "../")) or len(p.parts) > 2, base / p
            if local and not _exists(where):
                yield diag(
                    source,
                    key,
                    f"{key}: {value} does not exist (relative to {base})",
                    "fix the path, or use an absolute cluster path / a hub name",
                )
                continue
        if local and _is_dir(where) and not _has_weights(where):
            yield diag(
                source,
                key,
                f"{key}: {value} holds no weights (no *.safetensors, *.bin or *.pt files)",
                "point it at the checkpoint directory itself (config.json next to the weight files)",
            )


WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.safetensors.index.json", "*.bin.index.json")


def _has_weights(directory: Path) -> bool:
    try:
        return any(next(directory.glob(pattern), None) is not None for pattern in WEIGHT_PATTERNS)
    except OSError:
        return True  # unreadable here: nothing to say


def _exists(path: Path) -> bool:
    return os.path.exists(path)  # False, not OSError, for a name over NAME_MAX


def _is_dir(path: Path) -> bool:
    return os.path.isdir(path)


# ---------------------------------------------------------------------------------------------- agent
def _agent_path(recipe: RlRecipe) -> str:
    return recipe.agent.path if recipe.agent is not None else ""


def _agent_file(recipe: RlRecipe, source: SourceMap) -> Path | None:
    agent = recipe.agent
    if agent is None:
        return None
    p = Path(agent.path)
    base = path_base(source, "agent.path")
    return p if p.is_absolute() or base is None else base / p


def missing_agent(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    An `agent:` section, required for every estimator except on_policy_distill (which has a built-in agent).

    ## Why it matters
    The agent turns prompts into rewarded trajectories; gae included, every RL run needs one. Molt raises
    "--train.agent_path is required" in its CLI; eval datasets and dynamic filtering need it too.

    ## Example
    ```yaml
    agent: null
    ```

    ## Use instead
    ```yaml
    agent: {path: agents/step_agent.py}
    ```

    ## References
    molt_rules.md A3, L7, C3
    """
    if recipe.agent is None and recipe.algo.estimator != "on_policy_distill":
        path = "agent" if source.is_set("agent") else "algo.estimator"
        yield diag(
            source,
            path,
            f"algo.estimator {recipe.algo.estimator} needs an agent, but the recipe has no `agent:` section",
            "add `agent: {path: agents/<file>.py}`",
            ["algo.estimator"],
        )


def agent_file_not_found(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    `agent.path` names an existing file (relative to the file that sets it; to the project root for `--set`: the
    recipe's repository, as the job runs there, so the plan is the same from any working directory).

    ## Why it matters
    The agent ships with the recipe; every runner process imports it at start-up and the run dies there.

    ## Example
    ```yaml
    agent: {path: agents/no_such_agent.py}
    ```

    ## Use instead
    ```yaml
    agent: {path: agents/step_agent.py}
    ```

    ## References
    molt_rules.md L4
    """
    f = _agent_file(recipe, source)
    if f is not None and not inspect_agent(str(f)).exists:
        yield diag(
            source,
            "agent.path",
            f"agent.path {_agent_path(recipe)}: no such file ({f})",
            "fix the path; it is relative to the file that sets it (the project root for --set)",
        )


def agent_file_not_python(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    `agent.path` ends in `.py`.

    ## Why it matters
    Molt loads the agent with `spec_from_file_location` and asserts the suffix inside every runner.

    ## Example
    ```yaml
    agent: {path: agents/step_agent.txt}
    ```

    ## Use instead
    ```yaml
    agent: {path: agents/step_agent.py}
    ```

    ## References
    molt_rules.md L4
    """
    f = _agent_file(recipe, source)
    if f is not None and inspect_agent(str(f)).exists and not inspect_agent(str(f)).is_python:
        yield diag(
            source,
            "agent.path",
            f"agent.path {_agent_path(recipe)} is not a .py file",
            "point agent.path at the Python file that defines AgentRunner",
        )


def agent_file_syntax_error(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    The agent file parses as Python.

    ## Why it matters
    A syntax error surfaces only when each runner imports the file, after the cluster and models are up.

    ## Example
    ```yaml
    agent: {path: agents/broken_syntax.py}
    ```

    ## Use instead
    ```yaml
    agent: {path: agents/step_agent.py}
    ```

    ## References
    molt_rules.md L4
    """
    f = _agent_file(recipe, source)
    info = inspect_agent(str(f)) if f is not None else None
    if info is not None and info.syntax_error:
        yield diag(
            source,
            "agent.path",
            f"{_agent_path(recipe)}:{info.syntax_line}: syntax error: {info.syntax_error}",
            "fix the agent file",
        )


def agent_runner_missing(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    The agent file defines `AgentRunner` at module level (see `molt_compile/agent_check.py` for the accepted forms).

    ## Why it matters
    The runner actors look up `AgentRunner` by name; Molt asserts it in every runner at start-up.

    ## Example
    ```yaml
    agent: {path: agents/no_runner.py}
    ```

    ## Use instead
    ```yaml
    agent: {path: agents/step_agent.py}
    ```

    ## References
    molt_rules.md L4, §6.1
    """
    f = _agent_file(recipe, source)
    info = inspect_agent(str(f)) if f is not None else None
    if (
        info is not None
        and info.exists
        and info.is_python
        and not info.syntax_error
        and info.runner is None
        and info.not_a_runner is None
    ):
        yield diag(
            source,
            "agent.path",
            f"{_agent_path(recipe)} defines no module-level AgentRunner",
            "add `AgentRunner = StepEnvRunner(MyEnv)` (or ChatAgentRunner(MyAgent)) at the end of the file",
        )


def agent_runner_not_a_runner(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    `AgentRunner` is a Runner: a subclass of `Runner`/`StepEnvRunner`/`ChatAgentRunner`, or an instance such as
    `StepEnvRunner(MyEnv)`; and the class given to `StepEnvRunner(...)` / `ChatAgentRunner(...)` derives from
    `Env` / `ChatAgent` when it is defined in the same file.

    ## Why it matters
    Molt asserts both in every runner process at start-up.

    ## Example
    ```yaml
    agent: {path: agents/not_a_runner.py}
    ```

    ## Use instead
    ```yaml
    agent: {path: agents/step_agent.py}
    ```

    ## References
    molt_rules.md L4, L5, L6
    """
    f = _agent_file(recipe, source)
    info = inspect_agent(str(f)) if f is not None else None
    if info is None:
        return
    for why, line in ((info.not_a_runner, info.runner_line), (info.wrong_env, info.wrong_env_line)):
        if why:
            yield diag(
                source,
                "agent.path",
                f"{_agent_path(recipe)}:{line}: {why}",
                "bind AgentRunner to StepEnvRunner(<Env subclass>) or ChatAgentRunner(<ChatAgent subclass>)",
            )


def chat_agent_without_chat_template(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    A chat-style agent (ChatAgentRunner, or a runner with `PRERENDER_PROMPT = False`) with
    `data.apply_chat_template: false`.

    ## Why it matters
    Chat agents consume the dataset rows as chat messages; Molt raises "Chat agents consume the same chat-format
    dataset as step agents: pass --data.apply_chat_template" when the generator starts.

    ## Example
    ```yaml
    agent: {path: agents/chat_agent.py}
    data: {apply_chat_template: false}
    ```

    ## Use instead
    ```yaml
    agent: {path: agents/chat_agent.py}
    data: {apply_chat_template: true}
    ```

    ## References
    molt_rules.md L1, §6.1
    """
    f = _agent_file(recipe, source)
    info = inspect_agent(str(f)) if f is not None else None
    if info is not None and info.chat_style and not recipe.data.apply_chat_template:
        yield diag(
            source,
            "data.apply_chat_template",
            f"{_agent_path(recipe)} is a chat agent (ChatAgentRunner), which needs chat-format rows",
            "set data.apply_chat_template: true",
            ["agent.path"],
        )


def _mix(recipe) -> tuple[list[float] | None, str, int]:
    """The data mix of a recipe: its probabilities, their key, and how many sources they weigh."""
    d = recipe.data
    spec, probs, key = (
        (d.dataset, d.dataset_probs, "data.dataset_probs")
        if isinstance(d, SftData)
        else (d.prompts, d.prompt_probs, "data.prompt_probs")
    )
    return probs, key, len(_sources(spec))
