"""One run per directory: the driver holds an exclusive lock on its run directory (`logging.out_dir`) and its
checkpoint directory (`ckpt.dir`) for as long as it runs.

Two submissions of one recipe would otherwise write the same metrics and checkpoints over each other. The lock is
`flock` on `<dir>/.molt-run.lock` (the kernel drops it when the process ends, however it ends: no stale locks); the
file holds the holder's pid and host, for the refusal message.
"""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path

LOCK_FILE = ".molt-run.lock"


class DirectoryInUse(RuntimeError):
    """Another run holds the lock of a directory this run writes."""


class RunLock:
    def __init__(self, dirs: list[str | Path]) -> None:
        self.dirs = [Path(d) for d in dict.fromkeys(str(d) for d in dirs)]
        self.files: list = []

    def acquire(self) -> RunLock:
        """Lock every directory (created when missing) or none: raises `DirectoryInUse` naming the holder."""
        try:
            for d in self.dirs:
                d.mkdir(parents=True, exist_ok=True)
                f = open(d / LOCK_FILE, "a+")
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    f.seek(0)
                    holder = f.read().strip() or "another process"
                    f.close()
                    raise DirectoryInUse(
                        f"{d} is in use by another run ({holder}); wait for it or stop it, or give this run its own "
                        "directories (another `name:`, whose run directory is runs/<name>, and ckpt.dir)") from None
                f.seek(0)
                f.truncate()
                f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
                f.flush()
                self.files.append(f)
        except BaseException:
            self.release()
            raise
        return self

    def release(self) -> None:
        for f in self.files:
            f.close()  # closing the descriptor drops the flock
        self.files = []
