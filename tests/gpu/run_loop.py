"""The whole RL loop on one GPU under Ray (issue 18; not part of `just test`).

    source tests/gpu/setup_device.sh .gpuwheels && python3 tests/gpu/run_loop.py OUT_DIR [--steps N] [--runs A,B]

1. `molt-compile recipes/demo_gpu.yaml --submit` exactly as a user runs it (local Ray cluster through the `ray` CLI,
   the trainer rank and the hf engine colocated on the GPU, CUDA IPC weight sync): the demo task, reward rising.
2. A throughput run of the same recipe on a random Qwen3-1.7B-shaped model (the demo's tokenizer, so its small
   vocabulary: ~1.4 B parameters), longer generations, a few steps: the step time split into generation, trainer,
   weight sync and idle waits, and the overlap efficiency max(generation, train + sync) / step time.
3. The same throughput run with compiled decoder layers and no activation checkpointing (`model.compile_layers`).
4. `moe`: the demo on the MoE demo's tiny Qwen3-MoE (recipes/demo_moe.yaml's settings) on the automodel backend:
   nemo-automodel's own Qwen3-MoE in the trainer (bf16 compute, fp32 frozen gates), routing replay from the hf
   engine (CUDA graphs), the aux losses; router agreement and the sync's log-prob check reported.
5. `moe-hf`: the same on the hf backend (transformers' Qwen3-MoE in the trainer): the baseline of `moe`.
`--runs` picks some of demo, throughput, throughput-compiled, moe, moe-hf (default: all).
Writes OUT_DIR/run_loop.json (and copies each run's metrics.jsonl there) and prints the summary.
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RECIPE = "recipes/demo_gpu.yaml"


def _compile_cmd(*sets: str) -> list[str]:
    cmd = [sys.executable, "-c", "import sys; from molt_compile.cli import main; sys.exit(main())", RECIPE]
    for s in sets:
        cmd += ["--set", s]
    return cmd


def _run(name: str, out: Path, sets: list[str], timeout_s: float, env: dict[str, str] | None = None) -> dict:
    t0 = time.perf_counter()
    proc = subprocess.run([*_compile_cmd(*sets), "--submit"], cwd=ROOT, capture_output=True, text=True, env=env,
                          timeout=timeout_s)
    wall = time.perf_counter() - t0
    (out / f"{name}.log").write_text(proc.stdout + proc.stderr)
    metrics_files = sorted(ROOT.glob("runs/**/metrics.jsonl"), key=lambda p: p.stat().st_mtime)
    result: dict = {"rc": proc.returncode, "wall_s": wall, "log_tail": (proc.stdout + proc.stderr)[-3000:]}
    if not metrics_files:
        return result
    mfile = metrics_files[-1]
    shutil.copy(mfile, out / f"{name}.metrics.jsonl")
    rows = [json.loads(line) for line in mfile.read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "timing/step_total" in r]
    evals = [r for r in rows if any(k.startswith("eval/") for k in r)]
    result["metrics_file"] = str(mfile)
    result["steps"] = len(steps)
    if steps:
        def mean(key: str, rs=steps) -> float | None:
            vals = [r[key] for r in rs if key in r]
            return statistics.mean(vals) if vals else None

        head, tail = steps[: max(1, len(steps) // 10)], steps[-max(1, len(steps) // 10):]
        result["reward_first"] = mean("rollout/reward_mean", head)
        result["reward_last"] = mean("rollout/reward_mean", tail)
        warm = steps[1:] if len(steps) > 2 else steps
        split = {k: mean(k, warm) for k in ("timing/step_total", "timing/generation", "timing/policy_train",
                                             "timing/make_experience", "timing/weight_sync_total",
                                             "timing/vllm_idle_wait", "timing/actor_idle_wait",
                                             "timing/weight_sync_lock_wait", "timing/probe",
                                             "timing/weight_sync", "timing/weight_sync_gather",
                                             "timing/weight_sync_transfer", "timing/weight_sync_load")}
        result["timing_mean_warm"] = split
        result["policy_train_per_step"] = [r.get("timing/policy_train") for r in steps]
        result["step_total_per_step"] = [r.get("timing/step_total") for r in steps]
        result["router_agreement_mean"] = mean("train/moe/router_agreement")
        diffs = [r["weight_sync/logprob_diff_max"] for r in steps if "weight_sync/logprob_diff_max" in r]
        result["weight_sync_logprob_diff_max"] = max(diffs) if diffs else None
        gen, train = split["timing/generation"], split["timing/policy_train"]
        sync, total = split["timing/weight_sync_total"], split["timing/step_total"]
        if None not in (gen, train, total) and total:
            result["overlap_efficiency"] = max(gen, train + (sync or 0.0)) / total
        tokens = mean("rollout/response_length_mean", warm)
        samples = mean("rollout/num_rollouts", warm)
        if tokens and samples and gen:
            result["generated_tokens_per_s"] = tokens * samples / gen
    if evals:
        result["eval_pass1_first"], result["eval_pass1_last"] = evals[0].get("eval/pass1"), evals[-1].get("eval/pass1")
    return result


def _big_model(dest: Path) -> None:
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    tok = AutoTokenizer.from_pretrained(ROOT / "recipes/data/demo_math/model")
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                      num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=4096,
                      tie_word_embeddings=True, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      bos_token_id=tok.bos_token_id)
    torch.manual_seed(0)
    Qwen3ForCausalLM(cfg).save_pretrained(dest)
    tok.save_pretrained(dest)
    gen = ROOT / "recipes/data/demo_math/model/generation_config.json"
    if gen.exists():
        shutil.copy(gen, dest / "generation_config.json")


def main() -> int:
    out = Path(sys.argv[1]).resolve()
    out.mkdir(parents=True, exist_ok=True)
    args = sys.argv[2:]
    steps = int(args[args.index("--steps") + 1]) if "--steps" in args else 60
    runs = args[args.index("--runs") + 1].split(",") if "--runs" in args else \
        ["demo", "throughput", "throughput-compiled", "moe", "moe-hf"]
    report: dict = {}
    if "demo" in runs:
        report["demo"] = _run("demo", out, [f"data.max_samples={steps * 8}"], 900)
    moe = [f"data.max_samples={steps * 8}", f"model.path={ROOT / 'recipes/data/demo_moe/model'}",
           "model.router_dtype=fp32", "actor.freeze.moe_router=true", "actor.loss.aux_loss_coef=0.001",
           "actor.loss.router_z_loss_coef=0.0001", "train.routing_replay=true",
           # padded sdpa rows: nemo-automodel's Qwen3-MoE packs only with te or tilelang (PACK002), and moe-hf is
           # its baseline in the same layout
           "actor.packing=false", "model.attn=sdpa"]
    if "moe" in runs:
        report["moe"] = _run("moe", out, [
            *moe, "model.backend=automodel", "model.moe_dispatcher=torch", "name=gpu-demo-moe",
            'ignore.MOE001="one GPU: nemo-automodel runs its MoE layers at ep 1"'], 900)
    if "moe-hf" in runs:
        report["moe-hf"] = _run("moe-hf", out, [
            *moe, "model.backend=hf", "name=gpu-demo-moe-hf",
            'ignore.MOE005="one GPU: no expert parallelism to lose"'], 900)
    big = Path(tempfile.gettempdir()) / "molt_gpu_loop_1p7b"
    if not (big / "config.json").exists():
        _big_model(big)
    throughput = [f"model.path={big}", "data.max_samples=48", "data.max_len=320", "rollout.max_new_tokens=256",
                  "eval.at_start=false", "eval.every=-1", "ckpt.every=-1", "ckpt.final_save=false",
                  "train.micro_batch_size=16"]
    if "throughput" in runs:
        report["throughput"] = _run("throughput", out, [*throughput, "model.gradient_checkpoint=full",
                                                       "model.compile_layers=false"], 900)
    if "throughput-compiled" in runs:
        report["throughput-compiled"] = _run("throughput-compiled", out, [
            *throughput, "model.gradient_checkpoint=none", "model.compile_layers=true"], 900)
    text = json.dumps(report, indent=1, default=str)
    print(text)
    (out / "run_loop.json").write_text(text)
    return 0 if all(r.get("rc") == 0 for r in report.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
