"""MoE in the runtime on a tiny Qwen3-MoE (4 experts, top-2, 2 layers), CPU, real transformers and FSDP2 (gloo).

- The hf engine's decode core records the experts each token was routed to (prompt and generated tokens, all but
  the last), and they are the ones a full forward of the same weights picks.
- Routing replay (R3): with perturbed trainer weights, a replayed forward selects exactly the recorded experts
  (padded and packed rows, two-turn episodes), and without replay it does not.
- A trainer rank (FSDP2, bf16 compute): the frozen router takes no gradient and stays fp32 while the rest trains;
  the router computes in fp32; the aux losses are reported and replay holds in its forward.
"""

from __future__ import annotations

import functools
import os

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from loop_support import trainer_rl

from runtime import moe
from runtime.agents.base import Trajectory
from runtime.engines.hf_decode import DecodeCore, Request
from runtime.experience import from_token_lists
from runtime.logprobs import token_logprobs
from runtime.tiny_model import build_tiny_model

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19, 20]]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(engine model dir, trainer model dir): the same tiny MoE, the trainer's with perturbed router and MLP weights."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("moe")
    engine_dir = build_tiny_model(root / "engine", seed=0, vocab_size=300, experts=4, experts_per_token=2)
    model = AutoModelForCausalLM.from_pretrained(engine_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".mlp." in name:
                p.add_(0.5 * p.std() * torch.randn(p.shape, generator=g))
    model.save_pretrained(root / "trainer")
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(engine_dir).save_pretrained(root / "trainer")
    return engine_dir, root / "trainer"


def _generate(model, prompts, max_tokens=6) -> list[Request]:
    core = DecodeCore(model, slots=4, max_model_len=64, eos_ids=[], pad_id=0, raw_logprobs=False, cuda_graphs=False,
                      chunk_steps=4, record_routing=True)
    reqs = [Request(list(p), max_tokens, 1.0, 1.0) for p in prompts]
    for r in reqs:
        core.submit(r)
    done = []
    while len(done) < len(reqs):
        done += core.run_chunk()
    return reqs


@functools.cache
def _episodes(engine_dir, turns: int = 1) -> list[Trajectory]:
    """Step-runner-like episodes: each turn generates after the whole stream so far, then appends 2 feedback tokens."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(engine_dir, dtype=torch.float32)
    torch.manual_seed(0)
    trajs = [Trajectory(prompt=None, label=None, observation_text="", token_ids=list(p)) for p in PROMPTS]
    for turn in range(turns):
        for traj, r in zip(trajs, _generate(model, [t.token_ids for t in trajs]), strict=True):
            assert r.routed_experts().shape == (len(traj.token_ids) + len(r.token_ids) - 1, 2, 2)
            traj.append_action(r.token_ids, None)
            traj.absorb_routing(r.routed_experts())
            if turn < turns - 1:
                traj.append_feedback("", [21, 22])
    return trajs


def _batch(trajs):
    return from_token_lists([t.token_ids for t in trajs], [t.action_ranges for t in trajs], [[] for _ in trajs], 0,
                            routed_experts=[t.routing_rows() for t in trajs])


def _selected(model, batch, packed: bool, replay: bool) -> float:
    """Share of recorded (token, layer, slot) routing entries the forward selects (as sets per token and layer)."""
    targets = moe.flat_targets(batch.routed_experts, batch.attention_mask, packed)
    with moe.replay(model) as state:
        state.targets = targets if replay else None
        token_logprobs(model, batch.sequences, batch.attention_mask, 1.0, packed=packed)
    chosen = torch.stack(state.selected, dim=1)                      # (tokens, layers, k)
    known = (targets >= 0).all(-1)                                   # (tokens, layers)
    same = (chosen.sort(-1).values == targets.long().sort(-1).values).all(-1)
    real = batch.attention_mask.reshape(-1) if not packed else torch.ones(len(targets), dtype=torch.bool)
    keep = known & real[:, None]
    return float(same[keep].float().mean())


def test_engine_routing_is_what_a_full_forward_picks(models):
    from transformers import AutoModelForCausalLM

    trajs = _episodes(models[0])
    model = AutoModelForCausalLM.from_pretrained(models[0], dtype=torch.float32)
    batch = _batch(trajs)
    assert batch.routed_experts.dtype == torch.int16 and batch.routed_experts.shape[2:] == (2, 2)
    # The last token of each episode was never fed to a forward: no routing (-1).
    last = batch.attention_mask.sum(-1) - 1
    assert (batch.routed_experts[torch.arange(3), last] == -1).all()
    assert _selected(model, batch, packed=False, replay=False) == 1.0


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("turns", [1, 2])
def test_replay_selects_recorded_experts_with_perturbed_weights(models, packed, turns):
    from transformers import AutoModelForCausalLM

    trajs = _episodes(models[0], turns)
    if turns == 2:  # every token but the last was routed by some turn (feedback tokens by the second turn's prefill)
        assert all((t.routing_rows()[:-1] >= 0).all() for t in trajs)
    batch = _batch(trajs)
    trainer_model = AutoModelForCausalLM.from_pretrained(models[1], dtype=torch.float32)
    assert _selected(trainer_model, batch, packed, replay=True) == 1.0
    assert _selected(trainer_model, batch, packed, replay=False) < 0.9


def test_first_writer_wins():
    traj = Trajectory(prompt=None, label=None, observation_text="", token_ids=[1, 2, 3])
    traj.absorb_routing(np.zeros((2, 1, 2), np.int16))
    traj.token_ids += [4, 5]
    traj.absorb_routing(np.ones((4, 1, 2), np.int16))
    assert traj.routing_rows()[:, 0, 0].tolist() == [0, 0, 1, 1, -1]


def test_aux_losses():
    logits = [torch.zeros(6, 4), torch.tensor([[5.0, 0, 0, 0]] * 6)]
    mask = torch.ones(6)
    balanced = moe.load_balancing_loss(logits[:1], 2, mask)
    skewed = moe.load_balancing_loss(logits[1:], 2, mask)
    assert balanced == pytest.approx(1.0) and skewed > 1.5
    assert moe.z_loss(logits[:1], mask) == pytest.approx(float(torch.log(torch.tensor(4.0)) ** 2))


# ------------------------------------------------------------------------------------------------ trainer rank
def _rank_main(rank: int, port: int, out: str, rl, batch) -> None:
    torch.set_num_threads(1)
    from runtime.trainer import PolicyWorker

    worker = PolicyWorker(rl.trainer, rl.model, rl.ref, rl.algo, rl.device, rl.dist_backend, rank, "127.0.0.1", port)
    named = dict(worker.model.named_parameters())
    gate = {n: p for n, p in named.items() if n.endswith("mlp.gate.weight")}
    before = {n: p.full_tensor().clone() for n, p in named.items()}
    picked = []  # the top-k indices the experts modules were called with: what the forward really used
    experts = [m for m in worker.model.modules() if type(m).__name__ == "Qwen3MoeExperts"]
    hooks = [m.register_forward_pre_hook(lambda m, args: picked.append(args[1])) for m in experts]
    with moe.collect_logits(worker.model) as sink:
        rows, old, _ = worker.forward_logprobs(batch)
        dtypes = sorted({str(lg.dtype) for lg in sink.logits})
    for h in hooks:
        h.remove()
    targets = moe.flat_targets(batch.routed_experts, batch.attention_mask, packed=rl.trainer.packing)
    chosen = torch.stack(picked, 1)
    known = (targets >= 0).all(-1) & batch.attention_mask.reshape(-1)[:, None]
    same = (chosen.sort(-1).values == targets.long().sort(-1).values).all(-1)[known].float().mean()
    mask = batch.action_mask
    from dataclasses import replace

    train = replace(batch, old_log_probs=old, advantages=torch.randn(mask.shape) * mask, rollout_log_probs=old)
    stats = [worker.train(train, kl_coef=0.0) for _ in range(2)]
    after = {n: p.full_tensor() for n, p in named.items()}
    torch.save({"same": float(same), "logit_dtypes": dtypes, "stats": stats,
                "gate_dtype": {n: str(p.dtype) for n, p in gate.items()},
                "gate_grad": {n: p.requires_grad for n, p in gate.items()},
                "changed": {n: not torch.equal(before[n], after[n]) for n in named}}, out)
    worker.shutdown()


@pytest.mark.slow
def test_trainer_router_frozen_fp32_replayed(models, tmp_path):
    rl = trainer_rl(1, ref=False, model={"path": str(models[1]), "dtype": "bfloat16", "router_dtype": "float32"},
                    trainer={"micro_batch_size": 3, "grad_accum": 1, "max_epochs": 1, "temperature": 1.0, "seed": 0,
                             "packing": False, "dynamic_batch_max_tokens": None, "local_batch_size": None,
                             "routing_replay": True, "freeze_moe_router": True},
                    optimizer=dict(lr=1e-2, max_norm=0.0, scheduler="constant", warmup_steps=0, total_steps=10),
                    loss=dict(aux_loss_coef=0.01, router_z_loss_coef=0.001),
                    is_correction=dict(level="off"))
    batch = _batch(_episodes(models[0], turns=2))
    from runtime.trainer import free_port

    out = str(tmp_path / "rank0.pt")
    mp.start_processes(_rank_main, args=(free_port(), out, rl, batch), nprocs=1, start_method="spawn")
    r = torch.load(out, weights_only=False)
    assert r["same"] == 1.0                                           # the old-logprob forward replays
    assert r["logit_dtypes"] == ["torch.float32"]                      # the routers compute in fp32 under bf16
    assert set(r["gate_dtype"].values()) == {"torch.float32"} and len(r["gate_dtype"]) == 2
    assert not any(r["gate_grad"].values())
    assert not any(r["changed"][n] for n in r["gate_dtype"])          # frozen after two steps
    assert r["changed"]["model.layers.0.mlp.experts.gate_up_proj"] and r["changed"]["model.embed_tokens.weight"]
    for s in r["stats"]:
        assert s["moe/load_balancing_loss_x_tokens"] > 0 and s["moe/router_z_loss_x_tokens"] > 0
    assert os.path.getsize(out) > 0
