"""Expert parallelism on the automodel backend (`runtime/models/automodel.py`): nemo-automodel's own device mesh and
MoE parallelizer, its `torch` token dispatcher, on 2 and 4 gloo ranks (fp32, a tiny Qwen3-MoE), through the real
trainer (`PolicyWorker`).

Each layout gives the same old log-probs, loss statistics and gradients as the one-rank run of the same batch (FSDP2
over one rank), and three clipped optimizer steps keep the weights equal: the loss is the global token mean over dp
(an expert's gradient, summed over the ep group's tokens by the dispatcher and averaged over ep_shard, is divided
back to the mean), and the gradient norm is the whole mesh's. Then what a weight sync streams, the HF export and a
DCP save / resume. The layouts:
- EP 2 on 2 ranks: each rank holds 2 of the 4 experts of each layer (ep = the ranks), the rest FSDP2 over both;
- EP 2 x dp 2 on 4 ranks: each expert's weights FSDP2-sharded over the 2 ranks of its ep_shard group (dim 1), the
  rest over all 4 (`shard_layout`'s (Shard(1), Shard(0)) box, gathered into the engine's layout);
- HSDP with EP 2 on the same 4 ranks (one spawn): dp_replicate 2 x dp_shard 2 for the non-expert parameters
  ((Replicate, Shard(0))), the experts as above; and HSDP at ep 1 (the hf backend's FSDP2 units over its 2-D mesh,
  the experts replicated and sharded like the rest).
LoRA (`LORA`: nemo-automodel's adapters on the attention, `runtime/lora.py` `apply_automodel`) runs as one more
layout of the same spawns, at EP 2 and EP 2 x dp 2, against the one-rank LoRA run: the same checks, only the
adapters training, the engines getting the merged weights (W + scale·B@A, the adapters left out) and the export being
the PEFT adapter.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import replace

import pytest
import torch
import torch.multiprocessing as mp
from loop_support import trainer_rl

from runtime import moe
from runtime.experience import from_token_lists
from runtime.tiny_model import build_tiny_model
from schemas.plan import LoraPlan, MeshPlan

ROWS = 8
STEPS = 3
DEVICE = os.environ.get("MOLT_PARALLEL_DEVICE", "cpu")
"""`cuda`: the same layouts over NCCL, one GPU per rank (tests/gpu/check_expert_parallel.py)."""
LORA = LoraPlan(dim=4, alpha=8, scale=2.0,
                target_modules=["*.self_attn.q_proj", "*.self_attn.o_proj", "*.mlp.down_proj"])
"""The adapters of the LoRA layouts: a column-parallel (q) and row-parallel (o, down) layer under tensor
parallelism; the MoE model has no dense down_proj (its experts are never adapted)."""
Layout = tuple[MeshPlan, LoraPlan | None] | tuple[MeshPlan, LoraPlan | None, bool]
"""The mesh, the adapters, and what more the running module's `_rl` takes (test_tensor_parallel.py: sequence
parallelism, then CPU offload's level)."""


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("moe") / "model", seed=0, vocab_size=300, experts=4,
                                experts_per_token=2, tie_word_embeddings=False))


def _rl(world: int, path: str, mesh: MeshPlan, lora: LoraPlan | None = None, replay: bool = False,
        compiled: bool = False):
    # one optimizer-step window of the whole batch in every layout: world 1 runs 4 micro-batches of 2 rows, each of
    # 2 ranks 2 micro-batches, each of 4 ranks one. `replay`: R3 of `_batch`'s recorded routing; `compiled`: the
    # decoder layers compiled, with full checkpointing (the recompute replays too)
    return trainer_rl(
        world, ref=False,
        model={"path": path, "backend": "automodel", "moe_dispatcher": "torch", "router_dtype": "float32",
               "compile_layers": compiled, "gradient_checkpoint": "full" if compiled else "none"},
        trainer={"micro_batch_size": 2, "grad_accum": ROWS // 2 // world, "max_epochs": 1, "temperature": 1.0,
                 "seed": 0, "packing": False, "dynamic_batch_max_tokens": None, "local_batch_size": None,
                 "mesh": mesh, "lora": lora, "routing_replay": replay,
                 # contiguous micro-batches: grouped by length, each rank would group its own shard, and one rank the
                 # whole batch, an order of float sums that moves three Adam steps past this test's 1e-5
                 "micro_batches_by_length": False},
        # Adam's eps above fp32 noise: an element whose gradient is ~0 would turn rounding into a full step
        optimizer=dict(lr=1e-2, eps=1e-5, max_norm=max_norm(lora), scheduler="constant", warmup_steps=0,
                       total_steps=10),
        loss=dict(mode="ppo", clip_low=0.2, clip_high=0.2, dual_clip=None, entropy_coef=0.0, aux_loss_coef=0.0,
                  router_z_loss_coef=0.0),
        kl=dict(estimator="k3", use_loss=False), is_correction=dict(level="off"),
        device=DEVICE, dist_backend="nccl" if DEVICE == "cuda" else "gloo")


def max_norm(lora: LoraPlan | None) -> float:
    """Low enough that clipping acts at every step (the adapters' gradient norm is a few tenths)."""
    return 0.5 if lora is None else 0.05


def _batch(routed: bool = False):
    """The batch of every layout; `routed`: with a recorded routing to replay (2 of the 4 experts per token and MoE
    layer, drawn at random, so the model's own top-k differs; each row's last token not captured, as an engine's)."""
    g = torch.Generator().manual_seed(0)
    lengths = [6, 14, 9, 7, 12, 8, 11, 10]
    tokens = [torch.randint(5, 290, (n,), generator=g).tolist() for n in lengths]
    ranges = [[(3, n)] for n in lengths]
    routing = None
    if routed:
        routing = [torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(n * 2)]).view(n, 2, 2)
                   for n in lengths]
        for r in routing:
            r[-1] = moe.NO_ROUTING
    batch = from_token_lists(tokens, ranges, [[] for _ in tokens], pad_id=0, routed_experts=routing)
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


def _rank_main(rank: int, world: int, port: int, out_dir: str, path: str, layouts: list[Layout],
               then: Callable[[int, int, int, str, str], None] | None = None) -> None:
    """Each layout in turn in the same processes (a spawn costs more than a layout's run), over one process group:
    torch's meshes remember their groups by name, and a re-created default group reuses the names. `then`: one
    more run in the same group (rank, world, port, out_dir, path)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    if DEVICE == "cuda":  # one GPU per rank, as Ray pins them (before this process touches CUDA)
        os.environ["CUDA_VISIBLE_DEVICES"] = str(rank)
    init = dist.init_process_group
    dist.init_process_group = lambda *a, **k: None if dist.is_initialized() else init(*a, **k)  # type: ignore
    for k, (mesh, lora, *options) in enumerate(layouts):
        _layout(rank, world, port, os.path.join(out_dir, str(k)), path, mesh, lora, *options)
    if then is not None:
        then(rank, world, port, out_dir, path)
    dist.destroy_process_group()


def _layout(rank: int, world: int, port: int, out_dir: str, path: str, mesh: MeshPlan,
            lora: LoraPlan | None, *options) -> None:
    from torch._dynamo.utils import counters

    from runtime.trainer import PolicyWorker

    counters.clear()  # this layout's compiles (`model.compile_layers`) only
    rl = _rl(world, path, mesh, lora, *options)
    worker = PolicyWorker(rl.trainer, rl.model, rl.ref, rl.algo, rl.device, rl.dist_backend, rank, "127.0.0.1", port)
    grads: list[dict[str, torch.Tensor]] = []
    step = worker._optimizer_step

    def recorded_step() -> float:
        grads.append({n: _full(p.grad) for n, p in worker.model.named_parameters() if p.grad is not None})
        return step()

    worker._optimizer_step = recorded_step
    batch = _batch(rl.trainer.routing_replay)
    out: dict = {"old": [], "stats": [], "max_norm": rl.trainer.optimizer.max_norm}
    for k in range(STEPS):
        rows, old, _ref = worker.forward_logprobs(batch)
        full_old = gathered(rows, old, world)  # as the driver puts the ranks' rows together
        out["old"].append((rows, old))
        trained = replace(batch, old_log_probs=full_old, rollout_log_probs=full_old)
        with saved_bytes(worker.model) as saved:
            out["stats"].append(worker.train(trained, kl_coef=0.0))
        if k == 0:
            out["saved_bytes"] = saved[0]
    out["grads"] = grads
    out["graph_breaks"], out["graphs"] = sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"]
    if rl.trainer.routing_replay:  # the last forward's (a checkpoint's recompute): the experts each router used
        state = worker._replay_state
        out["replayed"] = (torch.stack(state.selected, dim=1).cpu(), state.targets.cpu())
    out["weights"] = {n: _full(p) for n, p in worker.model.named_parameters()}
    out["synced"] = _synced(worker)
    out["hf_dir"] = worker.export_hf(os.path.join(out_dir, "hf"))
    if world > 1:  # DCP: save, train a step, load, train the same step again: the same weights
        worker.save_checkpoint(os.path.join(out_dir, "dcp"))
        worker.train(trained, kl_coef=0.0)
        after = {n: _full(p) for n, p in worker.model.named_parameters()}
        worker.load_checkpoint(os.path.join(out_dir, "dcp"))
        out["restored"] = {n: _full(p) for n, p in worker.model.named_parameters()}
        worker.train(trained, kl_coef=0.0)
        out["resumed"] = {n: torch.equal(_full(p), after[n]) for n, p in worker.model.named_parameters()}
    out["placements"] = {n: str(getattr(p, "placements", None)) + str(getattr(p, "device_mesh", None))
                         for n, p in worker.model.named_parameters()}
    if rl.trainer.offload != "none":  # what the level changed in the built rank, after the resume's step
        from test_offload import offload_checks

        out["offload"] = offload_checks(worker, rl.trainer.offload)
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))


@contextlib.contextmanager
def saved_bytes(model):
    """The bytes of the activations autograd saves for the backward under it (parameters, which it also saves,
    left out), as a one-element list: what activation checkpointing cuts."""
    params = {(p.to_local() if hasattr(p, "to_local") else p).untyped_storage().data_ptr() for p in model.parameters()}
    total = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        local = t.to_local() if hasattr(t, "to_local") else t
        try:
            parameter = isinstance(local, torch.nn.Parameter) or local.untyped_storage().data_ptr() in params
        except RuntimeError:  # a wrapper subclass without storage of its own (an activation)
            parameter = False
        if not parameter:
            total[0] += local.numel() * local.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield total


def gathered(rows: torch.Tensor, values: torch.Tensor, world: int) -> torch.Tensor:
    """Every rank's (rows, values) put together in batch order, on every rank (`gather_rows`: each row from the rank
    that returns it, a data-parallel rank's first cp or tp rank)."""
    import torch.distributed as dist

    from runtime.ranks import gather_rows

    parts: list = [None] * world
    dist.all_gather_object(parts, (rows, values))
    return gather_rows(parts)


def _run(world: int, layouts: list[Layout], path: str, out_dir) -> list[list[dict]]:
    """Per layout, every rank's results."""
    from runtime.trainer import free_port

    for k in range(len(layouts)):
        os.makedirs(os.path.join(out_dir, str(k)), exist_ok=True)
    mp.spawn(_rank_main, args=(world, free_port(), str(out_dir), path, layouts), nprocs=world, join=True)
    return [[torch.load(os.path.join(out_dir, str(k), f"rank{r}.pt")) for r in range(world)]
            for k in range(len(layouts))]


def _mesh(ep: int, dp_replicate: int = 1) -> MeshPlan:
    return MeshPlan(tp=1, cp=1, ep=ep, pp=1, dp_replicate=dp_replicate)


@pytest.fixture(scope="module")
def single(moe_checkpoint, tmp_path_factory) -> tuple[dict, dict, dict]:
    """The one-rank eager runs every layout is held against: without and with LoRA, and under routing replay."""
    plain, lora, replayed = _run(1, [(_mesh(1), None), (_mesh(1), LORA), (_mesh(1), None, True)], moe_checkpoint,
                                 tmp_path_factory.mktemp("single"))
    return plain[0], lora[0], replayed[0]


COMPILED_BREAKS, COMPILED_GRAPHS = 4, 12
"""The compiled layout's graph breaks and its layers' graphs on each rank: per grad mode (the no-grad old log-probs,
the training forward with its backward) 6 graphs, shared by both layers and every width (each rank's two
micro-batches differ), and 2 breaks: nemo-automodel's attention's padding check (`key_mask.all().item()`) and the
eager MoE block. Resumed graphs compiled for one width (dynamo's default) would recompile at each rank's second width
(4 graphs more per grad mode). dynamo's count also holds nemo-automodel's own compiled kernels, which the eager MoE
block calls (its experts' activation, `weighted_swiglu_back`): at most one of them meets an argument pattern the
spawn's earlier layouts did not."""
FAILURES: list = []


def _close(a: torch.Tensor, b: torch.Tensor, what: str, scale: float | None = None) -> None:
    """Within 1e-5 of `scale` (default: the largest magnitude of `b`); failures are collected, then reported."""
    scale = b.abs().max().item() if scale is None else scale
    worst = (a - b).abs().max().item()
    if worst > 1e-5 * max(scale, 1e-3):
        FAILURES.append((what, worst / max(scale, 1e-3)))


def test_ep2_matches_one_rank(moe_checkpoint, single, tmp_path):
    ep, ep_lora, compiled = _run(2, [(_mesh(2), None), (_mesh(2), LORA), (_mesh(2), None, True, True)],
                                 moe_checkpoint, tmp_path)
    # nemo-automodel placed the experts over ep (2 of 4 per rank) and the rest over dp_shard
    placed = ep[0]["placements"]
    assert "ep=2" in placed["model.layers.0.mlp.experts.gate_and_up_projs"].lower()
    assert "dp_shard_cp=2" in placed["model.layers.0.self_attn.q_proj.weight"].lower()
    _check(single[0], ep)
    # LoRA: the adapters FSDP2-sharded over dp_shard like the attention they adapt, the experts over ep (frozen)
    placed = ep_lora[0]["placements"]
    assert "dp_shard_cp=2" in placed["model.layers.0.self_attn.q_proj.lora_A.weight"].lower()
    assert "ep=2" in placed["model.layers.0.mlp.experts.gate_and_up_projs"].lower()
    _check(single[1], ep_lora)
    # compiled decoder layers (`model.compile_layers`, full checkpointing around them) under routing replay (R3): the
    # attention and norms compiled, the MoE block (gate, replay, token dispatch, experts) eager between them
    # (hf.compile_layers says why); the graphs are generic from the first micro-batch (every later width and the
    # recompute reuse them); the numbers and the replay are the one-rank eager replayed run's
    for r in compiled:
        assert r["graph_breaks"] == COMPILED_BREAKS and 0 <= r["graphs"] - COMPILED_GRAPHS <= 1, (
            r["graph_breaks"], r["graphs"])
    _check(single[2], compiled)


def test_ep2_by_dp2_and_hsdp_match_one_rank(moe_checkpoint, single, tmp_path):
    ep_dp, hsdp, hsdp_only, ep_dp_lora = _run(
        4, [(_mesh(2), None), (_mesh(2, dp_replicate=2), None), (_mesh(1, dp_replicate=2), None), (_mesh(2), LORA)],
        moe_checkpoint, tmp_path)
    single, single_lora, _ = single
    # ep 2 of 4 ranks: every expert's weights FSDP2-sharded over its ep_shard pair (dim 1), the rest over all 4
    placed = ep_dp[0]["placements"]
    assert "(shard(dim=1), shard(dim=0))" in placed["model.layers.0.mlp.experts.gate_and_up_projs"].lower()
    assert "ep_shard=2, ep=2" in placed["model.layers.0.mlp.experts.gate_and_up_projs"].lower()
    assert "dp_shard_cp=4" in placed["model.layers.0.self_attn.q_proj.weight"].lower()
    _check(single, ep_dp)
    # HSDP: two replicas of dp_shard 2 for the rest
    placed = hsdp[0]["placements"]
    assert "(replicate(), shard(dim=0))" in placed["model.layers.0.self_attn.q_proj.weight"].lower()
    assert "dp_replicate=2" in placed["model.layers.0.self_attn.q_proj.weight"].lower()
    _check(single, hsdp)
    # HSDP without expert parallelism (the hf backend's FSDP2 units over its 2-D mesh): experts replicated too
    placed = hsdp_only[0]["placements"]
    assert "(replicate(), shard(dim=0))" in placed["model.layers.0.mlp.experts.gate_and_up_projs"].lower()
    _check(single, hsdp_only)
    # LoRA at ep 2 x dp 2: the adapters over all 4 ranks, the frozen experts as above
    placed = ep_dp_lora[0]["placements"]
    assert "dp_shard_cp=4" in placed["model.layers.0.self_attn.o_proj.lora_B.weight"].lower()
    assert "ep_shard=2, ep=2" in placed["model.layers.0.mlp.experts.gate_and_up_projs"].lower()
    _check(single_lora, ep_dp_lora)


def _check(single: dict, ep: list[dict]) -> None:
    """`ep` (every rank's results) against the one-rank run; all differences are reported together. Under routing
    replay every router of every rank used the recorded experts for every captured token of the last forward (a
    checkpoint's recompute, where one ran), where its own top-k mostly differed."""
    for r in (single, *ep) if "replayed" in single else ():
        chosen, targets = r["replayed"]
        known = (targets >= 0).all(-1)
        assert known.sum() > 0 and torch.equal(chosen.sort(-1).values[known], targets.long().sort(-1).values[known])
        agreement = sum(s["moe/router_agreement_x_tokens"] for s in r["stats"]) / sum(s["tokens"] for s in r["stats"])
        assert agreement < 0.9, agreement
    FAILURES.clear()
    adapters = {n for n in single["weights"] if ".lora_" in n}
    if adapters:  # only the adapters train, and B moved off its zero start
        assert all(set(step) == adapters for step in single["grads"])
        assert all(single["weights"][n].abs().max() > 0 for n in adapters if ".lora_B." in n)
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
        assert single["stats"][s]["grad_norm"] > single["max_norm"]  # clipping was active
        largest = max(g.abs().max().item() for g in single["grads"][s].values())
        for name, g in single["grads"][s].items():  # relative to the step's largest gradient element
            _close(ep[0]["grads"][s][name], g, f"gradient of {name}, step {s}", largest)
    for name, w in single["weights"].items():
        for rank, r in enumerate(ep):
            _close(r["weights"][name], w, f"{name} after {STEPS} steps (rank {rank})")
    # weight sync: the engine receives the trained weights whole, under transformers' names and layouts
    from runtime.models import automodel

    synced, weights = ep[0]["synced"], ep[0]["weights"]
    assert synced.keys() == single["synced"].keys() and not any(".lora_" in n for n in synced)
    for name, w in weights.items():
        if ".lora_" in name:
            continue
        hf_name, swapped = automodel.hf_name(name)
        adapter = name.removesuffix("weight") + "lora_"
        if adapter + "A.weight" in weights:  # under LoRA the engines get the merged weight
            merged = w + LORA.scale * weights[adapter + "B.weight"] @ weights[adapter + "A.weight"]
            _close(synced[hf_name], merged, f"merged {hf_name}")
            assert not torch.equal(merged, w), name  # the adapters change it
        else:
            assert torch.equal(synced[hf_name], w.transpose(1, 2) if swapped else w), name
        _close(synced[hf_name], single["synced"][hf_name], f"synced {hf_name}")
    # the HF export from the EP shards is the one-rank run's (under LoRA: the PEFT adapter)
    from safetensors.torch import load_file

    file = "adapter_model.safetensors" if adapters else "model.safetensors"
    exported, single_exported = load_file(f"{ep[0]['hf_dir']}/{file}"), load_file(f"{single['hf_dir']}/{file}")
    assert exported.keys() == single_exported.keys() and all(r["hf_dir"] is None for r in ep[1:])
    for name, t in exported.items():  # (transformers saves its fused experts one expert per key)
        _close(t, single_exported[name], f"exported {name}")
    # DCP resume: the checkpoint restored the weights and the step after it repeats exactly
    for name, w in ep[0]["weights"].items():
        assert torch.equal(ep[0]["restored"][name], w), name
    assert all(all(r["resumed"].values()) for r in ep)
    assert not FAILURES, sorted(FAILURES, key=lambda f: -f[1])[:10]
