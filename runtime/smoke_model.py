"""Build the randomly initialised, shrunk model of a smoke run (`molt-compile RECIPE --smoke`), offline, in seconds.

    python -m runtime.smoke_model SPEC.json OUT_DIR

The compiler (which never imports torch or transformers) writes SPEC.json: the architecture to build, the shrunk
config fields, and where the recipe's tokenizer is (`tokenizer`: a local directory, or null). This process loads
that tokenizer (else trains the offline byte-level one of `runtime.tiny_model`), sizes the vocabulary from it,
initialises the model from a fixed seed and saves both to OUT_DIR (written to a temporary sibling, then renamed, so
a cached directory is always complete). Same SPEC -> byte-identical files. A VLM the compiler names a tiny builder
for (`tiny_vlm`: runtime/tiny_vlm.py) is that builder's model, vision tower, tokenizer and processor.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path


def build(spec: dict, out_dir: Path) -> Path:
    if spec.get("tiny_vlm"):
        return _build_tiny_vlm(spec, out_dir)
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from runtime.tiny_model import CHAT_TEMPLATE, build_tokenizer, default_corpus

    if spec.get("tokenizer"):
        tokenizer = AutoTokenizer.from_pretrained(spec["tokenizer"])
    else:
        tokenizer = build_tokenizer(default_corpus(spec["seed"]), vocab_size=spec["vocab_size"])
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = CHAT_TEMPLATE
    special = {k: getattr(tokenizer, f"{k}_id", None) for k in ("eos_token", "pad_token", "bos_token")}
    pad = special["pad_token"] if special["pad_token"] is not None else special["eos_token"]
    fields = dict(spec["config"], vocab_size=len(tokenizer), eos_token_id=special["eos_token"], pad_token_id=pad,
                  bos_token_id=special["bos_token"] if special["bos_token"] is not None else special["eos_token"],
                  architectures=[spec["architecture"]])
    config = AutoConfig.for_model(spec["model_type"], **fields)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec["seed"])
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = special["eos_token"]
    model.generation_config.pad_token_id = pad
    tmp = _fresh(out_dir)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    return _publish(spec, tmp, out_dir)


def _build_tiny_vlm(spec: dict, out_dir: Path) -> Path:
    """A VLM with a tiny builder (`spec["tiny_vlm"]`, a function of runtime/tiny_vlm.py): vision tower, processor
    and tokenizer of its own."""
    from runtime import tiny_vlm

    builders = {"tiny_moe_vlm": tiny_vlm.build_tiny_moe_vlm, "tiny_omni": tiny_vlm.build_tiny_omni}
    tmp = _fresh(out_dir)
    builders[spec["tiny_vlm"]](tmp, seed=spec["seed"], **spec["options"])
    return _publish(spec, tmp, out_dir)


def _fresh(out_dir: Path) -> Path:
    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    return tmp


def _publish(spec: dict, tmp: Path, out_dir: Path) -> Path:
    """`tmp` (complete) becomes `out_dir`, with the spec it was built from."""
    (tmp / "smoke_spec.json").write_text(json.dumps(spec, indent=1, sort_keys=True) + "\n")
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    spec = json.loads(Path(args[0]).read_text())
    out = build(spec, Path(args[1]))
    n = sum(p.numel() for p in __import__("safetensors.torch", fromlist=["load_file"])
            .load_file(str(out / "model.safetensors")).values())
    print(f"smoke model {spec['architecture']} ({n / 1e6:.2f} M parameters) written to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
