"""`python -m tests.runtime.ray_down`: a Ray instance of its own whose GCS is killed (-9) while the supervisor waits
on an actor; prints the supervisor's line (issue 32.7: a GCS death was blamed on "trainer rank 0"). A subprocess,
so that the test session's Ray is never touched."""

from __future__ import annotations

import os
import signal
import time

import ray

from runtime.supervisor import RunAborted, StopFlag, Supervisor
from schemas.plan import SupervisorPlan
from tests.runtime.supervised import Sleeper


def main() -> None:
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    sup = Supervisor(SupervisorPlan.model_construct(poll_s=0.2, stall_timeout_s=60.0, stop_timeout_s=1.0), StopFlag())
    rank = ray.remote(Sleeper).remote()
    sup.watch("actor[0] (trainer rank 0)", rank, rank.ping.remote, "actor")
    ref = rank.sleep.remote(120)
    node = ray._private.worker._global_node
    print("PIDS", *[p.process.pid for ps in node.all_processes.values() for p in ps], flush=True)
    gcs = node.all_processes["gcs_server"][0].process
    os.kill(gcs.pid, signal.SIGKILL)
    t0 = time.monotonic()
    try:
        with sup.phase("weight sync", "trainer rank 0 and the engines", "rollout.engine"):
            sup.get(ref)
    except RunAborted as exc:
        print(f"ABORTED in {time.monotonic() - t0:.1f} s: {exc}", flush=True)
    os._exit(0)  # no ray.shutdown: its GCS is gone (the test kills what is left of this instance)


if __name__ == "__main__":
    main()
