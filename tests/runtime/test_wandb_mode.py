"""`logging.wandb.mode` (issue 30.8): `offline` keeps a run offline even with a key and `WANDB_MODE=online`."""

from __future__ import annotations

from runtime.metrics import WandbRun


def test_offline_mode_wins_over_a_key_and_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("MOLT_TEST_WANDB_KEY", "0" * 40)
    monkeypatch.setenv("WANDB_MODE", "online")  # no network here: online would fail or hang
    settings = {"project": "p", "entity": None, "group": None, "run_name": "r", "key": "${env:MOLT_TEST_WANDB_KEY}",
                "mode": "offline"}
    run = WandbRun(settings, tmp_path, {"a": 1}, resume=False)
    try:
        run.log(1, {"x": 1.0})
    finally:
        run.close()
    runs = [p.name for p in (tmp_path / "wandb").glob("*run-*") if p.is_dir() and not p.is_symlink()]
    assert len(runs) == 1 and runs[0].startswith("offline-run-"), runs
