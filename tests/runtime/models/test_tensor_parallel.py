"""Tensor parallelism on the automodel backend (`runtime/models/automodel.py` `tensor_parallel`): nemo-automodel's
own device mesh, its dense parallelizer and its Qwen3 tensor-parallel plan (q/k/v, gate and up column-wise, o and
down row-wise, the embedding and the lm_head vocabulary-parallel), on 2 gloo ranks (fp32, a tiny dense Qwen3),
through the real trainer (`PolicyWorker`).

TP 2 on 2 ranks (one data-parallel rank: both ranks run the same rows), TP 2 with compiled decoder layers
(`model.compile_layers`: no graph break, one graph per grad mode; then with full activation checkpointing around
them: no graph more, under a quarter of the saved activations), TP 2 with sequence parallelism (the plan's
sequence-parallel styles: the norms and residuals on positions cut over tp, unevenly at the odd widths of this
batch's micro-batches; the final norm's sequence-sharded output gathered before the head, `runtime/logprobs.py`),
and TP 2 x dp 2 on 4 ranks (FSDP2 over the data-parallel pair cuts each tp shard again: `_StridedShard`), give the
same old log-probs (the vocab-sharded logits gathered per chunk), loss statistics and gradients as the one-rank run
of the same batch, and
three clipped optimizer steps keep the weights equal (the gradient norm is the whole mesh's, each replicated piece
counted once). Then what a weight sync streams (each rank's column / row shard of a matrix, `shard_layout`), the HF
export and a DCP save / resume. The structure and the comparison are test_expert_parallel.py's (its rank loop runs
this module's plan). LoRA (`ep_test.LORA`: nemo-automodel's adapters on q, o and down, which its plan's LoRA-aware
styles cut with their layers) runs as one more layout of the same spawns, at TP 2 and TP 2 x dp 2, against the
one-rank LoRA run; the engines get the merged weights, each rank adding B@A over its own box of W. HSDP with TP:
(dp_replicate 2, dp_shard 2, tp 2) on 8 ranks against the same one-rank runs, without and with LoRA. The critic
(gae's value model, `CriticWorker` on the plan's critic mesh: the actor's tp, nemo-automodel's plan without the
vocabulary head's entry, the scalar head replicated) runs after the layouts of the one-rank and the TP 2 x dp 2
spawns: its values, value loss, gradients, gradient norms and weights over two critic steps equal the one-rank run's.
CPU offload (`actor.offload`, runtime/fsdp.py) runs as two more layouts of the TP 2 spawn, held to the same checks
against the one-rank run (the DCP resume included): `optimizer` (`HostAdamW`: the tp shards stepped chunk by chunk on
host copies, the states on the host) and `full` (FSDP2's CPUOffloadPolicy, which nemo-automodel's parallelizer puts on
every unit).

Qwen3-MoE is not here: nemo-automodel 0.7.0 registers no tensor-parallel plan for its own MoE models (its custom-MoE
TP path refuses them), and rule MOE002 refuses the recipe.
"""

from __future__ import annotations

import os

import pytest
import test_expert_parallel as ep_test
import torch
import torch.multiprocessing as mp
from loop_support import trainer_rl

from runtime.tiny_model import build_tiny_model
from schemas.plan import LoraPlan, MeshPlan

DEVICE = ep_test.DEVICE
"""`cuda`: the same layouts over NCCL, one GPU per rank (tests/gpu/check_tensor_parallel.py)."""


@pytest.fixture(scope="module")
def dense_checkpoint(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("dense") / "model", seed=0, vocab_size=300,
                                tie_word_embeddings=False))


def _rl(world: int, path: str, mesh: MeshPlan, lora: LoraPlan | None = None, sequence_parallel: bool = False,
        offload: str = "none", compiled: bool = False, checkpoint: str = "none"):
    # one optimizer-step window of the whole batch: world 1 runs 4 micro-batches of 2 rows, and so does each tp
    # rank (they take the same rows)
    dp = world // mesh.tp
    return trainer_rl(
        world, ref=False,
        model={"path": path, "backend": "automodel", "compile_layers": compiled, "gradient_checkpoint": checkpoint},
        trainer={"micro_batch_size": 2, "grad_accum": ep_test.ROWS // 2 // dp, "max_epochs": 1, "temperature": 1.0,
                 "seed": 0, "packing": False, "dynamic_batch_max_tokens": None, "local_batch_size": None,
                 "mesh": mesh, "dp": dp, "lora": lora, "sequence_parallel": sequence_parallel,
                 "offload": offload},
        # Adam's eps further above fp32 noise than test_expert_parallel's: tensor parallelism sums each row-parallel
        # matmul in two partial sums (gradients 5e-7 apart at the first step), which eps 1e-5 grows to 2e-5 of
        # the weights in three steps through elements whose gradient is ~0
        optimizer=dict(lr=1e-2, eps=1e-4, max_norm=ep_test.max_norm(lora), scheduler="constant", warmup_steps=0,
                       total_steps=10),
        loss=dict(mode="ppo", clip_low=0.2, clip_high=0.2, dual_clip=None, entropy_coef=0.0, aux_loss_coef=0.0,
                  router_z_loss_coef=0.0),
        kl=dict(estimator="k3", use_loss=False), is_correction=dict(level="off"),
        # on GPUs as the compiler derives it (B26): full offload's host shards need gloo for their collectives
        device=DEVICE, dist_backend="gloo" if DEVICE != "cuda" else "cuda:nccl,cpu:gloo" if offload == "full" else "nccl")


def _run(world: int, layouts: list[ep_test.Layout], path: str, out_dir, critic_tp: int | None = None
         ) -> list[list[dict]]:
    """Per layout, every rank's results; with `critic_tp` the critic's too (`_critic`), as one more entry."""
    from runtime.trainer import free_port

    ep_test._rl = _rl  # the layouts run through test_expert_parallel's rank loop with this module's plan
    for k in range(len(layouts) + 1):
        os.makedirs(os.path.join(out_dir, str(k)), exist_ok=True)
    mp.spawn(_rank_main, args=(world, free_port(), str(out_dir), path, layouts, critic_tp), nprocs=world, join=True)
    return [[torch.load(os.path.join(out_dir, str(k), f"rank{r}.pt")) for r in range(world)]
            for k in range(len(layouts) + (critic_tp is not None))]


def _rank_main(rank: int, world: int, port: int, out_dir: str, path: str, layouts: list[ep_test.Layout],
               critic_tp: int | None) -> None:
    from runtime import fsdp

    ep_test._rl = _rl
    fsdp.HOST_STEP_CHUNK_BYTES = 1 << 16  # offload: optimizer steps the tiny model in many chunks, as test_offload.py
    then = None
    if critic_tp is not None:
        def then(rank, world, port, out_dir, path):
            _critic(rank, world, port, os.path.join(out_dir, str(len(layouts))), path, _mesh(critic_tp))
    ep_test._rank_main(rank, world, port, out_dir, path, layouts, then)


def _critic(rank: int, world: int, port: int, out_dir: str, path: str, mesh: MeshPlan) -> None:
    """The critic (gae's value model, `CriticWorker`) on the plan's critic mesh: `CRITIC_STEPS` rounds of values
    then `critic.train` (2 epochs: 2 clipped optimizer steps) towards fixed returns, recording the values, the
    value-loss sums, every optimizer step's gradients and the weights after."""
    from dataclasses import replace

    from loop_support import compile_plan

    from runtime import fsdp
    from runtime.critic import CriticWorker

    rl, dp = _rl(world, path, mesh), world // mesh.tp
    critic = compile_plan("recipes/demo_math_gae.yaml").rl.critic.model_copy(update={
        "path": path, "world": world, "mesh": mesh, "dp": dp, "grad_accum": ep_test.ROWS // 2 // dp, "max_epochs": 2,
        "value_clip": 0.2, "optimizer": rl.trainer.optimizer})
    # contiguous micro-batches (grouped by length, each rank would group its own shard: another order of sums)
    trainer = rl.trainer.model_copy(update={"micro_batches_by_length": False})
    worker = CriticWorker(critic, trainer, rl.model, rl.device, rl.dist_backend, rank, "127.0.0.1", port)
    grads: list[dict[str, torch.Tensor]] = []
    step = fsdp.clipped_step

    def recorded_step(model, *args) -> float:
        grads.append({n: ep_test._full(p.grad) for n, p in model.named_parameters() if p.grad is not None})
        return step(model, *args)

    fsdp.clipped_step = recorded_step
    batch = ep_test._batch()
    returns = torch.randn(batch.action_mask.shape, generator=torch.Generator().manual_seed(2)) * batch.action_mask
    out: dict = {"values": [], "stats": [], "max_norm": critic.optimizer.max_norm}
    for _ in range(CRITIC_STEPS):
        values = ep_test.gathered(*worker.values(batch), world)
        out["values"].append(values)
        out["stats"].append(worker.train(replace(batch, values=values, returns=returns)))
    fsdp.clipped_step = step
    out["grads"] = grads
    out["weights"] = {n: ep_test._full(p) for n, p in worker.model.named_parameters()}
    out["placements"] = {n: str(getattr(p, "placements", None)) + str(getattr(p, "device_mesh", None))
                         for n, p in worker.model.named_parameters()}
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))


CRITIC_STEPS = 2
COMPILED_GRAPHS = 2
"""The compiled layout's inductor graphs: the training forward (its backward in the same graph) and the no-grad
log-prob forward; one each for every batch shape and both layers."""


def _check_critic(single: dict, tp: list[dict]) -> None:
    """The critic's values, value loss, gradient norms and gradients at each step, and its weights after, against
    the one-rank run (test_expert_parallel's tolerance: 1e-5 of the largest magnitude)."""
    close = ep_test._close
    ep_test.FAILURES.clear()
    mask = ep_test._batch().action_mask
    for s in range(CRITIC_STEPS):
        for r in tp:
            close(r["values"][s] * mask, single["values"][s] * mask, f"values, step {s}")
        loss = sum(r["stats"][s]["value_loss_sum"] for r in tp) / sum(r["stats"][s]["tokens"] for r in tp)
        close(torch.tensor(loss), torch.tensor(single["stats"][s]["value_loss_sum"] / single["stats"][s]["tokens"]),
              f"value loss, step {s}")
        assert tp[0]["stats"][s]["optimizer_steps"] == single["stats"][s]["optimizer_steps"] == 2
    for k, step in enumerate(single["grads"]):
        assert tp[0]["grads"][k].keys() == step.keys()
        largest = max(g.abs().max().item() for g in step.values())
        for name, g in step.items():
            close(tp[0]["grads"][k][name], g, f"critic gradient of {name}, optimizer step {k}", largest)
    for s in range(CRITIC_STEPS):
        close(torch.tensor(tp[0]["stats"][s]["grad_norm"]), torch.tensor(single["stats"][s]["grad_norm"]),
              f"critic grad norm, step {s}")
        assert single["stats"][s]["grad_norm"] > single["max_norm"]  # clipping was active
    for name, w in single["weights"].items():
        for rank, r in enumerate(tp):
            close(r["weights"][name], w, f"critic {name} after {CRITIC_STEPS} steps (rank {rank})")
    assert single["values"][-1].ne(single["values"][0]).any()  # the critic trained
    assert not ep_test.FAILURES, sorted(ep_test.FAILURES, key=lambda f: -f[1])[:10]


def _mesh(tp: int) -> MeshPlan:
    return MeshPlan(tp=tp, cp=1, ep=1, pp=1, dp_replicate=1)


@pytest.fixture(scope="module")
def single(dense_checkpoint, tmp_path_factory) -> tuple[dict, dict, dict]:
    """The one-rank runs every layout is held against: without and with LoRA, and the critic's."""
    plain, lora, critic = _run(1, [(_mesh(1), None), (_mesh(1), ep_test.LORA)], dense_checkpoint,
                               tmp_path_factory.mktemp("single"), critic_tp=1)
    return plain[0], lora[0], critic[0]


def test_tp2_matches_one_rank(dense_checkpoint, single, tmp_path):
    tp, tp_lora, tp_sp, tp_opt, tp_full, tp_compiled, tp_checkpointed = _run(
        2, [(_mesh(2), None), (_mesh(2), ep_test.LORA), (_mesh(2), None, True), (_mesh(2), None, False, "optimizer"),
            (_mesh(2), None, False, "full"), (_mesh(2), None, False, "none", True),
            (_mesh(2), None, False, "none", True, "full")], dense_checkpoint, tmp_path / "tp")
    placed = tp[0]["placements"]
    # nemo-automodel's Qwen3 plan: q column-wise (dim 0), o row-wise (dim 1), the head over the vocabulary
    assert "shard(dim=0))" in placed["model.layers.0.self_attn.q_proj.weight"].lower()
    assert "shard(dim=1))" in placed["model.layers.0.self_attn.o_proj.weight"].lower()
    assert "tp=2" in placed["lm_head.weight"].lower()
    # sequence parallelism: its plan's sequence-parallel styles run the norms on positions cut over tp, their
    # weights replicated over tp (without it a norm is no tp module)
    norm = "model.layers.0.input_layernorm.weight"
    assert "tp=" not in placed[norm].lower()
    assert "replicate())" in tp_sp[0]["placements"][norm].lower() and "tp=2" in tp_sp[0]["placements"][norm].lower()
    ep_test._check(single[0], tp_sp)
    # the tp ranks ran the same rows: the one data-parallel rank's statistics are tp rank 0's
    for s in range(ep_test.STEPS):
        assert tp[1]["stats"][s]["tokens"] == 0.0
    ep_test._check(single[0], tp)
    # compiled decoder layers (`model.compile_layers`): the layers' DTensor forward and backward, TP's collectives in
    # them, without a graph break, compiled once per grad mode for every micro-batch shape, give the one-rank eager
    # run's numbers within the same 1e-5
    for r in tp_compiled:
        assert r["graph_breaks"] == 0 and r["graphs"] == COMPILED_GRAPHS, (r["graph_breaks"], r["graphs"])
    ep_test._check(single[0], tp_compiled)
    # with full activation checkpointing (an eager checkpoint around each compiled layer): the same numbers, the
    # compiled layout's graphs run again (dynamo's cache in these processes: the checkpoint and its recompute in the
    # backward compile nothing more), and a fraction of the activations saved (~1/10 in this model)
    for r, compiled in zip(tp_checkpointed, tp_compiled, strict=True):
        assert r["graph_breaks"] == 0 and r["graphs"] == 0, (r["graph_breaks"], r["graphs"])
        assert 4 * r["saved_bytes"] < compiled["saved_bytes"], (r["saved_bytes"], compiled["saved_bytes"])
    ep_test._check(single[0], tp_checkpointed)
    # LoRA: nemo-automodel's LoRA-aware styles cut a column-parallel layer's A by rank (its low-rank output
    # all-gathered) and B by output rows as the layer's weight, a row-parallel layer's A by input columns
    placed = tp_lora[0]["placements"]
    assert ", shard(dim=0))" in placed["model.layers.0.self_attn.q_proj.lora_B.weight"].lower()
    assert ", shard(dim=1))" in placed["model.layers.0.self_attn.o_proj.lora_A.weight"].lower()
    assert ", shard(dim=1))" in placed["model.layers.0.mlp.down_proj.lora_A.weight"].lower()
    ep_test._check(single[1], tp_lora)
    # CPU offload (runtime/fsdp.py): `optimizer` steps the tp shards chunk by chunk on host copies (the states
    # stay on the host, the DCP resume's too), `full` is FSDP2's CPUOffloadPolicy under nemo-automodel's parallelizer
    for level, run in (("optimizer", tp_opt), ("full", tp_full)):
        for r in run:
            checks = r["offload"]
            # every parameter is in an FSDP2 unit of nemo-automodel's parallelizer, which got the level's policy
            assert len(checks["offload_to_cpu"]) == len(r["placements"]), level
            assert set(checks["offload_to_cpu"]) == {level == "full"}, level
            assert checks["host_steps"] == (level == "optimizer"), level
        ep_test._check(single[0], run)
    checks = tp_opt[0]["offload"]
    assert checks["chunks"] > 2 and checks["restored"] and checks["stepped"] and checks["fused"], checks
    assert checks["states_apart"] and checks["states_on_host"], checks
    # the export is a transformers checkpoint of the same names as the one trained from
    from safetensors.torch import load_file

    assert load_file(f"{tp[0]['hf_dir']}/model.safetensors").keys() == load_file(
        f"{dense_checkpoint}/model.safetensors").keys()


def test_tp2_by_dp2_matches_one_rank(dense_checkpoint, single, tmp_path):
    tp_dp, tp_dp_lora, critic = _run(4, [(_mesh(2), None), (_mesh(2), ep_test.LORA)], dense_checkpoint,
                                     tmp_path / "tp_dp", critic_tp=2)
    # FSDP2 over the 2 data-parallel ranks cuts each tp rank's column shard again (a strided shard over dp)
    placed = tp_dp[0]["placements"]
    assert "(_stridedshard(dim=0, sf=2), shard(dim=0))" in placed["model.layers.0.self_attn.q_proj.weight"].lower()
    assert "dp_shard=2, tp=2" in placed["model.layers.0.self_attn.q_proj.weight"].lower()
    ep_test._check(single[0], tp_dp)
    # the critic (gae's value model) on the plan's critic mesh, the actor's tp: the same plan cuts its layers, its
    # scalar head stays whole on each tp rank (FSDP2 over dp only)
    placed = critic[0]["placements"]
    assert "(_stridedshard(dim=0, sf=2), shard(dim=0))" in placed["model.layers.0.self_attn.q_proj.weight"].lower()
    assert "tp" not in placed["lm_head.weight"].lower() and "dp_shard=2" in placed["lm_head.weight"].lower()
    for s in range(CRITIC_STEPS):  # the tp ranks of a data-parallel rank ran its rows: its tp rank 0 counted them
        assert [r["stats"][s]["tokens"] > 0 for r in critic] == [True, False, True, False]
    _check_critic(single[2], critic)
    # LoRA: the adapters' tp shards cut again over dp like their layers' (each rank merges its own box of W)
    placed = tp_dp_lora[0]["placements"]
    assert "(_stridedshard(dim=0, sf=2), shard(dim=0))" in placed["model.layers.0.self_attn.q_proj.lora_B.weight"].lower()
    ep_test._check(single[1], tp_dp_lora)


def test_tp2_by_hsdp_matches_one_rank(dense_checkpoint, single, tmp_path):
    """HSDP with tp on 8 ranks: nemo-automodel's (dp_replicate 2, dp_shard 2, tp 2) mesh (it refuses dp_shard 1, as
    rule PAR007 does); FSDP2 shards each tp shard over the dp_shard pair and replicates it over the replicate pair."""
    mesh = MeshPlan(tp=2, cp=1, ep=1, pp=1, dp_replicate=2)
    hsdp, hsdp_lora = _run(8, [(mesh, None), (mesh, ep_test.LORA)], dense_checkpoint, tmp_path / "tp_hsdp")
    placed = hsdp[0]["placements"].get("model.layers.0.self_attn.q_proj.weight", "").lower()
    assert "(dp_replicate=2, " in placed and "dp_shard=2, tp=2)" in placed, placed
    assert "(replicate(), _stridedshard(dim=0, sf=2), shard(dim=0))" in placed, placed
    ep_test._check(single[0], hsdp)
    ep_test._check(single[1], hsdp_lora)
