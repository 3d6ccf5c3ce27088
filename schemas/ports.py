"""Local port picking, shared by the compiler's local Ray cluster (`molt_compile/local_cluster.py`) and the
runtime's rank worlds (`runtime/ranks.py`): the one mechanism both sides of the import line may use (neither imports
the other). Importable without torch, ray, vllm or transformers."""

from __future__ import annotations

import socket

_given: set[int] = set()
"""Every port this process has handed out."""


def free_port() -> int:
    """A port free now and never handed out before by this process: the kernel may give the same ephemeral port to
    two bind-and-close probes in a row (one `ray start` takes seven: two of its components on one port once in 34
    starts; a test that picks a world's ports up front started two worlds on one port)."""
    while True:
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        if port not in _given:
            _given.add(port)
            return port
