"""Context parallelism (`runtime/context_parallel.py`) on gloo ranks: what runs on CPU.

torch's ring attention has no CPU path (the CPU SDPA op has no sharding strategy), so no decoder with torch's
attention runs here under CP. What does: nemo-automodel's mesh with a cp axis (`automodel.device_mesh`), its sharder entering
torch's `context_parallel` context (the rows cut and put back), and everything around the attention: the chunked
lm_head log-probs, entropy and top-k log-probs of a per-token model (no attention) on the shards, and the trainer's
loss and token-count math (global token mean over dp, dp factor, the cp ranks' gradients summed by the all-gather's
backward, FSDP2's average over dp x cp), held against one rank on the same rows:
- cp 2 on 2 ranks (dp 1), and dp 2 x cp 2 on 4 ranks;
- cp 2 x tp 2 on the same 4 ranks (their second mesh: dp 1): each cp rank's cut shared by its tp ranks, the per-token
  model tensor-parallel as nemo-automodel's plan cuts a decoder's ends (the lm_head vocabulary-parallel, its logits
  gathered per chunk; the decoder output sequence-parallel, cut over tp by positions and gathered before the head),
  FSDP2's average over dp x cp only (nemo-automodel's `dp_shard_cp`), the rows returned by one rank; and the dense
  demo's model as `automodel.build` places it on that mesh (its TP plan, FSDP2 over dp x cp, the CP setup, the weight
  sync's boxes). No TP model runs a forward under CP here (no ring attention on CPU).
At cp 2 the same ranks also run GLM-5.2's own CP of a packed THD row (`runtime/packed_cp.py`): nemo-automodel's
tiny GLM-5.2 with its TileLang kernels replaced by torch references (tests/runtime/dsa_support.py), its layers
all-gathering keys and values over the cp ranks, held against its one-rank packed THD run.
"""

from __future__ import annotations

import contextlib
import faulthandler
import math
import os
import types

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from runtime.experience import from_token_lists

TOKENS = [[1, 5, 7, 2, 9, 4, 3], [6, 2, 8], [3, 3, 1, 7, 5], [9, 8, 7, 6, 5, 4, 3, 2], [4, 1, 2, 3],
          [2, 2], [7, 6, 5, 4, 3, 2, 1], [1, 9, 1, 9, 1]]
VOCAB = 12


def _batch(tokens: list[list[int]] = TOKENS):
    ranges = [[(1, len(t))] for t in tokens]
    g = torch.Generator().manual_seed(3)
    rollout = [(-torch.rand(len(t), generator=g)).tolist() for t in tokens]
    batch = from_token_lists(tokens, ranges, rollout, pad_id=0)
    shape = batch.action_mask.shape
    batch.advantages = torch.randn(shape, generator=g)
    batch.old_log_probs = batch.rollout_log_probs + 0.05 * torch.randn(shape, generator=g)
    batch.ref_log_probs = batch.rollout_log_probs + 0.1 * torch.randn(shape, generator=g)
    return batch


class _Backbone(nn.Module):
    """Token and position embeddings, no attention: every position's output depends on its token and position
    alone, so the same numbers come out of a context-parallel shard."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.embed, self.pos = nn.Embedding(VOCAB, 8), nn.Embedding(width, 8)

    def forward(self, input_ids, position_ids=None, use_cache=False, attention_mask=None, padding_mask=None):
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1]).expand_as(input_ids)
        return torch.tanh(self.embed(input_ids) + self.pos(position_ids))


class _TokenLM(nn.Module):
    """The shape `runtime/logprobs.py` reads from nemo-automodel's own models: `model` and the lm_head."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.model, self.lm_head = _Backbone(), nn.Linear(8, VOCAB)

    def get_output_embeddings(self):
        return self.lm_head


def _loss(lp, part, tokens: float, dp: int, mode: str, level: str):
    """The trainer's policy loss call (`PolicyWorker._micro_step_in`) on (b, T-1) log-probs."""
    from runtime import algo

    is_mode, low = ("mask", 0.5) if level in ("seq", "geo") else ("trunc", None)  # its rejection levels: mask
    is_out = algo.is_correction(part.old_log_probs, part.rollout_log_probs, part.action_mask, level=level,
                                mode=is_mode, low=low, high=2.0)
    return algo.actor_loss(lp, part.old_log_probs, part.advantages, part.action_mask, mode=mode, clip_low=0.2,
                           clip_high=0.28, global_num_tokens=tokens, dp_size=dp, is_coef=is_out.coef,
                           ref_log_probs=part.ref_log_probs, kl_coef=0.1, kl_estimator="k3").loss


CASES = (("ppo", "token"), ("gspo", "geo"))


def _scatter_from_group_index() -> None:
    """torch 2.13's gloo backward of the differentiable `all_gather` (`_AlltoAll`, NCCL reduce-scatters instead)
    passes a group index as `dist.scatter`'s global `src`, which fails on a cp group without global rank 0 (the
    second cp group of dp 2 x cp 2). Within this test process, every scatter gets its source as a group index."""
    import torch.distributed as dist

    scatter = dist.scatter

    def by_group_index(tensor, scatter_list=None, src=None, group=None, async_op=False, group_src=None):
        return scatter(tensor, scatter_list, group=group, async_op=async_op,
                       group_src=src if group_src is None else group_src)

    dist.scatter = by_group_index


def _tensor_parallel(model: _TokenLM, tp_mesh) -> _TokenLM:
    """The per-token model's ends as nemo-automodel's tensor-parallel plan with sequence parallelism leaves a
    decoder's: its output a (b, n, hidden) DTensor cut over tp by positions (the final norm's, Shard(1)), the lm_head
    column-wise over the vocabulary, its logits a vocab-sharded DTensor (`use_local_output=False`)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleOutput, parallelize_module

    return parallelize_module(model, tp_mesh, {
        "model": PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1),
                                     use_local_output=False),
        "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)})


def _rank_main(rank: int, world: int, layouts: list[tuple[int, int]], port: int, out_dir: str) -> None:
    from runtime.ranks import FsdpRank

    torch.set_num_threads(1)
    faulthandler.dump_traceback_later(600, exit=True)  # a rank stuck in a collective dumps its stack and exits
    _scatter_from_group_index()
    worker = FsdpRank(world, 0, "cpu", "gloo", rank, "127.0.0.1", port)
    # each (cp, tp) layout on its own nemo-automodel mesh over the same ranks
    outs = {layout: _layout(worker, rank, world, *layout) for layout in layouts}
    torch.save(outs, os.path.join(out_dir, f"rank{rank}.pt"))
    worker.shutdown()


def _layout(worker, rank: int, world: int, cp: int, tp: int) -> dict:
    from nemo_automodel.components.distributed.mesh_utils import get_fsdp_dp_mesh

    from runtime.logprobs import token_top_logprobs
    from runtime.models import automodel

    meshes = automodel.device_mesh("cpu", world, types.SimpleNamespace(tp=tp, cp=cp, ep=1, pp=1, dp_replicate=1))
    worker.use_meshes(meshes.cp, meshes.tp, world // (cp * tp))
    # FSDP2's mesh: nemo-automodel's dense parallelizer takes the world mesh and shards over its dp x cp ranks
    fsdp = meshes.fsdp if meshes.tp is None else get_fsdp_dp_mesh(meshes.fsdp)
    out: dict = {"dp_rank": worker.dp_rank, "cp_rank": meshes.cp.get_local_rank(), "fsdp": fsdp.size(),
                 "tp_rank": worker.tp_rank, "leads_rows": worker.leads_rows, "replicas": worker.replicas}
    batch = _batch()
    rows, shard, _ = worker.shard(batch, balanced=False)
    out["rows"] = rows
    part = shard.trim()
    tokens = worker.window_tokens(shard, range(shard.batch_size))
    out["tokens"] = tokens
    seq, mask = part.sequences, part.attention_mask

    # the sharder's cut, and its inverse
    with worker.cp_rows(part) as rows_cp:
        # copies: torch's context_parallel restores the position ids in place when the block ends
        out["local_ids"], out["positions"] = rows_cp.input_ids.clone(), rows_cp.position_ids.clone()
        out["labels"], out["padding"] = rows_cp.labels.clone(), rows_cp.padding_mask.clone()
        out["indices"] = rows_cp.sharder._indices(rows_cp.sharder.shard_layout.padded_seq_len, torch.device("cpu"))
        out["round_trip"] = rows_cp.gather(rows_cp.shard(seq.float()))
        # MoE routing replay's recorded experts, cut like the tokens (the trainer's `_routing`)
        out["routed"] = torch.arange(seq.numel() * 6).view(*seq.shape, 3, 2)
        out["routed_local"] = rows_cp.shard(out["routed"], fill=-1)
        # a VLM's cut (runtime/logprobs.py `_vlm_shard_hidden`): M-RoPE's (3, b, w) positions on their dim 2, and
        # the spliced embeddings as nemo-automodel's own VLM forward cuts them (`shard_sequence_for_cp_round_robin`,
        # which Nemotron-Omni's forward runs on its spliced rows: its positions, padding mask and labels are these)
        from nemo_automodel.components.distributed.context_parallel.sharder import shard_sequence_for_cp_round_robin

        out["mrope"] = torch.arange(3 * seq.numel()).view(3, *seq.shape)
        out["mrope_local"] = rows_cp.shard(out["mrope"], seq_dim=2)
        embeds = torch.randn(*seq.shape, 4, generator=torch.Generator().manual_seed(5))
        out["embeds_local"] = rows_cp.shard(embeds)
        out["embeds_nemo"] = shard_sequence_for_cp_round_robin(meshes.cp, embeds)[0]

    # the loss from precomputed per-token log-probs: the shards are the leaves
    g = torch.Generator().manual_seed(7)
    full_lp = -torch.rand(batch.action_mask.shape, generator=g)
    lp_rows = full_lp[rows][:, :seq.shape[1] - 1]
    for mode, level in CASES:
        with worker.cp_rows(part) as rows_cp:
            local = rows_cp.shard(torch.nn.functional.pad(lp_rows, (0, 1))).requires_grad_()
            loss = _loss(rows_cp.gather(local)[:, :-1], part, tokens, worker.dp, mode, level)
            loss.backward()
        out[f"loss_{mode}"], out[f"local_grad_{mode}"] = loss.detach(), local.grad

    # a per-token model's log-probs, entropy and top-k log-probs on the shards, and its gradients
    model = _TokenLM() if meshes.tp is None else _tensor_parallel(_TokenLM(), meshes.tp)
    top_ids = torch.randint(0, VOCAB, (*mask.shape[:1], mask.shape[1] - 1, 3), generator=g)
    with worker.cp_rows(part) as rows_cp:
        lp, ent, top = token_top_logprobs(model, seq, mask, 0.7, top_ids, with_entropy=True, cp=rows_cp)
        _loss(lp, part, tokens, worker.dp, "ppo", "token").backward()
    grads = {}
    for n, p in model.named_parameters():  # FSDP2's gradient average over dp x cp (the lm_head's: its tp shard's)
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        torch.distributed.all_reduce(grad, group=fsdp.get_group())
        grads[n] = grad / fsdp.size()
    out.update(lp=lp.detach(), ent=ent.detach(), top=top.detach(), top_ids=top_ids, grads=grads,
               head=str(getattr(model.lm_head.weight, "placements", None)),
               decoder_out=str(getattr(model.model(seq), "placements", None)))
    if world == cp == 2:
        out["glm"] = _glm_packed_cp(worker, meshes.fsdp)
    if tp > 1:  # the dense demo's model as the trainer builds it on these meshes (its TP, then its CP setup)
        out["build"] = _built(_DENSE, meshes, world)
    return out


LAYOUTS = {2: [(2, 1)], 4: [(2, 1), (2, 2)]}
"""(cp, tp) layouts per world: one spawn each world, its layouts one after the other."""


def _run(world: int, out_dir) -> list[dict]:
    from runtime.ranks import free_port

    mp.spawn(_rank_main, args=(world, LAYOUTS[world], free_port(), str(out_dir)), nprocs=world, join=True)
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(world)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every rank's results of the (cp, tp) layout on `world` ranks: one spawn per world (the cp 2 ranks serve
    two tests, the 4 ranks two layouts)."""
    done: dict = {}

    def run(world: int, cp: int, tp: int = 1) -> list[dict]:
        if world not in done:
            done[world] = _run(world, tmp_path_factory.mktemp(f"world{world}"))
        return [out[cp, tp] for out in done[world]]

    return run


def _padded(t: torch.Tensor, cp: int) -> torch.Tensor:
    return torch.nn.functional.pad(t, (0, (-t.shape[1]) % (2 * cp)))


@pytest.mark.parametrize(("world", "cp", "tp"), [(2, 2, 1), (4, 2, 1), (4, 2, 2)], ids=["cp2", "dp2xcp2", "cp2xtp2"])
def test_context_parallel_matches_one_rank(world, cp, tp, runs):
    from runtime.logprobs import token_top_logprobs

    outs = runs(world, cp, tp)
    dp = world // (cp * tp)
    replicas = cp * tp
    batch = _batch()
    g = torch.Generator().manual_seed(7)
    full_lp = -torch.rand(batch.action_mask.shape, generator=g)
    total = float(batch.action_mask.sum())
    for rank, out in enumerate(outs):
        # the mesh: tp innermost, cp inside dp (rank = (dp_rank x cp + cp_rank) x tp + tp_rank), FSDP2 over the
        # dp x cp ranks
        assert (out["dp_rank"], out["cp_rank"], out["tp_rank"]) == (rank // replicas, rank // tp % cp, rank % tp)
        assert (out["fsdp"], out["replicas"], out["leads_rows"]) == (dp * cp, replicas, rank % replicas == 0)
        # the cp x tp ranks of a data-parallel rank take its rows; the token count is the data-parallel ranks'
        assert torch.equal(out["rows"], outs[rank // replicas * replicas]["rows"])
        assert out["tokens"] == total
        # the tp ranks of a cp rank share its cut (and, after the gather, every result)
        for key in ("local_ids", "positions", "lp", "ent", "top"):
            assert torch.equal(out[key], outs[rank - rank % tp][key])
        part = batch.select(out["rows"]).trim()
        seq, mask = part.sequences, part.attention_mask
        # the cut: nemo-automodel's head-tail chunk pair, global positions, next-token labels, padding
        idx, width = out["indices"], seq.shape[1]
        assert idx.numel() * cp == _padded(seq, cp).shape[1]
        assert torch.equal(out["local_ids"], _padded(seq, cp)[:, idx])
        real = idx < width
        assert torch.equal(out["positions"][:, real], idx[real].expand(seq.shape[0], -1))
        nxt = torch.nn.functional.pad(seq[:, 1:], (0, 1 + (-width) % (2 * cp)))
        assert torch.equal(out["labels"], nxt[:, idx])
        assert torch.equal(out["padding"][:, real], ~mask.bool()[:, idx[real]])
        assert out["padding"][:, ~real].all()
        assert torch.equal(out["round_trip"], seq.float())
        pad = (-width) % (2 * cp)
        routed = torch.nn.functional.pad(out["routed"], (0, 0, 0, 0, 0, pad), value=-1)
        assert torch.equal(out["routed_local"], routed[:, idx])
        assert torch.equal(out["mrope_local"], torch.nn.functional.pad(out["mrope"], (0, pad))[:, :, idx])
        assert torch.equal(out["embeds_local"], out["embeds_nemo"])

        # the loss on precomputed log-probs: the dp ranks' losses sum (over dp, /dp) to the one-rank loss, and
        # each rank's gradient, averaged over dp x cp by FSDP2, is the one-rank gradient at its positions
        for mode, level in CASES:
            dp_losses = [outs[d * replicas][f"loss_{mode}"] for d in range(dp)]
            assert all(torch.equal(outs[d * replicas + r][f"loss_{mode}"], dp_losses[d]) for d in range(dp)
                       for r in range(replicas))
            whole = full_lp.clone().requires_grad_()
            one = _loss(whole, batch, total, 1, mode, level)
            one.backward()
            torch.testing.assert_close(sum(dp_losses) / dp, one.detach(), rtol=1e-6, atol=1e-7)
            expected = torch.nn.functional.pad(whole.grad[out["rows"]][:, :width - 1], (0, 1 + (-width) % (2 * cp)))
            torch.testing.assert_close(out[f"local_grad_{mode}"] / (dp * cp), expected[:, idx], rtol=1e-5,
                                       atol=1e-8)

        # a per-token model (at tp 2 its lm_head vocabulary-parallel): the same log-probs, entropy and top-k
        # log-probs as one rank on the same rows
        assert (out["head"], out["decoder_out"]) == (("(Shard(dim=0),)", "(Shard(dim=1),)") if tp > 1 else ("None",) * 2)
        model = _TokenLM()
        lp, ent, top = token_top_logprobs(model, seq, mask, 0.7, out["top_ids"], with_entropy=True)
        torch.testing.assert_close(out["lp"], lp.detach(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(out["ent"], ent.detach(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(out["top"], top.detach(), rtol=1e-6, atol=1e-6)

    if tp > 1:  # the trainer's build at cp 2 x tp 2: nemo-automodel's TP plan, FSDP2 over the dp x cp ranks (a
        # tp shard cut again over cp), the CP setup of a dense model (its attention hooks, unused units reduced)
        for out in outs:
            build = out["build"]
            assert build["sharded"] and build["hooked"] and build["cp_mesh"] and all(build["unused"]), build
            assert not build["untiled"], build["untiled"]
            assert build["q_proj"] == "dp_shard_cp, tp (_StridedShard(dim=0, sf=2), Shard(dim=0))", build
    # its gradients: the one-rank run of the whole batch (each dp rank's own top ids)
    model = _TokenLM()
    total_loss = 0.0
    for d in range(dp):
        out = outs[d * replicas]
        part = batch.select(out["rows"]).trim()
        lp, _, _ = token_top_logprobs(model, part.sequences, part.attention_mask, 0.7, out["top_ids"],
                                      with_entropy=True)
        total_loss = total_loss + _loss(lp, part, total, 1, "ppo", "token")
    total_loss.backward()
    for name, p in model.named_parameters():
        for out in outs:
            torch.testing.assert_close(out["grads"][name], p.grad, rtol=1e-5, atol=1e-7)


_DENSE = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "recipes", "data", "demo_math", "model"))
"""The dense demo's checkpoint (a tiny Qwen3: transformers-style attention)."""

GLM_LENGTHS = (90, 70, 75)  # one packed row of 235 tokens: cp 2 pads it to 236, 118 queries per rank
GLM_VOCAB = 96


def _glm_inputs():
    """GLM-5.2's micro-batch (3 rows, vocabulary 96), the sampler's top-3 ids per position (score centering) and a
    rollout's (b, w, layers 1, k 2) routing that is not the model's own (replayed: R3)."""
    g = torch.Generator().manual_seed(1)
    part = _batch([torch.randint(1, GLM_VOCAB, (n,), generator=g).tolist() for n in GLM_LENGTHS])
    b, w = part.sequences.shape
    top_ids = torch.randint(0, GLM_VOCAB, (b, w - 1, 3), generator=g)
    routed = torch.rand(b, w, 1, 4, generator=g).argsort(-1)[..., :2].to(torch.int16)  # 2 of its 4 experts
    return part, top_ids, routed


def _glm_packed_cp(worker, fsdp_mesh) -> dict:
    """GLM-5.2 as the trainer holds it (FSDP2 over both ranks in bf16, full activation checkpointing, its CP set
    up by `context_parallel.prepare`), one forward and backward of its packed THD row in training mode, the rollout's
    routing replayed: at cp 1 (each rank the whole row, a data-parallel run of the same rows) and cut by its own CP
    at cp 2 (`cp_rows` packed). Each gives its log-probs, entropy, top-k log-probs, router logits, the trainer's
    loss and the gradients (FSDP2's average over the ranks)."""
    import dsa_support

    from runtime import context_parallel, moe
    from runtime.logprobs import token_top_logprobs
    from runtime.models import automodel, hf

    dsa_support.use_cpu_kernels()
    plan = dsa_support.model_plan("tilelang").model_copy(update={"dtype": "bfloat16", "gradient_checkpoint": "full"})
    glm = dsa_support.tiny_glm("tilelang")
    model = hf.shard(glm, automodel.decoder_layers(glm), plan, fsdp_mesh, True, False, None)
    context_parallel.prepare(model, worker.cp_mesh)
    model.train()
    part, top_ids, routed = _glm_inputs()
    seq, mask = part.sequences, part.attention_mask
    out: dict = {}
    for cp in (1, 2):
        model.zero_grad()
        block = worker.cp_rows(part, model, packed=True) if cp == 2 else contextlib.nullcontext()
        with block as rows, moe.replay(model) as replay, moe.collect_logits(model) as router:
            replay.targets = (moe.flat_targets(routed, mask, packed=True) if rows is None
                              else rows.replay_targets(routed, mask))
            lp, ent, top = token_top_logprobs(model, seq, mask, 0.7, top_ids, with_entropy=True, packed=True, cp=rows)
            logits = list(router.logits) if rows is None else rows.gather_router_logits(router.logits)
            loss = _loss(lp, part, float(part.action_mask.sum()), worker.dp, "ppo", "token")
            loss.backward()
        out[cp] = {"lp": lp.detach(), "ent": ent.detach(), "top": top.detach(), "loss": loss.detach(),
                   "router": [layer.detach() for layer in logits], "replayed": replay.known,
                   "grads": {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}}
        if rows is not None:
            out["inputs"] = {k: v for k, v in rows.inputs.items() if isinstance(v, torch.Tensor)}
            out["labels"], out["targets"] = rows.labels, replay.targets
    return out


def test_glm_packed_thd_cp_matches_one_rank(runs):
    """GLM-5.2's own CP of a packed THD row at cp 2 (nemo-automodel's `prepare_model_inputs_for_cp` sharder, its
    DSA layers' K/V all-gather) against the same packed row without CP (`runtime.packed_thd`), on the same FSDP2
    model."""
    from runtime import moe
    from runtime.logprobs import pack

    outs = [out["glm"] for out in runs(2, 2)]
    part, _, routed = _glm_inputs()
    seq, mask = part.sequences, part.attention_mask

    # the cut: one THD stream padded to 236 (the pad slot extends the last document, marked padding), rank r its
    # contiguous r-th half of the queries with the whole stream's cu_seqlens, positions and next-token labels, and
    # the replayed experts cut like the tokens (the pad slot: none, it keeps its own)
    flat, positions = pack(seq, mask.sum(-1))
    flat, labels = torch.nn.functional.pad(flat[0], (0, 1)), torch.nn.functional.pad(flat[0, 1:], (0, 2))
    targets = torch.nn.functional.pad(moe.flat_targets(routed, mask, packed=True), (0, 0, 0, 0, 0, 1), value=-1)
    for rank, out in enumerate(outs):
        mine = slice(118 * rank, 118 * (rank + 1))
        inputs = out["inputs"]
        assert inputs["cu_seqlens"].tolist() == [0, 90, 160, 236]
        assert torch.equal(inputs["glm_dsa_cp_query_indices"], torch.arange(236, dtype=torch.int32)[mine])
        assert torch.equal(inputs["input_ids"], flat[mine]) and torch.equal(out["labels"], labels[mine])
        assert torch.equal(inputs["position_ids"][:117], positions[0, mine][:117])
        assert torch.equal(inputs["padding_mask"], torch.arange(236)[mine] == 235)
        assert torch.equal(out["targets"], targets[mine])
        # every token's rollout routing replayed, in the forward and in its recompute (full checkpointing)
        assert (out[1]["replayed"], out[2]["replayed"]) == (2 * 235, 2 * (118 - rank))

    # the same numbers as without CP, to bf16 precision: the kernels take bf16 latents, and CPU bf16 matmuls round
    # differently on 118 rows than on 235, enough to flip a few near-tied top-k keys (4 of the 235 queries in layer 0,
    # 9 in layer 1): the log-probs, entropy, top-k log-probs and router logits every cp rank holds after the gather
    # (mean differences 2e-4 to 6e-4; wrong cu_seqlens give 0.035, test_automodel_dsa.py), the loss, and each
    # parameter's gradient (cosine 0.9996 at least, the difference 3 % of the norm at most: layer 1's attention)
    for out in outs:
        one, cp = out[1], out[2]
        for name in ("lp", "ent", "top"):
            difference = (cp[name] - one[name]).abs()
            assert difference.max() < 0.1 and difference.mean() < 0.002, (name, difference.max(), difference.mean())
        for got, expected in zip(cp["router"], one["router"], strict=True):
            torch.testing.assert_close(got, expected, rtol=0, atol=0.05)
        torch.testing.assert_close(cp["loss"], one["loss"], rtol=0.01, atol=1e-4)
        assert cp["grads"].keys() == one["grads"].keys() and len(one["router"]) == 1
        # the indexers' gradients: zeros (FSDP2 reduces unused parameters' at cp > 1, `prepare`), the same in both
        trained = {n: g for n, g in one["grads"].items() if ".indexer." not in n}
        assert len(trained) == 30 and not any(one["grads"][n].any() or cp["grads"][n].any() for n in
                                              one["grads"].keys() - trained.keys())
        for name, expected in trained.items():
            got, expected = cp["grads"][name].flatten(), expected.flatten()
            assert torch.nn.functional.cosine_similarity(got, expected, dim=0) > 0.999, name
            assert (got - expected).norm() < 0.1 * expected.norm(), name


def _build_main(rank: int, world: int, port: int, out_dir: str, paths: list[str]) -> None:
    from runtime.models import automodel
    from runtime.ranks import FsdpRank

    torch.set_num_threads(1)
    FsdpRank(world, 0, "cpu", "gloo", rank, "127.0.0.1", port)
    meshes = automodel.device_mesh("cpu", world, types.SimpleNamespace(tp=1, cp=world, ep=1, pp=1, dp_replicate=1))
    out = {path: _built(path, meshes, world) for path in paths}
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    torch.distributed.destroy_process_group()


def _built(path: str, meshes, world: int) -> dict:
    """`automodel.build` of the checkpoint at `path` on `meshes`, and what its CP setup did to it."""
    from nemo_automodel.components.moe.layers import MoE
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from runtime import shard_layout
    from runtime.models import automodel
    from schemas.plan import ModelPlan

    plan = ModelPlan.model_construct(path=path, arch=None, backend="automodel", dtype="float32", attn="sdpa",
                                     gradient_checkpoint="full", compile_layers=False, disable_fast_tokenizer=False,
                                     router_dtype="float32", moe_dispatcher="torch")
    model = automodel.build(plan, path, meshes, torch.device("cpu"))
    attn = [m for n, m in model.named_modules() if n.endswith("self_attn")]
    moe = [m for m in model.modules() if isinstance(m, MoE)]
    q = dict(model.named_parameters()).get("model.layers.0.self_attn.q_proj.weight")
    # what the weight sync reads (`shard_layout`): boxes tiling each parameter (a parameter whose mesh is one tp
    # coordinate's: rank 0's mesh's copy), this rank's its own box
    untiled = []
    for name, p in automodel.hf_weights(model):
        if getattr(p, "swapped", False):  # an MoE's grouped experts (test_automodel.py checks their layout)
            continue
        boxes = shard_layout.pieces(p, world)
        mine = [(b.offset, b.shape) for b in boxes if b.rank == torch.distributed.get_rank()]
        read = 0 in p.device_mesh.mesh
        if (sum(math.prod(b.shape) for b in boxes) != (p.numel() if read else 0)
                or mine not in ([], [shard_layout.own_box(p)])):
            untiled.append(name)
    # FSDP2 over nemo-automodel's dp x cp ranks (`dp_shard_cp`: every rank but for the tp ranks of one), each
    # parameter's mesh (dp_shard_cp, tp) where the TP plan cuts it
    return {"sharded": all(isinstance(p, DTensor) and p.device_mesh.mesh_dim_names[0] == "dp_shard_cp" and
                           p.device_mesh.size(0) == world // (1 if meshes.tp is None else meshes.tp.size())
                           for p in model.parameters()),
            "moe_cp": bool(moe) and all(m.cp_mesh is meshes.cp for m in moe),
            "cp_mesh": getattr(model, "cp_mesh", None) is meshes.cp,
            "hooked": all(m._forward_pre_hooks for m in attn), "native": not hasattr(model, "get_decoder"),
            "unused": [g.reduce_scatter_unused_params for m in model.modules() if isinstance(m, FSDPModule)
                       for g in m._get_fsdp_state()._fsdp_param_groups],
            "untiled": untiled, "q_proj": None if q is None else f"{', '.join(q.device_mesh.mesh_dim_names)} {q.placements}"}


def test_the_automodel_build_under_cp(tmp_path):
    """nemo-automodel's build at cp 2 on 2 gloo ranks (its mesh, FSDP2 over its dp x cp ranks, its CP setup on the
    model: `context_parallel.prepare`), for the MoE demo's model (its own Qwen3-MoE: no attention mask under CP)
    and the dense demo's (transformers-style attention: nemo-automodel's hook drops the mask for a causal SDPA)."""
    from runtime.ranks import free_port

    root = os.path.join(os.path.dirname(__file__), "..", "..", "recipes", "data")
    paths = [os.path.abspath(os.path.join(root, name, "model")) for name in ("demo_moe", "demo_math")]
    mp.spawn(_build_main, args=(2, free_port(), str(tmp_path), paths), nprocs=2, join=True)
    for rank in range(2):
        out = torch.load(os.path.join(tmp_path, f"rank{rank}.pt"))
        moe, dense = out[paths[0]], out[paths[1]]
        for model in (moe, dense):  # FSDP2 over both ranks; a unit a rank did not run joins with zeros; the weight
            # sync reads each parameter whole
            assert model["sharded"] and model["unused"] and all(model["unused"]) and not model["untiled"]
        # nemo-automodel's own MoE takes no mask under CP (runtime/logprobs.py); the dense model's layers are
        # transformers-style, and nemo-automodel's hook turns their masked SDPA into a causal one
        assert moe["native"] and not moe["hooked"]
        assert not dense["native"] and dense["hooked"]
        # the rest of nemo-automodel's CP setup (`apply_cp` but for te attention): the model and its MoE layers
        # hold the cp mesh (their routers' statistics over the cp ranks)
        assert moe["cp_mesh"] and moe["moe_cp"] and dense["cp_mesh"] and not dense["moe_cp"]
