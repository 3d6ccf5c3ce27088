"""`python -m runtime.preflight PLAN.json`: wait until the Ray cluster has every node and resource the plan needs.

The readiness barrier of the Slurm script and of the local launcher (`molt-compile --submit`): it connects to the
running cluster (`--address`, else RAY_ADDRESS, else `auto`), polls `ray.nodes()` until

- at least `cluster.nodes` alive nodes each offer the plan's `cluster.node_resources` (what the launcher told
  every `ray start` to declare), and
- the whole cluster covers the plan's total demand (`Plan.resource_demand()`: placement-group bundles plus the
  roles scheduled outside them),

or the timeout passes (`--timeout`, else the recipe's `launch.slurm.ready_timeout_s`). It prints what it sees
against what the plan needs whenever that changes, and a table of the nodes it sees when it gives up.
Exit status: 0 ready, 1 timed out (or no cluster to connect to), 2 unusable plan file or arguments.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from schemas.plan import Plan

EPS = 1e-9


@dataclass(frozen=True)
class Need:
    """What the plan needs from a Ray cluster."""

    nodes: int
    per_node: dict[str, float]
    total: dict[str, float]

    @classmethod
    def of(cls, plan: Plan) -> Need:
        return cls(nodes=plan.cluster.nodes, per_node=dict(plan.cluster.node_resources), total=plan.resource_demand())


@dataclass(frozen=True)
class Seen:
    """What the cluster offers: the total resources of every alive node."""

    nodes: list[dict[str, float]]

    @property
    def total(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for res in self.nodes:
            for k, v in res.items():
                out[k] = out.get(k, 0.0) + v
        return out


def covers(offer: dict[str, float], need: dict[str, float]) -> bool:
    return all(offer.get(k, 0.0) + EPS >= v for k, v in need.items())


def shortfall(need: Need, seen: Seen) -> list[str]:
    """Why the cluster is not ready yet, one phrase per missing thing; empty when it is ready."""
    missing = []
    fitting = sum(1 for res in seen.nodes if covers(res, need.per_node))
    if fitting < need.nodes:
        missing.append(f"{fitting} of the {need.nodes} nodes with {fmt(need.per_node)} each")
    total = seen.total
    for key, amount in sorted(need.total.items()):
        if total.get(key, 0.0) + EPS < amount:
            missing.append(f"{key} {num(total.get(key, 0.0))} of {num(amount)}")
    return missing


def num(x: float) -> str:
    return str(int(x)) if abs(x - round(x)) < EPS else f"{x:g}"


def fmt(res: dict[str, float]) -> str:
    """`CPU 5, device_slot 3`: the plan's resources (and only those) in a stable order."""
    return ", ".join(f"{k} {num(v)}" for k, v in sorted(res.items())) or "nothing"


def status_line(need: Need, seen: Seen) -> str:
    total = seen.total
    parts = [f"{len(seen.nodes)}/{need.nodes} nodes"]
    parts += [f"{k} {num(total.get(k, 0.0))}/{num(v)}" for k, v in sorted(need.total.items())]
    return ", ".join(parts)


def node_table(nodes: list[dict], keys: list[str]) -> str:
    """The nodes Ray knows (alive or dead) with the resources the plan cares about."""
    rows = [["node", "ip", "state", *keys]]
    for n in nodes:
        res = n.get("Resources", {})
        rows.append([n.get("NodeName", "?") if n.get("NodeName") != n.get("NodeManagerAddress") else "-",
                     n.get("NodeManagerAddress", "?"), "alive" if n.get("Alive") else "dead",
                     *[num(res.get(k, 0.0)) for k in keys]])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)


def _gcs_answers(address: str) -> bool:
    """The GCS port accepts a TCP connection (checked before ray.init, which logs a warning per failed try)."""
    import socket

    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        return True  # `auto` and other forms: let ray.init resolve them
    try:
        with socket.create_connection((host, int(port)), timeout=2.0):
            return True
    except OSError:
        return False


def _connect(address: str, deadline: float, say) -> bool:
    """ray.init against a cluster that may still be starting: retry until the deadline."""
    while not _gcs_answers(address):
        if time.monotonic() >= deadline:
            say(f"error: nothing answers at {address} (the Ray head's GCS port)")
            return False
        time.sleep(1.0)
    import ray

    last = ""
    while True:
        try:
            ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False)
            return True
        except Exception as exc:  # Ray raises ConnectionError, RuntimeError, ... while starting
            last = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
        if time.monotonic() >= deadline:
            say(f"error: could not connect to the Ray cluster at {address}: {last}")
            return False
        time.sleep(2.0)


def wait_ready(plan: Plan, *, address: str, timeout_s: float, interval_s: float = 1.0, out=sys.stdout) -> int:
    """Block until the cluster at `address` can run `plan` (0) or `timeout_s` passes (1)."""

    def say(msg: str) -> None:
        print(f"preflight: {msg}", file=out, flush=True)

    need = Need.of(plan)
    start = time.monotonic()
    deadline = start + timeout_s
    say(f"waiting up to {num(timeout_s)} s for {need.nodes} node(s) with {fmt(need.per_node)} each "
        f"(the job takes {fmt(need.total)}) at {address}")
    if not _connect(address, deadline, say):
        return 1
    import ray

    try:
        last_line = ""
        while True:
            nodes = ray.nodes()
            seen = Seen([dict(n.get("Resources", {})) for n in nodes if n.get("Alive")])
            missing = shortfall(need, seen)
            line = status_line(need, seen)
            if not missing:
                say(f"ready after {time.monotonic() - start:.1f} s: {line}")
                return 0
            if line != last_line:
                say(f"sees {line}")
                last_line = line
            if time.monotonic() >= deadline:
                keys = sorted(set(need.per_node) | set(need.total))
                say(f"error: after {num(timeout_s)} s the cluster still lacks: {'; '.join(missing)}.\n"
                    f"  The plan needs {need.nodes} node(s) with {fmt(need.per_node)} each; Ray sees:\n"
                    f"{node_table(nodes, keys)}\n"
                    "  Check that every node's `ray start` ran (its log) and declared the plan's resources.")
                return 1
            time.sleep(interval_s)
    finally:
        ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runtime.preflight",
                                     description="Wait until Ray sees every node and resource a plan needs.")
    parser.add_argument("plan", type=Path, help="the plan JSON")
    parser.add_argument("--address", default=None, help="Ray address (default: $RAY_ADDRESS, else auto)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds to wait (default: the recipe's launch.slurm.ready_timeout_s)")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between polls")
    args = parser.parse_args(argv)
    try:
        plan = Plan.from_json(args.plan.read_text())
    except (OSError, ValueError) as exc:
        print(f"preflight: {args.plan}: cannot use this plan: {exc}", file=sys.stderr)
        return 2
    timeout = args.timeout
    if timeout is None:
        timeout = float(plan.recipe.get("launch", {}).get("slurm", {}).get("ready_timeout_s", 600))
    address = args.address or os.environ.get("RAY_ADDRESS") or "auto"
    return wait_ready(plan, address=address, timeout_s=timeout, interval_s=args.interval)


if __name__ == "__main__":
    raise SystemExit(main())
