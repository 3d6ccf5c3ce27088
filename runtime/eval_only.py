"""An evaluation-only run (`eval.only`): score the eval set once and exit (`reference/molt_rules.md` A6, J4).

The plan has no trainer, so no FSDP model and no optimizer is built: only the rollout engines (loaded from
`model.path`: a policy checkpoint, or the HF export a training run wrote to its `ckpt.hf_dir`), the router, the
agent runners and the generator, which runs one eval round with `eval.n_samples_per_prompt` samples per prompt.
Reported: the eval/* metrics of training evals (reward, pass1, response length, truncation) and pass@k for each k of
`eval.pass_k` with the unbiased estimator (`runtime/passk.py`). Written: metrics.jsonl (one record, step 0) and
`eval_results.json` in `logging.out_dir`, the metrics with one record per eval prompt.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import ray

from runtime.engine_lock import EngineLock
from runtime.engines import engines_ready
from runtime.generator import Generator
from runtime.messages import RunResult
from runtime.metrics import MetricsSink
from runtime.roles import create_placement_groups, role_options, start_rollout, start_runners
from runtime.supervisor import Started, Supervisor
from schemas.plan import Plan, RlRuntime

RESULTS_FILE = "eval_results.json"


def run_eval_only(plan: Plan, rl: RlRuntime, sup: Supervisor, started: Started, *, live: bool = True) -> RunResult:
    """Under the driver's supervisor: a dead engine, runner or generator, or a stalled round, aborts with its name;
    `started` tears everything down on every exit path (`rl`: the plan's section)."""
    out_dir = Path(rl.logging.out_dir)
    sink = MetricsSink(out_dir, Path(rl.logging.tensorboard_dir) if rl.logging.tensorboard_dir else None, 1, live,
                       append=False, wandb=rl.logging.wandb, config=plan.recipe, engine=rl.engines.kind)
    started.sink = sink
    with sup.phase("placement groups", "the Ray cluster", "cluster"):
        pgs = create_placement_groups(plan, sup)
    started.pgs = list(pgs.values())
    engines, router = start_rollout(plan, pgs, sup, wait=False)
    started.handles += engines
    for i, e in enumerate(engines):
        sup.watch(f"rollout.engine[{i}]", e, e.weights_version.remote, "rollout.engine")
    # The runners and the generator start (imports, tokenizer, agent, prompts) while the engines load.
    lock = EngineLock.options(**role_options(plan, "lock")).remote()  # type: ignore[attr-defined]  # @ray.remote
    runners = start_runners(plan, router)
    started.handles += [lock, *runners]
    # No rollout queue or slots: the generator is only asked for one eval round.
    generator: Any = ray.remote(Generator).options(**role_options(plan, "generator")).remote(
        plan.rl, runners, None, None, lock)
    started.handles.append(generator)
    with sup.phase("engine start-up", "rollout.engine", "rollout"):
        sup.get(engines_ready(engines))  # init errors surface here, not at a generate
    with sup.phase("agent runner start-up", "runner", "agent.path"):
        sup.get([r.pid.remote() for r in runners])  # an agent file that fails to import stops the run here, clearly
    sink.status(f"evaluating {rl.eval.dataset} with {rl.eval.sampling.n_samples_per_prompt} samples per prompt")
    t0 = time.time()
    with sup.phase("eval round", "generator", "eval"):
        metrics, prompts = sup.get(generator.evaluate.remote(per_prompt=True))
    sink.log(0, metrics)
    sink.close()
    started.sink = None
    results = {"plan": plan.name, "fingerprint": plan.fingerprint, "model": rl.model.path,
               "dataset": rl.eval.dataset, "n_samples_per_prompt": rl.eval.sampling.n_samples_per_prompt,
               "pass_k": list(rl.eval.pass_k), "metrics": metrics, "seconds": time.time() - t0, "prompts": prompts}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / RESULTS_FILE).write_text(json.dumps(results, indent=2, default=str))
    accounting = {"prompts/consumed": len(prompts), "prompts/trained": 0}
    return RunResult("finished", 0, accounting, None, sink.path)
