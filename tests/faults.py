"""The fault campaign of issue 13 (`just faults`; minutes, not in CI): each scenario injects one fault into a short
run of the demo recipe on one local Ray cluster and the table says what came of it.

    python -m tests.faults [SCENARIO ...]

Scenarios: kill -9 of a runner, of the engine, of a trainer rank; SIGTERM to the driver (also while an `Env.step`
hangs); an agent that raises, hangs, blocks its event loop or crashes its process; a malformed data row. Issue 32's
run under the recipe's default agent and stall timeouts ("(defaults)"): a step that blocks in `time.sleep`, a 10 MB
observation, three prompts that crash their runner. Each row
shows the outcome (finished / stopped / aborted, with the supervisor's line), the seconds from the injection to
the end of the run, and the prompt books (consumed = trained + dropped, per reason; "balanced" checks it).
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROWS, SEED = 48, 0
AGENTS = {"misbehaving": ROOT / "tests/runtime/agents/misbehaving.py",
          "faulty": ROOT / "tests/runtime/agents/faulty_math.py"}


@dataclass
class Scenario:
    name: str
    agent: str = "misbehaving"
    faults: tuple[str, ...] = ()        # prompts of misbehaving.py ("crash ", "hang ", "block ") placed early
    inject: str | None = None           # kill:runner | kill:engine | kill:trainer | sigterm | corrupt_data
    sets: tuple[str, ...] = ()
    defaults: bool = False              # the recipe's default agent and stall timeouts, not the campaign's tight ones


SCENARIOS = [
    Scenario("kill -9 runner", inject="kill:runner"),
    Scenario("kill -9 engine", inject="kill:engine"),
    Scenario("kill -9 trainer rank 1", inject="kill:trainer"),
    Scenario("SIGTERM driver", inject="sigterm"),
    Scenario("SIGTERM during a hung Env.step", faults=("hang 2+2=",), inject="sigterm",
             sets=("agent.step_timeout_s=600", "agent.episode_timeout_s=900", "train.stop_timeout_s=10")),
    Scenario("Env.step raises", agent="faulty", sets=("agent.step_timeout_s=30",)),  # its steps sleep 2 s
    Scenario("Env.step hangs", faults=("hang 2+2=",)),
    Scenario("agent blocks its event loop", faults=("block 3+3=",)),
    Scenario("agent crashes its process", faults=("crash 1+2=",)),
    Scenario("malformed data row", inject="corrupt_data"),
    Scenario("SIGTERM to molt-compile --submit", inject="sigterm_submit"),
    Scenario("Env.step blocks in time.sleep (defaults)", faults=("block 3+3=",), defaults=True),
    Scenario("10 MB observation (defaults)", faults=("flood 2+2=",), defaults=True),
    Scenario("three prompts crash their runner (defaults)", faults=("crash 1+2=", "crash 2+3=", "crash 0+1="),
             defaults=True),
]


def write_data(path: Path, faults: tuple[str, ...]) -> None:
    order = list(range(ROWS))
    random.Random(SEED).shuffle(order)
    rows = [{"prompt": f"{i % 5}+{i % 4}=", "answer": str(i % 5 + i % 4)} for i in range(ROWS)]
    for k, prompt in enumerate(faults):
        rows[order[2 + 2 * k]] = {"prompt": prompt, "answer": "0"}
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def plan_sets(sc: Scenario, data: Path) -> list[str]:
    tight = () if sc.defaults else ("agent.step_timeout_s=2", "agent.episode_timeout_s=4", "train.stall_timeout_s=300")
    return [f"name=faults-{sum(map(ord, sc.name)) % 10**6}", "rollout.engine=hf", f"data.prompts={data}",
            f"data.max_samples={ROWS}", f"agent.path={AGENTS[sc.agent]}", *tight,
            "rollout.n_samples_per_prompt=4", "rollout.batch_size=4",
            "rollout.generate_batch_size=6", "train.batch_size=16", "train.micro_batch_size=4", f"train.seed={SEED}",
            "eval.dataset=null", "ckpt.every=-1", "ckpt.final_save=false", "logging.tensorboard_dir=null",
            *sc.sets]


def plan_for(sc: Scenario, data: Path):
    from molt_compile.compile import compile_recipe

    result = compile_recipe(ROOT / "recipes/demo_math.yaml", sets=plan_sets(sc, data))
    assert result.plan is not None, [d.message for d in result.diagnostics]
    return result.plan


def inject(sc: Scenario, plan, data: Path, at: dict) -> None:
    """Wait for the second logged step (the data fault: for the plan to start), then inject."""
    import ray

    metrics = ROOT / plan.rl.logging.out_dir / "metrics.jsonl"
    deadline = time.time() + 600
    if sc.inject == "corrupt_data":
        lines = data.read_text().splitlines(keepends=True)
        lines[4] = '{"prompt": "9+9=", "answer": \n'   # line 5, after compiling (the compiler would say DATA008)
        data.write_text("".join(lines))
        at["t"] = time.time()
        return
    while time.time() < deadline and not (metrics.is_file() and metrics.read_text().count('"rollout/reward_mean"') >= 2):
        time.sleep(0.2)
    at["t"] = time.time()
    if sc.inject == "sigterm":
        os.kill(os.getpid(), signal.SIGTERM)
        return
    name = {"kill:runner": "runner[0]", "kill:engine": "engine[0]", "kill:trainer": "actor[1]"}[sc.inject]
    actor = ray.get_actor(f"{plan.name}.{name}")
    os.kill(ray.get(actor.__ray_call__.remote(lambda self: os.getpid())), signal.SIGKILL)


def run_submit_sigterm(sc: Scenario) -> dict:
    """`molt-compile RECIPE --submit` in its own process (local cluster + job); SIGTERM to it after the second step:
    it forwards the signal, the job stops, the cluster it started is torn down (no process left under its dir)."""
    import subprocess

    data = Path(tempfile.mkdtemp(prefix="molt-faults-")) / "prompts.jsonl"
    write_data(data, ())
    plan = plan_for(sc, data)
    argv = [sys.executable, "-m", "molt_compile.cli", "recipes/demo_math.yaml", "--submit"]
    for kv in plan_sets(sc, data):
        argv += ["--set", kv]
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS",)}
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = ROOT / plan.rl.logging.out_dir / "metrics.jsonl"
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None and not (
            metrics.is_file() and metrics.read_text().count('"rollout/reward_mean"') >= 2):
        time.sleep(0.3)
    t = time.time()
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=300)
    ended = time.time()
    kept = [line.split("Ray logs kept in ", 1)[1].strip() for line in out.splitlines() if "Ray logs kept in " in line]
    left = [pid for pid in os.listdir("/proc") if pid.isdigit() and kept and _cmdline_has(pid, kept[0])]
    tail = [line for line in out.splitlines() if line.startswith(("stopped at step", "job "))]
    outcome = f"exit {proc.returncode}; {'; '.join(tail)}; processes left under its Ray dir: {len(left)}"
    acc = {}
    for line in out.splitlines():
        if line.startswith("stopped at step") and "prompts consumed" in line:
            acc = {"line": line}
    return {"scenario": sc.name, "outcome": outcome, "end_s": ended - t, "acc": acc, "rollout_drops": {},
            "restarts": 0}


def _cmdline_has(pid: str, text: str) -> bool:
    try:
        return text in Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return False


def run_scenario(sc: Scenario) -> dict:
    if sc.inject == "sigterm_submit":
        return run_submit_sigterm(sc)
    from runtime.loop import run
    from runtime.metrics import read_jsonl
    from runtime.supervisor import RunAborted

    data = Path(tempfile.mkdtemp(prefix="molt-faults-")) / "prompts.jsonl"
    write_data(data, sc.faults)
    plan = plan_for(sc, data)
    at: dict = {}
    if sc.inject == "corrupt_data":
        inject(sc, plan, data, at)
    elif sc.inject:
        threading.Thread(target=inject, args=(sc, plan, data, at), daemon=True).start()
    t0 = time.time()
    try:
        result = run(plan, live=False)
        outcome, acc = result.status, result.accounting
    except RunAborted as exc:
        outcome, acc = f"aborted: {exc.actor} {exc.what} during {exc.phase!r} (key {exc.key})", exc.accounting
    ended = time.time()
    metrics = ROOT / plan.rl.logging.out_dir / "metrics.jsonl"
    last = read_jsonl(metrics)[-1] if metrics.is_file() and metrics.read_text().strip() else {}
    rollout_drops = {k.removeprefix("rollout/dropped/"): v for r in (read_jsonl(metrics) if last else [])
                     for k, v in r.items() if k.startswith("rollout/dropped/") and k != "rollout/dropped/total" and v}
    return {"scenario": sc.name, "outcome": outcome, "end_s": ended - at.get("t", t0), "acc": acc,
            "rollout_drops": rollout_drops, "restarts": last.get("rollout/runner_restarts", 0)}


def books(acc: dict) -> tuple[str, bool]:
    if "line" in acc:  # the job's own last line (--submit scenario)
        line = acc["line"]
        nums = [int(x) for x in line.replace("(", " ").replace(",", " ").replace(":", " ").split() if x.isdigit()]
        return line.split(": ", 1)[1], len(nums) >= 4 and nums[1] == nums[2] + nums[3]
    dropped = {k.removeprefix("prompts/dropped/"): v for k, v in acc.items() if k.startswith("prompts/dropped/")}
    consumed, trained = acc.get("prompts/consumed", 0), acc.get("prompts/trained", 0)
    line = f"{consumed} = {trained} trained + {sum(dropped.values())} dropped {dropped or ''}".strip()
    return line, consumed == trained + sum(dropped.values())


def main(argv: list[str]) -> int:
    import ray

    os.chdir(ROOT)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    chosen = [s for s in SCENARIOS if not argv or any(a.lower() in s.name.lower() for a in argv)]
    ray.init(address="local", num_cpus=8, resources={"device_slot": 3}, include_dashboard=False, log_to_driver=False)
    rows = []
    for sc in chosen:
        print(f"--- {sc.name}", flush=True)
        row = run_scenario(sc)
        rows.append(row)
        print(json.dumps(row, default=str), flush=True)
    ray.shutdown()
    print("\n| scenario | outcome | s to end | books (consumed = trained + dropped) | balanced | rollout drops |")
    print("|---|---|---|---|---|---|")
    ok = True
    for r in rows:
        line, balanced = books(r["acc"])
        ok &= balanced
        print(f"| {r['scenario']} | {r['outcome']} | {r['end_s']:.1f} | {line} | {'yes' if balanced else 'NO'} | "
              f"{r['rollout_drops'] or ''} |")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
