"""The transformers engine in a real Ray actor: same interface and guarantees as the vLLM engine."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import ray  # noqa: E402
import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from runtime.agents.types import GenerateOutput  # noqa: E402
from runtime.engines import RolloutEngine, start_engines  # noqa: E402
from runtime.engines.hf_engine import HfEngine  # noqa: E402
from runtime.engines.local import cpu_engine_role, cpu_engines_plan  # noqa: E402
from runtime.engines.vllm_engine import VllmEngine  # noqa: E402
from runtime.tiny_model import build_tiny_model  # noqa: E402
from runtime.weight_sync_driver import StateDictSender  # noqa: E402

pytestmark = pytest.mark.slow

PROMPT = [5, 6, 7, 8, 9]
LOGPROB_TOL = 1e-4  # same library and dtype as the reference: only batching/padding reorders float sums


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("hf") / "tiny", seed=0)


@pytest.fixture(scope="module")
def engine(model_dir):
    ray.init(num_cpus=2, include_dashboard=False, namespace="test-engines-hf",
             runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1"}})
    try:
        [handle] = start_engines(cpu_engines_plan("hf"), cpu_engine_role("hf"), str(model_dir))
        yield handle
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def sender(engine, model_dir):
    """The test process as trainer rank 0; small buckets so that one sync spans many of them."""
    shapes = {n: tuple(p.shape) for n, p in reference(model_dir).named_parameters()}
    return StateDictSender([engine], shapes, "float32", bucket_bytes=64 << 10)


def reference(model_dir, state=None):
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    if state is not None:
        model.load_state_dict(state)
    return model


def greedy(model, prompt, n):
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


def logprobs_of(model, ids):
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1]
    return torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).squeeze(-1)


def test_both_engines_implement_the_protocol():
    for cls in (HfEngine, VllmEngine):
        for name in ("generate", "score", "pause", "resume", "join_weight_sync", "receive_weights", "weights_version"):
            assert callable(getattr(cls, name)), (cls, name)
    assert isinstance(HfEngine.__new__(HfEngine), RolloutEngine)


def test_generate_batch_of_mixed_requests(engine):
    specs = [(PROMPT[: 2 + i % 4], 4 + 3 * i, 1.0 if i % 2 else 0.7) for i in range(10)]
    outs = ray.get([engine.generate.remote(p, max_tokens=m, temperature=t, top_p=0.9, session_id=f"s{i}",
                                           logprobs=True) for i, (p, m, t) in enumerate(specs)])
    for (_, max_tokens, _), out in zip(specs, outs, strict=True):
        assert isinstance(out, GenerateOutput)
        assert 1 <= len(out.token_ids) <= max_tokens
        assert len(out.logprobs) == len(out.token_ids) and all(lp <= 0.0 for lp in out.logprobs)
        assert (out.finish_reason == "length") == (len(out.token_ids) == max_tokens and out.token_ids[-1] != 2)


def test_greedy_and_logprobs_match_transformers(engine, model_dir):
    out = ray.get(engine.generate.remote(PROMPT, max_tokens=24, temperature=0.0, top_p=1.0, session_id="g",
                                         logprobs=True))
    model = reference(model_dir)
    assert out.token_ids == greedy(model, PROMPT, 24)[: len(out.token_ids)]
    ref = logprobs_of(model, PROMPT + out.token_ids)
    assert (torch.tensor(out.logprobs) - ref[-len(out.token_ids):]).abs().max().item() < LOGPROB_TOL
    assert (torch.tensor(ray.get(engine.score.remote(PROMPT + out.token_ids))) - ref).abs().max().item() < LOGPROB_TOL


def test_sampled_logprobs_are_the_tempered_distribution(engine, model_dir):
    """processed_logprobs: logprobs of the distribution sampled from, i.e. log_softmax(logits / T)."""
    out = ray.get(engine.generate.remote(PROMPT, max_tokens=12, temperature=0.5, top_p=1.0, session_id="t",
                                         logprobs=True))
    ids = PROMPT + out.token_ids
    with torch.inference_mode():
        logits = reference(model_dir)(input_ids=torch.tensor([ids])).logits[0, :-1] / 0.5
    ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).squeeze(-1)
    assert (torch.tensor(out.logprobs) - ref[-len(out.token_ids):]).abs().max().item() < LOGPROB_TOL


def test_weight_update_then_score_matches_trainer(engine, model_dir, sender):
    before = ray.get(engine.generate.remote(PROMPT, max_tokens=12, temperature=0.0, top_p=1.0, session_id="w",
                                            logprobs=False)).token_ids
    gen = torch.Generator().manual_seed(3)
    state = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in reference(model_dir).state_dict().items()
             if k != "lm_head.weight"}
    version = ray.get(engine.weights_version.remote()) + 1
    sender.push(state, version)
    assert ray.get(engine.weights_version.remote()) == version
    trainer = reference(model_dir, {**state, "lm_head.weight": state["model.embed_tokens.weight"]})
    after = ray.get(engine.generate.remote(PROMPT, max_tokens=12, temperature=0.0, top_p=1.0, session_id="w",
                                           logprobs=False)).token_ids
    assert after != before and after == greedy(trainer, PROMPT, 12)[: len(after)]
    probe = PROMPT + list(range(100, 140))
    assert (torch.tensor(ray.get(engine.score.remote(probe))) - logprobs_of(trainer, probe)).abs().max() < LOGPROB_TOL
    assert ray.get(engine.weights_version.remote()) == version
    original = {k: v for k, v in reference(model_dir).state_dict().items() if k != "lm_head.weight"}
    sender.push(original, version + 1)


def test_pause_freezes_in_flight_requests_until_resume(engine):
    refs = [engine.generate.remote(PROMPT + [i], max_tokens=300, temperature=1.0, top_p=1.0, session_id=f"p{i}",
                                   logprobs=True) for i in range(4)]
    ray.wait(refs, num_returns=len(refs), timeout=0.3)  # let the batch start
    ray.get(engine.pause.remote())
    done_at_pause, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
    assert len(done_at_pause) < len(refs), "requests finished before the pause; lengthen them"
    late = engine.generate.remote(PROMPT, max_tokens=4, temperature=1.0, top_p=1.0, session_id="late", logprobs=True)
    done_while_paused, _ = ray.wait(refs + [late], num_returns=len(refs) + 1, timeout=2.0)
    assert len(done_while_paused) == len(done_at_pause)
    # the engine still answers control calls while paused
    assert ray.get(engine.weights_version.remote(), timeout=10) >= 0
    ray.get(engine.resume.remote())
    outs = ray.get(refs + [late], timeout=300)
    assert all(o.finish_reason in ("stop", "length") and len(o.logprobs) == len(o.token_ids) for o in outs)
    assert any(len(o.token_ids) == 300 for o in outs[:-1])
