"""render_summary(): the roles table and a per-node map that groups identical nodes, readable at any size."""

from __future__ import annotations

from plan_support import PLAN_DATA, lowered
from rich.console import Console

from molt_compile.render_plan import grouped_nodes, node_summary, render_summary


def _text(plan) -> str:
    console = Console(width=200, record=True, file=open("/dev/null", "w"))
    console.print(render_summary(plan))
    return console.export_text()


def test_glm_map_is_two_lines() -> None:
    plan, _ = lowered(PLAN_DATA / "rl_glm5_ep256.yaml")
    assert grouped_nodes(plan.gpu_map) == [
        ("node 0-3", "rollout.engine ×8", "rollout.engine 0"),
        ("node 4-35", "actor.rank ×8", "actor 0-255"),
    ]
    text = _text(plan)
    assert "36 node(s) × 8 h100-80gb = 288 GPUs, 288 used, 0 idle" in text
    assert "rollout.engine │ RolloutEngine  │ 1     │ 0 (+32 workers × 1)" in text
    assert len(text.splitlines()) < 60


def test_thousand_nodes_stay_short() -> None:
    plan, _ = lowered(PLAN_DATA / "synthetic_1024.yaml")
    rows = grouped_nodes(plan.gpu_map)
    assert rows == [("node 0-31", "rollout.engine ×8", "rollout.engine 0-7"),
                    ("node 32-1023", "actor.rank ×8", "actor 0-7935")]
    assert len(_text(plan).splitlines()) < 60


def test_mixed_and_idle_nodes() -> None:
    plan, _ = lowered(PLAN_DATA / "rl_qwen3_4b_quick.yaml")
    assert node_summary(plan.gpu_map[0]) == "rollout.engine ×4, actor.rank+ref.rank ×4"
    omni, _ = lowered(PLAN_DATA / "rl_omni3_30b.yaml")
    assert grouped_nodes(omni.gpu_map)[-1] == ("node 3", "idle ×8", "")
    text = _text(omni)
    assert "24 used, 8 idle" in text and "actor.grad_accum" in text and "batch_size 64 / (micro_batch_size 1 × dp 2)" in text


def test_sft_summary() -> None:
    plan, _ = lowered(PLAN_DATA / "sft_qwen3_4b.yaml")
    assert grouped_nodes(plan.gpu_map) == [("node 0-1", "sft.rank ×8", "sft 0-15")]
    assert "sft.nproc_per_node" in _text(plan)
