"""The offline tiny Qwen3 + byte-level BPE tokenizer: reloadable with the Auto classes, lossless, deterministic."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from runtime.tiny_model import SPECIAL_TOKENS, build_tiny_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


def test_reloads_offline_with_auto_classes(tiny_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    assert model.config.model_type == "qwen3"
    assert model.dtype == torch.float32
    n_params = sum(p.numel() for p in model.parameters())
    assert 200_000 < n_params < 1_000_000, n_params
    assert model.config.vocab_size == len(tok)
    assert tok.eos_token == "<|im_end|>" and model.generation_config.eos_token_id == tok.eos_token_id
    ids = tok("The answer is 42", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=5, do_sample=False)
    assert out.shape == (1, ids.shape[1] + 5) or out[0, -1].item() == tok.eos_token_id


@pytest.mark.parametrize(
    "text",
    ["plain ascii, digits 0123456789 and \\boxed{7}", "héllo wörld — ünïcödé 世界 🤖🚀", "  leading\tand\ntrailing  \n", ""],
)
def test_unicode_round_trip_is_lossless(tiny_dir, text):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert all(0 <= i < len(tok) for i in ids)


def test_special_tokens_are_single_ids(tiny_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    for i, special in enumerate(SPECIAL_TOKENS):
        assert tok.encode(special) == [i]


def test_chat_template(tiny_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    without = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert not without.endswith("assistant\n")
    ids = tok.encode(text)
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 3
    assert ids.count(tok.eos_token_id) == 2


def test_same_seed_same_files_other_seed_other_weights(tmp_path, tiny_dir):
    again = build_tiny_model(tmp_path / "again", seed=0)
    names = sorted(p.name for p in tiny_dir.iterdir())
    assert names == sorted(p.name for p in again.iterdir())
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(names)
    for name in names:
        assert (tiny_dir / name).read_bytes() == (again / name).read_bytes(), name
    other = build_tiny_model(tmp_path / "other", seed=1)
    assert (other / "model.safetensors").read_bytes() != (tiny_dir / "model.safetensors").read_bytes()


def test_custom_corpus_changes_merges(tmp_path, tiny_dir):
    from transformers import AutoTokenizer

    corpus = ["zyxwv zyxwv zyxwv qqq"] * 50
    custom = build_tiny_model(tmp_path / "custom", corpus=corpus, vocab_size=300)
    tok = AutoTokenizer.from_pretrained(custom)
    assert len(tok.encode("zyxwv")) == 1  # learned from the corpus
    assert len(tok.encode("zyxwv")) < len(AutoTokenizer.from_pretrained(tiny_dir).encode("zyxwv"))
    assert tok.decode(tok.encode("unseen ü text")) == "unseen ü text"


def test_cli(tmp_path):
    out = tmp_path / "cli"
    proc = subprocess.run([sys.executable, "-m", "runtime.tiny_model", str(out)], capture_output=True, text=True,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert str(out) in proc.stdout and "params" in proc.stdout
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
