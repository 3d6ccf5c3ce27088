"""One run per directory: the driver holds an exclusive lock on its run directory (`logging.out_dir`) and its
checkpoint directory (`ckpt.dir`) for as long as it runs.

Two submissions of one recipe would otherwise write the same metrics and checkpoints over each other. The lock is
`flock` on `<dir>/.molt-run.lock` (the kernel drops it when the process ends, however it ends: no stale locks); the
file holds the holder's pid and host, for the refusal message.
"""

from __future__ import annotations

import errno
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
                f = _open_lock_file(d)
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


def _open_lock_file(d: Path):
    """`<d>/.molt-run.lock` opened for the lock (`d` created); a directory that cannot be written is named, with why
    (a read-only file system, no space, permissions), as an OSError: before Ray starts, not as a traceback."""
    try:
        d.mkdir(parents=True, exist_ok=True)
        return open(d / LOCK_FILE, "a+")
    except OSError as exc:
        why = {errno.EROFS: "it is on a read-only file system", errno.ENOSPC: "no space left on it",
               errno.EACCES: "permission denied"}.get(exc.errno, exc.strerror or str(exc))
        raise OSError(exc.errno, f"cannot write the run directory {d}: {why} (a run writes its lock, metrics and "
                                 "checkpoints there)") from None
