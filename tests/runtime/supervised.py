"""An actor for the supervisor tests (tests/runtime/test_supervisor.py), in a module Ray's workers can import."""

from __future__ import annotations

import os
import time


class Sleeper:
    def __init__(self, data_path: str | None = None):
        if data_path is not None:  # the generator reads its prompts in its constructor
            from runtime.datasource import read_prompts

            read_prompts(data_path, "train", "prompt", "answer", None, 10)

    def ping(self) -> int:
        return os.getpid()

    def sleep(self, s: float) -> float:
        time.sleep(s)
        return s


class CrashyRunner:
    """An agent runner's interface (`run_group`, `pid`) whose process dies (`os._exit`) on "crash" prompts, as an
    agent that crashes its runner does; other groups ("ok SECONDS") take that long and come back with every rollout
    dropped."""

    def pid(self) -> int:
        return os.getpid()

    def run_group(self, req):
        from runtime.runners import GroupResult

        if "crash" in req.prompt:
            os._exit(3)
        time.sleep(float(req.prompt.split()[-1]))
        return GroupResult(req.group_id, None, [], [])


class Rank:
    """Two of these stand for trainer ranks joined by a collective: rank 1 `serve`s a TCP connection, rank 0's `step`
    reads from it and fails, as gloo does, when its peer's process dies ("Connection closed by peer")."""

    def ping(self) -> int:
        return os.getpid()

    def listen(self) -> int:
        import socket

        self.server = socket.create_server(("127.0.0.1", 0))
        return self.server.getsockname()[1]

    def serve(self) -> None:
        conn, _ = self.server.accept()
        conn.recv(1)  # never sent: the collective waits on its peer

    def step(self, port: int) -> None:
        import socket

        with socket.create_connection(("127.0.0.1", port)) as conn:
            if not conn.recv(1):
                raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer")
