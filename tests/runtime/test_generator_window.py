"""The generator's per-batch filter statistics (no Ray: `_accept` and `_Window.flush` are plain Python)."""

from collections import Counter
from types import SimpleNamespace

from runtime.generator import Generator, _Window
from runtime.runners import GroupResult


def _generator(n: int) -> Generator:
    g = Generator.__new__(Generator)
    g.rl = SimpleNamespace(sampling=SimpleNamespace(n_samples_per_prompt=n),
                           generator=SimpleNamespace(dynamic_filtering=[0.01, 0.99]))
    g.ready, g.window, g.prompts_dropped, g.dropped_positions = [], _Window(), Counter(), {}
    g.runner_failures = g.runner_restarts = g.consumed = 0
    return g


def test_pass_rate_counts_the_window_not_the_batch():
    """12 groups finish in one window (generate_batch_size > batch_size), 8 go into the batch; the 4 left over
    join the next batch with 2 new groups. The rate was len(batch)/groups_seen = 8/2 there: 4.0 (`1.6` in the demo)."""
    g = _generator(2)
    mixed = [0.0, 1.0]  # mean 0.5: passes the (0.01, 0.99) filter
    for i in range(12):
        g._accept(GroupResult(i, experience=object(), rewards=mixed, scores=mixed), i)
    g.ready = g.ready[8:]  # 8 went into the batch
    assert g.window.flush(g)["rollout/dynamic_filtering_pass_rate"] == 1.0
    g._accept(GroupResult(12, experience=object(), rewards=mixed, scores=mixed), 12)
    g._accept(GroupResult(13, experience=object(), rewards=[1.0, 1.0], scores=[1.0, 1.0]), 13)  # all pass: filtered
    assert len(g.ready) == 5
    m = g.window.flush(g)
    assert m["rollout/dynamic_filtering_pass_rate"] == 0.5
    assert m["prompts/dropped/dynamic_filter"] == 1
    assert g.dropped_positions == {"dynamic_filter": [13]}  # done: a resume does not send it again
