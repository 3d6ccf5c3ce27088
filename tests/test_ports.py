"""`schemas.ports.free_port`, the one port picker of the compiler's local cluster and the runtime's rank worlds: a
process never gets the same port twice (bind-and-close alone repeats some: ~150 in 2,000 here; a `ray start` takes
seven, and tests pick several worlds' ports up front)."""

from __future__ import annotations

from schemas.ports import free_port


def test_free_ports_are_never_handed_out_twice() -> None:
    picks = [free_port() for _ in range(3000)]
    assert len(set(picks)) == len(picks)
