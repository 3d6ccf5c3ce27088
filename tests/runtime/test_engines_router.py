"""The router: session affinity by consistent hashing, ring stability, policies, and routing to real engine actors."""

from __future__ import annotations

import os
import pickle
from collections import Counter

import pytest

from runtime.engines.router import HashRing, Router, stable_hash

SESSIONS = [f"group{g}-sample{s}" for g in range(500) for s in range(8)]  # 4000 rollout ids


def test_stable_hash_is_process_independent():
    import subprocess
    import sys

    code = "from runtime.engines.router import stable_hash; print(stable_hash('rollout-42'))"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": "123"})
    assert int(other.stdout) == stable_hash("rollout-42")


def test_same_session_same_engine_across_router_copies():
    router = Router(["e0", "e1", "e2", "e3"], "consistent_hash")
    copy = pickle.loads(pickle.dumps(router))  # what each runner actor receives
    assert [router.pick(s) for s in SESSIONS] == [copy.pick(s) for s in SESSIONS]
    assert all(router.pick(s) == router.pick(s) for s in SESSIONS[:100])


@pytest.mark.parametrize("n_engines", [2, 4, 8])
def test_sessions_spread_evenly(n_engines):
    ring = HashRing(range(n_engines))
    counts = Counter(ring.lookup(s) for s in SESSIONS)
    assert set(counts) == set(range(n_engines))
    share = len(SESSIONS) / n_engines
    assert max(counts.values()) < 1.3 * share and min(counts.values()) > 0.7 * share, counts


def test_adding_an_engine_moves_about_one_nth_of_sessions_all_to_it():
    before = HashRing(range(4))
    after = HashRing(range(4))
    after.add(4)
    moved = [s for s in SESSIONS if before.lookup(s) != after.lookup(s)]
    assert all(after.lookup(s) == 4 for s in moved)  # nothing shuffles between the old engines
    assert 0.1 < len(moved) / len(SESSIONS) < 0.3  # ~1/5


def test_removing_an_engine_moves_only_its_sessions():
    ring = HashRing(range(5))
    owner = {s: ring.lookup(s) for s in SESSIONS}
    ring.remove(2)
    assert 2 not in ring.nodes
    for s in SESSIONS:
        if owner[s] != 2:
            assert ring.lookup(s) == owner[s]
        else:
            assert ring.lookup(s) != 2
    with pytest.raises(ValueError):
        ring.remove(2)
    with pytest.raises(LookupError):
        HashRing().lookup("x")


def test_round_robin_and_other_policies():
    rr = Router(["a", "b", "c"], "round_robin")
    assert [rr.pick("same") for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    rnd_router = Router(["a", "b"], "random", seed=1)
    rnd = Counter(rnd_router.pick(s) for s in SESSIONS)
    assert set(rnd) == {0, 1}
    p2 = Router(["a", "b", "c"], "power_of_two")
    p2._in_flight = [5, 0, 5]
    assert Counter(p2.pick("x") for _ in range(300))[1] > 150  # the idle engine wins whenever it is drawn
    assert Router(["a", "b"], "cache_aware").pick("s1") == Router(["a", "b"], "consistent_hash").pick("s1")
    with pytest.raises(ValueError, match="unknown router policy"):
        Router(["a"], "fastest")
    with pytest.raises(ValueError, match="at least one engine"):
        Router([], "round_robin")


@pytest.mark.slow
def test_router_reaches_the_hashed_engine(tmp_path):
    """Two real hf engines that answer differently (engine 1 gets other weights): every session's greedy answer is
    the answer of the engine the ring picks for it, turn after turn, through one Ray hop."""
    import asyncio

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import ray
    import torch

    from runtime.engines import start_engines
    from runtime.engines.local import cpu_engine_role, cpu_engines_plan
    from runtime.tiny_model import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "tiny", seed=0)
    ray.init(num_cpus=2, include_dashboard=False, namespace="test-engines-router",
             runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1"}})
    try:
        engines = start_engines(cpu_engines_plan("hf", count=2), cpu_engine_role("hf", count=2), str(model_dir))
        from safetensors.torch import load_file

        state = load_file(str(model_dir / "model.safetensors"))
        gen = torch.Generator().manual_seed(7)
        from tests.runtime.state_dict_sender import StateDictSender

        sender = StateDictSender([engines[1]], {k: tuple(v.shape) for k, v in state.items()}, "float32", 1 << 20)
        sender.push({k: v + 0.1 * torch.randn(v.shape, generator=gen) for k, v in state.items()}, 1)
        prompt = [5, 6, 7, 8]
        answers = [ray.get(e.generate.remote(prompt, max_tokens=8, temperature=0.0, top_p=1.0, session_id="probe",
                                             logprobs=False)).token_ids for e in engines]
        assert answers[0] != answers[1]
        router = Router(engines, "consistent_hash")

        async def episode(session: str) -> list[list[int]]:
            return [(await router.generate(prompt, max_tokens=8, temperature=0.0, top_p=1.0, session_id=session,
                                           logprobs=False)).token_ids for _ in range(2)]

        async def all_episodes(sessions):
            return await asyncio.gather(*(episode(s) for s in sessions))

        sessions = [f"rollout-{i}" for i in range(12)]
        results = asyncio.run(all_episodes(sessions))
        picks = [router.pick(s) for s in sessions]
        assert set(picks) == {0, 1}
        for s, pick, turns in zip(sessions, picks, results, strict=True):
            assert turns == [answers[pick]] * 2, s
    finally:
        ray.shutdown()
