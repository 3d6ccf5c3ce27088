"""logging.wandb through the real `wandb` client, offline (no network here): the metrics sink writes a W&B run next
to metrics.jsonl, and the test reads the run's transaction log back (tests/runtime/wandb_files.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from wandb_files import read_run

from runtime.metrics import MetricsSink, read_jsonl, resolve_env_ref

SETTINGS = {"project": "molt_train_rl", "entity": None, "group": "g1", "run_name": "demo-math",
            "key": "${env:MOLT_TEST_WANDB_KEY}", "mode": "auto"}


def _runs(out: Path) -> list[Path]:
    return sorted(p for p in (out / "wandb").glob("offline-run-*") if p.is_dir())


def test_metrics_reach_an_offline_wandb_run_and_a_resume_continues_it(tmp_path, monkeypatch):
    monkeypatch.delenv("MOLT_TEST_WANDB_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)  # no key: offline by itself
    out = tmp_path / "runs/demo-math"
    config = {"name": "demo-math", "logging": {"wandb": SETTINGS}}
    sink = MetricsSink(out, None, 3, live=False, append=False, wandb=SETTINGS, config=config)
    for step in (1, 2, 3):
        sink.log(step, {"rollout/reward_mean": step / 10, "timing/step_total": 1.5})
    sink.close()
    (first,) = _runs(out)
    run = read_run(first)
    assert (run["project"], run["name"]) == ("molt_train_rl", "demo-math")
    assert run["config"]["logging"] == {"wandb": SETTINGS} and run["config"]["name"] == "demo-math"
    assert [(h["_step"], h["rollout/reward_mean"]) for h in run["history"]] == [(1, 0.1), (2, 0.2), (3, 0.3)]
    assert [r["rollout/reward_mean"] for r in read_jsonl(out / "metrics.jsonl")] == [0.1, 0.2, 0.3]

    sink = MetricsSink(out, None, 5, live=False, append=True, wandb=SETTINGS, config=config)
    sink.log(4, {"rollout/reward_mean": 0.4})
    sink.close()
    second = [p for p in _runs(out) if p != first]
    resumed = read_run(second[0]) if second else read_run(first)
    assert resumed["id"] == run["id"] and resumed["history"][-1] == {"_step": 4, "rollout/reward_mean": 0.4}


def test_the_key_is_only_a_reference():
    assert resolve_env_ref("${env:SURELY_NOT_SET_123}") is None
    with pytest.raises(ValueError, match="reference") as err:
        resolve_env_ref("0123456789abcdef")
    assert "0123456789abcdef" not in str(err.value)


def test_no_wandb_section_writes_no_wandb_files(tmp_path):
    sink = MetricsSink(tmp_path, None, 1, live=False, append=False, wandb=None, config={})
    sink.log(1, {"x": 1.0})
    sink.close()
    assert not (tmp_path / "wandb").exists() and json.loads((tmp_path / "metrics.jsonl").read_text())["x"] == 1.0
