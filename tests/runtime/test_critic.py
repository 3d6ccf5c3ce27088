"""The critic's pieces on the demo model, in one process (a real gloo world of one rank): the value model keeps the
policy's weights under a fresh scalar head, values are aligned like log-probs and agree padded and packed, a few
critic steps fit the returns (value loss falls, the clip counts), and a DCP checkpoint restores the values."""

from __future__ import annotations

import math

import torch
from loop_support import ROOT, compile_plan

from runtime.critic import CriticWorker, explained_variance, token_values
from runtime.experience import from_token_lists
from runtime.models.hf import load_value_model
from runtime.ranks import free_port

MODEL = str(ROOT / "recipes/data/demo_math/model")


def gae_rl(**critic):
    rl = compile_plan("recipes/demo_math_gae.yaml").rl
    return rl.model_copy(update={
        "model": rl.model.model_copy(update={"path": MODEL}),
        "trainer": rl.trainer.model_copy(update={"world": 1, "dp": 1, "micro_batch_size": 2}),
        "critic": rl.critic.model_copy(update={"path": MODEL, "world": 1, "dp": 1, "grad_accum": 2, **critic}),
    })


def make_batch():
    g = torch.Generator().manual_seed(0)
    lengths = [6, 14, 9, 11]
    tokens = [torch.randint(5, 200, (n,), generator=g).tolist() for n in lengths]
    return from_token_lists(tokens, [[(3, n)] for n in lengths], [[] for _ in tokens], pad_id=0)


def value_model():
    torch.manual_seed(0)
    return load_value_model(MODEL, "sdpa")


def test_value_model_keeps_the_policy_weights_under_a_scalar_head():
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    critic = value_model()
    assert critic.score.out_features == 1 and critic.dropout.p == 0.0
    assert torch.equal(critic.model.embed_tokens.weight, policy.model.embed_tokens.weight)
    assert torch.equal(critic.model.layers[0].mlp.up_proj.weight, policy.model.layers[0].mlp.up_proj.weight)


def test_values_are_aligned_like_logprobs_and_agree_padded_and_packed():
    model = value_model().eval()
    batch = make_batch()
    with torch.no_grad():
        padded = token_values(model, batch.sequences, batch.attention_mask)
        packed = token_values(model, batch.sequences, batch.attention_mask, packed=True)
        assert padded.shape == batch.action_mask.shape
        for i, n in enumerate(batch.attention_mask.sum(-1).tolist()):
            alone = model(input_ids=batch.sequences[i:i + 1, :n]).logits[0, :, 0]  # row i without padding
            assert torch.allclose(padded[i, :n - 1], alone[:-1], atol=1e-5)  # position t: the state ending at t
            assert torch.allclose(packed[i, :n - 1], alone[:-1], atol=1e-5)
            assert not padded[i, n - 1:].any() and not packed[i, n - 1:].any()


def test_explained_variance():
    returns = torch.tensor([[1.0, 0.0, 2.0], [3.0, 5.0, 0.0]])
    mask = torch.tensor([[True, False, True], [True, True, False]])
    assert math.isclose(explained_variance(returns, returns, mask), 1.0)
    mean = returns[mask].mean()
    assert math.isclose(explained_variance(torch.full_like(returns, float(mean)), returns, mask), 0.0, abs_tol=1e-9)
    assert math.isclose(explained_variance(-returns, returns, mask), -3.0)  # Var(2R) / Var(R) = 4
    assert math.isnan(explained_variance(returns, torch.ones_like(returns), mask))


def test_critic_rank_fits_the_returns_and_checkpoints(tmp_path):
    rl = gae_rl(max_epochs=2, value_clip=0.2, optimizer=gae_rl().critic.optimizer.model_copy(update={"lr": 1e-2}))
    worker = CriticWorker(rl.critic, rl.trainer, rl.model, "cpu", "gloo", 0, "127.0.0.1", free_port())
    try:
        batch = make_batch()
        mask = batch.action_mask
        returns = torch.where(torch.arange(4)[:, None] % 2 == 0, 1.0, 0.1).expand_as(mask) * mask
        losses, clip_fracs = [], []
        for _ in range(4):
            rows, values = worker.values(batch)
            assert torch.equal(rows, torch.arange(4))
            stats = worker.train(batch.__class__(**{**batch.tensors(), "values": values, "returns": returns}))
            losses.append(stats["value_loss_sum"] / stats["tokens"])
            clip_fracs.append(stats["value_clip_frac_x_tokens"] / stats["tokens"])
            assert stats["optimizer_steps"] == 2 * 1  # 4 rows = one window of micro 2 x accum 2, two epochs
            assert stats["tokens"] == 2 * mask.sum()
        assert losses[-1] < 0.5 * losses[0], losses
        assert max(clip_fracs) > 0  # at lr 1e-2 the second epoch moves values past the 0.2 clip
        worker.save_checkpoint(str(tmp_path / "critic"))
        _, before = worker.values(batch)
        worker.train(batch.__class__(**{**batch.tensors(), "values": before, "returns": returns * 0 + 5}))
        _, moved = worker.values(batch)
        assert not torch.allclose(moved, before)
        worker.load_checkpoint(str(tmp_path / "critic"))
        _, restored = worker.values(batch)
        assert torch.allclose(restored, before, atol=1e-6)
    finally:
        worker.shutdown()
