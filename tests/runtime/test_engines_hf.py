"""The transformers engine in a real Ray actor: same interface and guarantees as the vLLM engine."""

from __future__ import annotations

import os
import threading
import time

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import ray
import torch
from partial_support import check_versions_and_metrics, generate_across_a_sync
from transformers import AutoModelForCausalLM

from runtime.agents.types import GenerateOutput
from runtime.engines import RolloutEngine, start_engines
from runtime.engines.hf_decode import DecodeCore, Request, top_p_filter
from runtime.engines.hf_engine import HfEngine, StepGate
from runtime.engines.local import cpu_engine_role, cpu_engines_plan
from runtime.engines.vllm_engine import VllmEngine
from runtime.tiny_model import build_tiny_model
from tests.runtime.state_dict_sender import StateDictSender

pytestmark = pytest.mark.slow

PROMPT = [5, 6, 7, 8, 9]
LOGPROB_TOL = 1e-4  # same library and dtype as the reference: only batching/padding reorders float sums
CORE_TOL = 1e-5  # the decode core in fp32 against a teacher-forced forward


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


def test_a_request_the_engine_raises_on_reaches_the_runner_as_engine_error(engine):
    """The router turns the engine actor's own exception (it stays alive) into `EngineError`, naming the engine and
    the cause: the runner drops the rollout as `engine_error`, not as the agent's. Here a prompt longer than the
    engine's context."""
    import asyncio

    from runtime.agents import EngineError
    from runtime.engines.router import Router

    router = Router([engine], "round_robin")
    with pytest.raises(EngineError, match=r"rollout engine 0 failed the request: ValueError: prompt of 5000 tokens"):
        asyncio.run(router.generate([5] * 5000, max_tokens=4, temperature=1.0, top_p=1.0, session_id="s",
                                    logprobs=True))
    out = asyncio.run(router.generate(PROMPT, max_tokens=4, temperature=1.0, top_p=1.0, session_id="s",
                                      logprobs=True))
    assert len(out.token_ids) > 0  # the engine serves the next request


def test_pause_freezes_in_flight_requests_until_resume(engine):
    refs = [engine.generate.remote(PROMPT + [i], max_tokens=300, temperature=1.0, top_p=1.0, session_id=f"p{i}",
                                   logprobs=True) for i in range(4)]
    ray.wait(refs, num_returns=len(refs), timeout=0.02)  # let the batch start (1,200 tokens took 0.22 s here)
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


def test_an_alternate_training_turn_waits_for_the_batch_then_has_the_engine_paused(engine):
    """`train.async.colocated_gpus: alternate` (runtime.engine_lock.trainer_turn): the step's turn starts once the
    generator releases the engine lock, the engine generates nothing through the turn (a 4-token request sent in it,
    as a group carried between batches asks for its next turn, stays unfinished), and every request finishes once
    the turn ends; under `overlap` the turn holds nothing."""
    import threading

    from runtime.engine_lock import EngineLock, trainer_turn
    from runtime.supervisor import StopFlag, Supervisor
    from schemas.plan import QueuePlan, SupervisorPlan

    sup = Supervisor(SupervisorPlan.model_construct(poll_s=0.2, stall_timeout_s=60.0, stop_timeout_s=10.0), StopFlag())
    alternate = QueuePlan.model_construct(size=1, partial_rollout=False, force_sync=True, colocated_gpus="alternate")
    lock = EngineLock.remote()
    ray.get(lock.acquire.remote())  # the generator, producing a batch
    carried = engine.generate.remote(PROMPT, max_tokens=300, temperature=1.0, top_p=1.0, session_id="carried",
                                     logprobs=True)
    timings: dict[str, float] = {}
    in_turn, leave = threading.Event(), threading.Event()
    during: dict[str, object] = {}

    def step():
        with trainer_turn(alternate, [engine], lock, sup, timings) as sync_lock:
            during["sync_lock"] = sync_lock
            in_turn.set()
            leave.wait(60)

    thread = threading.Thread(target=step)
    thread.start()
    assert not in_turn.wait(1.0), "the turn started while the generator held the engine lock"
    ray.get(lock.release.remote())  # the batch is done
    assert in_turn.wait(30)
    assert during["sync_lock"] is None and ray.get(lock.held.remote())  # the sync must not take the lock again
    short = engine.generate.remote(PROMPT, max_tokens=4, temperature=1.0, top_p=1.0, session_id="short",
                                   logprobs=True)
    done, _ = ray.wait([short], timeout=3.0)
    assert not done, "the engine generated during the training turn"
    leave.set()
    thread.join(30)
    assert not ray.get(lock.held.remote())
    outs = ray.get([carried, short], timeout=300)
    assert all(len(o.token_ids) > 0 and o.finish_reason in ("stop", "length") for o in outs)
    assert timings["timing/engine_lock_wait"] >= 0.9
    overlap = QueuePlan.model_construct(size=1, partial_rollout=False, force_sync=True, colocated_gpus="overlap")
    with trainer_turn(overlap, [engine], lock, sup, {}) as sync_lock:
        assert sync_lock is lock and not ray.get(lock.held.remote())


def test_a_stop_skips_the_weight_sync_waiting_for_the_engine_lock(engine):
    """A stop (here SIGUSR1, Slurm's time-limit warning) while a step's sync waits for the engine lock, which the
    generator holds until its batch is done however long its agents take: the sync returns at once, nothing synced
    (no engine generates again, and the checkpoint the stop saves needs only the trainer), instead of outlasting the
    stop bound and losing the checkpoint. An `alternate` turn's wait ends the same way, and its step syncs nothing.
    Neither the trainer nor the weight link is touched (None here); the engine is left unpaused."""
    import os
    import signal
    import threading

    from runtime.engine_lock import EngineLock, sync_weights, trainer_turn
    from runtime.supervisor import StopFlag, Supervisor
    from schemas.plan import QueuePlan, SupervisorPlan

    sup = Supervisor(SupervisorPlan.model_construct(poll_s=0.2, stall_timeout_s=60.0, stop_timeout_s=5.0), StopFlag())
    try:
        lock = EngineLock.remote()
        ray.get(lock.acquire.remote())  # the generator, on a batch that does not finish
        threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGUSR1)).start()
        t0 = time.monotonic()
        assert sync_weights(None, None, [engine], lock, PROMPT, 3, sup, {}) == {}
        assert 0.9 < time.monotonic() - t0 < 5.0 and sup.stop.requeue
        alternate = QueuePlan.model_construct(size=1, partial_rollout=False, force_sync=True,
                                              colocated_gpus="alternate")
        with trainer_turn(alternate, [engine], lock, sup, {}) as sync_lock:
            assert sync_lock is None
            assert sync_weights(None, None, [engine], sync_lock, PROMPT, 4, sup, {}) == {}
        assert time.monotonic() - t0 < 5.0
        out = ray.get(engine.generate.remote(PROMPT, max_tokens=4, temperature=1.0, top_p=1.0, session_id="after",
                                             logprobs=True), timeout=60)
        assert len(out.token_ids) > 0
    finally:
        sup.stop.restore()


def test_a_group_generated_across_a_sync_carries_both_policy_versions(engine, model_dir, sender):
    """Partial rollout: requests in flight survive the sync, each token carries the version that sampled it (the
    tokens before the sync keep their old-weight KV: not recomputed), and the metrics count the crossing."""
    gen = torch.Generator().manual_seed(5)
    original = {k: v for k, v in reference(model_dir).state_dict().items() if k != "lm_head.weight"}
    state = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in original.items()}
    try:
        exp, old, new = generate_across_a_sync(engine, sender, model_dir, state)
        check_versions_and_metrics(exp, old, new, reference(model_dir), LOGPROB_TOL)
    finally:
        sender.push(original, ray.get(engine.weights_version.remote()) + 1)


# ---------------------------------------------------------------- the decode core, in process (no Ray)
MIXED_PROMPTS = [[5, 6, 7, 8, 9], [3], [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20], [40, 41], [7] * 30, [99, 98, 97]]


@pytest.fixture(scope="module")
def sharp_dir(model_dir, tmp_path_factory):
    """The tiny model with its matrices perturbed: its greedy continuations vary with the prompt (the tiny model's
    own mostly repeat the last prompt token), so equal outputs are a real check."""
    model = reference(model_dir)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.add_(0.15 * torch.randn(p.shape, generator=gen))
    out = tmp_path_factory.mktemp("hf") / "sharp"
    model.save_pretrained(out)
    return out


def core_for(model_dir, *, slots=8, max_model_len=128, eos_ids=(), raw=False, chunk_steps=5):
    model = reference(model_dir)
    return DecodeCore(model, slots=slots, max_model_len=max_model_len, eos_ids=eos_ids, pad_id=0, raw_logprobs=raw,
                      cuda_graphs=False, chunk_steps=chunk_steps)


def drain(core, requests, in_flight=()):
    """Submit requests and run the core until every request (these and those already in flight) is done."""
    for r in requests:
        core.submit(r)
    done = []
    while core.busy():
        done += core.run_chunk()
    assert sorted(map(id, done)) == sorted(map(id, list(requests) + list(in_flight)))
    return requests


def teacher_forced(model, r, *, raw=False):
    """log-probs of r's generated tokens under the distribution the engine samples from (or the raw one)."""
    ids = torch.tensor([r.prompt_ids + r.token_ids])
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0, len(r.prompt_ids) - 1: -1].float()
    if not raw and r.temperature > 0:
        logits = top_p_filter(logits / r.temperature, torch.full((len(logits),), r.top_p))
    return torch.log_softmax(logits, -1).gather(-1, ids[0, len(r.prompt_ids):, None])[:, 0]


def test_core_greedy_equals_generate_on_mixed_prompts(sharp_dir):
    """Six prompts of lengths 1..30 in one continuous batch of 4 slots (so some wait and join between chunks)."""
    core = core_for(sharp_dir, slots=4)
    reqs = drain(core, [Request(p, 9 + 4 * i, 0.0, 1.0) for i, p in enumerate(MIXED_PROMPTS)])
    model = reference(sharp_dir)
    for r in reqs:
        assert r.token_ids == greedy(model, r.prompt_ids, r.max_tokens) and r.finish_reason == "length"
        assert (torch.tensor(r.logprobs) - teacher_forced(model, r)).abs().max().item() < CORE_TOL


def test_core_score_is_the_teacher_forced_logprobs(sharp_dir):
    ids = PROMPT + list(range(100, 140))
    ref = logprobs_of(reference(sharp_dir), ids)
    assert (torch.tensor(core_for(sharp_dir).score(ids)) - ref).abs().max().item() < CORE_TOL


def test_core_requests_join_a_running_batch(sharp_dir):
    core = core_for(sharp_dir)
    first = [Request(p, 20, 0.0, 1.0) for p in MIXED_PROMPTS[:3]]
    for r in first:
        core.submit(r)
    core.run_chunk()
    assert all(0 < len(r.token_ids) < 20 for r in first)
    late = drain(core, [Request(p, 12, 0.0, 1.0) for p in MIXED_PROMPTS[3:]], in_flight=first)
    model = reference(sharp_dir)
    for r in first + late:
        assert r.token_ids == greedy(model, r.prompt_ids, r.max_tokens)


@pytest.mark.parametrize("raw", [False, True])
def test_core_sampled_logprobs_are_exact(sharp_dir, raw):
    """Mixed temperatures and top-p in one batch: each token's logprob is log-softmax(logits / T) after the top-p
    cut (processed_logprobs) or of the plain logits (raw_logprobs), as a teacher-forced forward computes them."""
    torch.manual_seed(0)
    core = core_for(sharp_dir, raw=raw)
    settings = [(1.0, 1.0), (0.7, 1.0), (1.0, 0.8), (0.5, 0.6), (0.0, 1.0), (1.3, 0.95)]
    reqs = drain(core, [Request(p, 24, t, tp) for p, (t, tp) in zip(MIXED_PROMPTS, settings, strict=True)])
    model = reference(sharp_dir)
    for r in reqs:
        ref = teacher_forced(model, r, raw=raw)
        assert torch.isfinite(ref).all(), "a token outside the top-p nucleus was sampled"
        assert (torch.tensor(r.logprobs) - ref).abs().max().item() < CORE_TOL
    assert len({tuple(r.token_ids) for r in reqs}) == len(reqs)


def test_core_stops_at_eos_and_limits(sharp_dir):
    model = reference(sharp_dir)
    free_run = greedy(model, PROMPT, 20)
    eos = next(t for i, t in enumerate(free_run) if i >= 4 and free_run.index(t) == i)
    core = core_for(sharp_dir, eos_ids=[eos], max_model_len=32)
    stop, length, context = drain(core, [Request(PROMPT, 20, 0.0, 1.0), Request(PROMPT, 3, 0.0, 1.0),
                                         Request(list(range(3, 28)), 50, 0.0, 1.0)])
    assert stop.token_ids == free_run[: free_run.index(eos) + 1] and stop.finish_reason == "stop"
    assert length.token_ids == free_run[:3] and length.finish_reason == "length"
    # 25 prompt tokens in a 32-token context: 7 new at most
    assert context.finish_reason in ("length", "stop") and len(context.token_ids) <= 7
    assert context.token_ids == greedy(model, context.prompt_ids, 7)[: len(context.token_ids)]
    with pytest.raises(ValueError, match="prompt of 32 tokens"):
        core.submit(Request(list(range(32)), 4, 0.0, 1.0))


@pytest.mark.parametrize("raw", [False, True])
def test_core_min_tokens_bans_eos_until_the_minimum(sharp_dir, raw):
    """EOS = the first greedy token: without a minimum a greedy request stops at once; with `min_tokens` 6 its first
    6 tokens are the greedy choice among the rest (EOS's logit at -inf, a processing step: processed log-probs are
    of that distribution, raw ones of the plain logits), then it may end; a sampled request whose minimum is its
    cap never ends early. Requests with and without a minimum share the batch."""
    model = reference(sharp_dir)
    eos = greedy(model, PROMPT, 1)[0]
    core = core_for(sharp_dir, eos_ids=[eos], raw=raw, chunk_steps=4)
    torch.manual_seed(0)
    plain, held, full = drain(core, [Request(PROMPT, 20, 0.0, 1.0), Request(PROMPT, 20, 0.0, 1.0, min_tokens=6),
                                     Request(PROMPT, 20, 1.0, 1.0, min_tokens=20)])
    assert plain.token_ids == [eos] and plain.finish_reason == "stop"
    ids, want, logprobs = list(PROMPT), [], []
    with torch.inference_mode():
        for i in range(20):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
            allowed = logits.clone()
            if i < 6:
                allowed[eos] = float("-inf")
            token = int(allowed.argmax())
            want.append(token)
            logprobs.append(float(torch.log_softmax(logits if raw else allowed, -1)[token]))
            ids.append(token)
            if token == eos:
                break
    assert held.token_ids == want and eos not in held.token_ids[:6]
    assert (torch.tensor(held.logprobs) - torch.tensor(logprobs)).abs().max().item() < CORE_TOL
    assert len(full.token_ids) == 20 and full.finish_reason == "length" and eos not in full.token_ids


def test_core_decodes_all_slots_together(sharp_dir):
    """No per-batch cap below the plan's max_num_seqs: 100 requests of mixed settings share every decode step."""
    core = core_for(sharp_dir, slots=100, chunk_steps=4)
    reqs = [Request([3 + i % 50, 4 + i % 7], 8, (i % 3) * 0.5, 1.0 if i % 2 else 0.9) for i in range(100)]
    for r in reqs:
        core.submit(r)
    core.run_chunk()
    assert len(core.active) == 100 and all(len(r.token_ids) == 5 for r in reqs)  # prefill token + 4 steps


def test_core_serves_a_queue_longer_than_its_slots(sharp_dir):
    """16 slots and 40 requests of different lengths and limits: every request completes, greedy = generate."""
    core = core_for(sharp_dir, slots=16, chunk_steps=3)
    reqs = drain(core, [Request([3 + i, 4 + i % 5], 2 + i % 7, 0.0, 1.0) for i in range(40)])
    model = reference(sharp_dir)
    for r in reqs[::7]:
        assert r.token_ids == greedy(model, r.prompt_ids, r.max_tokens)


def test_core_chunk_ends_after_one_step_when_the_gate_is_wanted(sharp_dir):
    """A pause (or a weight load, or a probe's score) waits at the engine's gate while a chunk runs: the chunk ends
    after the step in progress instead of its 16, and the requests go on unchanged afterwards (greedy = generate).
    Before, the alternate turn's pause waited for the rest of the chunk: about 0.5 s a step on one H100."""
    gate = StepGate()
    model = reference(sharp_dir)
    core = DecodeCore(model, slots=4, max_model_len=128, eos_ids=(), pad_id=0, raw_logprobs=False, cuda_graphs=False,
                      chunk_steps=16, yield_to=gate.wanted)
    reqs = [Request(p, 40, 0.0, 1.0) for p in MIXED_PROMPTS[:3]]
    for r in reqs:
        core.submit(r)
    with gate.forward():  # the generation thread's chunk, as in HfEngine._generate_forever
        closer = threading.Thread(target=gate.close)  # the engine's pause, from its event loop
        closer.start()
        while not gate.wanted():
            time.sleep(0.001)
        core.run_chunk()
    closer.join(timeout=10)
    assert not closer.is_alive()
    assert [len(r.token_ids) for r in reqs] == [2, 2, 2]  # the prefill's token + one decode step
    gate.open()
    with gate.forward():
        core.run_chunk()  # nobody waits: a whole chunk
    assert [len(r.token_ids) for r in reqs] == [18, 18, 18]
    drain(core, [], in_flight=reqs)
    for r in reqs:
        assert r.token_ids == greedy(model, r.prompt_ids, 40)


def test_check_weight_update_equal_reports_the_parameters_a_sync_left_out(engine, model_dir):
    """`train.check_weight_update_equal`: a full sync assigns every engine parameter (0 reported); a stream that leaves
    out one tensor reports exactly that one (without the check the engine refuses such a stream). Last engine test of
    the module: it re-forms the engine's weight-sync group."""
    state = {n: p.detach().clone() for n, p in reference(model_dir).named_parameters()}
    full = StateDictSender([engine], {n: tuple(t.shape) for n, t in state.items()}, "float32", 64 << 10,
                           check_unassigned=True)
    [received] = full.push(state, ray.get(engine.weights_version.remote()) + 1)["received"]
    assert received["unassigned"] == []
    partial = StateDictSender([engine], {n: tuple(t.shape) for n, t in state.items() if n != "model.norm.weight"},
                              "float32", 64 << 10, check_unassigned=True)
    [received] = partial.push(state, ray.get(engine.weights_version.remote()) + 1)["received"]
    assert received["unassigned"] == ["model.norm.weight"]
