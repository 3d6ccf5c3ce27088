"""Run model-written Python in a sandboxed subprocess (the geo3k agent's tool).

    result = await run_python(code, SandboxLimits(timeout_s=10))
    result.observation()   # text fed back to the model

Each call starts this file as a *boot* process (`python -I sandbox.py --boot CONFIG`, a fresh single-threaded
interpreter, so no `preexec_fn` runs inside the multi-threaded runner) that confines itself with kernel mechanisms
before it execs the untrusted code:

| threat                         | containment                                                                          |
|--------------------------------|--------------------------------------------------------------------------------------|
| network                        | new network namespace: only a loopback that is down; abstract unix sockets are per-ns  |
| writes outside the work dir    | new mount namespace: every mount remounted read-only, private size-capped tmpfs over  |
|                                | /tmp, /var/tmp, /dev/shm, /run (work dir = /tmp/sandbox); RLIMIT_FSIZE per file      |
| escaping cleanup (daemons)     | new PID namespace; the code runs as its PID 1, so when it exits or its boot parent is  |
|                                | killed (PDEATHSIG) the kernel kills every process left in it                          |
| fork bombs                     | RLIMIT_NPROC under a uid of its own (root host) or the caller's uid (rootless)        |
| infinite loops                 | wall-clock timeout in the caller + RLIMIT_CPU                                        |
| memory hogs                    | RLIMIT_AS                                                                            |
| huge output                    | the caller reads at most `max_output_bytes`, then kills the sandbox                   |
| privilege                      | root host: setuid to an unused uid, no groups; rootless: nested user namespace with a |
|                                | non-zero uid; both with PR_SET_NO_NEW_PRIVS, so setuid binaries do not elevate        |
| secrets in the environment     | the code gets a minimal environment, not the runner's                                |

On a root host the boot process uses the namespaces directly; otherwise (another user, or root without
CAP_SYS_ADMIN as in a default container) it first enters a user namespace (needs user namespaces to be allowed,
the default on current kernels). If any step fails the boot exits with code 125 and a
"sandbox setup failed" message *before* running the code: the tool fails closed, never unconfined.
The interpreter (`sys.executable` and its site-packages) must be readable by other users on a root host, because the
code runs under a uid of its own.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import random
import signal
import sys
from dataclasses import asdict, dataclass

SETUP_FAILED_EXIT = 125
WORK_DIR = "/tmp/sandbox"
_PRIVATE_TMPFS = ("/tmp", "/var/tmp", "/dev/shm", "/run")


@dataclass(frozen=True)
class SandboxLimits:
    timeout_s: float = 10.0  # wall clock, enforced by the caller
    cpu_s: int = 10  # RLIMIT_CPU (SIGXCPU, then SIGKILL one second later)
    memory_bytes: int = 1 << 30  # RLIMIT_AS
    max_processes: int = 16  # RLIMIT_NPROC (threads count too)
    max_file_bytes: int = 8 << 20  # RLIMIT_FSIZE
    tmpfs_bytes: int = 32 << 20  # size of each private writable tmpfs
    max_open_files: int = 64  # RLIMIT_NOFILE
    max_output_bytes: int = 4096  # stdout + stderr that come back
    max_code_bytes: int = 64 << 10


@dataclass(frozen=True)
class SandboxResult:
    output: str  # stdout and stderr interleaved, at most max_output_bytes (decoded leniently)
    exit_code: int | None  # None when the sandbox was killed by the caller (timeout or output cap)
    timed_out: bool = False
    output_truncated: bool = False
    setup_failed: bool = False

    def observation(self) -> str:
        """The tool's answer as the model sees it: output, then one status line when something went wrong."""
        notes = []
        if self.setup_failed:
            notes.append("sandbox unavailable, the code did not run")
        if self.timed_out:
            notes.append("timed out: the code was stopped")
        if self.output_truncated:
            notes.append("output truncated")
        if self.exit_code is not None and self.exit_code > 128:
            notes.append(f"killed by {_signal_name(self.exit_code - 128)} (CPU or memory limit)")
        elif self.exit_code not in (None, 0, SETUP_FAILED_EXIT):
            notes.append(f"exit code {self.exit_code}")
        text = self.output.rstrip("\n")
        return text + (f"\n[{'; '.join(notes)}]" if notes else "")


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


# --------------------------------------------------------------------------------------------------- caller side
def _sandbox_env() -> dict[str, str]:
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": WORK_DIR, "TMPDIR": "/tmp", "LANG": "C.UTF-8",
        "PYTHONIOENCODING": "utf-8", "PYTHONDONTWRITEBYTECODE": "1", "MPLBACKEND": "Agg",
        # one thread each: BLAS pools would otherwise count against RLIMIT_NPROC and RLIMIT_AS
        "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
    }


def _interpreter_paths() -> list[str]:
    """Directories the sandboxed interpreter needs: the prefixes and every directory on its symlink chain."""
    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    link = sys.executable
    for _ in range(16):
        paths.add(os.path.dirname(os.path.abspath(link)))
        if not os.path.islink(link):
            break
        link = os.path.join(os.path.dirname(link), os.readlink(link))
    return sorted(paths)


async def run_python(code: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run `code` in a fresh sandbox and collect its output. Never raises for anything the code does."""
    data = code.encode("utf-8", errors="replace")
    if len(data) > limits.max_code_bytes:
        return SandboxResult(output=f"code too long ({len(data)} bytes > {limits.max_code_bytes})", exit_code=None,
                             setup_failed=True)
    config = {"limits": asdict(limits), "uid": random.randrange(200_000, 1_000_000), "python": sys.executable,
              "env": _sandbox_env(), "expose": _interpreter_paths()}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-I", os.path.abspath(__file__), "--boot", json.dumps(config),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        env=_sandbox_env(), start_new_session=True)
    try:
        proc.stdin.write(data)
        await proc.stdin.drain()
        proc.stdin.close()
    except (BrokenPipeError, ConnectionResetError):
        pass  # the boot failed before reading; its message is on stdout

    output = bytearray()
    timed_out = truncated = False
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limits.timeout_s
    try:
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0:
                timed_out = True
                break
            try:
                chunk = await asyncio.wait_for(proc.stdout.read(65536), remaining)
            except TimeoutError:
                timed_out = True
                break
            if not chunk:
                break
            output += chunk
            if len(output) > limits.max_output_bytes:
                truncated = True
                break
    finally:
        if timed_out or truncated or proc.returncode is None:
            # Killing the boot process kills the sandbox's PID 1 (PDEATHSIG) and with it the whole PID namespace.
            _kill_group(proc.pid)
            # asyncio reports the exit only once stdout reaches EOF; a reader that stopped early may have paused
            # the pipe (buffer full), so drain it. Everything that held the pipe died with the PID namespace.
            try:
                await asyncio.wait_for(proc.stdout.read(), 10)
            except TimeoutError:
                pass
        exit_code = await asyncio.wait_for(proc.wait(), 10) if proc.stdout.at_eof() else proc.returncode
    text = bytes(output[: limits.max_output_bytes]).decode("utf-8", errors="replace")
    killed = timed_out or truncated
    return SandboxResult(output=text, exit_code=None if killed else exit_code, timed_out=timed_out,
                         output_truncated=truncated, setup_failed=exit_code == SETUP_FAILED_EXIT and not killed)


def _kill_group(pid: int) -> None:
    for target in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
        try:
            target()
        except (ProcessLookupError, PermissionError):
            pass


# --------------------------------------------------------------------------------------------------- boot side
# Linux constants (sched.h, mount.h, prctl.h); the boot needs nothing but the stdlib and libc.
CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_MOVE, MS_REC = 1024, 2048, 4096, 8192, 16384
MS_PRIVATE, MS_RELATIME = 1 << 18, 1 << 21
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
_LIBC = None


def _libc():
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None, use_errno=True)
    return _LIBC


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _unshare(flags: int) -> None:
    _check(_libc().unshare(flags), "unshare")


def _mount(source, target, fstype, flags, data=None) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(_libc().mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)), f"mount {target}")


def _prctl(option: int, arg: int) -> None:
    _check(_libc().prctl(option, ctypes.c_ulong(arg), 0, 0, 0), "prctl")


def _map_ids(inside: int, outside_uid: int, outside_gid: int) -> None:
    """Map one uid/gid into the user namespace just created (a process may map only its own ids)."""
    with open("/proc/self/setgroups", "w") as f:
        f.write("deny")
    with open("/proc/self/uid_map", "w") as f:
        f.write(f"{inside} {outside_uid} 1")
    with open("/proc/self/gid_map", "w") as f:
        f.write(f"{inside} {outside_gid} 1")


def _mount_points() -> list[str]:
    points = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            raw = line.split()[4]
            points.append(raw.encode().decode("unicode_escape"))  # "\040" -> " "
    return points


def _kept_flags(path: str) -> int:
    """The per-mount flags to keep on a read-only remount (dropping nosuid/nodev/noexec would loosen the mount)."""
    f = os.statvfs(path).f_flag
    flags = 0
    for st, ms in ((os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC),
                   (os.ST_NOATIME, MS_NOATIME), (os.ST_NODIRATIME, MS_NODIRATIME), (os.ST_RELATIME, MS_RELATIME)):
        if f & st:
            flags |= ms
    return flags


def _traversable_by_others(path: str) -> bool:
    return bool(os.stat(path).st_mode & 0o001)


def _blocking_ancestor(path: str) -> str | None:
    """The topmost ancestor of `path` that other users cannot enter (e.g. a 0700 home), or None."""
    parts = os.path.abspath(path).split("/")[1:]
    for i in range(1, len(parts)):
        ancestor = "/" + "/".join(parts[:i])
        if not _traversable_by_others(ancestor):
            return ancestor
    return None


def _expose(paths: list[str], staging_root: str) -> None:
    """Make `paths` (the interpreter and its libraries) reachable for the sandbox uid at their own paths, when an
    ancestor such as a 0700 home directory hides them: bind each path aside, cover the blocking ancestor with an
    empty tmpfs, and move the binds back into place. Nothing else of the ancestor becomes visible."""
    blocked = [(p, _blocking_ancestor(p)) for p in paths if os.path.isdir(p)]
    blocked = [(p, a) for p, a in blocked if a is not None]
    # keep only the outermost of nested paths
    blocked = [(p, a) for p, a in blocked if not any(p != q and p.startswith(q + "/") for q, _ in blocked)]
    staged = []
    for i, (path, _) in enumerate(blocked):
        stage = os.path.join(staging_root, str(i))
        os.makedirs(stage)
        _mount(path, stage, None, MS_BIND | MS_REC)
        staged.append((stage, path))
    for ancestor in sorted({a for _, a in blocked}):
        _mount("tmpfs", ancestor, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,mode=0755")
    for stage, path in staged:
        os.makedirs(path, exist_ok=True)
        _mount(stage, path, None, MS_MOVE)
        os.rmdir(stage)
    if staged:
        os.rmdir(staging_root)


def _outermost(paths: list[str]) -> list[str]:
    return [p for p in paths if not any(p != q and p.startswith(q + "/") for q in paths)]


def _under_private_tmpfs(path: str) -> bool:
    return any(path == d or path.startswith(d + "/") for d in _PRIVATE_TMPFS)


def _set_aside(paths: list[str]) -> list[tuple[str, str]]:
    """Bind the interpreter directories that a private tmpfs is about to hide (a checkout under /tmp, say) to a
    staging tmpfs, so they can be moved back on top of it. Returns (stage, path) pairs for `_put_back`."""
    hidden = _outermost(sorted(p for p in paths if os.path.isdir(p) and _under_private_tmpfs(os.path.abspath(p))))
    if not hidden:
        return []
    # The staging tmpfs covers an existing directory that holds none of the interpreter and is not hidden itself.
    staging = next(d for d in ("/mnt", "/media", "/srv", "/opt", "/home")
                   if os.path.isdir(d) and not _under_private_tmpfs(d)
                   and not any(p == d or p.startswith(d + "/") for p in paths))
    _mount("tmpfs", staging, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,mode=0700")
    staged = []
    for i, path in enumerate(hidden):
        stage = os.path.join(staging, str(i))
        os.makedirs(stage)
        _mount(path, stage, None, MS_BIND | MS_REC)
        staged.append((stage, path))
    return staged


def _put_back(staged: list[tuple[str, str]]) -> None:
    """Move the set-aside directories onto their own paths inside the private tmpfs, read-only."""
    for stage, path in staged:
        os.makedirs(path, exist_ok=True)
        _mount(stage, path, None, MS_MOVE)
        _mount(None, path, None, MS_BIND | MS_REMOUNT | MS_RDONLY | _kept_flags(path))


def _make_filesystem_read_only(limits: dict, expose: list[str], rootless: bool) -> None:
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing we do here propagates to the host
    set_aside = _set_aside(expose)
    _mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={limits['tmpfs_bytes']},mode=1777")
    if not rootless:  # a rootless sandbox runs as the owner of a 0700 home anyway
        _expose([p for p in expose if not _under_private_tmpfs(os.path.abspath(p))], "/tmp/.expose")
    for point in _mount_points():
        if point == "/tmp":
            continue  # the private tmpfs stays writable
        try:
            _mount(None, point, None, MS_BIND | MS_REMOUNT | MS_RDONLY | _kept_flags(point))
        except OSError:
            if point == "/":
                raise
            # A special mount (e.g. under /proc or /sys) that refuses the remount is not writable by the
            # sandbox uid anyway; the world-writable places get a private tmpfs below.
    for path in _PRIVATE_TMPFS[1:]:
        if os.path.isdir(path) and not os.path.islink(path):
            _mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV,
                   f"size={limits['tmpfs_bytes']},mode=1777")
    _put_back(set_aside)


def _set_limits(limits: dict) -> None:
    import resource

    for res, value in ((resource.RLIMIT_AS, limits["memory_bytes"]), (resource.RLIMIT_NPROC, limits["max_processes"]),
                       (resource.RLIMIT_FSIZE, limits["max_file_bytes"]),
                       (resource.RLIMIT_NOFILE, limits["max_open_files"]), (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(res, (value, value))
    resource.setrlimit(resource.RLIMIT_CPU, (limits["cpu_s"], limits["cpu_s"] + 1))


def _enter_namespaces(rootless: bool) -> bool:
    """Unshare the mount, network, IPC, UTS and PID namespaces; returns whether a user namespace was needed.

    Root normally has the capability to do it directly. Root *without* CAP_SYS_ADMIN (a default container) and any
    other user go through a user namespace in which they are root."""
    flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWPID
    if not rootless:
        try:
            _unshare(flags)
            return False
        except PermissionError:
            pass
    outer_uid, outer_gid = os.getuid(), os.getgid()
    _unshare(CLONE_NEWUSER)
    _map_ids(0, outer_uid, outer_gid)  # root inside, to set up the namespaces below
    _unshare(flags)
    return True


def _boot(config: dict) -> None:
    limits = config["limits"]
    code = sys.stdin.buffer.read(limits["max_code_bytes"] + 1)
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # the caller died or gave up: so do we
    rootless = _enter_namespaces(rootless=os.geteuid() != 0)
    uid = os.getuid() if rootless else config["uid"]
    _make_filesystem_read_only(limits, config["expose"], rootless)
    os.makedirs(WORK_DIR, mode=0o700)
    with open(os.path.join(WORK_DIR, "main.py"), "wb") as f:
        f.write(code)
    if not rootless:
        os.chown(WORK_DIR, uid, uid)
        os.chown(os.path.join(WORK_DIR, "main.py"), uid, uid)

    child = os.fork()  # the child is PID 1 of the new PID namespace
    if child == 0:
        try:
            _exec_code(config, uid, rootless)
        except BaseException as exc:  # still before any untrusted code ran
            _report_setup_failure(exc)
    _, status = os.waitpid(child, 0)
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))


def _exec_code(config: dict, uid: int, rootless: bool) -> None:
    try:  # a /proc of this PID namespace: the code sees only its own processes
        _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    except OSError:
        pass  # kernels that refuse a new proc here leave the host's, read-only
    _set_limits(config["limits"])
    if rootless:
        # A nested user namespace with a non-zero uid: no capabilities over the mounts made above.
        outer_uid, outer_gid = os.getuid(), os.getgid()  # read before unsharing: unmapped ids read as 65534
        _unshare(CLONE_NEWUSER)
        _map_ids(1000, outer_uid, outer_gid)
    else:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    _prctl(PR_SET_NO_NEW_PRIVS, 1)
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # cleared by the uid change above; re-armed for the code
    os.chdir(WORK_DIR)
    devnull = os.open("/dev/null", os.O_RDONLY)
    os.dup2(devnull, 0)
    python = config["python"]
    os.execve(python, [python, "-I", "-B", "main.py"], config["env"])


def _report_setup_failure(exc: BaseException) -> None:
    import traceback

    frame = traceback.extract_tb(exc.__traceback__)[-1]
    print(f"sandbox setup failed in {frame.name} (line {frame.lineno}): {type(exc).__name__}: {exc}", flush=True)
    os._exit(SETUP_FAILED_EXIT)


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--boot":
    try:
        _boot(json.loads(sys.argv[2]))
    except BaseException as exc:
        _report_setup_failure(exc)
