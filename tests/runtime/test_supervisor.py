"""The driver's supervisor against real Ray actors (issue 13.1, 13.2, 13.6): a constructor that fails on a bad data
row, an actor killed while the loop waits on something else, a phase that stalls, a stop that the phase ignores.
Each ends in a bounded time with the actor, the phase and the likely recipe key."""

from __future__ import annotations

import os
import signal
import time

import pytest

from schemas.plan import SupervisorPlan
from tests.runtime.supervised import Sleeper  # importable by the Ray workers (the project root is on their path)

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
    supervisor.watch("rollout.engine[0]", engine, "ping", "rollout.engine")
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
