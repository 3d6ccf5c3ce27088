"""Shared set-up of the model-backend tests: a one-rank gloo world and its data-parallel meshes."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="module")
def world():
    """A one-rank gloo process group for a module's builds (FSDP2 needs one), and the hf backend's meshes on it."""
    import torch.distributed as dist

    from runtime.models import hf
    from runtime.ranks import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield hf.dp_meshes("cpu", 1)
    dist.destroy_process_group()
