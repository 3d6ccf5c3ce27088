"""The generator's dispatch of suspect groups (no Ray actors: `_run_group` and `_pick_runner` are asyncio code over
runner handles; these fakes answer `run_group.remote` and `pid.remote` with coroutines)."""

import asyncio
from types import SimpleNamespace

import ray

from runtime.generator import Generator
from runtime.runners import GroupRequest


class FakeRunner:
    """Answers a group after `seconds`; the group ids in `crash_on` fail as a dead actor would, once each."""

    def __init__(self, log: list, crash_on: set[int], seconds: float = 0.02):
        self.log, self.crash_on, self.seconds = log, crash_on, seconds
        self.run_group = SimpleNamespace(remote=self._run_group)
        self.pid = SimpleNamespace(remote=self._pid)

    async def _run_group(self, req: GroupRequest):
        await asyncio.sleep(self.seconds)
        if req.group_id in self.crash_on:
            self.crash_on.discard(req.group_id)
            raise ray.exceptions.RayActorError()
        self.log.append(req.group_id)
        return req.group_id

    async def _pid(self):
        return 1


def _generator(runners) -> Generator:
    g = Generator.__new__(Generator)
    g.rl = SimpleNamespace(agent=SimpleNamespace(max_prompt_attempts=2, group_timeout_s=10.0, episode_timeout_s=5.0,
                                                 max_restarts=3, restart_window_s=3600.0))
    g.runners, g.runner_load = runners, [0] * len(runners)
    g.runner_deaths, g.load_at_death = [[] for _ in runners], [0] * len(runners)
    g.runners_alone, g.runners_down, g.runners_dead = set(), set(), set()
    g._next_runner = g.runner_failures = g.runner_restarts = 0
    return g


def test_a_suspect_is_retried_alone_soon_not_after_the_stream():
    """Group 0's runner dies under it: it becomes a suspect and must run alone on a drained runner. Groups that
    merely finish on the runner it reserved must not free that reservation (they did: the suspect then waited
    while 60 new groups were handed to its runner, and was retried only at the end of the stream)."""
    log: list[int] = []
    g = _generator([FakeRunner(log, {0}), FakeRunner(log, set())])

    async def stream():
        suspect = asyncio.ensure_future(g._run_group(GroupRequest(0, "p", None, 1, None)))
        for group_id in range(1, 61):  # a steady stream: 4 groups in flight at any time
            while sum(g.runner_load) >= 4:
                await asyncio.sleep(0.005)
            asyncio.ensure_future(g._run_group(GroupRequest(group_id, "p", None, 1, None)))
            await asyncio.sleep(0.005)
        assert await suspect == 0
        while len(log) < 61:
            await asyncio.sleep(0.01)

    asyncio.run(asyncio.wait_for(stream(), 30))
    assert sorted(log) == list(range(61)) and g.runner_failures == 1
    # Without the fix it ran last (index 60); under load a fair retry lands within the first half or so.
    assert log.index(0) < 45, log
