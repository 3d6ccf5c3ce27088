"""What the local launcher says when its job's driver ended without saying why itself (issue 32.7).

A driver killed by a signal (`kill -9`, the kernel's OOM killer) prints nothing, and Popen reports it as a negative
status that `sys.exit` would turn into an undocumented 247. A Ray head that died under the job (its `ray start
--head --block` process exited, or its GCS port no longer answers) takes the driver with it, often before the
driver can print its failure line. In both cases the launcher names what it saw, with the books the run last
logged (`metrics.jsonl`: the driver's own final line never came), and exits with a documented status:

    128 + N   the driver was killed by signal N (137: SIGKILL), as a shell reports it
    1         the Ray head died under the job (the driver's own status otherwise)
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
from pathlib import Path

SIGNAL_BASE = 128


def exit_status(returncode: int) -> int:
    """A child's Popen status as the launcher's exit status: death by signal N becomes 128 + N."""
    return SIGNAL_BASE - returncode if returncode < 0 else returncode


def signal_name(returncode: int) -> str:
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"


def head_down(head: subprocess.Popen | None, gcs_address: str | None) -> str | None:
    """How the local Ray head is gone ("exited with status S", "its GCS at ADDR refuses connections"), or None."""
    if head is not None and head.poll() is not None:
        return f"the local Ray head (`ray start --head`, pid {head.pid}) exited with status {head.returncode}"
    if gcs_address:
        host, _, port = gcs_address.rpartition(":")
        try:
            socket.create_connection((host or "127.0.0.1", int(port)), timeout=1.0).close()
        except (OSError, ValueError):
            return f"the Ray GCS at {gcs_address} (head node) refuses connections"
    return None


def last_books(out_dir: str | Path) -> str | None:
    """The prompt books of the last row of `<out_dir>/metrics.jsonl` that has them (a torn last line is skipped)."""
    path = Path(out_dir) / "metrics.jsonl"
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if not isinstance(row, dict) or "prompts/consumed" not in row:
            continue
        consumed, trained = int(row["prompts/consumed"]), int(row.get("prompts/trained", 0))
        dropped = {
            k.removeprefix("prompts/dropped/"): int(v) for k, v in row.items() if k.startswith("prompts/dropped/") and v
        }
        lost = consumed - trained - sum(dropped.values())
        return (
            f"last logged books (step {row.get('step', '?')}): prompts consumed {consumed} (trained {trained}, "
            f"dropped {sum(dropped.values())}: {dropped}; {lost} in flight, lost with the driver: a resume "
            "from the last checkpoint runs them again)"
        )
    return None


def explain(
    returncode: int, out_dir: str | Path, head: subprocess.Popen | None = None, gcs_address: str | None = None
) -> tuple[int, list[str]]:
    """The launcher's exit status and its lines for a job that ended with `returncode` (no lines: nothing to add,
    the job said it itself)."""
    down = head_down(head, gcs_address) if returncode != 0 else None
    lines: list[str] = []
    status = exit_status(returncode)
    if down is not None:
        lines.append(
            f"the job failed because Ray itself failed: {down} (the driver ended with "
            f"{signal_name(returncode) if returncode < 0 else f'status {returncode}'}; see the Ray logs)"
        )
        status = 1
    elif returncode < 0:
        lines.append(
            f"the job's driver was killed by {signal_name(returncode)} (no failure line of its own: "
            f"out of memory, or killed from outside); exit status {status}"
        )
    if lines:
        books = last_books(out_dir)
        lines.append(books or f"no books were logged yet ({Path(out_dir) / 'metrics.jsonl'})")
    return status, lines
