"""runtime.preflight's arithmetic: what a cluster lacks for a plan, per node and in total (pure, no Ray)."""

from __future__ import annotations

from runtime.preflight import Need, Seen, node_table, shortfall, status_line
from schemas.plan import Plan


def test_need_comes_from_the_plan(cpu_plan: Plan) -> None:
    need = Need.of(cpu_plan)
    assert need.nodes == 2
    assert need.per_node == {"CPU": 3.0, "device_slot": 2.0}
    assert need.total == {"CPU": 5.0, "device_slot": 3.0}  # bundles + router + 2 runners


def test_ready_only_when_enough_nodes_each_offer_the_node_resources(cpu_plan: Plan) -> None:
    need = Need.of(cpu_plan)
    node = {"CPU": 3.0, "device_slot": 2.0, "memory": 1e9}
    assert shortfall(need, Seen([node, node])) == []
    assert shortfall(need, Seen([node])) == ["1 of the 2 nodes with CPU 3, device_slot 2 each", "CPU 3 of 5",
                                             "device_slot 2 of 3"]
    # Enough in total, but one node declared too few slots: not the cluster the plan was placed on.
    small = {"CPU": 3.0, "device_slot": 1.0}
    assert shortfall(need, Seen([node, small])) == ["1 of the 2 nodes with CPU 3, device_slot 2 each"]
    assert status_line(need, Seen([node, small])) == "2/2 nodes, CPU 6/5, device_slot 3/3"


def test_node_table_shows_dead_nodes_and_the_plans_resources() -> None:
    nodes = [{"NodeName": "10.0.0.1", "NodeManagerAddress": "10.0.0.1", "Alive": True,
              "Resources": {"CPU": 3.0, "device_slot": 2.0}},
             {"NodeName": "10.0.0.2", "NodeManagerAddress": "10.0.0.2", "Alive": False, "Resources": {}}]
    table = node_table(nodes, ["CPU", "device_slot"]).splitlines()
    assert table[0].split() == ["node", "ip", "state", "CPU", "device_slot"]
    assert table[1].split() == ["-", "10.0.0.1", "alive", "3", "2"]
    assert table[2].split() == ["-", "10.0.0.2", "dead", "0", "0"]
