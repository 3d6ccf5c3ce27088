"""Expert parallelism on the automodel backend (`runtime/models/automodel.py`): nemo-automodel's own device mesh and
MoE parallelizer, its `torch` token dispatcher, on 2 gloo ranks (fp32, a tiny Qwen3-MoE), through the real trainer
(`PolicyWorker`).

The EP 2 run (each rank holds 2 of the 4 experts of each layer, and its own rows of the batch) gives the same old
log-probs, loss statistics and gradients as the one-rank run of the same batch (FSDP2 over one rank), and three
clipped optimizer steps keep the weights equal: the loss is the global token mean over dp (an expert's gradient,
summed over the ep group's tokens by the dispatcher, is divided back to the mean), and the gradient norm is the whole
mesh's (experts on `ep`, the rest on `dp_shard`).
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch
import torch.multiprocessing as mp
from loop_support import trainer_rl

from runtime.experience import from_token_lists
from runtime.tiny_model import build_tiny_model
from schemas.plan import MeshPlan

ROWS = 8
STEPS = 3


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("moe") / "model", seed=0, vocab_size=300, experts=4,
                                experts_per_token=2, tie_word_embeddings=False))


def _rl(world: int, path: str, ep: int):
    # one optimizer-step window of the whole batch in both layouts: world 1 runs 4 micro-batches of 2 rows, each of
    # the 2 ranks 2 micro-batches of 2 rows
    return trainer_rl(
        world, ref=False,
        model={"path": path, "backend": "automodel", "moe_dispatcher": "torch", "router_dtype": "float32"},
        trainer={"micro_batch_size": 2, "grad_accum": ROWS // 2 // world, "max_epochs": 1, "temperature": 1.0,
                 "seed": 0, "packing": False, "dynamic_batch_max_tokens": None, "local_batch_size": None,
                 "mesh": MeshPlan(tp=1, cp=1, ep=ep, pp=1)},
        # Adam's eps above fp32 noise: an element whose gradient is ~0 would turn rounding into a full step
        optimizer=dict(lr=1e-2, eps=1e-5, max_norm=0.5, scheduler="constant", warmup_steps=0, total_steps=10),
        loss=dict(mode="ppo", clip_low=0.2, clip_high=0.2, dual_clip=None, entropy_coef=0.0, aux_loss_coef=0.0,
                  router_z_loss_coef=0.0),
        kl=dict(estimator="k3", use_loss=False), is_correction=dict(level="off"))


def _batch():
    g = torch.Generator().manual_seed(0)
    lengths = [6, 14, 9, 7, 12, 8, 11, 10]
    tokens = [torch.randint(5, 290, (n,), generator=g).tolist() for n in lengths]
    ranges = [[(3, n)] for n in lengths]
    batch = from_token_lists(tokens, ranges, [[] for _ in tokens], pad_id=0)
    advantages = torch.randn(batch.action_mask.shape, generator=torch.Generator().manual_seed(1)) * batch.action_mask
    return replace(batch, advantages=advantages)


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _synced(worker) -> dict[str, torch.Tensor] | None:
    """What a weight sync streams to the engines, as rank 0 assembles it from every rank's shards (the trainer's
    own gather, `ShardGather`, bucket by bucket), under the engine's names."""
    import torch.distributed as dist

    from runtime import weight_sync

    sources = worker.backend.hf_weights(worker.model)
    metas = weight_sync.wire_metas(sources, "float32")
    gather = weight_sync.ShardGather(sources, metas, dist.group.WORLD, worker.rank, worker.world, worker.device,
                                     1 << 16)
    out = {}
    for bucket in weight_sync.bucket_layout(metas, 1 << 16):
        buf = torch.empty(sum(metas[i].nbytes for i in bucket), dtype=torch.uint8) if worker.rank == 0 else None
        gather(bucket, buf)
        if buf is not None:
            out.update((n, t.clone()) for n, t in weight_sync.unpack(buf, metas, bucket, {}))
    gather._finish_sends()
    return out if worker.rank == 0 else None


def _rank_main(rank: int, world: int, port: int, out_dir: str, path: str, ep: int) -> None:
    torch.set_num_threads(1)
    from runtime.trainer import PolicyWorker

    rl = _rl(world, path, ep)
    worker = PolicyWorker(rl.trainer, rl.model, rl.ref, rl.algo, rl.device, rl.dist_backend, rank, "127.0.0.1", port)
    grads: list[dict[str, torch.Tensor]] = []
    step = worker._optimizer_step

    def recorded_step() -> float:
        grads.append({n: _full(p.grad) for n, p in worker.model.named_parameters() if p.grad is not None})
        return step()

    worker._optimizer_step = recorded_step
    batch = _batch()
    out: dict = {"old": [], "stats": []}
    for _ in range(STEPS):
        rows, old, _ref = worker.forward_logprobs(batch)
        full_old = torch.zeros(batch.action_mask.shape)
        full_old[rows] = old
        out["old"].append((rows, old))
        trained = replace(batch, old_log_probs=full_old, rollout_log_probs=full_old)
        out["stats"].append(worker.train(trained, kl_coef=0.0))
    out["grads"] = grads
    out["weights"] = {n: _full(p) for n, p in worker.model.named_parameters()}
    out["synced"] = _synced(worker)
    out["hf_dir"] = worker.export_hf(os.path.join(out_dir, "hf"))
    if ep > 1:  # DCP: save, train a step, load, train the same step again: the same weights
        worker.save_checkpoint(os.path.join(out_dir, "dcp"))
        worker.train(trained, kl_coef=0.0)
        after = {n: _full(p) for n, p in worker.model.named_parameters()}
        worker.load_checkpoint(os.path.join(out_dir, "dcp"))
        out["restored"] = {n: _full(p) for n, p in worker.model.named_parameters()}
        worker.train(trained, kl_coef=0.0)
        out["resumed"] = {n: torch.equal(_full(p), after[n]) for n, p in worker.model.named_parameters()}
    out["placements"] = {n: str(getattr(p, "placements", None)) + str(getattr(p, "device_mesh", None))
                         for n, p in worker.model.named_parameters()}
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    worker.shutdown()


def _run(world: int, ep: int, path: str, out_dir) -> list[dict]:
    from runtime.trainer import free_port

    os.makedirs(out_dir, exist_ok=True)
    mp.spawn(_rank_main, args=(world, free_port(), str(out_dir), path, ep), nprocs=world, join=True)
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(world)]


FAILURES: list = []


def _close(a: torch.Tensor, b: torch.Tensor, what: str, scale: float | None = None) -> None:
    """Within 1e-5 of `scale` (default: the largest magnitude of `b`); failures are collected, then reported."""
    scale = b.abs().max().item() if scale is None else scale
    worst = (a - b).abs().max().item()
    if worst > 1e-5 * max(scale, 1e-3):
        FAILURES.append((what, worst / max(scale, 1e-3)))


def test_ep2_matches_one_rank(moe_checkpoint, tmp_path):
    FAILURES.clear()
    single = _run(1, 1, moe_checkpoint, tmp_path / "single")[0]
    ep = _run(2, 2, moe_checkpoint, tmp_path / "ep")
    # nemo-automodel placed the experts over ep (2 of 4 per rank) and the rest over dp_shard
    placed = ep[0]["placements"]
    assert "ep=2" in placed["model.layers.0.mlp.experts.gate_and_up_projs"].lower()
    assert "dp_shard_cp=2" in placed["model.layers.0.self_attn.q_proj.weight"].lower()
    mask = _batch().action_mask
    for s in range(STEPS):
        old = torch.zeros(mask.shape)
        for r in ep:
            rows, lp = r["old"][s]
            old[rows] = lp
        _close(old * mask, single["old"][s][1] * mask, f"old log-probs, step {s}")
        for key in ("policy_loss_x_tokens", "tokens"):
            _close(torch.tensor(sum(r["stats"][s][key] for r in ep)), torch.tensor(single["stats"][s][key]), key)
        _close(torch.tensor(ep[0]["stats"][s]["grad_norm"]), torch.tensor(single["stats"][s]["grad_norm"]),
               f"grad norm, step {s}")
        assert single["stats"][s]["grad_norm"] > 0.5  # clipping was active
        largest = max(g.abs().max().item() for g in single["grads"][s].values())
        for name, g in single["grads"][s].items():  # relative to the step's largest gradient element
            _close(ep[0]["grads"][s][name], g, f"gradient of {name}, step {s}", largest)
    for name, w in single["weights"].items():
        _close(ep[0]["weights"][name], w, f"{name} after {STEPS} steps")
        _close(ep[1]["weights"][name], w, f"{name} after {STEPS} steps (rank 1)")
    # weight sync: the engine receives the trained weights whole, under transformers' names and layouts
    from runtime.models import automodel

    synced = ep[0]["synced"]
    assert synced.keys() == single["synced"].keys()
    for name, w in ep[0]["weights"].items():
        hf_name, swapped = automodel.hf_name(name)
        assert torch.equal(synced[hf_name], w.transpose(1, 2) if swapped else w), name
        _close(synced[hf_name], single["synced"][hf_name], f"synced {hf_name}")
    # the HF export from the EP shards is the one-rank run's
    from safetensors.torch import load_file

    exported, single_exported = load_file(f"{ep[0]['hf_dir']}/model.safetensors"), load_file(
        f"{single['hf_dir']}/model.safetensors")
    assert exported.keys() == single_exported.keys() and ep[1]["hf_dir"] is None
    for name, t in exported.items():  # (transformers saves its fused experts one expert per key)
        _close(t, single_exported[name], f"exported {name}")
    # DCP resume: the checkpoint restored the weights and the step after it repeats exactly
    for name, w in ep[0]["weights"].items():
        assert torch.equal(ep[0]["restored"][name], w), name
    assert all(ep[0]["resumed"].values()) and all(ep[1]["resumed"].values())
    assert not FAILURES, sorted(FAILURES, key=lambda f: -f[1])[:10]
