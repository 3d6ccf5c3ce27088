"""The router: which engine serves a `generate` call.

A plain, picklable object holding the engine actor handles — not a Ray actor. Every agent runner gets its own copy
and calls the chosen engine directly, so a request costs one Ray hop (runner -> engine) instead of two through a
central router actor, and no single process sees every request of the run. Consistent hashing needs no shared state:
every copy maps a session id to the same engine. (The plan's `router` role keeps its CPU reservation; with this
design nothing runs in it.)

Policies (`EnginesPlan.router_policy`):
- `consistent_hash`: a hash ring with `VNODES_PER_ENGINE` virtual nodes per engine; a session (all turns of one
  episode) always reaches the same engine and reuses its prefix cache, and adding or removing an engine moves only
  the sessions of the ring arcs that change hands (~1/N of them).
- `cache_aware`: served as `consistent_hash` — the session id is the cache key of a multi-turn episode.
- `round_robin`: the next engine for each call (per router copy).
- `random`: a uniformly random engine.
- `power_of_two`: the less loaded of two random engines, by this copy's own count of requests in flight.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import random
from collections.abc import Sequence
from typing import Any

import ray

from runtime.agents.base import EngineError
from runtime.agents.types import GenerateOutput, turn_keywords

VNODES_PER_ENGINE = 160
"""Ring points per engine: with 160, each engine's share of sessions stays within a few percent of 1/N."""


def stable_hash(key: str) -> int:
    """64-bit hash that is the same in every process (Python's `hash` of a str is salted per process)."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")


class HashRing:
    """Consistent hashing of string keys onto integer node ids."""

    def __init__(self, nodes: Sequence[int] = (), vnodes: int = VNODES_PER_ENGINE):
        self.vnodes = vnodes
        self._points: list[int] = []
        self._owners: list[int] = []
        for node in nodes:
            self.add(node)

    @property
    def nodes(self) -> list[int]:
        return sorted(set(self._owners))

    def add(self, node: int) -> None:
        if node in self._owners:
            raise ValueError(f"node {node} is already on the ring")
        for v in range(self.vnodes):
            point = stable_hash(f"engine-{node}#{v}")
            i = bisect.bisect(self._points, point)
            self._points.insert(i, point)
            self._owners.insert(i, node)

    def remove(self, node: int) -> None:
        if node not in self._owners:
            raise ValueError(f"node {node} is not on the ring")
        kept = [(p, o) for p, o in zip(self._points, self._owners, strict=True) if o != node]
        self._points = [p for p, _ in kept]
        self._owners = [o for _, o in kept]

    def lookup(self, key: str) -> int:
        """The node owning the first ring point clockwise from the key's hash."""
        if not self._points:
            raise LookupError("the hash ring has no nodes")
        i = bisect.bisect(self._points, stable_hash(key)) % len(self._points)
        return self._owners[i]


class Router:
    """Implements `GenerateClient` over several engine actors; see the module docstring for the policies."""

    POLICIES = ("consistent_hash", "cache_aware", "round_robin", "random", "power_of_two")

    def __init__(self, engines: Sequence[Any], policy: str, *, seed: int = 0):
        if not engines:
            raise ValueError("the router needs at least one engine")
        if policy not in self.POLICIES:  # the recipe schema lists the same names
            raise ValueError(f"unknown router policy {policy!r}; expected one of {', '.join(self.POLICIES)}")
        self.engines = list(engines)
        self.policy = policy
        self.seed = seed
        self._init_local_state()

    def _init_local_state(self) -> None:
        self._ring = HashRing(range(len(self.engines)))
        self._next = itertools.count()
        self._rng = random.Random(self.seed)
        self._in_flight = [0] * len(self.engines)

    # Per-copy state (round-robin cursor, RNG, in-flight counts) is rebuilt after unpickling, not shipped.
    def __getstate__(self) -> dict:
        return {"engines": self.engines, "policy": self.policy, "seed": self.seed}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._init_local_state()

    def pick(self, session_id: str) -> int:
        """Index of the engine that serves a call of this session."""
        if self.policy in ("consistent_hash", "cache_aware"):
            return self._ring.lookup(session_id)
        if self.policy == "round_robin":
            return next(self._next) % len(self.engines)
        if self.policy == "random":
            return self._rng.randrange(len(self.engines))
        a, b = self._rng.randrange(len(self.engines)), self._rng.randrange(len(self.engines))
        return a if self._in_flight[a] <= self._in_flight[b] else b

    async def generate(self, prompt_ids: list[int], *, max_tokens: int, temperature: float, top_p: float,
                       session_id: str, logprobs: bool, images: list | None = None,
                       top_logprobs: int = 0, min_tokens: int = 0) -> GenerateOutput:
        i = self.pick(session_id)
        self._in_flight[i] += 1
        # only the keywords set reach the engine (its other callers never see them); the runner cut the minimum
        extra: dict[str, Any] = dict(turn_keywords(top_logprobs, min_tokens, max_tokens))
        if images:  # VLM: the conversation's images, in placeholder order
            extra["images"] = images
        try:
            return await self.engines[i].generate.remote(prompt_ids, max_tokens=max_tokens, temperature=temperature,
                                                         top_p=top_p, session_id=session_id, logprobs=logprobs,
                                                         **extra)
        except ray.exceptions.RayTaskError as exc:  # the engine raised (alive: a death is RayActorError, re-sent)
            cause = exc.cause if getattr(exc, "cause", None) is not None else exc
            last = str(cause).strip().splitlines()[-1] if str(cause).strip() else ""
            raise EngineError(f"rollout engine {i} failed the request: {type(cause).__name__}: {last}") from None
        finally:
            self._in_flight[i] -= 1
