"""The fault campaign of issues 13 and 32 (`just faults`; tens of minutes, not in CI): each scenario injects one
fault into a short run of the demo recipe on one local Ray cluster and the table says what came of it.

    python -m tests.faults [SCENARIO ...]       (a scenario is chosen by a part of its name)

Every scenario runs with the recipe's DEFAULT agent, stall and stop timeouts (120 s step, 600 s episode, 1,800 s
stall); only a scenario whose point is a setting sets it. Issue 32's items, one scenario or more each:
1 a 10 MB observation; 2 a step that blocks in `time.sleep` (and one that hangs in an await); 3 `${env:NAME}`
secrets reach the runner and the trainer (and an unset one stops `--submit` by name); 4 resume after a torn newest
checkpoint and a torn metrics line, a read-only and a full checkpoint directory (real tmpfs mounts: root); 5 a second
run of the same plan while the first runs; 6 three prompts that crash their runner; 7 kill -9 of a trainer rank,
of the GCS, of the driver under `--submit`; 8 SIGTERM saves a checkpoint. Issue 13's: kills of a runner and the
engine, SIGTERM (also during a hung step), an agent that raises, a malformed data row.

Each row shows the outcome (finished / stopped / aborted with the supervisor's line, or what refused the run), the
seconds from the injection to the end, the prompt books (consumed = trained + dropped, per reason; "balanced" checks
it) and a note of what the scenario checked besides.
"""

from __future__ import annotations

import ast
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROWS, SEED = 48, 0
AGENTS = {"misbehaving": ROOT / "tests/runtime/agents/misbehaving.py",
          "faulty": ROOT / "tests/runtime/agents/faulty_math.py"}


SECRET = "MOLT_FAULTS_TOKEN"


@dataclass
class Scenario:
    name: str
    agent: str = "misbehaving"
    faults: tuple[str, ...] = ()        # prompts of misbehaving.py ("crash ", "hang ", "block ", "flood ") placed early
    inject: str | None = None           # see `inject` and `run_scenario`
    sets: tuple[str, ...] = ()
    ckpt_every: int = -1                # >0: checkpoints every N steps into a fresh directory
    disk: str | None = None             # "ro" | "full": the checkpoint directory on a read-only or a 1 MB tmpfs


SCENARIOS = [
    Scenario("kill -9 runner", inject="kill:runner"),
    Scenario("kill -9 engine", inject="kill:engine"),
    Scenario("kill -9 trainer rank 1 (32.7)", inject="kill:trainer"),
    Scenario("SIGTERM driver", inject="sigterm"),
    Scenario("SIGTERM saves a checkpoint (32.8)", inject="sigterm", ckpt_every=1000),
    Scenario("SIGTERM during a hung Env.step", faults=("hang 2+2=",), inject="sigterm",
             sets=("agent.step_timeout_s=600", "agent.episode_timeout_s=900", "train.stop_timeout_s=10")),
    Scenario("Env.step raises", agent="faulty"),
    Scenario("Env.step hangs in an await (32.2)", faults=("hang 2+2=",)),
    Scenario("Env.step blocks in time.sleep (32.2)", faults=("block 3+3=",)),
    Scenario("10 MB observation (32.1)", faults=("flood 2+2=",)),
    Scenario("agent crashes its process", faults=("crash 1+2=",)),
    Scenario("three prompts crash their runner (32.6)", faults=("crash 1+2=", "crash 2+3=", "crash 0+1=")),
    Scenario("malformed data row", inject="corrupt_data"),
    Scenario("${env:} secret reaches runner and trainer (32.3)", inject="check:secret",
             sets=(f"env.{SECRET}=${{env:{SECRET}}}", f"agent.env.{SECRET}=${{env:{SECRET}}}")),
    Scenario("unset ${env:} secret under --submit (32.3)", inject="unset_submit",
             sets=(f"env.{SECRET}=${{env:{SECRET}_UNSET}}",)),
    Scenario("resume after a torn checkpoint and metrics line (32.4)", inject="tear_resume", ckpt_every=2),
    Scenario("read-only checkpoint dir (32.4)", ckpt_every=2, disk="ro"),
    Scenario("full checkpoint disk (32.4)", ckpt_every=1, disk="full"),
    Scenario("second run of the same plan (32.5)", inject="second_run"),
    Scenario("SIGTERM to molt-compile --submit", inject="sigterm_submit"),
    Scenario("kill -9 driver under --submit (32.7)", inject="kill_driver_submit"),
    Scenario("kill -9 Ray GCS (32.7)", inject="kill:gcs"),   # its driver and Ray in a child process (run_in_child)
]


def write_data(path: Path, faults: tuple[str, ...]) -> None:
    order = list(range(ROWS))
    random.Random(SEED).shuffle(order)
    rows = [{"prompt": f"{i % 5}+{i % 4}=", "answer": str(i % 5 + i % 4)} for i in range(ROWS)]
    for k, prompt in enumerate(faults):
        rows[order[2 + 2 * k]] = {"prompt": prompt, "answer": "0"}
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def plan_sets(sc: Scenario, data: Path, ckpt_dir: Path | None = None) -> list[str]:
    ckpt = (f"ckpt.dir={ckpt_dir}", f"ckpt.every={sc.ckpt_every}") if sc.ckpt_every > 0 else ("ckpt.every=-1",)
    return [f"name=faults-{sum(map(ord, sc.name)) % 10**6}", "rollout.engine=hf", f"data.prompts={data}",
            f"data.max_samples={ROWS}", f"agent.path={AGENTS[sc.agent]}",
            "rollout.n_samples_per_prompt=4", "rollout.batch_size=4",
            "rollout.generate_batch_size=6", "train.batch_size=16", "train.micro_batch_size=4", f"train.seed={SEED}",
            "eval.dataset=null", *ckpt, "ckpt.final_save=false", "logging.tensorboard_dir=null",
            *sc.sets]


def plan_for(sc: Scenario, data: Path, ckpt_dir: Path | None = None):
    from molt_compile.compile import compile_recipe

    result = compile_recipe(ROOT / "recipes/demo_math.yaml", sets=plan_sets(sc, data, ckpt_dir))
    assert result.plan is not None, [d.message for d in result.diagnostics]
    return result.plan


def wait_steps(plan, n: int, proc: subprocess.Popen | None = None) -> None:
    metrics = ROOT / plan.rl.logging.out_dir / "metrics.jsonl"
    deadline = time.time() + 900
    while time.time() < deadline and (proc is None or proc.poll() is None) and not (
            metrics.is_file() and metrics.read_text().count('"rollout/reward_mean"') >= n):
        time.sleep(0.3)


def inject(sc: Scenario, plan, data: Path, at: dict) -> None:
    """Wait for the second logged step (the data fault: for the plan to start), then inject."""
    import ray

    if sc.inject == "corrupt_data":
        lines = data.read_text().splitlines(keepends=True)
        lines[4] = '{"prompt": "9+9=", "answer": \n'   # line 5, after compiling (the compiler would say DATA008)
        data.write_text("".join(lines))
        at["t"] = time.time()
        return
    wait_steps(plan, 4 if sc.inject == "tear_resume" else 2)
    at["t"] = time.time()
    if sc.inject in ("sigterm", "tear_resume"):
        os.kill(os.getpid(), signal.SIGTERM)
        return
    if sc.inject == "check:secret":  # what the actors' processes see (the plan keeps the reference)
        seen = {}
        for name in ("runner[0]", "actor[0]"):
            actor = ray.get_actor(f"{plan.name}.{name}")
            seen[name] = ray.get(actor.__ray_call__.remote(lambda self: os.environ.get(SECRET)))
        at["note"] = "secret in " + ", ".join(f"{k}: {'yes' if v == os.environ[SECRET] else repr(v)}"
                                               for k, v in seen.items())
        return
    if sc.inject == "second_run":  # `python -m runtime PLAN` while this run holds the directories
        plan_file = Path(tempfile.mkdtemp(prefix="molt-faults-")) / "plan.json"
        plan_file.write_text(plan.to_json())
        p = subprocess.run([sys.executable, "-m", "runtime", str(plan_file)], cwd=ROOT, capture_output=True,
                           text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
        at["note"] = f"second run: exit {p.returncode}: {(p.stderr.strip().splitlines() or [''])[-1][-200:]}"
        return
    if sc.inject == "kill:gcs":
        node = ray._private.worker._global_node
        os.kill(node.all_processes["gcs_server"][0].process.pid, signal.SIGKILL)
        return
    name = {"kill:runner": "runner[0]", "kill:engine": "engine[0]", "kill:trainer": "actor[1]"}[sc.inject]
    actor = ray.get_actor(f"{plan.name}.{name}")
    os.kill(ray.get(actor.__ray_call__.remote(lambda self: os.getpid())), signal.SIGKILL)


def run_submit(sc: Scenario) -> dict:
    """`molt-compile RECIPE --submit` in its own process (local cluster + job). `sigterm_submit`: SIGTERM to it after
    the second step: it forwards the signal, the job stops, the cluster it started is torn down (no process left
    under its dir). `kill_driver_submit`: SIGKILL to the job's driver (`python -m runtime`): the launcher names it,
    prints the last logged books and exits 137. `unset_submit`: a `${env:NAME}` that is not set stops it at start."""
    data = Path(tempfile.mkdtemp(prefix="molt-faults-")) / "prompts.jsonl"
    write_data(data, ())
    plan = plan_for(sc, data)
    argv = [sys.executable, "-m", "molt_compile.cli", "recipes/demo_math.yaml", "--submit"]
    for kv in plan_sets(sc, data):
        argv += ["--set", kv]
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS",)}
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    t = time.time()
    if sc.inject != "unset_submit":
        wait_steps(plan, 2, proc)
        t = time.time()
        if sc.inject == "sigterm_submit":
            proc.send_signal(signal.SIGTERM)
        else:
            driver = [pid for pid in os.listdir("/proc") if pid.isdigit() and _parent(pid) == proc.pid
                      and _cmdline_has(pid, "-m runtime")]
            for pid in driver:
                os.kill(int(pid), signal.SIGKILL)
    out, _ = proc.communicate(timeout=600)
    ended = time.time()
    kept = [line.split("Ray logs kept in ", 1)[1].strip() for line in out.splitlines() if "Ray logs kept in " in line]
    left = [pid for pid in os.listdir("/proc") if pid.isdigit() and kept and _cmdline_has(pid, kept[0])]
    said = [line for line in out.splitlines() if line.startswith(("stopped at step", "job ", "molt-compile: the job",
                                                                   "molt-compile: last logged", "molt-compile: job"))
            or "not set" in line]
    outcome = f"exit {proc.returncode}; {'; '.join(said)[-600:]}; processes left under its Ray dir: {len(left)}"
    acc: dict = {}
    for line in out.splitlines():
        if line.startswith("stopped at step") and "prompts consumed" in line:
            acc = {"line": line}
        if "last logged books" in line:
            acc = {"text": line.split("last logged books", 1)[1], "balanced": None}
    return {"scenario": sc.name, "outcome": outcome, "end_s": ended - t, "acc": acc, "rollout_drops": {},
            "restarts": 0, "note": ""}


def _parent(pid: str) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


@contextmanager
def checkpoint_dir(sc: Scenario):
    """A fresh checkpoint directory; on a read-only or a 1 MB tmpfs for the disk scenarios."""
    where = Path(tempfile.mkdtemp(prefix="molt-faults-ckpt-"))
    if sc.disk is None:
        yield where / "ckpt"
        return
    opts = "size=1m" + (",ro" if sc.disk == "ro" else "")
    subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(where)], check=True)
    try:
        yield where / ("ckpt" if sc.disk == "full" else "")
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def _cmdline_has(pid: str, text: str) -> bool:
    try:
        return text in Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return False


def run_scenario(sc: Scenario) -> dict:
    if sc.inject in ("sigterm_submit", "kill_driver_submit", "unset_submit"):
        return run_submit(sc)
    data = Path(tempfile.mkdtemp(prefix="molt-faults-")) / "prompts.jsonl"
    write_data(data, sc.faults)
    with checkpoint_dir(sc) as ckpt_dir:
        plan = plan_for(sc, data, ckpt_dir)
        # the injection waits on this file's steps: an earlier run's file would fire it before this run starts
        (ROOT / plan.rl.logging.out_dir / "metrics.jsonl").unlink(missing_ok=True)
        at: dict = {}
        row = one_run(sc, plan, data, at)
        if sc.inject == "tear_resume":  # damage the newest save and the metrics' last line, then run again
            from runtime import ckpt

            newest = sorted(Path(ckpt_dir).glob("step_*"))[-1]
            shard = max(newest.rglob("*.distcp"), key=lambda f: f.stat().st_size)
            shard.write_bytes(shard.read_bytes()[:64])
            with open(ROOT / plan.rl.logging.out_dir / "metrics.jsonl", "a") as f:
                f.write('{"step": 99, "rollout/rew')
            skipped: list[str] = []
            found = ckpt.latest(ckpt_dir, skipped)
            first = row["outcome"]
            row = one_run(Scenario(sc.name, sc.agent, sc.faults, None, sc.sets, sc.ckpt_every), plan, data, {})
            row["note"] = (f"run 1 {first}; resumed from {found[0].name if found else None}, "
                           f"skipped {len(skipped)}: {skipped[0][-90:] if skipped else ''}")
        elif sc.ckpt_every > 0 and sc.disk is None:
            saves = sorted(p.name for p in Path(ckpt_dir).glob("step_*"))
            row["note"] = (row.get("note") or "") + f" saves: {saves}"
    return row


def one_run(sc: Scenario, plan, data: Path, at: dict) -> dict:
    from runtime.loop import run
    from runtime.metrics import read_jsonl
    from runtime.run_lock import RunLock
    from runtime.supervisor import RunAborted

    if sc.inject == "check:secret":  # Ray started as `python -m runtime` starts it: the resolved job env
        import ray

        from runtime.env_refs import driver_env

        os.environ[SECRET] = "s3cret-" + os.urandom(4).hex()
        ray.shutdown()
        ray.init(address="local", num_cpus=8, resources={"device_slot": 3}, include_dashboard=False,
                 log_to_driver=False, runtime_env={"env_vars": driver_env(plan, os.environ)})
    if sc.inject == "corrupt_data":
        inject(sc, plan, data, at)
    elif sc.inject:  # after a fresh Ray: the injection looks actors up in this one
        threading.Thread(target=inject, args=(sc, plan, data, at), daemon=True).start()
    t0 = time.time()
    lock = RunLock([])
    try:
        lock = RunLock([plan.rl.logging.out_dir, plan.rl.ckpt.dir]).acquire()  # as `python -m runtime` takes it
        result = run(plan, live=False)
        outcome, acc = f"{result.status} at step {result.step}", result.accounting
    except RunAborted as exc:
        outcome, acc = f"aborted: {exc.actor} {exc.what} during {exc.phase!r} (key {exc.key})", exc.accounting
    except Exception as exc:  # noqa: BLE001 - a refusal at start (read-only or full disk): its message is the row
        outcome, acc = f"refused: {type(exc).__name__}: {str(exc)[-200:]}", {}
    finally:
        lock.release()
    ended = time.time()
    metrics = ROOT / plan.rl.logging.out_dir / "metrics.jsonl"
    rows = read_jsonl(metrics) if metrics.is_file() and metrics.read_text().strip() else []
    last = rows[-1] if rows else {}
    rollout_drops = {k.removeprefix("rollout/dropped/"): v for r in rows
                     for k, v in r.items() if k.startswith("rollout/dropped/") and k != "rollout/dropped/total" and v}
    return {"scenario": sc.name, "outcome": outcome, "end_s": ended - at.get("t", t0), "acc": acc,
            "rollout_drops": rollout_drops, "restarts": last.get("rollout/runner_restarts", 0),
            "note": at.get("note", "")}


def books(acc: dict) -> tuple[str, bool | None]:
    if "line" in acc:  # the job's own last line (--submit scenario)
        line = acc["line"]
        nums = [int(x) for x in line.replace("(", " ").replace(",", " ").replace(":", " ").split() if x.isdigit()]
        return line.split(": ", 1)[1], len(nums) >= 4 and nums[1] == nums[2] + nums[3]
    if "text" in acc:  # the launcher's line for a killed driver: the in-flight prompts died with it
        return acc["text"], acc["balanced"]
    dropped = {k.removeprefix("prompts/dropped/"): v for k, v in acc.items() if k.startswith("prompts/dropped/")}
    consumed, trained = acc.get("prompts/consumed", 0), acc.get("prompts/trained", 0)
    line = f"{consumed} = {trained} trained + {sum(dropped.values())} dropped {dropped or ''}".strip()
    return line, consumed == trained + sum(dropped.values())


def run_in_child(sc: Scenario) -> dict:
    """The scenario with its driver (and its own Ray) in a child process: once the GCS is dead, Ray's core worker
    ends the driver's process ("Failed to connect to GCS within 60 seconds"), which must not be the campaign's."""
    proc = subprocess.run([sys.executable, "-m", "tests.faults", "--child", sc.name], cwd=ROOT, capture_output=True,
                          text=True, timeout=1800)
    log = Path(tempfile.mkdtemp(prefix="molt-faults-")) / "driver.log"
    log.write_text(proc.stdout + proc.stderr)
    rows = [line for line in proc.stdout.splitlines() if line.startswith('{"scenario"')]
    if rows:
        return json.loads(rows[-1])
    aborted = re.search(r"^run aborted: (.*?); prompts consumed (\d+) \(trained (\d+), dropped \d+: (\{.*?\})\)",
                        proc.stdout + proc.stderr, re.MULTILINE)
    if aborted:  # the runtime's own line came out; Ray's core worker then ended the process (no row of ours)
        acc = {"prompts/consumed": int(aborted.group(2)), "prompts/trained": int(aborted.group(3))}
        acc |= {f"prompts/dropped/{k}": v for k, v in ast.literal_eval(aborted.group(4)).items()}
        return {"scenario": sc.name, "outcome": f"aborted: {aborted.group(1)}", "end_s": float("nan"), "acc": acc,
                "rollout_drops": {}, "restarts": 0,
                "note": f"then the driver's process exited {proc.returncode}, ended by Ray (log: {log})"}
    return {"scenario": sc.name, "outcome": f"no verdict: the driver's process exited {proc.returncode} (log: {log})",
            "end_s": float("nan"), "acc": {"text": "none (no verdict)", "balanced": False}, "rollout_drops": {},
            "restarts": 0, "note": ""}


def main(argv: list[str]) -> int:
    import ray

    os.chdir(ROOT)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if argv[:1] == ["--child"]:  # run_in_child: one scenario, its row on stdout
        sc = next(s for s in SCENARIOS if s.name == argv[1])
        ray.init(address="local", num_cpus=8, resources={"device_slot": 3}, include_dashboard=False,
                 log_to_driver=False)
        print(json.dumps(run_scenario(sc), default=str), flush=True)
        os._exit(0)  # a dead GCS would make ray.shutdown() wait on it
    exact = [s for s in SCENARIOS if s.name in argv]  # a whole name picks that scenario only
    chosen = exact or [s for s in SCENARIOS if not argv or any(a.lower() in s.name.lower() for a in argv)]
    rows = []
    for sc in chosen:
        print(f"--- {sc.name}", flush=True)
        if sc.inject == "kill:gcs":
            row = run_in_child(sc)
        else:
            if not ray.is_initialized():
                ray.init(address="local", num_cpus=8, resources={"device_slot": 3}, include_dashboard=False,
                         log_to_driver=False)
            row = run_scenario(sc)
        rows.append(row)
        print(json.dumps(row, default=str), flush=True)
        if sc.inject == "check:secret":  # this Ray has the job env: the next starts another
            ray.shutdown()
    if ray.is_initialized():
        ray.shutdown()
    print("\n| scenario | outcome | s to end | books (consumed = trained + dropped) | balanced | rollout drops | note |")
    print("|---|---|---|---|---|---|---|")
    ok = True
    for r in rows:
        line, balanced = books(r["acc"])
        ok &= balanced is not False
        shown = {True: "yes", False: "NO", None: "n/a (driver killed)"}[balanced]
        print(f"| {r['scenario']} | {r['outcome']} | {r['end_s']:.1f} | {line} | {shown} | "
              f"{r['rollout_drops'] or ''} | {r.get('note', '')} |")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
