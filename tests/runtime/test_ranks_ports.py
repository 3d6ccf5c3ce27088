"""`runtime.ranks.free_port`: a process never gets the same port twice (tests pick several worlds' ports up front;
bind-and-close alone can repeat one, tests/launch/test_local_ports.py measured ~150 repeats in 2,000)."""

from __future__ import annotations

from runtime.ranks import free_port


def test_free_ports_are_never_handed_out_twice() -> None:
    picks = [free_port() for _ in range(3000)]
    assert len(set(picks)) == len(picks)
