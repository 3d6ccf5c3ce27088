"""`python -m runtime PLAN.json`: run a compiled plan (the Ray job entrypoint, locally, under Ray Jobs or Slurm).

Connects to the Ray cluster named by RAY_ADDRESS (Ray Jobs and the Slurm script set it); without one, starts a
local Ray instance with exactly the node resources the plan declares, and stops it at the end.
Exit status: 0 finished, 1 the run failed (or finished with every prompt it consumed dropped, none trained), 130
stopped by a signal, 75 checkpointed on SIGUSR1 (run it again: it resumes), 2 unusable plan file (or an unset
`${env:NAME}`, or run/checkpoint directories another run holds).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0] in ("-h", "--help"):
        print(__doc__.strip().splitlines()[0], file=sys.stderr)
        return 2
    from runtime.plan_file import PlanUnusable, read_plan

    path = Path(args[0])
    try:  # `${env:NAME}` references: resolved here, never written back into the plan
        plan, env = read_plan(path)
    except PlanUnusable as exc:
        print(exc, file=sys.stderr)
        return 2
    if plan.kind == "sft" and plan.sft is not None and "WORLD_SIZE" in os.environ:  # a torchrun rank
        from runtime.sft import main as sft_main

        return sft_main([str(path)])
    if plan.kind != "rl" or plan.rl is None:
        print(f"{path}: kind {plan.kind!r} plans run under torchrun (`{' '.join(plan.entrypoint)}`), not this "
              "entrypoint", file=sys.stderr)
        return 2

    from runtime.run_lock import DirectoryInUse, RunLock

    try:  # one run per directory: a second submission of the recipe must not write over this one
        lock = RunLock([plan.rl.logging.out_dir, plan.rl.ckpt.dir]).acquire()
    except (DirectoryInUse, OSError) as exc:  # OSError: a directory that cannot be written (read-only, full)
        print(f"{path}: {exc.strerror if isinstance(exc, OSError) and exc.strerror else exc}", file=sys.stderr)
        return 2
    try:
        return _run_rl(plan, env)
    finally:
        lock.release()


def driver_threads(torch) -> None:
    """One torch thread for the driver unless the job's environment sets OMP_NUM_THREADS.

    The driver (the plan's controller role) reserves no CPU; Ray runs every such process with one thread, and so does
    this one. Its tensor work is one batch's bookkeeping, and beside busy engines, ranks and runners each parallel
    region took 7-13 ms: 0.35 s a step on one H100 (issue 29)."""
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)


def _run_rl(plan, env: dict[str, str]) -> int:
    import ray
    import torch

    from runtime.loop import run

    driver_threads(torch)
    os.environ.update(env)
    started_here = not os.environ.get("RAY_ADDRESS")
    if started_here:
        node = plan.cluster.node_resources
        ray.init(address="local", num_cpus=int(node.get("CPU", 1)), num_gpus=int(node.get("GPU", 0)),
                 resources={k: v for k, v in node.items() if k not in ("CPU", "GPU")}, include_dashboard=False,
                 runtime_env={"env_vars": env}, log_to_driver=True)
    else:
        # A Ray Job (the Jobs API) brings the resolved env in its runtime_env; a plain driver on a cluster it did
        # not start (the Slurm script, smoke runs) gives it to its actors itself.
        in_job = "RAY_JOB_CONFIG_JSON_ENV_VAR" in os.environ
        ray.init(runtime_env=None if in_job else {"env_vars": env})
    try:
        result = run(plan, live=sys.stdout.isatty())
    except Exception as exc:  # one clear line (Ray errors carry the remote traceback in their text)
        cause = getattr(exc, "cause", None) or exc
        print(f"run failed: {type(cause).__name__}: {str(cause).strip().splitlines()[-1]}", file=sys.stderr)
        return 1
    finally:
        if started_here:
            ray.shutdown()
    acc = result.accounting
    dropped = sum(v for k, v in acc.items() if k.startswith("prompts/dropped/"))
    print(f"{result.status} at step {result.step}: prompts consumed {acc.get('prompts/consumed', 0)} "
          f"(trained {acc.get('prompts/trained', 0)}, dropped {dropped}: "
          f"{ {k.removeprefix('prompts/dropped/'): v for k, v in acc.items() if k.startswith('prompts/dropped/')} })")
    print(f"last checkpoint: {result.last_checkpoint or 'none'}")
    print(f"metrics: {result.metrics_path}")
    if result.plot_path is not None:
        print(f"plot: {result.plot_path}")
    if (failed := nothing_trained(result.status, acc, result.books_at_start)) is not None:
        print(f"run failed: {failed}", file=sys.stderr)
        return 1
    from runtime.loop import REQUEUE_EXIT_STATUS

    return {"finished": 0, "requeue": REQUEUE_EXIT_STATUS}.get(result.status, 130)


def nothing_trained(status: str, accounting: dict[str, int], at_start: dict[str, int] | None = None) -> str | None:
    """Why a run that finished is a failure: this launch dropped prompts and trained none (an engine or agent that
    fails every rollout ends the data with no step trained). `at_start`: a resumed or requeued launch's books when
    it began (prompts `trained`, `dropped`), counted from; None otherwise (an eval-only run consumes none,
    a resumed run with nothing left to train drops none)."""
    at_start = at_start or {}
    dropped = {k.removeprefix("prompts/dropped/"): v for k, v in accounting.items() if k.startswith("prompts/dropped/")}
    trained_before = at_start.get("trained", 0)
    if (status != "finished" or accounting.get("prompts/trained", 0) > trained_before
            or sum(dropped.values()) <= at_start.get("dropped", 0)):
        return None
    since = f" since the resume ({trained_before} prompts were trained before it)" if trained_before else ""
    return (f"no step trained{since}: of the {accounting.get('prompts/consumed', 0)} prompts consumed, every one "
            f"left was dropped {dropped} (the runners' errors are in the log above)")


if __name__ == "__main__":
    raise SystemExit(main())
