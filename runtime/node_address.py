"""A rank world's master address (`runtime/ranks.py`): the IP of the node a Ray task lands on and a free port there.

A module of its own, importing neither torch nor the model code: the task runs in a fresh worker process that
imports the function's module before it answers (3 s of CPU for `runtime.ranks` and torch on a small machine), and
the group's ranks are created only after it has answered."""

from __future__ import annotations

from schemas.ports import free_port


def node_ip_and_port() -> tuple[str, int]:
    import ray

    return ray.util.get_node_ip_address(), free_port()
