"""Engine benchmark on the tiny model: init time, batch generate throughput, weight-update time, probe logprob error.

    python -m tests.bench_engines [--kinds vllm,hf] [--batch 16] [--tokens 64] [--repeats 3]

Each engine runs in a Ray actor on an in-process local Ray cluster, as in a run. Throughput is generated tokens per
second for `batch` concurrent requests of `tokens` tokens each (sampling at temperature 1, `ignore_eos`-like: the
tiny random model rarely emits EOS; the token count actually generated is what is reported). The first batch is a
warm-up and is not timed. Prints one JSON line per engine kind.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time


def bench_kind(kind: str, model_dir: str, batch: int, tokens: int, repeats: int) -> dict:
    import ray
    import torch
    from transformers import AutoModelForCausalLM

    from runtime.engines import start_engines
    from runtime.engines.local import cpu_engine_role, cpu_engines_plan

    t0 = time.perf_counter()
    [engine] = start_engines(cpu_engines_plan(kind, max_model_len=512), cpu_engine_role(kind), model_dir)
    start_s = time.perf_counter() - t0
    init_s = ray.get(engine.init_seconds.remote())

    def run_batch() -> tuple[int, float]:
        t = time.perf_counter()
        outs = ray.get([engine.generate.remote([5, 6, 7, 8 + i], max_tokens=tokens, temperature=1.0, top_p=1.0,
                                               session_id=f"b{i}", logprobs=True) for i in range(batch)])
        return sum(len(o.token_ids) for o in outs), time.perf_counter() - t

    run_batch()  # warm-up
    runs = [run_batch() for _ in range(repeats)]
    tps = [n / s for n, s in runs]

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    gen = torch.Generator().manual_seed(0)
    state = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in model.state_dict().items()
             if k != "lm_head.weight"}
    model.load_state_dict({**state, "lm_head.weight": state["model.embed_tokens.weight"]})
    from tests.runtime.state_dict_sender import StateDictSender

    sender = StateDictSender([engine], {k: tuple(v.shape) for k, v in state.items()}, "float32", 64 << 20)
    update_s = []
    for v in range(1, repeats + 1):
        t = time.perf_counter()
        sender.push(state, v)
        update_s.append(time.perf_counter() - t)
    probe = [5, 6, 7] + list(range(100, 161))
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([probe])).logits[0, :-1]
    trainer_lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(probe[1:]).unsqueeze(-1)).squeeze(-1)
    engine_lp = torch.tensor(ray.get(engine.score.remote(probe)))
    ray.get(engine.shutdown.remote())
    ray.kill(engine)
    return {
        "engine": kind, "start_engines_s": round(start_s, 2), "engine_init_s": round(init_s, 2),
        "batch": batch, "max_tokens": tokens, "tokens_per_batch": [n for n, _ in runs],
        "batch_s": [round(s, 3) for _, s in runs], "tokens_per_s_median": round(statistics.median(tps), 1),
        "update_weights_s_median": round(statistics.median(update_s), 4),
        "probe_max_abs_logprob_diff": float((engine_lp - trainer_lp).abs().max()),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.bench_engines", description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", default="vllm,hf")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import ray

    from runtime.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(build_tiny_model(os.path.join(tmp, "tiny")))
        ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1"}})
        try:
            for kind in args.kinds.split(","):
                print(json.dumps(bench_kind(kind, model_dir, args.batch, args.tokens, args.repeats)), flush=True)
        finally:
            ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
