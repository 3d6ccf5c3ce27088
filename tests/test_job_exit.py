"""Issue 32.7, the launcher's side: a driver killed by `kill -9` (or the OOM killer) and a Ray head that died
under the job are named, with the last logged books and a documented status (was: an undocumented 247, no line).
Real processes, killed for real; `tests/faults.py` ("kill -9 driver under --submit") runs it through `--submit`."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

from molt_compile.job_exit import explain


def killed(sig: int) -> int:
    return subprocess.run([sys.executable, "-c", f"import os; os.kill(os.getpid(), {sig})"]).returncode


def metrics(tmp_path, rows: list[dict], torn: str = "") -> None:
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + torn)


def test_a_driver_killed_by_sigkill_exits_137_with_a_line_and_the_last_books(tmp_path):
    metrics(tmp_path, [{"step": 1, "prompts/consumed": 8, "prompts/trained": 4},
                       {"step": 2, "prompts/consumed": 16, "prompts/trained": 8, "prompts/dropped/agent_crash": 1}],
            torn='{"step": 3, "prompts/cons')
    status, lines = explain(killed(9), tmp_path)
    assert status == 137 and "killed by SIGKILL" in lines[0], lines
    assert "step 2" in lines[1] and "consumed 16 (trained 8, dropped 1" in lines[1] and "7 in flight" in lines[1]


def test_a_dead_ray_head_is_named_as_ray_itself(tmp_path):
    head = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    head.wait()
    status, lines = explain(1, tmp_path, head)
    assert status == 1 and "Ray itself failed" in lines[0] and f"pid {head.pid}) exited with status 3" in lines[0]
    assert "no books were logged yet" in lines[1]


def test_a_gcs_that_refuses_connections_is_named_and_a_live_cluster_adds_nothing(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    head = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        status, lines = explain(killed(9), tmp_path, head, f"127.0.0.1:{port}")
        assert status == 1 and f"the Ray GCS at 127.0.0.1:{port}" in lines[0] and "SIGKILL" in lines[0], lines
        with socket.socket() as live:
            live.bind(("127.0.0.1", 0))
            live.listen()
            assert explain(1, tmp_path, head, f"127.0.0.1:{live.getsockname()[1]}") == (1, [])  # it said why itself
            assert explain(0, tmp_path, head, f"127.0.0.1:{port}") == (0, [])
    finally:
        head.kill()
        head.wait()
