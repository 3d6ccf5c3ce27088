"""Running a smoke recipe (`molt-compile RECIPE --smoke`) and its verdict.

    compile the real recipe -> the smoke pass (molt_compile/smoke.py) -> check its data is readable -> build the
    smoke model (cached) -> compile phase 1 and phase 2 with the ordinary passes -> run phase 1 (one step and a
    checkpoint) and phase 2 (resume, the second step, eval, export) on one local Ray cluster -> verdict

The verdict is short: roles started, steps done, tokens trained, rewards, drops by reason, checkpoint resumed, eval;
`passed` only when all of that happened. A failure names the phase, the actor and the recipe key most likely at
fault, with the log file to read (the job's output goes there, not to the terminal). Nothing here imports torch or
ray: the model builder and the job are subprocesses, as in `--submit`.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from molt_compile.compile import CompileResult, compile_recipe
from molt_compile.smoke import SMOKE_STEPS, SmokePlan, smoke_plan


@dataclass
class Verdict:
    recipe: str
    status: str = "failed"  # passed | refused (CAP001 at compile time) | invalid (other errors) | failed
    phase: str = ""  # where it stopped (or "done")
    detail: str = ""
    roles: str = ""
    steps: int = 0
    tokens: float = 0.0
    rewards: list[float] = field(default_factory=list)
    per_step: str = "rewards"  # what `rewards` holds: rollout rewards (RL) or the train loss (SFT)
    drops: dict[str, int] = field(default_factory=dict)
    resumed: bool = False
    eval_metrics: dict[str, float] = field(default_factory=dict)
    truncated: list[float] = field(default_factory=list)
    """rollout/truncated_rate per step (RL)."""
    max_new_tokens: int | None = None
    """The smoke's new-token budget per rollout (RL)."""
    seconds: float = 0.0
    log: str = ""
    compile_result: CompileResult | None = None
    notes: list[str] = field(default_factory=list)
    """What the smoke model stands in for (an architecture or tokenizer this machine cannot build)."""

    @property
    def ok(self) -> bool:
        return self.status == "passed"

    def lines(self) -> list[str]:
        head = f"smoke {self.recipe}: {self.status.upper()}"
        if self.status == "passed":
            rewards = ", ".join(f"{r:.3f}" for r in self.rewards) or "none"
            ev = ", ".join(f"{k} {v:.3f}" for k, v in sorted(self.eval_metrics.items())) or "none"
            return [
                f"{head} in {self.seconds:.0f} s",
                *(f"  note: {n}" for n in self.notes),
                f"  roles started: {self.roles}",
                f"  steps done: {self.steps} (phase 1: 1 + checkpoint; phase 2: resumed "
                f"{'yes' if self.resumed else 'NO'})",
                f"  tokens trained: {self.tokens:.0f}; {self.per_step} per step: {rewards}",
                f"  dropped: {self.drops or 'none'}; eval: {ev}",
                *(f"  note: {n}" for n in [self.reward_note()] if n),
                f"  logs: {self.log}",
            ]
        out = [f"{head} at {self.phase}: {self.detail}", *(f"  note: {n}" for n in self.notes)]
        if self.log:
            out.append(f"  log: {self.log}")
        return out

    def reward_note(self) -> str:
        """Why every reward is 0 when every rollout was cut by the smoke's short new-token budget: the random
        model's text cannot reach the answer format in that many tokens, so the rewards say nothing here."""
        if self.per_step != "rewards" or not self.rewards or any(r != 0 for r in self.rewards):
            return ""
        if not self.truncated or min(self.truncated) < 1.0:
            return ""
        budget = f"{self.max_new_tokens} new tokens" if self.max_new_tokens else "the smoke's new-token budget"
        return (
            f"rewards 0 with every rollout truncated: {budget} (rollout.max_new_tokens) cannot reach the "
            "answer format; a smoke checks the pipeline, not the rewards"
        )


# ---------------------------------------------------------------------------------------------------- compile
def prepare(
    recipe: Path, sets: tuple[str, ...] = (), root: Path | None = None
) -> tuple[Verdict, SmokePlan | None, dict[int, CompileResult]]:
    """Everything before running: the smoke pass, its data, its model and the two compiled phases."""
    name = recipe.name
    verdict = Verdict(name)
    real = compile_recipe(recipe, sets, lower=False)
    if real.recipe is None or real.derived is None:
        verdict.status, verdict.phase, verdict.compile_result = "invalid", "compile", real
        verdict.detail = "the recipe itself does not compile (diagnostics above)"
        return verdict, None, {}
    sp = smoke_plan(real.recipe, real.derived, real.source, root)
    verdict.notes = list(sp.notes)
    err = build_model(sp)
    if err:
        verdict.phase, verdict.detail = "model", err
        return verdict, sp, {}
    phases = {k: compile_recipe(recipe, (*sets, *sp.sets(k))) for k in (1, 2)}
    for result in phases.values():
        if result.plan is None:
            codes = {d.code for d in result.diagnostics if d.severity == "error"}
            refusals = {"CAP001", "DATA004"} if sp.text_only else {"CAP001"}
            verdict.status = "refused" if codes <= refusals else "invalid"
            verdict.phase, verdict.compile_result = "compile", result
            keys = sorted({d.path for d in result.diagnostics if d.severity == "error" and d.code == "CAP001"})
            reasons = [f"the runtime does not implement what {', '.join(keys)} ask for (CAP001)"] if keys else []
            if "DATA004" in codes and sp.text_only:
                reasons.append(f"{sp.text_only} (DATA004)")
            all_keys = sorted({d.path for d in result.diagnostics if d.severity == "error"})
            verdict.detail = (
                "; ".join(reasons)
                if verdict.status == "refused"
                else f"the smoke recipe has errors ({', '.join(sorted(codes))} at {', '.join(all_keys)})"
            )
            return verdict, sp, phases
    missing = _unreadable_data(real)
    if missing:
        key, path = missing
        verdict.status, verdict.phase = "failed", "data"
        verdict.detail = (
            f"`{key}` ({path}) is not readable here; a smoke run trains on the first rows of the "
            f"recipe's own data: --set {key}=PATH to a small local copy in the same format"
        )
    return verdict, sp, phases


def _unreadable_data(real: CompileResult) -> tuple[str, str] | None:
    from molt_compile.paths import resolve_sources

    r = real.recipe
    keys = [("data.prompts", r.data.prompts)] if r.kind == "rl" else [("data.dataset", r.data.dataset)]
    if r.eval.dataset:
        keys.append(("eval.dataset", r.eval.dataset))
    for key, value in keys:
        for path in resolve_sources(value, key, real.source):
            if not os.path.exists(path):
                return key, path
    return None


def build_model(sp: SmokePlan) -> str:
    """Build the smoke model unless its cache directory exists; an error line, or ''."""
    if (sp.model_dir / "config.json").is_file():
        return ""
    sp.model_dir.parent.mkdir(parents=True, exist_ok=True)
    spec_file = sp.model_dir.parent / f"{sp.model_dir.name}.spec.json"
    spec_file.write_text(json.dumps(sp.model_spec, indent=1, sort_keys=True))
    proc = subprocess.run(
        [sys.executable, "-m", "runtime.smoke_model", str(spec_file), str(sp.model_dir)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        return f"building the smoke model ({sp.model_spec['architecture']}) failed: {last}"
    return ""


# ---------------------------------------------------------------------------------------------------- run
PHASES = {1: "train step 1 and checkpoint", 2: "resume, step 2, eval"}
PROGRESS = re.compile(
    r"^(step \d+/\d+ |eval at step \d+/\d+ |resumed from |checkpointed step |(sft )?\w+ at step \d+: |"
    r"run (failed|aborted)|sft failed)"
)
"""The job's lines that a smoke run repeats on the terminal while it runs (its whole output goes to the log)."""
HEARTBEAT_S = 30.0
POLL_S = 1.0
"""How often the log is read while the job runs."""
LINE_WIDTH = 120


def progress_line(line: str, prefix: str) -> str | None:
    """`prefix` + the job's line when it is one to show (a finished step, an eval round, the resume, the end),
    clipped in its middle to LINE_WIDTH (a path's start and end say the most); else None."""
    line = line.strip()
    if not PROGRESS.match(line):
        return None
    room = LINE_WIDTH - len(prefix)
    if len(line) > room:
        head = (room - 5) // 2
        line = f"{line[:head]} ... {line[len(line) - (room - 5 - head) :]}"
    return prefix + line


def run_logged(argv: list[str], env: dict[str, str], cwd: Path, log: Path, prefix: str, say) -> int:
    """Run `argv` with its output into `log`; say its progress lines as they come, and how long it has run after
    HEARTBEAT_S without one (the roles' start-up takes minutes on a small machine). Its exit status."""
    with log.open("w") as f:
        proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    t0 = last = time.monotonic()
    pending, stepped = "", False
    try:
        with log.open(errors="replace") as reader:
            while True:
                done = proc.poll() is not None
                *lines, pending = (pending + reader.read()).split("\n")
                for line in lines + ([pending] if done else []):
                    shown = progress_line(line, prefix)
                    if shown:
                        say(shown)
                        last, stepped = time.monotonic(), True
                if done:
                    return proc.returncode
                if time.monotonic() - last >= HEARTBEAT_S:
                    what = "training" if stepped else "starting the roles (engines, trainer ranks, runners)"
                    say(f"{prefix}{what}, {time.monotonic() - t0:.0f} s so far")
                    last = time.monotonic()
                with contextlib.suppress(subprocess.TimeoutExpired):  # back at once when the job ends
                    proc.wait(timeout=POLL_S)
    except BaseException:
        proc.kill()
        proc.wait()
        raise


def run_phases(
    verdict: Verdict, sp: SmokePlan, phases: dict[int, CompileResult], cluster: Any | None, say=None
) -> Verdict:
    """Run phase 1 then phase 2 of one smoke recipe (on `cluster`, a running LocalCluster, for RL plans), saying
    their progress through `say`."""
    import shutil

    from molt_compile import job_launch, local_cluster

    root = sp.root
    t0 = time.monotonic()
    plan1 = phases[1].plan
    section = plan1.rl if plan1.kind == "rl" else plan1.sft
    for stale in (sp.work_dir, root / section.logging.out_dir):  # a smoke run starts from nothing, every time
        shutil.rmtree(stale, ignore_errors=True)
    sp.work_dir.mkdir(parents=True, exist_ok=True)
    verdict.roles = ", ".join(f"{r.name} x{r.count}" for r in plan1.roles if r.count)
    logs = []
    for k in (1, 2):
        plan = phases[k].plan
        plan_file = root / job_launch.write_plan_file(plan, root)
        log = sp.work_dir / f"phase{k}.log"
        logs.append(str(log))
        if plan.kind == "sft":
            argv = local_cluster.torchrun_argv(plan, plan_file)
            env = {**os.environ, **job_launch.resolve_env(plan.env)}
        else:
            assert cluster is not None, "RL smoke runs share the local Ray cluster run_smokes starts"
            argv, env = job_launch.entrypoint_command(plan, plan_file, local=True), cluster.env
        prefix = f"smoke {verdict.recipe} phase {k}: "
        if say is not None:
            say(f"{prefix}{PHASES[k]} (log: {log})")
        status = run_logged(argv, env, root, log, prefix, say or (lambda line: None))
        text = log.read_text(errors="replace")
        if status != 0:
            actor, key = blame(text)
            verdict.phase = f"phase {k} ({PHASES[k]})"
            verdict.detail = f"the job exited {status}: {_failure_line(text)} — likely {actor} ({key})"
            verdict.log = str(log)
            return verdict
        untrained = re.search(r"finished at step 0: .*", text)
        if untrained or (k == 1 and not re.search(r"last checkpoint: (?!none)", text)):
            actor, key = blame(text)
            why = f"no step was trained ({untrained.group(0)})" if untrained else "no checkpoint was written"
            verdict.phase, verdict.log = f"phase {k}", str(log)
            verdict.detail = f"{why}; the log's last error: {_failure_line(text)} — likely {actor} ({key})"
            return verdict
        if k == 2:
            verdict.drops = _drops(text)
    verdict.seconds = time.monotonic() - t0
    verdict.log = ", ".join(logs)
    return _read_metrics(verdict, sp, phases[2].plan)


def _read_metrics(verdict: Verdict, sp: SmokePlan, plan: Any) -> Verdict:
    section = plan.rl if plan.kind == "rl" else plan.sft
    path = sp.root / section.logging.out_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    steps = sorted({int(r["step"]) for r in rows if "step" in r and _is_train_row(r)})
    verdict.steps = len(steps)
    verdict.resumed = steps == list(range(1, SMOKE_STEPS + 1)) and _resumed(sp)
    train = [r for r in rows if _is_train_row(r)]
    verdict.tokens = sum(float(r.get("train/tokens", 0.0)) for r in train)
    metric = "rollout/reward_mean" if plan.kind == "rl" else "train/loss"
    verdict.per_step = "rewards" if plan.kind == "rl" else "train loss"
    verdict.rewards = [float(r[metric]) for r in train if metric in r]
    verdict.truncated = [float(r["rollout/truncated_rate"]) for r in train if "rollout/truncated_rate" in r]
    if plan.kind == "rl":
        verdict.max_new_tokens = plan.rl.sampling.max_new_tokens
    verdict.eval_metrics = {
        k: float(v) for r in rows for k, v in r.items() if k.startswith("eval/") and isinstance(v, (int, float))
    }
    problems = []
    if verdict.steps != SMOKE_STEPS:
        problems.append(f"{verdict.steps} steps logged, not {SMOKE_STEPS}")
    if not verdict.resumed:
        problems.append("phase 2 did not resume from phase 1's checkpoint")
    if verdict.tokens <= 0:
        problems.append("no tokens trained")
    if sp.has_eval and not verdict.eval_metrics:
        problems.append("no eval round")
    if problems:
        verdict.phase, verdict.detail = "verdict", "; ".join(problems)
        return verdict
    verdict.status, verdict.phase = "passed", "done"
    return verdict


def _is_train_row(row: dict) -> bool:
    return any(k.startswith("train/") for k in row)


def _resumed(sp: SmokePlan) -> bool:
    log = sp.work_dir / "phase2.log"
    return log.exists() and bool(re.search(r"resumed from \S+ at step 1\b", log.read_text(errors="replace")))


def _drops(text: str) -> dict[str, int]:
    m = re.search(r"dropped \d+: (\{.*?\})", text)
    if not m:
        return {}
    try:
        return {k: int(v) for k, v in json.loads(m.group(1).replace("'", '"')).items()}
    except ValueError:
        return {}


def _failure_line(text: str) -> str:
    for pattern in (r"^run failed: .*$", r"^sft failed.*$", r"^.*cannot run on this build.*$", r"^\w*Error: .*$"):
        found = re.findall(pattern, text, re.M)
        if found:
            return found[-1].strip()[:300]
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return lines[-1][:300] if lines else "(no output)"


BLAME = (
    (r"AgentRunner|runners\.py|agents/|Env\.step|ChatAgent", "an agent runner", "agent.path"),
    (
        r"JSONDecodeError|read_jsonl|input_key|label_key|KeyError: '(prompt|input|label)",
        "the generator",
        "data.prompts / data.input_key",
    ),
    (r"chat.template|apply_chat_template", "the tokenizer", "data.apply_chat_template"),
    (r"VllmEngine|vllm|HfEngine|hf_engine", "a rollout engine", "rollout.*"),
    (r"PolicyWorker|trainer\.py|fsdp|fully_shard", "a trainer rank", "actor.*"),
    (r"Generator|generator\.py", "the generator", "rollout.* / data.*"),
    (r"torch\.distributed|sft\.py", "an SFT rank", "actor.* / data.dataset"),
)


def blame(text: str) -> tuple[str, str]:
    """The actor and the recipe key most likely at fault, from the job's output (the first pattern that matches
    the error's traceback, read from its end)."""
    tail = text[-20000:]
    for pattern, actor, key in BLAME:
        if re.search(pattern, tail):
            return actor, key
    return "the driver", "the recipe"


# ---------------------------------------------------------------------------------------------------- many
def run_smokes(
    items: list[tuple[Path, tuple[str, ...]]],
    root: Path | None = None,
    say=print,
    announce: bool = True,
    jobs: int = 1,
) -> list[Verdict]:
    """Smoke-run every (recipe, sets) on one local Ray cluster; verdicts in order (each also said as it ends when
    `announce`). `jobs` recipes run at once (their phases stay in order): the cluster is sized for the `jobs`
    largest of them together. A phase waits on imports and engine start-up much of its time, so two at once finish
    sooner even on two cores. SFT runs (torchrun, one master port) run one at a time."""
    import concurrent.futures
    import itertools
    import threading

    from molt_compile import job_launch, local_cluster

    prepared = []
    for recipe, sets in items:
        t0 = time.monotonic()
        verdict, sp, phases = prepare(recipe, sets, root)
        verdict.seconds = time.monotonic() - t0
        prepared.append((verdict, sp, phases))
        if verdict.phase and announce:
            say("\n".join(verdict.lines()))
    runnable = [(v, sp, ph) for v, sp, ph in prepared if not v.phase and sp is not None]
    rl_runs = [(sp, ph) for _, sp, ph in runnable if ph[1].plan.kind == "rl"]
    rl_plans = [ph[k].plan for _, ph in rl_runs for k in (1, 2)]
    cluster = None
    try:
        if rl_plans:
            resources: dict[str, float] = {}
            for key in {k for plan in rl_plans for k in plan.cluster.node_resources}:
                # per recipe, the larger of its two phases; then the `jobs` largest recipes together
                needs = [max(ph[k].plan.cluster.node_resources.get(key, 0.0) for k in (1, 2)) for _, ph in rl_runs]
                resources[key] = sum(sorted(needs, reverse=True)[:jobs])
            root = rl_runs[0][0].root  # Ray's workers inherit `ray start`'s working directory: the job root
            say(
                f"smoke: starting one local Ray cluster for {len(rl_runs)} RL smoke run(s) "
                f"({', '.join(f'{k} {v:g}' for k, v in sorted(resources.items()))})"
            )
            plan_file = root / job_launch.write_plan_file(rl_plans[0], root)
            cluster = local_cluster.start_local_cluster(rl_plans[0], {}, root, plan_file, 600, resources)
        one_sft_at_a_time = threading.Lock()

        def smoke(verdict: Verdict, sp: SmokePlan, phases: dict[int, CompileResult]) -> None:
            with one_sft_at_a_time if phases[1].plan.kind == "sft" else contextlib.nullcontext():
                say(f"smoke {verdict.recipe}: running 2 phases ({sp.kind}) ...")
                run_phases(verdict, sp, phases, cluster, say)
            if announce:
                say("\n".join(verdict.lines()))

        # SFT runs alternate with RL ones: two SFT runs taken at once would leave a worker waiting on the lock
        sft = [run for run in runnable if run[2][1].plan.kind == "sft"]
        rl = [run for run in runnable if run[2][1].plan.kind != "sft"]
        order = [run for pair in itertools.zip_longest(sft, rl) for run in pair if run is not None]
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            for done in [pool.submit(smoke, *run) for run in order]:
                done.result()
    except job_launch.LaunchError as err:
        for verdict, _, _ in runnable:
            if not verdict.phase:
                verdict.phase, verdict.detail = "cluster", err.message + (f"; {err.help}" if err.help else "")
    finally:
        if cluster is not None:
            cluster.stop(keep_logs=not all(v.ok for v, _, _ in runnable))
    return [v for v, _, _ in prepared]


def table(verdicts: list[Verdict]) -> str:
    """recipe -> verdict, one line each (the summary `just smoke` prints)."""
    width = max((len(v.recipe) for v in verdicts), default=10)
    rows = [f"{'recipe'.ljust(width)}  verdict   where / what"]
    for v in verdicts:
        what = (
            f"{v.steps} steps, {v.tokens:.0f} tokens, resumed, {len(v.eval_metrics)} eval metrics, {v.seconds:.0f} s"
            if v.ok
            else f"{v.phase}: {v.detail}"
        )
        rows.append(f"{v.recipe.ljust(width)}  {v.status.ljust(8)}  {what}")
    return "\n".join(rows)
