"""Issue 32.2 and 32.6 in the generator: a late group gets a line, a prompt that kills its runner alone is
quarantined at once, runner restarts are budgeted per time window, and the books close when the run ends under it.
Fakes where the dispatch is asyncio code over runner handles; real Ray actors where a runner's process must die."""

from __future__ import annotations

import asyncio

from test_generator_dispatch import FakeRunner, _generator

from runtime.runners import GroupRequest


def test_a_late_group_gets_a_line_before_it_is_given_up(capsys):
    """32.2: nothing was printed while a group waited up to 31 minutes; now a line says it is late at the episode
    bound, naming the runner and when it is given up."""
    g = _generator([FakeRunner([], set(), seconds=0.6)])
    g.rl.agent.episode_timeout_s, g.rl.agent.group_timeout_s = 0.2, 5.0
    assert asyncio.run(g._run_group(GroupRequest(4, "p", None, 1, None))) == 4
    out = capsys.readouterr().out
    assert "group 4 is late: runner 0 has not answered in 0 s" in out and "given up at 5 s" in out


def test_a_prompt_that_kills_its_runner_alone_is_quarantined_at_once():
    """32.6: a group alone on its runner when the runner died is the culprit: dropped after one death, not re-sent
    `max_prompt_attempts` times (each a runner death, from the restart budget)."""
    runner = FakeRunner([], set())
    runner.crash_on = _Always()
    g = _generator([runner, FakeRunner([], set())])
    g.rl.agent.max_prompt_attempts = 4
    g.runner_deaths = [[], []]
    assert asyncio.run(g._run_group(GroupRequest(0, "p", None, 1, None))) == "agent_crash"
    assert g.runner_failures == 1


class _Always(set):
    """Every group id crashes, every time."""

    def __contains__(self, item) -> bool:
        return True

    def discard(self, item) -> None:
        pass


def test_deaths_further_apart_than_the_window_do_not_add_up():
    """32.6: the restart budget is per window (here 1 restart per 0.3 s): two deaths 0.4 s apart leave the runner
    in service (the give-up past the budget, with a real runner process, is in test_supervisor.py)."""
    g = _generator([FakeRunner([], {0, 2})])
    g.rl.agent.max_restarts, g.rl.agent.restart_window_s = 1, 0.3

    async def apart():
        assert await g._run_group(GroupRequest(0, "p", None, 1, None)) == "agent_crash"  # alone: quarantined
        await asyncio.sleep(0.4)
        assert await g._run_group(GroupRequest(2, "p", None, 1, None)) == "agent_crash"
        return await g._run_group(GroupRequest(3, "p", None, 1, None))

    assert asyncio.run(asyncio.wait_for(apart(), 20)) == 3
    assert g.runner_failures == 2 and not g.runners_dead
