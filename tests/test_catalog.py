"""Model and GPU catalogs, and model facts read from config.json (no transformers)."""

from __future__ import annotations

import json

import pytest

from molt_compile.model_facts import facts_from_config, max_positions, resolve_model
from schemas.catalog import GPUS, MODELS

REQUIRED_MODELS = {"qwen3-4b", "qwen3.6-35b-a3b", "nemotron-3-nano-omni-30b-a3b", "glm-5.2", "qwen3-8b",
                   "qwen3-30b-a3b", "llama-3.1-8b", "tiny-qwen3"}


def test_catalog_covers_the_reference_recipes():
    assert REQUIRED_MODELS <= set(MODELS)
    assert {"h100-80gb", "h200-141gb", "a100-80gb", "b200-180gb", "l40s-48gb", "cpu"} <= set(GPUS)


@pytest.mark.parametrize("key", sorted(MODELS))
def test_model_rows_are_consistent(key):
    m = MODELS[key]
    assert m.key == key
    assert 0 < m.params_active <= m.params_total
    assert m.layers > 0 and m.hidden_size > 0 and m.vocab > 0 and m.kv_bytes_per_token > 0
    assert m.heads % m.kv_heads == 0
    assert m.is_moe == (m.experts > 1)
    assert (m.experts_per_token > 0) == m.is_moe
    assert m.experts_per_token <= m.experts
    assert set(m.estimated) <= set(m.__dataclass_fields__), m.estimated
    if not m.is_moe:
        assert m.params_active == m.params_total


def test_reference_model_properties_from_molt_rules():
    glm = MODELS["glm-5.2"]
    assert glm.experts == 256 and glm.has_mtp_head and glm.native_automodel and glm.thd_packing
    assert 740e9 < glm.params_total < 760e9
    omni = MODELS["nemotron-3-nano-omni-30b-a3b"]
    assert omni.is_vlm and omni.is_moe and not omni.has_mtp_head and omni.cp_hook  # F12: no MTP head
    assert MODELS["qwen3.6-35b-a3b"].is_vlm and MODELS["qwen3.6-35b-a3b"].cp_hook
    assert not MODELS["qwen3-4b"].native_automodel  # dense Qwen3 runs on Molt's HF fallback (H9)


def test_tiny_model_parameter_count_matches_the_formula():
    # the config.json estimate of the demo model's shape against the count measured in environment.md (423,680)
    tiny = MODELS["tiny-qwen3"]
    cfg = {"architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": 2, "hidden_size": 128,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 256,
           "vocab_size": 1000, "tie_word_embeddings": True}
    est = facts_from_config(cfg).params_total
    assert abs(est - tiny.params_total) / tiny.params_total < 0.001  # only q/k norms are not in the formula


def test_gpu_rows():
    for key, g in GPUS.items():
        assert g.key == key
        if key != "cpu":
            assert g.memory_gib > 40 and g.bf16 and g.gpus_per_node == 8 and g.cpus_per_node >= 64
    assert GPUS["cpu"].memory_gib == 0


def test_derive_reads_cpus_per_node_from_the_gpu_catalog():
    from molt_compile.derive.cluster import gpu_catalog_cpus as _gpu_catalog_cpus

    assert _gpu_catalog_cpus("h100-80gb") == 224
    assert _gpu_catalog_cpus("cpu") is None


# ---------------------------------------------------------------------------------------------- config.json facts
def test_moe_detected_from_expert_count_like_molt():
    for key in ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts"):
        f = facts_from_config({"architectures": ["XForCausalLM"], key: 64, "num_experts_per_tok": 4,
                               "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 2, "vocab_size": 10})
        assert f.is_moe and f.experts == 64 and f.experts_per_token == 4, key
    one = facts_from_config({"architectures": ["XForCausalLM"], "num_experts": 1, "num_hidden_layers": 1,
                             "hidden_size": 8, "num_attention_heads": 1, "vocab_size": 10})
    assert not one.is_moe  # Molt: > 1 experts


def test_moe_detected_from_architecture_name_alone():
    f = facts_from_config({"architectures": ["Qwen3MoeForCausalLM"], "num_hidden_layers": 1, "hidden_size": 8,
                           "num_attention_heads": 1, "vocab_size": 10})
    assert f.is_moe and f.native_automodel


def test_vlm_and_mtp_detected():
    f = facts_from_config({"architectures": ["GlmMoeDsaForCausalLM"], "num_nextn_predict_layers": 1,
                           "vision_config": {}, "text_config": {"num_hidden_layers": 3, "hidden_size": 16,
                                                                "num_attention_heads": 2, "vocab_size": 10}})
    assert f.is_vlm and f.has_mtp_head and f.layers == 3 and f.thd_packing
    dense = facts_from_config({"architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": 1, "hidden_size": 8,
                               "num_attention_heads": 1, "vocab_size": 10})
    assert not dense.is_vlm and not dense.has_mtp_head and not dense.native_automodel


def test_resolve_model_prefers_arch_then_local_config(tmp_path):
    assert resolve_model({"path": "anything", "arch": "qwen3-8b"}, None) is MODELS["qwen3-8b"]
    hub = resolve_model({"path": "Qwen/Qwen3-8B", "arch": None}, tmp_path)  # a catalog hub id: its row (issue 30)
    assert hub is not None and hub.key == "qwen3-8b" and "hub id" in hub.source
    assert resolve_model({"path": "someone/Unknown-7B", "arch": None}, tmp_path) is None  # a hub id it does not hold
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["MixtralForCausalLM"], "num_local_experts": 8,
                                               "num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 4,
                                               "vocab_size": 100}))
    f = resolve_model({"path": "m", "arch": None}, tmp_path)
    assert f is not None and f.is_moe and f.experts == 8 and f.source.endswith("config.json")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{not json")
    assert resolve_model({"path": "bad"}, tmp_path) is None


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"max_position_embeddings": 40960}, 40960),
        ({"max_position_embeddings": 4096, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}, 8192),
        ({"max_position_embeddings": 4096, "rope_scaling": {"type": "dynamic", "factor": 4}}, 16384),
        # yarn and llama3: max_position_embeddings is already the scaled length
        ({"max_position_embeddings": 131072, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, 131072),
        ({"max_position_embeddings": 131072, "rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, 131072),
        # one RoPE dict per layer type
        ({"max_position_embeddings": 1024, "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 3},
                                                               "sliding_attention": {"rope_type": "default"}}}, 3072),
        ({"max_position_embeddings": 8192, "n_positions": 2048}, 2048),  # the smallest key
        ({"max_position_embeddings": 8192, "model_max_length": 16384}, 16384),  # model_max_length wins
        ({"text_config": {"max_position_embeddings": 32768}, "vision_config": {}}, 32768),  # a VLM's text model
        ({"model_type": "gemma3", "max_position_embeddings": 131072,
          "rope_scaling": {"rope_type": "linear", "factor": 8.0}}, 131072),  # gemma3's length is already scaled
        ({"hidden_size": 64}, 0),  # no key: unknown, no check
    ],
)
def test_max_positions_follows_vllm(config, expected):
    assert max_positions(config) == expected


def test_the_tokenizer_limit_caps_max_positions(tmp_path):
    config = {"architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": 2, "hidden_size": 64,
              "max_position_embeddings": 40960}
    for name, limit in (("plain", None), ("shorter", 32768), ("longer", 1e30)):  # 1e30: transformers' "no limit"
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
        if limit is not None:
            (tmp_path / name / "tokenizer_config.json").write_text(json.dumps({"model_max_length": limit}))
    assert resolve_model({"path": str(tmp_path / "plain")}, None).max_positions == 40960
    assert resolve_model({"path": str(tmp_path / "shorter")}, None).max_positions == 32768
    assert resolve_model({"path": str(tmp_path / "longer")}, None).max_positions == 40960
