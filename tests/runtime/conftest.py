"""Runtime tests: a real local Ray cluster with the device slots the demo plans need."""

from __future__ import annotations

import os

import pytest
from loop_support import ROOT

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def local_ray():
    """A real local Ray instance (its own, never someone else's) with 3 device slots, run from the project root."""
    import ray

    cwd = os.getcwd()
    os.chdir(ROOT)  # plan paths are relative to the project root
    ray.init(address="local", num_cpus=8, resources={"device_slot": 3}, include_dashboard=False,
             log_to_driver=False)
    yield
    ray.shutdown()
    os.chdir(cwd)
