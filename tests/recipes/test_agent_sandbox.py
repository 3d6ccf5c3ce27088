"""Escape attempts against the geo3k tool sandbox: each must be contained and reported in the observation.

These run the real sandbox (namespaces, rlimits, a uid of its own) — nothing is faked. Each case costs about one
interpreter start.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

sys.path.append(str(Path(__file__).resolve().parents[2] / "recipes" / "agents"))
from sandbox import SandboxLimits, run_python

LIMITS = SandboxLimits(timeout_s=20, cpu_s=20, max_output_bytes=2000)


def run(code: str, limits: SandboxLimits = LIMITS):
    return asyncio.run(run_python(code, limits))


def leftover_sandbox_processes() -> list[str]:
    """Host processes still running sandboxed code (the exec'd interpreter runs `main.py` with -I -B)."""
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if "-I -B main.py" in line or "sandbox.py --boot" in line]


def test_plain_code_runs_and_may_write_its_own_dir():
    result = run("open('note.txt', 'w').write('hi')\nprint(open('note.txt').read(), 6 * 7)\n"
                 "import os; print(os.getcwd(), os.getuid() != 0)")
    assert result.exit_code == 0 and not result.timed_out
    assert result.observation() == "hi 42\n/tmp/sandbox True"


def test_writes_outside_the_temp_dir_do_not_reach_the_host(tmp_path):
    project_file = Path(__file__).resolve().parents[2] / "SANDBOX_ESCAPE_TEST"
    host_tmp_file = tmp_path / "escape.txt"
    code = "\n".join([
        "import os",
        f"for path in [{str(project_file)!r}, {str(host_tmp_file)!r}, '/tmp/escape_tmp', '/dev/shm/escape_shm', '/var/tmp/escape_var']:",
        "    try:",
        "        open(path, 'w').write('x')",
        "        print('wrote', path)",
        "    except OSError as e:",
        "        print('blocked', path, e.strerror)",
    ])
    result = run(code)
    assert result.exit_code == 0
    obs = result.observation()
    # read-only mounts refuse outright; a checkout under /tmp is not even visible (only the interpreter is)
    refusal = "Read-only file system" if not str(project_file).startswith("/tmp/") else "Permission denied"
    assert f"blocked {project_file} {refusal}" in obs
    assert f"blocked {host_tmp_file} No such file or directory" in obs
    assert not project_file.exists() and not host_tmp_file.exists()
    # /tmp, /dev/shm, /var/tmp are private tmpfs inside the sandbox: the writes succeed there and vanish
    for path in ("/tmp/escape_tmp", "/dev/shm/escape_shm", "/var/tmp/escape_var"):
        assert f"wrote {path}" in obs
        assert not Path(path).exists()


def test_file_size_limit():
    result = run("open('big', 'wb').write(b'x' * (64 << 20))", SandboxLimits(timeout_s=20, max_file_bytes=1 << 20))
    # RLIMIT_FSIZE raises SIGXFSZ, which kills the interpreter
    assert "killed by SIGXFSZ" in result.observation() or "File too large" in result.observation()


def test_network_is_unreachable_even_on_host_loopback():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.5)
    port = server.getsockname()[1]
    accepted = []
    sandbox_done = threading.Event()

    def accept():  # listen until the sandboxed code has finished
        while not sandbox_done.is_set():
            try:
                accepted.append(server.accept())
                return
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept)
    thread.start()
    code = "\n".join([
        "import socket",
        f"for addr in [('127.0.0.1', {port}), ('1.1.1.1', 80)]:",
        "    s = socket.socket(); s.settimeout(3)",
        "    try:",
        "        s.connect(addr); print('connected', addr)",
        "    except OSError as e:",
        "        print('refused', addr, e.strerror)",
        "try:",
        "    socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', ('8.8.8.8', 53)); print('sent udp')",
        "except OSError as e:",
        "    print('udp', e.strerror)",
        "try:",
        "    socket.getaddrinfo('pypi.org', 443); print('resolved')",
        "except OSError as e:",
        "    print('dns failed')",
    ])
    result = run(code)
    sandbox_done.set()
    thread.join()
    server.close()
    obs = result.observation()
    assert "connected" not in obs and "sent udp" not in obs and "resolved" not in obs
    assert f"refused ('127.0.0.1', {port}) Network is unreachable" in obs
    assert "refused ('1.1.1.1', 80) Network is unreachable" in obs
    assert "dns failed" in obs
    assert accepted == []


def test_fork_bomb_is_capped_and_cleaned_up():
    code = "\n".join([
        "import os, time",
        "n = 0",
        "try:",
        "    while True:",
        "        if os.fork() == 0:",
        "            time.sleep(60); os._exit(0)",
        "        n += 1",
        "except OSError as e:",
        "    print('fork refused after', n, e.strerror)",
    ])
    result = run(code, SandboxLimits(timeout_s=20, max_processes=8))
    assert "fork refused after" in result.observation()
    assert int(result.output.split("after ")[1].split()[0]) < 8
    time.sleep(0.5)
    assert leftover_sandbox_processes() == []


def test_background_daemon_dies_with_the_code():
    # the main program exits at once, leaving a detached child that would run for a minute
    code = "import os, time\nif os.fork() == 0:\n    os.setsid(); time.sleep(60)\nelse:\n    print('parent done')"
    result = run(code)
    assert result.observation() == "parent done"
    time.sleep(0.5)
    assert leftover_sandbox_processes() == []


def test_infinite_loop_times_out():
    start = time.monotonic()
    result = run("while True:\n    pass", SandboxLimits(timeout_s=3, cpu_s=60))
    elapsed = time.monotonic() - start
    assert result.timed_out and result.exit_code is None
    assert "[timed out: the code was stopped]" in result.observation()
    assert elapsed < 10
    assert leftover_sandbox_processes() == []


def test_cpu_limit_kills_a_busy_loop_before_the_wall_clock():
    result = run("while True:\n    pass", SandboxLimits(timeout_s=30, cpu_s=1))
    assert not result.timed_out
    assert "killed by SIGXCPU" in result.observation() or "killed by SIGKILL" in result.observation()


def test_huge_output_is_truncated():
    result = run("while True:\n    print('y' * 1000)", SandboxLimits(timeout_s=20, max_output_bytes=1500))
    assert result.output_truncated
    assert len(result.output.encode()) <= 1500
    assert result.observation().endswith("[output truncated]")
    assert leftover_sandbox_processes() == []


def test_memory_hog_is_refused():
    result = run("chunks = []\nwhile True:\n    chunks.append(bytearray(50 << 20))",
                 SandboxLimits(timeout_s=20, memory_bytes=512 << 20))
    assert "MemoryError" in result.observation()
    assert "[exit code 1]" in result.observation()


def test_runner_environment_and_privileges_do_not_leak():
    os.environ["MOLT_TEST_SECRET"] = "hunter2"
    try:
        result = run("import os\nprint(os.environ.get('MOLT_TEST_SECRET'))\n"
                     "try:\n    os.setuid(0); print('root')\nexcept PermissionError:\n    print('no root')\n"
                     "print(len([p for p in os.listdir('/proc') if p.isdigit()]))")
    finally:
        del os.environ["MOLT_TEST_SECRET"]
    assert result.observation() == "None\nno root\n1"  # only its own process is visible


def test_exceptions_in_the_code_are_reported():
    result = run("1 / 0")
    obs = result.observation()
    assert "ZeroDivisionError: division by zero" in obs and obs.endswith("[exit code 1]")


def test_oversized_code_is_refused_without_running():
    result = run("x = 1\n" * 20000, SandboxLimits(max_code_bytes=1000))
    assert result.setup_failed and "code too long" in result.observation()


def test_scientific_libraries_are_available_inside_the_limits():
    result = run("import numpy as np, sympy\nprint(np.linalg.norm([3, 4]), sympy.nsimplify(sympy.sqrt(8)))",
                 SandboxLimits(timeout_s=60, cpu_s=60))
    assert result.observation() == "5.0 2*sqrt(2)"


ROOTLESS_SCRIPT = """
import asyncio, sys
sys.path.append(%r)
from sandbox import SandboxLimits, run_python
code = '''
import os, socket
try:
    open(%r, 'w').write('x'); print('wrote host file')
except OSError as e:
    print('write', e.strerror)
try:
    socket.create_connection(('1.1.1.1', 80), 2); print('connected')
except OSError as e:
    print('net', e.strerror)
print('uid', os.getuid())
'''
r = asyncio.run(run_python(code, SandboxLimits(timeout_s=30)))
print(r.observation())
"""


@pytest.mark.skipif(os.geteuid() != 0 or not Path("/usr/bin/setpriv").exists() or not Path("/usr/bin/python3").exists(),
                    reason="needs root (to become an unprivileged user), setpriv and a system python3")
def test_rootless_mode_uses_user_namespaces():
    """Started by an unprivileged user the sandbox enters a user namespace instead of switching uid; the same
    containment holds. The system interpreter is used because the venv's may live under a 0700 home."""
    repo = Path(__file__).resolve().parents[2]
    agents = str(repo / "recipes" / "agents")
    # A directory the unprivileged user *can* write on the host (checked below), outside any tmpfs the sandbox
    # replaces: only the sandbox's read-only remount can stop the write.
    host_dir = Path(tempfile.mkdtemp(prefix=".sandbox_rootless_", dir=repo))
    try:
        host_dir.chmod(0o777)
        target = host_dir / "escape"
        nobody = ["/usr/bin/setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
        control = subprocess.run(nobody + ["/usr/bin/touch", str(host_dir / "control")], capture_output=True)
        assert control.returncode == 0 and (host_dir / "control").exists()
        proc = subprocess.run(nobody + ["/usr/bin/python3", "-I", "-c", ROOTLESS_SCRIPT % (agents, str(target))],
                              capture_output=True, text=True, timeout=120, cwd="/")
        assert proc.returncode == 0, proc.stderr
        # a checkout under /tmp is hidden by the sandbox's private /tmp: the write then finds no directory
        refusal = "Read-only file system" if not str(host_dir).startswith("/tmp/") else "No such file or directory"
        assert proc.stdout.strip().splitlines() == [
            f"write {refusal}", "net Network is unreachable", "uid 1000"]  # uid of the nested userns
        assert not target.exists()
    finally:
        shutil.rmtree(host_dir)


@pytest.mark.skipif(os.geteuid() != 0 or not Path("/usr/bin/setpriv").exists(),
                    reason="needs root and setpriv to drop CAP_SYS_ADMIN")
def test_root_without_cap_sys_admin_falls_back_to_a_user_namespace():
    """Root in a default container lacks CAP_SYS_ADMIN: the boot cannot unshare directly and must go through a
    user namespace instead of failing (or running unconfined)."""
    agents = str(Path(__file__).resolve().parents[2] / "recipes" / "agents")
    target = Path(__file__).resolve().parents[2] / "CAPLESS_ESCAPE_TEST"
    proc = subprocess.run(["/usr/bin/setpriv", "--bounding-set=-sys_admin", "--inh-caps=-sys_admin", sys.executable,
                           "-c", ROOTLESS_SCRIPT % (agents, str(target))],
                          capture_output=True, text=True, timeout=120, cwd="/")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[1:] == ["net Network is unreachable", "uid 1000"]
    if str(target).startswith("/tmp/"):
        # a checkout under /tmp lies inside the sandbox's private /tmp: a write may land there, and vanishes
        assert lines[0] in ("write Read-only file system", "wrote host file")
    else:
        assert lines[0] == "write Read-only file system"
    assert not target.exists()
