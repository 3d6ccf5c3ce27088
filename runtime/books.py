"""The driver's prompt books: which positions of the seeded data order are done (trained or dropped).

A checkpoint records them (`state()`), so that a resumed run skips exactly those and trains the prompts that were in
flight at the save (issue 13.3: counting prompts *sent out* lost them).
"""

from __future__ import annotations

from collections import Counter

from runtime.messages import RolloutBatch


class Books:
    """The driver's prompt books: positions trained or dropped (done), for the checkpoint and an exact resume."""

    def __init__(self, done: set[int] | None = None, trained: int = 0, dropped: dict[str, int] | None = None):
        self.done: set[int] = set(done or ())
        self.trained = trained
        self.dropped: Counter = Counter(dropped or {})
        self.consumed_seen = len(self.done)

    @classmethod
    def from_state(cls, state: dict) -> Books:
        p = state["prompts"]
        return cls(set(range(p["done_below"])) | set(p["done_above"]), p["trained"], p["dropped"])

    def seen(self, msg: RolloutBatch) -> None:
        """A batch arrived: the drops it reports happened before it (they are done whatever happens next)."""
        for reason, positions in msg.dropped_positions.items():
            self.done.update(positions)
            self.dropped[reason] += len(positions)
        self.consumed_seen = max(self.consumed_seen, msg.prompts_consumed)

    def trained_batch(self, msg: RolloutBatch) -> None:
        self.done.update(msg.prompt_positions)
        self.trained += len(msg.prompt_positions)

    def done_positions(self) -> list[int]:
        return sorted(self.done)

    def state(self) -> dict:
        below = 0
        while below in self.done:
            below += 1
        return {"done_below": below, "done_above": sorted(p for p in self.done if p > below),
                "trained": self.trained, "dropped": dict(self.dropped)}

    def last_accounting(self) -> dict[str, int]:
        """Accounting from what this loop saw (the generator is gone): the rest of what it took is unfinished."""
        acc = {"prompts/consumed": self.consumed_seen, "prompts/batched": self.trained}
        acc.update({f"prompts/dropped/{k}": v for k, v in self.dropped.items()})
        unfinished = self.consumed_seen - self.trained - sum(self.dropped.values())
        if unfinished > 0:
            acc["prompts/dropped/run_ended"] = acc.get("prompts/dropped/run_ended", 0) + unfinished
        return acc
