"""The driver's supervisor against real Ray actors (issue 13.1, 13.2, 13.6): a constructor that fails on a bad data
row, an actor killed while the loop waits on something else, a phase that stalls, a stop that the phase ignores.
Each ends in a bounded time with the actor, the phase and the likely recipe key."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections import Counter
from types import SimpleNamespace

import pytest
from test_generator_dispatch import _generator

from schemas.plan import SupervisorPlan

# importable by the Ray workers (the project root is on their path)
from tests.runtime.supervised import CrashyRunner, Rank, Sleeper

BOUNDS = SupervisorPlan.model_construct(poll_s=0.2, stall_timeout_s=3.0, stop_timeout_s=1.0)


@pytest.fixture
def supervisor(local_ray):
    from runtime.supervisor import StopFlag, Supervisor

    stop = StopFlag()
    yield Supervisor(BOUNDS, stop)
    stop.restore()


def test_a_bad_data_row_in_the_generator_names_file_line_and_key(supervisor, tmp_path):
    import ray

    from runtime.supervisor import RunAborted

    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": \n')
    generator = ray.remote(Sleeper).remote(str(data))
    supervisor.watch_call("generator", generator, generator.sleep.remote(30), "agent")
    idle = ray.remote(Sleeper).remote()
    t0 = time.monotonic()
    with pytest.raises(RunAborted) as err, supervisor.phase("waiting for a rollout batch", "generator", "rollout"):
        supervisor.get(idle.sleep.remote(30))
    assert time.monotonic() - t0 < 20
    assert err.value.actor == "generator" and err.value.key == "data.prompts"
    assert f"{data}:2" in str(err.value) and "not valid JSON" in str(err.value)


def test_a_killed_actor_is_named_while_the_loop_waits_on_another(supervisor):
    import ray

    from runtime.supervisor import RunAborted

    engine, trainer = ray.remote(Sleeper).remote(), ray.remote(Sleeper).remote()
    pid = ray.get(engine.ping.remote())
    supervisor.watch("rollout.engine[0]", engine, engine.ping.remote, "rollout.engine")
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(RunAborted) as err, supervisor.phase("policy step", "actor", "actor"):
        supervisor.get(trainer.sleep.remote(30))
    assert err.value.actor == "rollout.engine[0]" and "died" in err.value.what
    assert err.value.phase == "policy step" and err.value.key == "rollout.engine"


def test_a_stalled_phase_ends_past_its_bound(supervisor):
    import ray

    from runtime.supervisor import RunAborted

    hung = ray.remote(Sleeper).remote()
    t0 = time.monotonic()
    with pytest.raises(RunAborted) as err, supervisor.phase("weight sync", "trainer rank 0 and the engines",
                                                            "rollout.engine"):
        supervisor.get(hung.sleep.remote(60))
    assert BOUNDS.stall_timeout_s <= time.monotonic() - t0 < BOUNDS.stall_timeout_s + 5
    assert "stalled" in err.value.what and "train.stall_timeout_s" in err.value.key
    assert err.value.phase == "weight sync"


def test_a_stop_signal_gives_the_phase_its_bound_then_gives_up(supervisor):
    import ray

    from runtime.supervisor import RunStopped

    hung = ray.remote(Sleeper).remote()
    ref = hung.sleep.remote(60)
    os.kill(os.getpid(), signal.SIGTERM)   # the StopFlag's handler: stop after the current phase
    assert supervisor.stop.requested
    t0 = time.monotonic()
    with pytest.raises(RunStopped):
        supervisor.get(ref)
    assert time.monotonic() - t0 < BOUNDS.stop_timeout_s + 2


def test_a_dead_rank_is_named_not_the_peer_whose_collective_it_broke(supervisor):
    """32.7: a killed trainer rank was reported as the other rank's gloo error, "likely recipe key:
    actor.micro_batch_size". The actor that died is named, with the key of its role."""
    import ray

    from runtime.supervisor import RunAborted

    r0, r1 = (ray.remote(Rank).options(num_cpus=0).remote() for _ in range(2))
    port, pid = ray.get([r1.listen.remote(), r1.ping.remote()])
    refs = [r0.step.remote(port), r1.serve.remote()]
    for r, handle in enumerate((r0, r1)):
        supervisor.watch(f"actor[{r}] (trainer rank {r})", handle, handle.ping.remote, "actor")
    time.sleep(0.5)
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(RunAborted) as err, supervisor.phase("log-probs (π_old, π_ref)", "actor",
                                                            "actor.micro_batch_size"):
        supervisor.get(refs)
    assert err.value.actor == "actor[1] (trainer rank 1)" and err.value.key == "actor", str(err.value)
    assert "died" in err.value.what and "Connection closed by peer" in err.value.what


# ------------------------------------------------------------------------------- the generator's runner budget
def _crashy_generator(prompts: list[str], *, max_restarts: int, window_s: float):
    import ray

    from runtime.generator import _Window

    runner = ray.remote(CrashyRunner).options(max_restarts=-1, num_cpus=0).remote()
    g = _generator([runner])
    g.rl.agent.max_restarts, g.rl.agent.restart_window_s = max_restarts, window_s
    g.rl.generator = SimpleNamespace(batch_size=len(prompts), generate_batch_size=1, dynamic_filtering=None)
    g.rl.sampling = SimpleNamespace(n_samples_per_prompt=1)
    g.sampling, g.inflight, g.ready, g.consumed, g.batched = None, {}, [], 0, 0
    g.prompts_dropped, g.window, g.dropped_positions = Counter(), _Window(), {}
    stream = iter([(i, ((p, "0", None), None)) for i, p in enumerate(prompts)])

    async def produce():
        try:
            return await g._generate_batch(stream)
        finally:
            g._abandon_inflight()
    return g, runner, produce


def books_balance(g) -> bool:
    acc = g.accounting()
    return acc["prompts/consumed"] == acc["prompts/batched"] + sum(
        v for k, v in acc.items() if k.startswith("prompts/dropped/"))


def test_restarts_are_budgeted_per_window_and_the_books_close_when_every_runner_is_given_up(local_ray):
    """32.6: a runner's death past its restart budget within the window gives it up (test_generator_faults.py has
    deaths further apart); with no runner left the generator ends with every prompt it took in the books (the one
    in flight was lost: 106 = 96 + 9)."""
    alone, _, produce_alone = _crashy_generator(["crash", "ok 0", "ok 0"], max_restarts=0, window_s=60.0)
    with pytest.raises(RuntimeError, match="every agent runner was given up"):
        asyncio.run(asyncio.wait_for(produce_alone(), 60))
    assert alone.runners_dead == {0} and alone.prompts_dropped == {"agent_crash": 1, "run_ended": 1}
    assert alone.consumed == 2 and books_balance(alone), alone.accounting()


def test_a_dead_gcs_is_named_as_ray_itself_not_the_actor_waited_on():
    """32.7: a GCS killed under a run was blamed on "trainer rank 0" (the actor the loop waited on). Ray's own
    components are checked while waiting and on every error: the GCS is named, within seconds."""
    import subprocess
    import sys
    import tempfile

    from loop_support import ROOT

    short = tempfile.mkdtemp(prefix="rd", dir="/tmp")  # Ray's socket paths must stay under 108 characters
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_TMPDIR": short}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, "-m", "tests.runtime.ray_down"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    for pid in next((ln.split()[1:] for ln in proc.stdout.splitlines() if ln.startswith("PIDS")), []):
        try:  # what is left of that Ray instance, by pid
            os.kill(int(pid), signal.SIGKILL)
        except OSError:
            pass
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("ABORTED")), proc.stdout + proc.stderr)
    assert "the Ray GCS (head node" in line and "is down" in line and "trainer rank 0" not in line, line
    assert float(line.split()[2]) < 10, line


def test_a_broken_collective_with_no_dead_actor_found_blames_no_recipe_key(supervisor, monkeypatch):
    """32.7: when Ray has not (yet) reported which peer died, a rank's gloo error ("Connection closed by peer") was
    blamed on the phase's recipe key (actor.micro_batch_size). It says a peer died, and names no key."""
    import ray

    from runtime import supervisor as sup_module
    from runtime.supervisor import RunAborted

    monkeypatch.setattr(sup_module, "COLLECTIVE_GRACE_S", 1.0)  # the peer is not watched: nothing will be found
    r0, r1 = (ray.remote(Rank).options(num_cpus=0).remote() for _ in range(2))
    port, pid = ray.get([r1.listen.remote(), r1.ping.remote()])
    ref = r0.step.remote(port)
    r1.serve.remote()
    supervisor.watch("actor[0] (trainer rank 0)", r0, r0.ping.remote, "actor")
    time.sleep(0.5)
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(RunAborted) as err, supervisor.phase("log-probs (π_old, π_ref)", "actor",
                                                            "actor.micro_batch_size"):
        supervisor.get(ref)
    assert "micro_batch_size" not in err.value.key and "peer rank's process died" in err.value.key, str(err.value)
    assert "lost a peer of its collective" in err.value.what and "Connection closed by peer" in err.value.what
