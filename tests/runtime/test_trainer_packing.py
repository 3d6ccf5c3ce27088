"""Packed, token-budget and length-grouped micro-batches train exactly like padded fixed ones (fp32, CPU, real gloo
FSDP2 ranks).

For world 1 and 2, each rank builds one `PolicyWorker` and runs the same batch through these layouts: padded fixed
micro-batches of contiguous rows, the same grouped by length within each window (`micro_batches_by_length`),
packed fixed micro-batches, and packed micro-batches by token budget (with Molt's length-balanced rank shards);
world 1 also runs the padded pair under a seq-mean loss aggregation. The old/ref log-probs, the loss sums, the
objective that was backpropagated and the gradients of every optimizer step must agree. The gradients are read at
each optimizer step (the rank's `_optimizer_step` is replaced by a recorder that zeroes them), so every run starts
from the same weights (equal gradients: equal weights after the step).

Also: the chunked lm_head path gives the full-logits numbers (log-probs, entropy, gradients) and never asks the
lm_head for more than one chunk of positions.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch
import torch.multiprocessing as mp
from loop_support import ROOT, trainer_rl

from runtime import algo, microbatch
from runtime.experience import from_token_lists
from runtime.logprobs import token_logprobs

MODEL = str(ROOT / "recipes/data/demo_math/model")
ROWS = 8


def trainer_rl_for(world: int, agg_mode: str = "token-mean", **trainer):
    # world 1: micro 2 x accum 2 = two optimizer-step windows of 4 rows; world 2: one window of 4 rows per rank.
    return trainer_rl(
        world, trainer={"micro_batch_size": 2, "grad_accum": 2, "max_epochs": 1, "temperature": 0.7, "seed": 0,
                        "packing": False, "dynamic_batch_max_tokens": None, "local_batch_size": None,
                        "micro_batches_by_length": False, **trainer},
        optimizer=dict(lr=1e-2, max_norm=0.0, scheduler="constant", warmup_steps=0, total_steps=10),
        loss=dict(mode="ppo", clip_low=0.2, clip_high=0.2, dual_clip=None, entropy_coef=0.01, agg_mode=agg_mode),
        kl=dict(estimator="k3", use_loss=True), is_correction=dict(level="token", mode="clip", low=0.8, high=1.2))


def skewed_batch():
    """Rows of 6..40 tokens (a few long ones), one or two action spans each."""
    g = torch.Generator().manual_seed(0)
    lengths = [6, 40, 9, 7, 33, 8, 12, 10]
    tokens = [torch.randint(5, 200, (n,), generator=g).tolist() for n in lengths]
    ranges = [[(2, 4), (5, n)] if i % 2 else [(3, n)] for i, n in enumerate(lengths)]
    return from_token_lists(tokens, ranges, [[] for _ in tokens], pad_id=0)


def layouts(world: int) -> dict[str, object]:
    """The trainer sections of the layouts (the model, ref and algo sections are the same)."""
    step_rows = 4  # rows per rank per optimizer step, as micro 2 x accum 2
    seq_mean = {"seq-mean padded": trainer_rl_for(world, "seq-mean-token-mean"),
                "seq-mean by length": trainer_rl_for(world, "seq-mean-token-mean", micro_batches_by_length=True)}
    return {
        "padded": trainer_rl_for(world),
        "by length": trainer_rl_for(world, micro_batches_by_length=True),
        "packed": trainer_rl_for(world, packing=True),
        # 30 tokens: the 33- and 40-token rows exceed it (a bin each), short rows share bins; ranks get unequal bin
        # counts, so empty filler micro-batches are exercised.
        "dynamic": trainer_rl_for(world, packing=True, dynamic_batch_max_tokens=30, local_batch_size=step_rows),
        **(seq_mean if world == 1 else {}),
    }


def _rank_main(rank: int, world: int, port: int, out_dir: str, rls: dict) -> None:
    torch.set_num_threads(1)
    from runtime.trainer import PolicyWorker

    rl = rls["padded"]
    worker = PolicyWorker(rl.trainer, rl.model, rl.ref, rl.algo, rl.device, rl.dist_backend, rank, "127.0.0.1", port)
    steps: list[list[torch.Tensor]] = []

    def record_step() -> float:
        steps.append([p.grad.full_tensor().clone() for p in worker.model.parameters()])
        worker.optimizer.zero_grad(set_to_none=True)
        return 0.0

    worker._optimizer_step = record_step
    objective: list[float] = []  # the policy objective each micro-batch backpropagates
    actor_loss = algo.actor_loss

    def recording_actor_loss(*args, **kwargs):
        out = actor_loss(*args, **kwargs)
        objective.append(float(out.loss))
        return out

    algo.actor_loss = recording_actor_loss
    batch = skewed_batch()
    mask = batch.action_mask
    advantages = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1)) * mask
    results = {}
    for name, rl in rls.items():
        worker.t = rl.trainer
        rows, old, ref = worker.forward_logprobs(batch)
        # Each rank fills only its own rows (and trains only those); the rest stay 0.
        old_full, ref_full = torch.zeros(mask.shape), torch.zeros(mask.shape)
        old_full[rows], ref_full[rows] = old, ref
        train_batch = replace(batch, old_log_probs=old_full, ref_log_probs=ref_full, advantages=advantages,
                              rollout_log_probs=(old_full - 0.05) * mask,  # an engine that disagrees a little
                              group_ids=torch.arange(ROWS) // 2)
        steps.clear()
        objective.clear()
        stats = worker.train(train_batch, kl_coef=0.05)
        results[name] = {"rows": rows, "old": old, "ref": ref, "stats": stats, "grads": list(steps),
                         "objective": sum(objective)}
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    worker.shutdown()


def _gather(results: list[dict], name: str):
    old = torch.zeros(ROWS, skewed_batch().action_mask.shape[1])
    for r in results:
        old[r[name]["rows"]] = r[name]["old"]
    sums = {k: sum(r[name]["stats"][k] for r in results) for k in results[0][name]["stats"]
            if k.endswith("_x_tokens") or k == "tokens"}
    sums["objective"] = sum(r[name]["objective"] for r in results)
    return old, sums, results[0][name]["grads"]


@pytest.mark.parametrize("world", [1, 2])
def test_packed_and_token_budget_match_padded(world, tmp_path):
    from runtime.trainer import free_port

    mp.spawn(_rank_main, args=(world, free_port(), str(tmp_path), layouts(world)), nprocs=world, join=True)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    mask = skewed_batch().action_mask
    # the skewed lengths regroup: world 1's first window [6, 40, 9, 7] as [40, 9] + [6, 7], not [6, 40] + [9, 7]
    assert microbatch.length_grouped_micro_batches(range(4), skewed_batch().attention_mask.sum(-1), 2) == [[1, 2],
                                                                                                          [0, 3]]
    pairs = [("packed", "padded"), ("dynamic", "padded"), ("by length", "padded")]
    if world == 1:
        pairs.append(("seq-mean by length", "seq-mean padded"))
    for name, base in pairs:
        old_p, sums_p, grads_p = _gather(results, base)
        assert len(grads_p) == (2 if world == 1 else 1)  # optimizer steps
        assert max(g.abs().max().item() for g in grads_p[0]) > 1e-3  # the gradients are not trivially zero
        old, sums, grads = _gather(results, name)
        assert torch.allclose(old * mask, old_p * mask, atol=1e-5), name
        assert sums.keys() == sums_p.keys()
        for k in sums:
            assert abs(sums[k] - sums_p[k]) <= 1e-5 * max(1.0, abs(sums_p[k])), (name, k, sums[k], sums_p[k])
        if "by length" in name:  # π_old came from the training step's micro-batches: the PPO ratio is exactly 1
            assert sums["policy_kl_x_tokens"] == 0.0 and sums["ratio_mean_x_tokens"] == sums["tokens"], name
        assert len(grads) == len(grads_p), name
        for step, step_p in zip(grads, grads_p, strict=True):
            worst = max((a - b).abs().max().item() for a, b in zip(step, step_p, strict=True))
            assert worst < 1e-5, (name, worst)
    sums_p = _gather(results, "padded")[1]
    assert sums_p["tokens"] == mask.sum().item()
    if world == 2:  # the token-budget run balanced the shards by length, so rows moved between ranks
        assert not torch.equal(results[0]["dynamic"]["rows"], results[0]["padded"]["rows"])


def test_chunked_lm_head_matches_full_logits_and_stays_chunked():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32, attn_implementation="sdpa")
    batch = skewed_batch()
    seqs, attn, mask = batch.sequences, batch.attention_mask, batch.action_mask

    def full_formula():
        logits = model(input_ids=seqs, attention_mask=attn.long()).logits[:, :-1].float() / 0.7
        logz = torch.logsumexp(logits, -1)
        lp = logits.gather(-1, seqs[:, 1:, None]).squeeze(-1) - logz
        return lp, logz - (torch.softmax(logits, -1) * logits).sum(-1)

    def grads(loss):
        model.zero_grad()
        loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    lp_full, ent_full = full_formula()
    g_full = grads(algo.global_token_mean(lp_full - 0.1 * ent_full, mask, mask.sum()))
    rows_seen = []
    hook = model.get_output_embeddings().register_forward_hook(lambda m, i, o: rows_seen.append(o.shape[0]))
    for packed in (False, True):
        rows_seen.clear()
        lp, ent = token_logprobs(model, seqs, attn, 0.7, with_entropy=True, packed=packed, chunk_tokens=16)
        assert torch.allclose(lp * mask, lp_full * mask, atol=1e-5)
        assert torch.allclose(ent * mask, ent_full * mask, atol=1e-5)
        g = grads(algo.global_token_mean(lp - 0.1 * ent, mask, mask.sum()))
        assert max((a - b).abs().max().item() for a, b in zip(g, g_full, strict=True)) < 1e-5
        # lm_head sees (chunk, hidden) inputs only, forward and recomputed backward alike
        assert rows_seen and max(rows_seen) <= 16 and len(rows_seen) > 2 * (attn.sum() // 16)
    hook.remove()


def test_lm_head_chunks_get_16_byte_aligned_inputs(monkeypatch):
    """A packed row's targets are the view `input_ids[0, 1:]`, 8 bytes into its storage; the compiled chunk's Triton
    kernels (GPUs) load 16-byte aligned: on an H200 the RL loop with packing died with a misaligned address."""
    from transformers import AutoModelForCausalLM

    from runtime import logprobs

    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32, attn_implementation="sdpa")
    batch = skewed_batch()
    offsets: list[int] = []
    chunk = logprobs._chunk

    def recording(head, *args):
        offsets.extend(t.storage_offset() * t.element_size() % 16 for t in args if isinstance(t, torch.Tensor))
        return chunk(head, *args)

    monkeypatch.setattr(logprobs, "_chunk", recording)
    with torch.no_grad():
        lp, _ = token_logprobs(model, batch.sequences, batch.attention_mask, 0.7, packed=True, chunk_tokens=16)
    assert len(offsets) >= 2 * (batch.attention_mask.sum() // 16) and set(offsets) == {0}
    monkeypatch.setattr(logprobs, "_aligned", lambda t: t)  # without the copy, the packed targets start 8 bytes in
    offsets.clear()
    with torch.no_grad():
        lp_view, _ = token_logprobs(model, batch.sequences, batch.attention_mask, 0.7, packed=True, chunk_tokens=16)
    assert 8 in offsets and torch.equal(lp, lp_view)
