"""`python -m runtime`'s exit status for a run that finished: a failure when every consumed prompt was dropped."""

from __future__ import annotations

import os
import subprocess
import sys

from runtime.__main__ import nothing_trained


def test_a_finished_run_that_dropped_every_prompt_failed():
    books = {"prompts/consumed": 16, "prompts/trained": 0, "prompts/dropped/runner_error": 16}
    why = nothing_trained("finished", books)
    assert why is not None and "16 prompts consumed" in why and "runner_error" in why


def test_a_resumed_launch_that_dropped_every_prompt_left_failed():
    """A requeued run resumed at step 3 (24 prompts trained before) whose engine then failed every request: the
    books still say 24 trained, yet this launch trained nothing (seen on a real two-node Slurm requeue)."""
    books = {"prompts/consumed": 96, "prompts/trained": 24, "prompts/dropped/all_rollouts_dropped": 72}
    at_start = {"trained": 24, "dropped": 0}
    why = nothing_trained("finished", books, at_start)
    assert why is not None and "since the resume (24 prompts" in why and "all_rollouts_dropped" in why
    assert nothing_trained("finished", {**books, "prompts/trained": 32}, at_start) is None
    # resumed with nothing left to train: the drops are the first launch's, this one dropped nothing
    assert nothing_trained("finished", books, {"trained": 24, "dropped": 72}) is None


def test_a_run_that_trained_or_consumed_nothing_or_stopped_is_not_that_failure():
    assert nothing_trained("finished", {"prompts/consumed": 16, "prompts/trained": 8,
                                        "prompts/dropped/runner_error": 8}) is None
    assert nothing_trained("finished", {"prompts/consumed": 0, "prompts/trained": 0}) is None  # eval only
    assert nothing_trained("stopped", {"prompts/consumed": 8, "prompts/trained": 0,
                                       "prompts/dropped/run_ended": 8}) is None


def _driver_threads_in_a_fresh_process(omp: str | None) -> int:
    """torch's thread count is process-wide, so each case runs in its own interpreter."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if omp is not None:
        env["OMP_NUM_THREADS"] = omp
    code = ("import torch; torch.set_num_threads(2); from runtime.__main__ import driver_threads; "
            "driver_threads(torch); print(torch.get_num_threads())")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return int(out.stdout.strip())


def test_the_driver_runs_torch_on_one_thread_unless_the_job_sets_omp_num_threads():
    assert _driver_threads_in_a_fresh_process(None) == 1
    # the job's own setting stands (torch read it at import; the test's 2 threads stay)
    assert _driver_threads_in_a_fresh_process("2") == 2
