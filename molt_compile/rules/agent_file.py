"""The agent file (molt_rules.md §2.L, A3): it ships with the recipe, so every problem with it is an error: missing,
not Python, a syntax error, no runner class, or a chat agent on a model without a chat template."""

from __future__ import annotations

from collections.abc import Iterator

from molt_compile.agent_check import inspect_agent
from molt_compile.derive import Derived
from molt_compile.diagnostics import Diagnostic
from molt_compile.rules._base import agent_file_path, diag
from molt_compile.source import SourceMap
from schemas.recipe import RlRecipe


def _agent_path(recipe: RlRecipe) -> str:
    return recipe.agent.path if recipe.agent is not None else ""


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
    f = agent_file_path(recipe, source)
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
    f = agent_file_path(recipe, source)
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
    f = agent_file_path(recipe, source)
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
    f = agent_file_path(recipe, source)
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
    f = agent_file_path(recipe, source)
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
    f = agent_file_path(recipe, source)
    info = inspect_agent(str(f)) if f is not None else None
    if info is not None and info.chat_style and not recipe.data.apply_chat_template:
        yield diag(
            source,
            "data.apply_chat_template",
            f"{_agent_path(recipe)} is a chat agent (ChatAgentRunner), which needs chat-format rows",
            "set data.apply_chat_template: true",
            ["agent.path"],
        )
