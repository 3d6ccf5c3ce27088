"""Issue 32, item 4: checkpoints and resume against ordinary disk trouble, on real files.

Real DCP saves (torch.distributed.checkpoint, no process group needed for one writer) with a truncated shard or a
truncated state file: resume takes the newest complete save and says which was skipped and why; a torn last line of
metrics.jsonl is dropped by name; a read-only or full checkpoint directory (a small tmpfs mounted for the test) is
reported at start, and a save that fills the disk says "no space left on <dir>" instead of torch's enforce text.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess

import pytest
import torch
import torch.distributed.checkpoint as dcp

from runtime import ckpt
from runtime.books import Books
from runtime.loop import save_checkpoint
from runtime.metrics import drop_records_after
from runtime.supervisor import RunAborted


def dcp_save(root, step: int, numel: int = 4096) -> None:
    tmp = ckpt.begin_save(root, step)
    dcp.save({"model": {"w": torch.full((numel,), float(step))}}, checkpoint_id=str(tmp))
    ckpt.write_state(tmp, {"step": step})
    ckpt.publish(tmp)


def test_resume_skips_a_truncated_shard_and_a_truncated_state_naming_them(tmp_path):
    for step in (2, 4, 6):
        dcp_save(tmp_path, step)
    shard = next(ckpt.step_dir(tmp_path, 6).glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])                      # a shard cut short
    state = ckpt.step_dir(tmp_path, 4) / ckpt.STATE_FILE
    state.write_text(state.read_text()[:5])                          # a state file cut short
    skipped: list[str] = []
    path, found = ckpt.latest(tmp_path, skipped)
    assert path.name == "step_000002" and found == {"step": 2}
    assert str(shard) in skipped[0] and "truncated" in skipped[0]
    assert str(state) in skipped[1] and "not JSON" in skipped[1]
    loaded = {"model": {"w": torch.zeros(4096)}}
    dcp.load(loaded, checkpoint_id=str(path))                        # what is chosen really loads
    assert float(loaded["model"]["w"][0]) == 2.0


def test_a_torn_last_metrics_line_is_dropped_by_name(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3)) + '{"step": 4, "rollo')
    drop_records_after(path, 2)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]
    assert f"{path} line 4 is not a whole JSON record" in capsys.readouterr().out


@contextlib.contextmanager
def small_tmpfs(where, size: str, read_only: bool = False):
    """A real tmpfs of `size` at `where` (mounting needs root, as on our CI machines)."""
    where.mkdir()
    opts = f"size={size}" + (",ro" if read_only else "")
    if subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(where)], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root (CAP_SYS_ADMIN); a chmod does not stop root's writes")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_read_only_checkpoint_dir_is_found_at_start(tmp_path):
    with small_tmpfs(tmp_path / "ro", "1m", read_only=True) as ro:
        with pytest.raises(OSError, match=f"{ro}.*read-only"):
            ckpt.check_dir(ro)


def test_a_full_disk_is_named_at_start_and_at_a_save(tmp_path):
    with small_tmpfs(tmp_path / "small", "2m") as small:
        dcp_save(small, 2, numel=300_000)                            # 1.2 MB of 2: the next one does not fit
        with pytest.raises(OSError, match=f"no space left on {small}"):
            ckpt.check_dir(small)

        class OneRank:  # the trainer group's save, as one rank writes it (a real DCP save onto the full tmpfs)
            def save_checkpoint(self, path):
                dcp.save({"model": {"w": torch.ones(300_000)}}, checkpoint_id=path)

        rl = type("Rl", (), {"ckpt": type("C", (), {"dir": str(small), "save_hf": False})()})()
        with pytest.raises(RunAborted, match=f"no space left on {small}") as err:
            save_checkpoint(OneRank(), None, rl, 4, 0.0, Books())
        assert "inline_container" not in str(err.value)
        assert not (small / "step_000004.tmp").exists() and os.listdir(small) == ["step_000002"]


def test_a_stop_signal_saves_when_a_save_fits_in_the_stop_bound():
    from runtime.loop import save_fits

    def rl(every):
        return type("Rl", (), {"schedule": type("S", (), {"ckpt_every": every})(),
                               "supervisor": type("B", (), {"stop_timeout_s": 60.0})()})()

    assert save_fits(rl(5), None, 1.0)             # no save measured yet: try (an interrupted save is harmless)
    assert save_fits(rl(5), 20.0, 30.0)            # 20 s of the 30 s left
    assert not save_fits(rl(5), 40.0, 30.0)        # would outlast the bound
    assert not save_fits(rl(None), None, 0.0)      # the plan never checkpoints


@pytest.mark.parametrize("damage", ["shard", "state"])
def test_prune_keeps_the_newest_complete_save_when_the_newest_save_is_damaged(tmp_path, damage):
    """keep=1 after a save whose shard (or state file) was cut short: the older save resume falls back to stays."""
    for step in (2, 4):
        dcp_save(tmp_path, step)
    if damage == "shard":
        shard = next(ckpt.step_dir(tmp_path, 4).glob("*.distcp"))
        shard.write_bytes(shard.read_bytes()[:100])
    else:
        state = ckpt.step_dir(tmp_path, 4) / ckpt.STATE_FILE
        state.write_text(state.read_text()[:5])
    ckpt.prune(tmp_path, keep=1)
    path, found = ckpt.latest(tmp_path)
    assert path.name == "step_000002" and found == {"step": 2}
    dcp_save(tmp_path, 6)                     # the next good save: both older ones go
    ckpt.prune(tmp_path, keep=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000006"]
