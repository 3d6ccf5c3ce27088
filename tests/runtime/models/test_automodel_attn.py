"""The plan's `model.attn` on the automodel backend (runtime/models/automodel.py `backend_config`): it goes to
nemo-automodel's own layers (`BackendConfig.attn`), and the capability rows it meets say exactly why
(schemas/capabilities.py `rl-automodel-attn`, `rl-automodel-te`). On nemo-automodel's Qwen3-MoE (GQA: 4 query heads,
2 key/value heads), unsharded, fp32, on CPU:

- sdpa builds nemo-automodel's sdpa attention; te reaches its te path, which imports transformer_engine (installed on
  none of our machines: the job's package check stops a te plan at start, tests/runtime/test_packages.py);
- flex stays refused, and each reason the row gives is checked here, so that the row's text fails this test the
  day nemo-automodel or torch lifts one: its Qwen3-MoE attention does not pass enable_gqa (the first forward fails),
  its FlexAttention has no backward on CPU, and with enable_gqa its forward equals sdpa on right-padded rows (causal
  masking only: the padding mask is dropped, which right padding survives and a packed row would not).
"""

from __future__ import annotations

import pytest
import torch

from runtime.models import automodel
from runtime.tiny_model import build_tiny_model
from schemas.plan import ModelPlan


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("moe") / "model", seed=0, vocab_size=300, experts=4,
                                experts_per_token=2, tie_word_embeddings=False))


def _load(path: str, attn: str):
    plan = ModelPlan(path=path, arch=None, backend="automodel", dtype="float32", attn=attn,
                     gradient_checkpoint="none", compile_layers=False, disable_fast_tokenizer=False,
                     router_dtype="float32", moe_dispatcher="torch")
    return automodel.load(plan, path, torch.device("cpu"))


def _rows() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(5, 290, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0  # a right-padded row
    return ids, mask


def test_the_plans_attention_goes_to_nemo_automodels_layers(checkpoint):
    model = _load(checkpoint, "sdpa")
    attention = model.model.layers["0"].self_attn
    assert attention.backend.attn == "sdpa" and attention.attn_module is None  # its sdpa: a function, no module
    with pytest.raises(ModuleNotFoundError, match="transformer_engine"):
        _load(checkpoint, "te")


def test_flex_stays_refused_for_the_reasons_its_row_gives(checkpoint):
    ids, mask = _rows()
    sdpa, flex = _load(checkpoint, "sdpa"), _load(checkpoint, "flex")
    assert type(flex.model.layers["0"].self_attn.attn_module).__name__ == "FlexAttention"
    with torch.no_grad(), pytest.raises(ValueError, match="enable_gqa"):
        flex.model(ids, attention_mask=mask)
    with torch.no_grad():
        expected = sdpa.model(ids, attention_mask=mask)
        got = flex.model(ids, attention_mask=mask, enable_gqa=True)
    real = mask.bool()
    torch.testing.assert_close(got[real], expected[real], rtol=1e-5, atol=1e-5)
    with pytest.raises(NotImplementedError, match="backward on CPU"):
        flex.model(ids, attention_mask=mask, enable_gqa=True).sum().backward()
