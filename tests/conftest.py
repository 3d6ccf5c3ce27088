"""Shared test setup: offline Hugging Face hub, paths of the test data."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"


@pytest.fixture
def data_dir() -> Path:
    """tests/data: `good/` recipes (with `good/base/` fragments) and `bad/` inputs, one per bad-input case."""
    return DATA


@pytest.fixture
def in_root(monkeypatch: pytest.MonkeyPatch) -> Path:
    """Run the test with the project root as the working directory (display paths are relative to it)."""
    monkeypatch.chdir(ROOT)
    return ROOT
