"""Weight-sync helpers: the tied lm_head is added for vLLM, tied tensors survive the safetensors hop, bad input is
named; and the hf engine's step gate blocks forward passes while closed."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
import torch

from runtime.engines.hf_engine import _StepGate
from runtime.engines.weights import (
    EMBED,
    LM_HEAD,
    complete_state_dict,
    resolve_weights,
    save_for_reload,
    tied_embeddings,
)


def test_tied_lm_head_is_added_only_when_tied_and_missing():
    embed = torch.randn(10, 4)
    state = {EMBED: embed, "model.norm.weight": torch.ones(4), "step": torch.tensor(3)}
    tied = complete_state_dict(state, tied=True)
    assert tied[LM_HEAD] is embed
    assert "step" not in tied  # only floating-point tensors are weights
    assert LM_HEAD not in complete_state_dict(state, tied=False)
    own_head = torch.randn(10, 4)
    assert complete_state_dict({**state, LM_HEAD: own_head}, tied=True)[LM_HEAD] is own_head


def test_save_for_reload_copies_shared_storage(tmp_path):
    from safetensors.torch import load_file

    embed = torch.randn(10, 4)
    path = tmp_path / "w.safetensors"
    save_for_reload({EMBED: embed, LM_HEAD: embed, "x": embed[:2]}, path)  # plain save_file refuses shared storage
    back = load_file(str(path))
    assert torch.equal(back[EMBED], embed) and torch.equal(back[LM_HEAD], embed) and torch.equal(back["x"], embed[:2])


def test_tied_embeddings_reads_the_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"tie_word_embeddings": True}))
    assert tied_embeddings(str(tmp_path))
    assert not tied_embeddings(str(tmp_path / "missing"))  # a hub name: nothing to add


def test_resolve_weights_rejects_non_state_dicts():
    with pytest.raises(TypeError, match="dict name -> torch.Tensor"):
        asyncio.run(resolve_weights([torch.zeros(1)]))
    with pytest.raises(TypeError, match="dict name -> torch.Tensor"):
        asyncio.run(resolve_weights({"w": [1.0]}))
    state = {"w": torch.zeros(1)}
    assert asyncio.run(resolve_weights(state)) is state


def test_step_gate_close_waits_for_the_running_step_and_blocks_the_next():
    gate = _StepGate()
    steps: list[float] = []

    def generation_thread():
        for _ in range(3):
            with gate.forward():
                time.sleep(0.05)
                steps.append(time.monotonic())

    gate.enter()  # a step is running when close() is called
    worker = threading.Thread(target=generation_thread)
    closer_done = []

    def close():
        gate.close()
        closer_done.append(time.monotonic())

    closer = threading.Thread(target=close)
    closer.start()
    time.sleep(0.05)
    assert not closer_done  # close() waits for the running step
    gate.leave()
    closer.join(timeout=5)
    assert closer_done
    worker.start()
    time.sleep(0.2)
    assert steps == []  # closed: the next step does not start
    gate.open()
    worker.join(timeout=5)
    assert len(steps) == 3
