"""LoRA through peft (runtime/lora.py) on the demo's tiny Qwen3, in one process: what trains, the merged weights the
engines get, and the PEFT adapter export."""

from __future__ import annotations

import pytest
import torch
from loop_support import ROOT

from runtime import lora
from runtime.models import hf
from schemas.plan import LoraPlan

MODEL = str(ROOT / "recipes/data/demo_math/model")


def _model(plan: LoraPlan):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32, attn_implementation="sdpa")
    return lora.apply(m, plan)


def _nudge_adapters(model) -> None:
    """lora_B starts at 0 (step 0 = the base model); give it values so the merge is not trivially W."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def test_target_regex_full_matches_like_fnmatch():
    import re

    rx = lora.target_regex(["*.q_proj", "model.layers.0.mlp.*"])
    assert re.fullmatch(rx, "model.layers.3.self_attn.q_proj")
    assert re.fullmatch(rx, "model.layers.0.mlp.down_proj")
    assert not re.fullmatch(rx, "model.layers.1.mlp.down_proj") and not re.fullmatch(rx, "q_proj_x")


def test_only_adapters_train_and_step_zero_is_the_base_model():
    from transformers import AutoModelForCausalLM

    m = _model(LoraPlan(dim=4, alpha=8, scale=2.0, target_modules=["*.q_proj", "*.v_proj"]))
    trainable = [n for n, p in m.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n in trainable)
    assert any("q_proj.lora_A" in n for n in trainable) and not any("k_proj" in n for n in trainable)
    base = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32, attn_implementation="sdpa")
    ids = torch.tensor([[1, 5, 9, 12, 7]])
    assert torch.allclose(m(ids).logits, base(ids).logits, atol=1e-6)


def test_no_match_is_refused():
    with pytest.raises(ValueError, match="not found in the base model|matched no modules"):  # peft's, or ours
        _model(LoraPlan(dim=4, alpha=8, scale=2.0, target_modules=["*.no_such_proj"]))


def test_merged_weights_are_what_the_engines_load():
    """The synced tensors under HF names load into the plain model and reproduce the adapted model's logits."""
    from transformers import AutoModelForCausalLM

    m = _model(LoraPlan(dim=4, alpha=8, scale=2.0, target_modules=None))  # every linear layer but lm_head
    _nudge_adapters(m)
    plain = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32, attn_implementation="sdpa")
    sources = hf.hf_weights(m)
    names = [n for n, _ in sources]
    assert names == [n for n, p in plain.named_parameters()]  # same names and order as a full-FT sync
    with torch.no_grad():
        params = dict(plain.named_parameters())
        for name, src in sources:
            params[name].copy_(src.local() if isinstance(src, lora.MergedWeight) else src)
    ids = torch.tensor([[1, 5, 9, 12, 7, 3]])
    assert torch.allclose(plain(ids).logits, m(ids).logits, atol=1e-5)
    assert not torch.allclose(plain(ids).logits, AutoModelForCausalLM.from_pretrained(MODEL)(ids).logits, atol=1e-4)


def test_export_is_a_peft_adapter_directory(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    m = _model(LoraPlan(dim=4, alpha=8, scale=2.0, target_modules=["*.q_proj", "*.o_proj"]))
    _nudge_adapters(m)
    out = lora.export_adapter(str(tmp_path / "hf"), m, MODEL, rank=0)
    assert {p.name for p in (tmp_path / "hf").iterdir()} == {"adapter_config.json", "adapter_model.safetensors"}
    base = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32, attn_implementation="sdpa")
    loaded = PeftModel.from_pretrained(base, out)
    ids = torch.tensor([[1, 5, 9, 12, 7, 3]])
    assert torch.allclose(loaded(ids).logits, m(ids).logits, atol=1e-5)


def test_fsdp_lora_trains_adapters_and_dcp_resumes_them(tmp_path):
    """A one-rank FSDP2 world (gloo): a step moves only the adapters; a DCP save/load restores them exactly."""
    import os

    import torch.distributed as dist

    from runtime import ckpt, fsdp, models
    from schemas.plan import ModelPlan, OptimizerPlan

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        mp = ModelPlan(path=MODEL, arch=None, backend="hf", dtype="float32", attn="sdpa", gradient_checkpoint="full",
                       compile_layers=False, disable_fast_tokenizer=False, router_dtype="float32", moe_dispatcher=None)
        meshes = models.backend(mp).device_mesh("cpu", 1, None)
        plan = LoraPlan(dim=4, alpha=8, scale=2.0, target_modules=["*.q_proj", "*.down_proj"])
        model = models.backend(mp).build(mp, MODEL, meshes, torch.device("cpu"), lora=plan)
        opt = OptimizerPlan(name="adam", lr=1e-2, betas=[0.9, 0.95], eps=1e-8, weight_decay=0.0, max_norm=1.0,
                            scheduler="constant", warmup_steps=0, total_steps=10, min_lr_ratio=0.1, muon=None)
        optimizer, scheduler = fsdp.build_optimizer(opt, model)
        before = {n: p.detach().full_tensor().clone() for n, p in model.named_parameters()}
        ids = torch.tensor([[1, 5, 9, 12, 7, 3]])
        model(ids, labels=ids).loss.backward()
        fsdp.clipped_step(model, optimizer, scheduler, 1.0)
        after = {n: p.detach().full_tensor().clone() for n, p in model.named_parameters()}
        moved = {n for n in before if not torch.equal(before[n], after[n])}
        assert moved and all("lora_" in n for n in moved)  # the base stays frozen
        ckpt.save_sharded(str(tmp_path / "step"), model, optimizer, scheduler)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_" in n:
                    p.zero_()
        ckpt.load_sharded(str(tmp_path / "step"), model, optimizer, scheduler)
        assert all(torch.equal(p.detach().full_tensor(), after[n]) for n, p in model.named_parameters())
    finally:
        dist.destroy_process_group()
