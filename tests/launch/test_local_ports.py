"""Issue 32, item 8: the local cluster's ports. Each `ray start` of `--submit` takes seven "free" ports, each found
by binding port 0 and closing; the kernel can hand the same port to two such probes (two Ray components on one
port: a failed start once in 34). Every port this process picks is one it never picked before."""

from __future__ import annotations

import re

from molt_compile.local_cluster import LocalCluster, _free_port
from schemas.plan import Plan


def test_free_ports_are_never_handed_out_twice() -> None:
    picks = [_free_port() for _ in range(3000)]  # bind-and-close alone repeats some (~150 of 2000 here)
    assert len(set(picks)) == len(picks)


def test_a_local_cluster_start_uses_seven_distinct_ports(demo_plan: Plan) -> None:
    cluster = LocalCluster(demo_plan, {})
    try:
        ports = [int(p) for p in re.findall(r"port=(\d+)", " ".join(cluster.command()))]
        assert len(ports) == 7 and len(set(ports)) == 7
    finally:
        cluster.stop(keep_logs=False)
