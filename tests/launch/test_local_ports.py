"""Issue 32, item 8: the local cluster's ports. Each `ray start` of `--submit` takes seven "free" ports, each found
by binding port 0 and closing; the kernel can hand the same port to two such probes (two Ray components on one
port: a failed start once in 34). Every port this process picks is one it never picked before (`schemas.ports`,
tests/test_ports.py)."""

from __future__ import annotations

import re

from molt_compile.local_cluster import LocalCluster
from schemas.plan import Plan


def test_a_local_cluster_start_uses_seven_distinct_ports(demo_plan: Plan) -> None:
    cluster = LocalCluster(demo_plan, {})
    try:
        ports = [int(p) for p in re.findall(r"port=(\d+)", " ".join(cluster.command()))]
        assert len(ports) == 7 and len(set(ports)) == 7
    finally:
        cluster.stop(keep_logs=False)
