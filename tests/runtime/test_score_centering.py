"""Score centering's data path (Molt 0.2.1 §3.4): the hf decode core returns the top-k of the distribution it
samples from, the Experience keeps the (B, T-1, k) ids and log-probs aligned with the action tokens through every
batch operation, the chunked head pass gathers their log-probs like the full-logits formula, and a real FSDP2 rank
(gloo, world 1) trains on exactly the direct loss ℓ = surrogate·coef + A·c, padded and packed.
(The vLLM engine's top-k is checked in test_engines_vllm.py, on that module's engine.)"""

from __future__ import annotations

import os
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from loop_support import ROOT, trainer_rl

from runtime import algo
from runtime.algo.score_centering import centering
from runtime.engines.hf_decode import DecodeCore, Request
from runtime.experience import concat, from_token_lists, pad_batch_to_multiple
from runtime.logprobs import pack_top_ids, token_top_logprobs, unpack

MODEL = str(ROOT / "recipes/data/demo_math/model")
K = 4
TEMPERATURE = 0.7


def _model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32, attn_implementation="sdpa").eval()


# --------------------------------------------------------------------------------------------------- engine
def test_hf_core_top_k_is_the_top_of_the_sampled_log_softmax():
    """Requests with k = 0, 3 and 5 and different temperatures share one batch (prefill and decode chunks): each
    generated token's rows are the k largest entries of log-softmax(logits / T), as a teacher-forced forward gives."""
    torch.manual_seed(0)
    model = _model()
    core = DecodeCore(model, slots=4, max_model_len=64, eos_ids=(), pad_id=0, raw_logprobs=False, cuda_graphs=False,
                      chunk_steps=3)
    reqs = [Request([5, 6, 7, 8][: 2 + i], 7, temp, 1.0, top_k=k)
            for i, (temp, k) in enumerate([(1.0, 3), (0.7, 5), (1.0, 0), (1.3, 5)])]
    for r in reqs:
        core.submit(r)
    while core.busy():
        core.run_chunk()
    for r in reqs:
        ids, lps = r.top_arrays()
        if r.top_k == 0:
            assert ids is None and lps is None
            continue
        assert ids.shape == lps.shape == (len(r.token_ids), r.top_k)
        seq = torch.tensor([r.prompt_ids + r.token_ids])
        with torch.inference_mode():
            logits = model(input_ids=seq).logits[0, len(r.prompt_ids) - 1:-1].float() / r.temperature
        ref = torch.log_softmax(logits, -1).topk(r.top_k, dim=-1)
        assert torch.equal(torch.from_numpy(ids), ref.indices)
        assert (torch.from_numpy(lps) - ref.values).abs().max().item() < 1e-5
        # the sampled token's log-prob comes from the same log-softmax as its top-k rows
        sampled = torch.log_softmax(logits, -1).gather(-1, seq[0, len(r.prompt_ids):, None])[:, 0]
        assert (torch.tensor(r.logprobs) - sampled).abs().max().item() < 1e-5


# --------------------------------------------------------------------------------------------------- Experience
def _top(n: int, base: int) -> tuple[np.ndarray, np.ndarray]:
    """(n, K) ids base, base+1, ... (unique per token) and log-probs -ids/1000, so each row names its token."""
    ids = base + np.arange(n * K).reshape(n, K)
    return ids, (-ids / 1000).astype(np.float32)


def _rows():
    tokens = [list(range(10, 19)), list(range(30, 35))]
    ranges = [[(2, 4), (6, 9)], [(1, 5)]]
    tops = [[_top(2, 100), _top(3, 200)], [_top(4, 300)]]
    return tokens, ranges, tops


def test_experience_keeps_top_k_aligned_with_the_action_tokens():
    tokens, ranges, tops = _rows()
    exp = from_token_lists(tokens, ranges, [[] for _ in tokens], pad_id=0, top_logprobs=tops)
    assert exp.rollout_top_ids.shape == exp.rollout_top_log_probs.shape == (2, 8, K)
    # token j of an action range lands at position j - 1 (position t scores token t + 1), zero elsewhere
    for i, (spans, row_tops) in enumerate(zip(ranges, tops, strict=True)):
        want = torch.zeros(8, K, dtype=torch.long)
        for (start, end), (ids, _) in zip(spans, row_tops, strict=True):
            want[start - 1:end - 1] = torch.from_numpy(ids)
        assert torch.equal(exp.rollout_top_ids[i], want)
        assert torch.equal(exp.rollout_top_ids[i].any(-1), exp.action_mask[i])
    assert torch.allclose(exp.rollout_top_log_probs, -exp.rollout_top_ids.float() / 1000)

    wide = from_token_lists([list(range(40, 52))], [[(3, 12)]], [[]], pad_id=0, top_logprobs=[[_top(9, 400)]])
    both = concat([exp, wide], pad_id=0)  # exp's rows padded from 9 to 12 tokens
    assert both.rollout_top_ids.shape == (3, 11, K)
    assert torch.equal(both.rollout_top_ids[:2, :8], exp.rollout_top_ids) and not both.rollout_top_ids[:2, 8:].any()
    picked = both.select(torch.tensor([2, 0]))
    assert torch.equal(picked.rollout_top_ids[1, :8], exp.rollout_top_ids[0])
    trimmed = both.select(torch.tensor([0, 1])).trim()  # back to the longest row (9 tokens)
    assert trimmed.rollout_top_ids.shape == (2, 8, K) and torch.equal(trimmed.rollout_top_ids, exp.rollout_top_ids)
    padded = pad_batch_to_multiple(both, 4)
    assert padded.rollout_top_ids.shape == (4, 11, K)
    assert torch.equal(padded.rollout_top_log_probs[:3], both.rollout_top_log_probs)

    # packing: each position's ids travel with its token, and unpacking restores the padded layout
    flat = pack_top_ids(both.rollout_top_ids, both.attention_mask)
    assert flat.shape == (1, int(both.attention_mask.sum()) - 1, K)
    back = unpack(flat, both.attention_mask.sum(-1), both.sequences.shape[1])
    assert torch.equal(back, both.rollout_top_ids)


def test_a_trajectory_refuses_misaligned_top_k():
    from runtime.agents.base import Trajectory

    traj = Trajectory(prompt="", label=None, observation_text="", token_ids=[1, 2], rollout_log_probs=[0.0, 0.0],
                      top_logprobs=[])
    traj.append_action([3, 4], [-0.1, -0.2], top=_top(2, 0))
    assert len(traj.top_logprobs) == 1 and traj.top_logprobs[0][0].shape == (2, K)
    with pytest.raises(RuntimeError, match="top-k rows"):
        traj.append_action([5, 6, 7], [-0.1, -0.2, -0.3], top=_top(2, 0))


# --------------------------------------------------------------------------------------------------- head pass
def _batch():
    """Rows of 7..20 tokens with one or two action spans, and the policy's own tempered top-K at every position as
    the sampler's (log-probs moved a little, as a sampler that disagrees)."""
    g = torch.Generator().manual_seed(0)
    lengths = [7, 20, 9, 12]
    tokens = [torch.randint(5, 200, (n,), generator=g).tolist() for n in lengths]
    ranges = [[(2, 4), (5, n)] if i % 2 else [(3, n)] for i, n in enumerate(lengths)]
    exp = from_token_lists(tokens, ranges, [[] for _ in tokens], pad_id=0)
    with torch.no_grad():
        logits = _model()(input_ids=exp.sequences, attention_mask=exp.attention_mask.long()).logits[:, :-1]
        top = torch.log_softmax(logits.float() / TEMPERATURE, -1).topk(K, dim=-1)
    m = exp.action_mask[..., None]
    sampler = (top.values - 0.05 + 0.02 * torch.randn(top.values.shape, generator=g)).clamp(max=-1e-3)
    return replace(exp, rollout_top_ids=top.indices * m, rollout_top_log_probs=sampler * m)


def _full_logits_top(model, exp):
    logits = model(input_ids=exp.sequences, attention_mask=exp.attention_mask.long()).logits[:, :-1].float()
    logp = torch.log_softmax(logits / TEMPERATURE, -1)
    return logp.gather(-1, exp.sequences[:, 1:, None])[..., 0], logp.gather(-1, exp.rollout_top_ids)


def test_chunked_top_logprobs_match_full_logits_padded_and_packed():
    model = _model()
    exp = _batch()
    mask = exp.action_mask
    lp_full, top_full = _full_logits_top(model, exp)
    for packed in (False, True):
        lp, _, top = token_top_logprobs(model, exp.sequences, exp.attention_mask, TEMPERATURE, exp.rollout_top_ids,
                                        packed=packed, chunk_tokens=8)
        assert top.shape == exp.rollout_top_ids.shape
        assert torch.allclose(lp * mask, lp_full * mask, atol=1e-5)
        assert torch.allclose(top * mask[..., None], top_full * mask[..., None], atol=1e-5), packed


# --------------------------------------------------------------------------------------------------- trainer
def _rl(packing: bool):
    rl = trainer_rl(1, ref=False, trainer={"micro_batch_size": 4 if not packing else 2,
                                           "grad_accum": 1 if not packing else 2, "max_epochs": 1,
                                           "temperature": TEMPERATURE, "seed": 0, "packing": packing,
                                           "dynamic_batch_max_tokens": None, "local_batch_size": None},
                    optimizer=dict(lr=1e-2, max_norm=0.0, scheduler="constant", warmup_steps=0, total_steps=10),
                    loss=dict(mode="ppo", clip_low=0.2, clip_high=0.2, dual_clip=None, entropy_coef=0.0),
                    is_correction=dict(level="token", mode="clip", low=0.8, high=1.2))
    return rl.model_copy(update={"algo": rl.algo.model_copy(update={"score_centering_top_k": K})})


def _train_batch(exp, old):
    mask = exp.action_mask
    advantages = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1)) * mask
    return replace(exp, old_log_probs=old, advantages=advantages, rollout_log_probs=(old - 0.05) * mask)


def _rank_main(rank: int, ports: list[int], out_dir: str) -> None:
    torch.set_num_threads(1)
    from runtime.trainer import PolicyWorker

    results = {}
    for packing, port in zip((False, True), ports, strict=True):
        rl = _rl(packing)
        worker = PolicyWorker(rl.trainer, rl.model, rl.ref, rl.algo, rl.device, rl.dist_backend, rank, "127.0.0.1",
                              port)
        grads: list = []

        def record_step(worker=worker, grads=grads) -> float:
            grads.append([p.grad.full_tensor().clone() for p in worker.model.parameters()])
            worker.optimizer.zero_grad(set_to_none=True)
            return 0.0

        worker._optimizer_step = record_step
        exp = _batch()
        _, old, _ = worker.forward_logprobs(exp)
        stats = worker.train(_train_batch(exp, old), kl_coef=0.0)
        results[packing] = {"old": old, "stats": stats, "grads": grads}
        worker.shutdown()
    torch.save(results, os.path.join(out_dir, "rank0.pt"))


def test_trainer_loss_with_centering_is_the_direct_loss(tmp_path):
    from runtime.trainer import free_port

    mp.spawn(_rank_main, args=([free_port(), free_port()], str(tmp_path)), nprocs=1, join=True)
    results = torch.load(tmp_path / "rank0.pt")

    model = _model()
    exp = _batch()
    mask = exp.action_mask
    logp, top = _full_logits_top(model, exp)
    batch = _train_batch(exp, results[False]["old"])
    is_out = algo.is_correction(batch.old_log_probs, batch.rollout_log_probs, mask, level="token", mode="clip",
                                low=0.8, high=1.2)
    sc = centering(top, batch.rollout_top_log_probs, mask, mode="clip", low=0.8, high=1.2)
    out = algo.actor_loss(logp, batch.old_log_probs, batch.advantages, mask, mode="ppo", clip_low=0.2, clip_high=0.2,
                          global_num_tokens=mask.sum(), is_coef=is_out.coef, centering=sc.correction)
    plain = algo.actor_loss(logp, batch.old_log_probs, batch.advantages, mask, mode="ppo", clip_low=0.2,
                            clip_high=0.2, global_num_tokens=mask.sum(), is_coef=is_out.coef)
    assert abs(out.loss.item() - plain.loss.item()) > 1e-4  # the correction is in the loss
    model.zero_grad()
    out.loss.backward()
    want = [p.grad for p in model.parameters()]
    tokens = mask.sum().item()
    for packing, r in results.items():
        [grads] = r["grads"]  # one optimizer step over the whole batch
        worst = max((a - b).abs().max().item() for a, b in zip(grads, want, strict=True))
        assert worst < 1e-5, (packing, worst)
        stats = r["stats"]
        for name, value in (("sampler_head_mass", sc.sampler_head_mass), ("policy_head_mass", sc.policy_head_mass)):
            got = stats[f"score_centering_{name}_x_tokens"] / tokens
            assert abs(got - float(value)) < 1e-4, (packing, name, got, float(value))
    assert max(g.abs().max().item() for g in want) > 1e-3
