"""The FSDP2 actor group (2 Ray actors, gloo) against a single-process reference: same log-probs, and one optimizer
step with gradient accumulation and the global token-mean loss lands on the same weights as one full-batch step.
Also: DCP checkpoint save/load round trip."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from loop_support import ROOT, trainer_rl

from runtime import algo
from runtime.experience import from_token_lists
from runtime.trainer import start_trainer_group, token_logprobs

pytestmark = pytest.mark.slow

MODEL = str(ROOT / "recipes/data/demo_math/model")
RL = trainer_rl(
    # selective checkpointing: its recomputation inside FSDP2's all-gather hooks must not change a number
    2, model=dict(gradient_checkpoint="selective"),
    trainer=dict(micro_batch_size=2, grad_accum=2, max_epochs=1, temperature=0.7, seed=0, packing=False,
                 dynamic_batch_max_tokens=None, local_batch_size=None),
    # eps 1e-3, not 1e-8: Adam's first step is lr * g / (|g| + eps), which turns the fp32 rounding (~1e-7) of a gradient
    # element of size ~eps into a weight difference of up to lr * rounding / (4 eps); the gradients of micro-batches cut
    # to their own width differ from the one-batch reference by such rounding. The test is about the aggregation.
    optimizer=dict(lr=1e-2, betas=[0.9, 0.95], eps=1e-3, weight_decay=0.01, max_norm=1.0, scheduler="constant",
                   warmup_steps=0, total_steps=10, min_lr_ratio=0.1),
    loss=dict(mode="ppo", clip_low=0.2, clip_high=0.2, dual_clip=None, entropy_coef=0.0),
    kl=dict(estimator="k2", use_loss=True), is_correction=dict(level="token", mode="clip", low=0.8, high=1.2))
TEMPERATURE = RL.trainer.temperature


def make_batch(rows: int = 8):
    """Rows of different lengths with one or two action spans each (so micro-batches hold different token counts)."""
    g = torch.Generator().manual_seed(0)
    tokens, ranges = [], []
    for i in range(rows):
        n = 8 + i % 5
        tokens.append(torch.randint(5, 200, (n,), generator=g).tolist())
        ranges.append([(3, 5), (6, n)] if i % 2 else [(4, n)])
    return from_token_lists(tokens, ranges, [[] for _ in tokens], pad_id=0)


@pytest.fixture(scope="module")
def group(local_ray):
    g = start_trainer_group(RL, [dict(num_cpus=1, resources={"device_slot": 1})] * RL.trainer.world)
    yield g
    g.shutdown()


def test_fsdp_step_matches_single_process_reference(group):
    import ray
    from transformers import AutoModelForCausalLM

    batch = make_batch()
    ref_model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32, attn_implementation="sdpa")
    old_ref, _ = token_logprobs(ref_model, batch.sequences, batch.attention_mask, TEMPERATURE)

    old, ref = group.forward_logprobs(ray.put(batch))
    mask = batch.action_mask
    assert torch.allclose(old * mask, old_ref.detach() * mask, atol=1e-5)
    assert torch.allclose(ref * mask, old * mask, atol=1e-6)  # the reference starts as the policy

    g = torch.Generator().manual_seed(1)
    advantages = torch.randn(mask.shape, generator=g) * mask
    rollout = (old + 0.1 * torch.randn(mask.shape, generator=g)) * mask  # an engine that disagrees a little
    train_batch = replace(batch, old_log_probs=old, ref_log_probs=ref, advantages=advantages,
                          rollout_log_probs=rollout)
    stats = group.train(ray.put(train_batch), kl_coef=0.05)
    assert stats["optimizer_steps"] == 1 and stats["tokens"] == mask.sum().item()

    # Reference: the whole batch at once, normaliser = all action tokens, plain AdamW step.
    opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-3, weight_decay=0.01)
    logp, _ = token_logprobs(ref_model, batch.sequences, batch.attention_mask, TEMPERATURE)
    is_out = algo.is_correction(old, rollout, mask, level="token", mode="clip", low=0.8, high=1.2)
    out = algo.actor_loss(logp, old, advantages, mask, mode="ppo", clip_low=0.2, clip_high=0.2,
                          global_num_tokens=mask.sum(), is_coef=is_out.coef, ref_log_probs=ref, kl_coef=0.05,
                          kl_estimator="k2")
    out.loss.backward()
    torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 1.0)
    opt.step()

    # The trained weights as the engines get them: streamed out of the shards over a real gloo group, this process
    # being the receiving engine; first in fp32, then in bf16 (the gather itself moves bf16).
    trained, received, sent = streamed_state(group, "float32", bucket_bytes=1 << 16)
    expected = {k: v for k, v in ref_model.state_dict().items() if k != "lm_head.weight"}  # tied: sent once
    assert set(trained) == set(expected)
    assert received.buckets > 1 and received.bytes == sent[0]["bytes"] and sent[1]["bytes"] == 0  # rank 0 sends
    worst = max((trained[k] - expected[k]).abs().max().item() for k in expected)
    moved = max((trained[k] - v).abs().max().item()
                for k, v in AutoModelForCausalLM.from_pretrained(MODEL).state_dict().items() if k in expected)
    half, received_half, _ = streamed_state(group, "bfloat16", bucket_bytes=1 << 16)
    assert received_half.bytes * 2 == received.bytes
    assert all(half[k].dtype == torch.bfloat16 and torch.equal(half[k], trained[k].to(torch.bfloat16)) for k in half)
    assert moved > 1e-3  # the step did something
    assert worst < 1e-5, worst


def streamed_state(group, dtype: str, bucket_bytes: int):
    """Join the trainer's weight-sync group as its only engine and receive one streamed sync into a dict."""
    import ray

    from runtime import weight_sync

    rank0 = group.workers[0]
    metas = [weight_sync.TensorMeta(n, d, tuple(s)) for n, d, s in ray.get(rank0.weight_sync_metas.remote(dtype))]
    host, port = ray.get(rank0.weight_sync_address.remote())
    opened = rank0.open_weight_sync.remote("gloo_broadcast", host, port, 2, 60.0)
    pg = weight_sync.join_group("gloo_broadcast", host, port, 1, 2, 60.0)
    ray.get(opened)
    sends = [w.send_weights.remote(dtype, bucket_bytes) for w in group.workers]
    out: dict[str, torch.Tensor] = {}
    stats = weight_sync.receive(pg, metas, bucket_bytes, torch.device("cpu"),
                                lambda pairs: out.update({n: t.clone() for n, t in pairs}), {})
    return out, stats, ray.get(sends)


def test_checkpoint_round_trip(group, tmp_path):
    import ray

    probe = make_batch(1).sequences[0].tolist()
    path = str(tmp_path / "step_000001")
    group.save_checkpoint(path)
    saved = torch.tensor(group.probe_logprobs(probe))
    batch = make_batch()
    old, ref = group.forward_logprobs(ray.put(batch))
    adv = torch.ones_like(old) * batch.action_mask
    group.train(ray.put(replace(batch, old_log_probs=old, ref_log_probs=ref, advantages=adv,
                                rollout_log_probs=old * batch.action_mask)), kl_coef=0.0)
    changed = torch.tensor(group.probe_logprobs(probe))
    assert (changed - saved).abs().max() > 1e-4
    group.load_checkpoint(path)
    restored = torch.tensor(group.probe_logprobs(probe))
    assert torch.allclose(restored, saved, atol=1e-6)


def test_best_checkpoint_save_and_load(group, tmp_path):
    """`ckpt.save_best` writes `<dir>/best` through the ranks' DCP save with its state last; loading it restores the
    weights it was taken from after a training step moved them; a better eval replaces it in place."""
    import ray

    from runtime import ckpt

    probe = make_batch(1).sequences[0].tolist()
    state = {"step": 4, "kl_coef": 0.0, "prompts": {}, "best_metric_key": "eval/pass1", "best_metric": 0.5}
    path = ckpt.save_best(group, None, tmp_path, state)
    assert path == tmp_path / "best" and not (tmp_path / "best.tmp").exists()
    assert ckpt.best_record(tmp_path) == state
    saved = torch.tensor(group.probe_logprobs(probe))
    batch = make_batch()
    old, ref = group.forward_logprobs(ray.put(batch))
    group.train(ray.put(replace(batch, old_log_probs=old, ref_log_probs=ref, advantages=torch.ones_like(old) *
                                batch.action_mask, rollout_log_probs=old * batch.action_mask)), kl_coef=0.0)
    assert (torch.tensor(group.probe_logprobs(probe)) - saved).abs().max() > 1e-4
    group.load_checkpoint(str(path))
    assert torch.allclose(torch.tensor(group.probe_logprobs(probe)), saved, atol=1e-6)
    ckpt.save_best(group, None, tmp_path, {**state, "step": 8, "best_metric": 0.75})
    assert ckpt.best_record(tmp_path)["step"] == 8 and sorted(p.name for p in tmp_path.iterdir()) == ["best"]
