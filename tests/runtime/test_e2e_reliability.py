"""Issue 13 on a real local Ray cluster (hf engine, 2 FSDP2 ranks), two runs of one misbehaving agent:

1. a run whose agent crashes its process on one prompt, hangs in `Env.step` on another and blocks its runner's event
   loop on a third (failures 2 and 6; since issue 32.2 the blocking step is given up at the step bound): each is dropped with its own reason, the runners are recycled, the other
   prompts train; then the engine is killed with SIGKILL (failure 6): the run ends at once with the actor, the phase,
   the likely recipe key and the accounting;
2. the same run resumed from its last checkpoint (failure 3): every prompt is trained or dropped exactly once over
   both runs (the ones in flight at the save are trained after the resume), the per-step logs hold each step once,
   and the books balance.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import threading
import time

import pytest
from loop_support import ROOT, compile_plan, fresh_out_dirs, read_metrics

pytestmark = pytest.mark.slow

ROWS = 96           # 24 steps of 4 groups, 1.5 s agent steps: the faults play out well before the end
SEED = 0
FAULTS = {2: "crash 1+2=", 4: "hang 2+2=", 6: "block 3+3="}   # position in the seeded order -> prompt
CKPT = "../ckpt/test-e2e-reliability/state"
DUMP = "../ckpt/test-e2e-reliability/rollouts"


def sets(data: str) -> tuple[str, ...]:
    return ("name=test-e2e-reliability", "rollout.engine=hf", f"data.prompts={data}", f"data.max_samples={ROWS}",
            f"agent.path={ROOT / 'tests/runtime/agents/misbehaving.py'}", "agent.step_timeout_s=2",
            "agent.episode_timeout_s=4", "agent.max_prompt_attempts=2", "agent.env.STEP_SLEEP_S='1.5'",
            "rollout.n_samples_per_prompt=4", "rollout.batch_size=4", "rollout.generate_batch_size=6",
            "train.batch_size=16", "train.micro_batch_size=4", f"train.seed={SEED}", "eval.dataset=null",
            "ckpt.every=2", "ckpt.keep=2", "ckpt.dcp_keep=0", "ckpt.save_hf=true", "ckpt.final_save=false",
            f"ckpt.dir={CKPT}", f"train.rollout_dump_dir={DUMP}", "logging.tensorboard_dir=null")


def write_data(path) -> None:
    """ROWS addition prompts; the fault prompts land at the FAULTS positions of the generator's seeded order."""
    order = list(range(ROWS))
    random.Random(SEED).shuffle(order)   # runtime/generator.py: episode 0 of one source
    rows = [{"prompt": f"{i % 5}+{i % 4}=", "answer": str(i % 5 + i % 4)} for i in range(ROWS)]
    for position, prompt in FAULTS.items():
        rows[order[position]] = {"prompt": prompt, "answer": "0"}
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def kill_engine_after_the_faults(plan, out: dict) -> None:
    """Once the three faults are dropped and a checkpoint came after them, SIGKILL the engine's process."""
    import ray

    metrics = ROOT / plan.rl.logging.out_dir / "metrics.jsonl"
    deadline = time.time() + 400
    while time.time() < deadline:
        records = read_metrics(metrics) if metrics.is_file() else []
        done = [r for r in records if r.get("prompts/dropped/agent_crash")
                and r.get("prompts/dropped/all_rollouts_dropped", 0) >= 2]
        if done and any(r["step"] > done[0]["step"] and "timing/ckpt" in r for r in records):
            break
        time.sleep(0.3)
    engine = ray.get_actor(f"{plan.name}.engine[0]")
    out["pid"] = ray.get(engine.__ray_call__.remote(lambda self: os.getpid()))
    os.kill(out["pid"], signal.SIGKILL)
    out["at"] = time.time()


@pytest.fixture(scope="module")
def runs(local_ray, tmp_path_factory):
    from runtime.loop import run
    from runtime.supervisor import RunAborted

    data = tmp_path_factory.mktemp("reliability") / "prompts.jsonl"
    write_data(data)
    plan = compile_plan("recipes/demo_math.yaml", *sets(str(data)))
    fresh_out_dirs(plan)
    shutil.rmtree(ROOT / DUMP, ignore_errors=True)
    killed: dict = {}
    killer = threading.Thread(target=kill_engine_after_the_faults, args=(plan, killed), daemon=True)
    killer.start()
    with pytest.raises(RunAborted) as aborted:
        run(plan, live=False)
    ended_at = time.time()
    killer.join(timeout=10)
    out = ROOT / plan.rl.logging.out_dir
    first = {"metrics": read_metrics(out / "metrics.jsonl"), "prompts": read_metrics(out / "prompts.jsonl")}
    resumed_plan = compile_plan("recipes/demo_math.yaml", *sets(str(data)), "ckpt.resume=true")
    result = run(resumed_plan, live=False)
    return {"plan": resumed_plan, "data": str(data), "aborted": aborted.value, "ended_after_kill_s": ended_at - killed["at"], "first": first,
            "result": result, "metrics": read_metrics(out / "metrics.jsonl"),
            "prompts": read_metrics(out / "prompts.jsonl")}


def test_engine_death_ends_the_run_naming_actor_phase_key_and_books(runs):
    exc = runs["aborted"]
    assert exc.actor == "rollout.engine[0]" and "died" in exc.what, str(exc)
    assert exc.key == "rollout.engine" and exc.phase
    assert "prompts consumed" in str(exc) and exc.accounting["prompts/consumed"] > 0
    assert runs["ended_after_kill_s"] < 30


def test_agent_faults_each_dropped_with_its_own_reason(runs):
    last = runs["first"]["metrics"][-1]
    assert last["prompts/dropped/agent_crash"] == 1          # the crashing prompt, after 2 attempts (not 4 lives)
    # the hung Env.step and the one blocking in time.sleep (its thread abandoned at the step bound, issue 32.2):
    # every rollout step_timeout
    assert last["prompts/dropped/all_rollouts_dropped"] == 2
    assert "prompts/dropped/episode_timeout" not in last
    assert sum(r.get("rollout/dropped/step_timeout", 0) for r in runs["first"]["metrics"]) == 8
    assert last["rollout/runner_restarts"] >= 1


def test_resume_trains_every_prompt_once_and_logs_each_step_once(runs):
    result, prompts = runs["result"], runs["prompts"]
    assert result.status == "finished"
    steps = [p["step"] for p in prompts]
    assert steps == list(range(1, len(steps) + 1))
    assert [r["step"] for r in runs["metrics"] if "rollout/reward_mean" in r] == steps
    trained = [pos for p in prompts for pos in p["prompts"]]
    assert len(trained) == len(set(trained))                              # nothing trained twice
    # nothing lost; the books say whether a missing prompt was dropped (a step over its 2 s bound on a loaded
    # machine drops its rollout: seen once with three test sessions on 2 cores) or lost
    missing = set(range(ROWS)) - set(trained) - set(FAULTS)
    assert not missing and not set(trained) & set(FAULTS), (sorted(missing), result.accounting)
    acc = result.accounting
    dropped = sum(v for k, v in acc.items() if k.startswith("prompts/dropped/"))
    assert acc["prompts/consumed"] == ROWS == acc["prompts/trained"] + dropped
    assert acc["prompts/trained"] == len(trained)


def test_hf_snapshots_at_each_save_pruned_to_keep(runs):
    snapshots = sorted((ROOT / CKPT / "_hf").iterdir())
    last = runs["prompts"][-1]["step"] // 2 * 2
    assert [p.name for p in snapshots] == [f"step_{last - 2:06d}", f"step_{last:06d}"]
    assert all((p / "config.json").is_file() and list(p.glob("*.safetensors")) for p in snapshots)


def test_replay_serves_the_dumped_batches_then_ends(runs):
    """`train.rollout_replay_dir`: the generator serves the dumped `rollout_step{N}.pt` instead of generating (no
    runner is called: it gets none), then ends the stream at the first missing step."""
    import ray
    import torch
    from ray.util.queue import Queue

    from runtime.engine_lock import EngineLock
    from runtime.generator import Generator
    from runtime.messages import EndOfStream, RolloutBatch

    steps = len(runs["prompts"])
    dumps = [torch.load(ROOT / DUMP / f"rollout_step{n}.pt", weights_only=False) for n in range(1, steps + 1)]
    assert [sorted(d["positions"]) for d in dumps[-3:]] == [p["prompts"] for p in runs["prompts"][-3:]]  # trained
    plan = compile_plan("recipes/demo_math.yaml", *sets(runs["data"]), f"train.rollout_replay_dir={DUMP}")
    queue, slots = Queue(maxsize=2), Queue(maxsize=2)
    generator = ray.remote(Generator).remote(plan.rl, [], queue, slots, EngineLock.remote())
    done = generator.run.remote(0, [], 0, {})
    served = []
    for step in range(steps + 1):
        slots.put(step)
        served.append(queue.get(timeout=120))
    assert all(isinstance(m, RolloutBatch) for m in served[:-1]) and isinstance(served[-1], EndOfStream)
    assert [m.prompt_positions for m in served[:-1]] == [d["positions"] for d in dumps]
    first = ray.get(served[0].experience)
    assert torch.equal(first.sequences, dumps[0]["experience"].sequences)
    assert ray.get(done, timeout=60)["prompts/consumed"] == sum(len(d["positions"]) for d in dumps)
