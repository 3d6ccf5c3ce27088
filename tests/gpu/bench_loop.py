"""The whole RL loop against a plain synchronous trainer on the same GPU, in one call (issue 29; not in `just test`).

    source tests/gpu/setup_device.sh .gpuwheels && python3 tests/gpu/bench_loop.py OUT_DIR [--steps N]
        [--checkpoint MODE[,MODE...]] [--samples PROMPTS]      MODE: full, selective or none, then +sync,
                                                               +alternate, +padded, +fixed, +profile

1. ours: `run_loop.py`'s throughput run (`molt-compile recipes/demo_gpu.yaml --submit` on a random Qwen3-1.7B-shaped
   model, the trainer rank and the hf engine colocated, `model.gradient_checkpoint: full`; since 2026-12-05 the
   recipe packs its rows (`actor.packing`, flash_attention_2 through torch's varlen kernel): `full` here is what the
   figures below call `full+packed`, and `+padded` runs the earlier default, padded sdpa rows; `+fixed` sets
   `rollout.min_new_tokens` to the cap, 256: every response full length, as plain's, whatever the random policy
   would end early);
2. plain: the loop a popular peer runs without vLLM (TRL's `GRPOTrainer` with `use_vllm=False`), written out in
   plain PyTorch + transformers so it needs nothing missing on the machine: `model.generate` of the same number of
   rollouts and response tokens (min = max new tokens = our mean response length), then one GRPO optimizer step on
   them (bf16 weights, full activation checkpointing, fused AdamW, the same micro-batch rows), synchronously.
Both count generated tokens per second of a warm step; the ratio is ours / plain, for each `--checkpoint` mode of
ours (one run each, against one plain run); also ours' trainer phase (make_experience + policy_train, the engine
generating beside it) over plain's training time. Writes OUT_DIR/bench_loop.json.
Measured 2026-12-03 on one H200 (ours with compiled layers and full checkpointing, the GPU default; 128 rollouts of
164 tokens on average): ours 7,416 tokens/s (step 2.83 s: generation 1.66 s and training 2.02 s overlapped, weight
sync 0.29 s, no old-log-prob pass) against plain 3,051 (generation 5.10 s + training 1.79 s): 2.43x. Our training
phase per step 1.56-2.38 s (mean 2.02 s, the engine generating beside it on the same GPU) against plain's 1.79 s
alone; the first step compiles (30 s). With `--checkpoint selective` (same day, another plain run: plain varies
+-13 % between runs, 3,457 tokens/s there): ours 8,116 tokens/s, 2.35x; training 1.66 s per step against plain's
1.59 s (the last two steps 1.32 and 1.25 s).
Measured 2026-12-04 on one H200 (`--steps 3 --samples 128 --checkpoint full,none`, 504 s whole call; the post-sync
probe now under the engine lock; 128 rollouts of 168 tokens): plain 2,291 tokens/s (generation 7.28 s + training
2.10 s); ours `full` (the default) 6,329 tokens/s, **2.76x** (step 3.39 s: generation 1.30 s, training 2.47 s, weight
sync 0.36 s of which lock wait 0.25 s, probe 0.48 s, was 1.5 s), trainer phase 2.49 s = **1.18x** plain's training;
ours `none` 6,538 tokens/s, **2.85x**, trainer phase 1.96 s = **0.93x** plain's training. Alone (bench_trainer) ours
`full` + compiled layers is 1.37x plain's speed: in the loop the engine generates the next batch on the same GPU while
the trainer trains (the two processes time-slice the GPU), which is what the trainer phase pays over plain's.
Same day, `full+sync` (train.async.force_sync; another plain run, 3,222 tokens/s): 6,495 tokens/s, 2.02x, trainer
phase 2.62 s = 1.50x plain's 1.74 s: the training is not faster without the next batch's generation beside it (the
generator's in-flight requests keep generating, Molt D12: every other step's batch is ready at once), so the time
slicing is not the gap; our rows are padded to the micro-batch's longest (up to 320 tokens), plain's all have the
mean length. `full+packed` (actor.packing, flash_attention_2 through torch's varlen kernel; plain 3,052 tokens/s):
first died in the first step with "CUDA driver error: misaligned address" (the compiled lm_head chunk's Triton
kernels fed the packed targets `input_ids[0, 1:]`, 8 bytes into their storage: now copied aligned,
runtime/logprobs.py), then ran: 4,566 tokens/s, 1.50x; trainer phase 3.51 s = 2.22x plain's, ~3 s even for a
step of 441 tokens: a per-step cost of the packed path in this loop not found yet (no device time left).
Measured 2026-12-05 on one H200, three calls on machines of unequal speed (the same sdpa step took 2.43 s on one and
3.69 s on another: compare within a call only). `full+packed` (plain 5,441 tokens/s): 7,855 tokens/s, 1.44x; trainer
phase 2.12 s = 1.65x plain's 1.29 s (83 against 50.5 µs per trained token); per step the post-sync probe took
0.62 s: the hf engine's `score` waited behind every generation chunk of the batch in flight (its gate let the
generation thread re-enter first). With the score going first (runtime/engines/hf_engine.py), on another machine:
probe 0.11 s (`full`) and 0.15 s (`full+packed`) a step; `full` 6,874 and `full+packed` 5,851 tokens/s (plain not
reached within the call). `full` again (plain 2,336 tokens/s): 4,386 tokens/s, 1.88x; trainer phase 3.41 s = 1.79x
plain's 1.90 s, median 2.58 s: the random policy's responses fell to 3 tokens in the last three steps, and the first
such step trained for 15.8 s (a recompile at the new shape: tests/gpu/check_compile_shapes.py counts the lm_head
chunk's graphs now).
Same day, a fourth machine, the lm_head chunk compiled with static shapes (runtime/logprobs.py; `--steps 3 --samples
128 --checkpoint full,full+packed`, 481 s whole call; 128 rollouts of 168-170 tokens): plain 2,408 tokens/s
(generation 6.79 s + training 2.14 s); ours `full` 6,391 tokens/s, **2.65x**, trainer phase 2.79 s = 1.30x plain's
training (median 2.62 s; 130 µs a trained token), probe 0.12 s; ours `full+packed` 7,466 tokens/s, **3.10x**, trainer
phase 2.12 s = **0.99x** plain's training (0.98x a trained token), probe 0.17 s. No mid-run stall: after the first
(compiling) step every training step took 1.7-4.8 s.
Measured 2026-12-05 later (one H200, `--checkpoint full,full+padded`, 514 s call with check_compile_shapes; padded
rows of the dense decoder now without their mask, runtime/logprobs.py): plain 2,944 tokens/s (generation 4.84 s +
training 2.07 s); ours `full` (packed) 6,882 tokens/s, 2.34x, trainer phase 2.40 s = 1.16x plain's training (median
2.05 s = 0.99x): one step trained for 8.7 s, a mid-run recompile of the packed layers at the first micro-batch with
a new document count and longest document (the varlen offsets are generic from the first compile since:
runtime/models/hf.py `_PACKED_ROW_SOURCES`); ours `full+padded` 7,412 tokens/s, **2.52x**, trainer phase 1.95 s =
**0.94x** plain's training (1.05x a trained token; was 1.30x with the mask).
Measured 2026-12-05 once more, after the packed offsets went generic (three calls, `--steps 3 --samples 128`):
- one H100, `full` (packed): plain 3,257 tokens/s (generation 4.98 s + training 1.74 s); ours 7,465 tokens/s, 2.29x;
  trainer phase 1.97 s = 1.14x plain's training (median 2.09 s). No mid-run recompile: every step after the first
  trained in 1.2-2.3 s. The last three steps, with no generation left beside them, trained in 1.21, 1.18 and 1.53 s
  (0.68-0.88x plain's); the twelve before, the engine generating the next batches on the same GPU, in 1.85-2.34 s.
- one H200, `full,full+sync` (plain 2,683 tokens/s: generation 4.58 s + training 2.15 s): `full` 6,322 tokens/s,
  2.36x, trainer phase 2.21 s = 1.03x plain's (1.03x a trained token); `full+sync` 7,061 tokens/s, 2.63x, trainer
  phase 2.22 s = 1.03x (0.87x a trained token: its responses were longer, 168 against 141 tokens).
- the same H200, next call, `full+padded` (plain 2,300 tokens/s, training 1.95 s: plain's own spread between two
  calls is 17 %): 6,418 tokens/s, 2.79x, trainer phase 2.41 s = 1.23x plain's. Against the packed call before it on
  the same machine, packed trains in 0.92x the padded time per step.
Measured 2026-12-05 (later) on one H100, two calls on fresh machines, `full` (overlap) against `full+alternate`
(train.async.colocated_gpus alternate: the engine paused through each training step):
- `--checkpoint full,full+alternate` (plain 3,554 tokens/s: generation 4.39 s + training 1.66 s at 168 tokens):
  `full` 6,660 tokens/s, 1.87x, trainer phase 2.32 s = 1.40x plain's; `full+alternate` 5,302 tokens/s, 1.49x,
  trainer phase 1.59 s = 0.96x plain's. The alternate run's random policy fell to 72, 22 and 2-token responses in
  three late steps; over its 12 steps of full-length responses (166 tokens): 5,981 tokens/s (0.90x `full`'s), trainer
  phase 1.63 s (0.98x plain's at its length).
- `--checkpoint full+alternate,full` (plain sized by the first mode's mean, 114 tokens: 2,457 tokens/s, training
  1.82 s): `full+alternate` 4,961 tokens/s, 2.02x, trainer phase 1.56 s = 0.86x plain's (its last five steps had
  1-29 token responses); `full` 6,776 tokens/s, 2.76x, trainer phase 2.22 s = 1.22x (0.83x a trained token: 169
  tokens a response). Over the first 10 steps (167 tokens): alternate 6,465 tokens/s = 0.95x `full`'s, trainer phase
  1.46 s = 0.66x `full`'s.
So sharing the GPU costs the overlapped training step 1.4-1.5x its time alone, and buys 5-10 % more tokens/s.
Measured 2026-12-05 (last) on one H100, fixed-length responses (`+fixed`: `rollout.min_new_tokens` 256, plain at 256
too; `--steps 3 --samples 96`, 12 steps of 128 rollouts x 256 tokens, two calls on one warm machine, 232 and 218 s):
- `--checkpoint full+fixed,full+alternate+fixed`: plain 5,045 tokens/s (generation 4.77 s + training 1.72 s);
  `full+fixed` 10,337 tokens/s, 2.05x, trainer phase 2.26 s = 1.31x plain's; `full+alternate+fixed` 10,898
  tokens/s, **2.16x**, trainer phase 1.20 s = **0.70x**.
- `--checkpoint full+alternate+fixed,full+fixed`: plain 4,880 tokens/s (generation 5.01 s + training 1.70 s);
  `full+alternate+fixed` 11,058 tokens/s, **2.27x**, trainer phase 1.15 s = **0.68x**; `full+fixed` 10,343 tokens/s,
  2.12x, trainer phase 2.27 s = 1.33x.
With no length drift, the two calls agree within 3.4 % on plain and 1.5 % on ours (plain varied 2,291-5,441 tokens/s
across the variable-length calls above). At full length `alternate` is the faster mode (1.05-1.07x `overlap`'s
tokens/s); `overlap`'s training steps took 2.2-2.5 s beside the engine's generation, 1.22 s in the last two steps
with none left. Where an `alternate` step (2.96-3.01 s) goes: waiting for the batch 0.15-0.61 s and for the engine
lock 0.53-1.00 s (the generator finishing the batch: generation 2.1-2.6 s a batch, 2.0-2.3x plain's `generate`),
experience 0.02-0.03 s, training 1.14-1.17 s, sync 0.05 s, probe 0.17 s, the rest (0.4 s) logging and queue hand-offs.
`overlap` (3.17 s): training 2.21 s, sync 0.50-0.55 s (0.42-0.46 s of it waiting for the engine lock), probe 0.13 s.
Measured 2026-12-06 on one H100 (a slower machine: plain's generation took 6.8-7.0 s here, 4.8-5.0 s above), one call
of 538 s: `--steps 3 --samples 96 --checkpoint full+alternate+fixed,none+alternate+fixed` with the hf engine's chunks
ending within two decode steps when a pause or a score waits (runtime/engines/hf_decode.py), then the engine before
that change (`full+alternate+fixed` again, its own plain run):
- plain 3,699 tokens/s (generation 7.01 s + training 1.85 s); `full+alternate+fixed` 9,019 tokens/s, **2.44x**,
  trainer phase 1.60 s = 0.86x plain's; `none+alternate+fixed` (demo_gpu's own `gradient_checkpoint: none`, from
  demo_math) 9,928 tokens/s, **2.68x**, trainer phase 1.48 s = 0.80x.
- the engine before: plain 3,791 tokens/s (6.80 s + 1.84 s); `full+alternate+fixed` 8,206 tokens/s, 2.16x, trainer
  phase 2.00 s = 1.08x (its training steps drifted from 1.49 to 2.60 s with the engine paused, the last two with
  nothing else running: the machine slowed during that run, so part of the gap is the machine).
- what the change does, per step: the turn's engine pause 0.072 -> 0.013-0.015 s, the probe 0.21 -> 0.10-0.13 s.
  Left unexplained: 0.33-0.35 s a step outside every timed phase (`untimed_s`: 0.02 s in the steps with no generation
  left), which the driver spends between phases while the engine generates.
Measured 2026-12-06 later, two H100s, one call each, `--samples 96 --checkpoint
full+fixed,full+alternate+fixed,none+alternate+fixed+profile` (`+profile`: the driver under cProfile,
tests/gpu/driver_profile):
- first machine: plain 4,368 tokens/s (generation 5.78 s + training 1.73 s); `full+fixed` (overlap) 2.44x, trainer
  phase 1.31x plain's; `full+alternate+fixed` 2.51x, 0.71x; `none+alternate+fixed` 2.64x, 0.63x; untimed 0.35-0.38 s.
  The profile: the step's bookkeeping (`partial_rollout_metrics` 0.28 s a step, `batch_metrics` 0.07 s) ran torch's
  CPU ops in parallel regions of 7-13 ms each (`masked_fill`, `any`, `sum`, `unique`: 40k elements) beside the busy
  engine and trainer rank.
- the driver on one thread since (runtime/__main__.py), second machine: plain 3,090 tokens/s (generation 8.74 s +
  training 1.86 s: this machine's host was slower; ours' generation too); `full+fixed` 11,473 tokens/s, 3.71x,
  trainer phase 2.34 s = 1.26x plain's; `full+alternate+fixed` 9,663 tokens/s, 3.13x, 1.59 s = 0.85x;
  `none+alternate+fixed` 10,622 tokens/s, 3.44x, 1.43 s = 0.77x; untimed 0.018-0.025 s a step in all three.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "gpu"))


def plain_loop(model_dir: Path, rows: int, prompt_len: int, new_tokens: int, micro_rows: int, steps: int) -> dict:
    """Seconds per synchronous step (generation, then training) of the plain loop; the first step is a warm-up."""
    import torch
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation="sdpa").cuda()
    model.gradient_checkpointing_enable()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    gen_s, train_s = [], []
    for _ in range(steps + 1):
        prompts = torch.randint(5, vocab - 1, (rows, prompt_len), generator=g).cuda()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.eval()
        with torch.no_grad():
            seqs = model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=True,
                                  max_new_tokens=new_tokens, min_new_tokens=new_tokens, top_k=0, top_p=1.0)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        model.train()
        adv = torch.randn(rows, device="cuda")
        for s in range(0, rows, micro_rows):
            x = seqs[s:s + micro_rows]
            logits = model(input_ids=x, use_cache=False).logits[:, prompt_len - 1:-1].float()
            lp = torch.gather(logits.log_softmax(-1), -1, x[:, prompt_len:, None]).squeeze(-1)
            ratio = torch.exp(lp - lp.detach())
            loss = -(ratio * adv[s:s + micro_rows, None]).sum() / (rows * new_tokens)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        gen_s.append(t1 - t0)
        train_s.append(time.perf_counter() - t1)
    gen, train = sum(gen_s[1:]) / steps, sum(train_s[1:]) / steps
    return {"generation_s": gen, "train_s": train, "step_s": gen + train,
            "tokens_per_s": rows * new_tokens / (gen + train), "rows": rows, "new_tokens": new_tokens,
            "prompt_len": prompt_len}


def main() -> int:
    import run_loop

    out = Path(sys.argv[1]).resolve()
    out.mkdir(parents=True, exist_ok=True)
    args = sys.argv[2:]
    steps = int(args[args.index("--steps") + 1]) if "--steps" in args else 2
    # ours: one run per mode (`full,none`: both in this call, against one plain run; `full+sync`: with
    # train.async.force_sync; `full+alternate`: with it and train.async.colocated_gpus alternate, the engine paused
    # through each training step; `full+padded`: padded sdpa rows, the recipe's layout before it packed); plain: full
    # checkpointing
    modes = (args[args.index("--checkpoint") + 1] if "--checkpoint" in args else "full").split(",")
    samples = int(args[args.index("--samples") + 1]) if "--samples" in args else 48  # prompts: ours runs samples/8 steps
    report: dict = {}
    big = Path(tempfile.gettempdir()) / "molt_gpu_loop_1p7b"
    if not (big / "config.json").exists():
        run_loop._big_model(big)
    for mode in modes:
        throughput = [f"model.path={big}", f"data.max_samples={samples}", "data.max_len=320",
                      "rollout.max_new_tokens=256", "eval.at_start=false", "eval.every=-1", "ckpt.every=-1",
                      "ckpt.final_save=false", "train.micro_batch_size=16",
                      f"model.gradient_checkpoint={mode.split('+')[0]}"]
        if "+sync" in mode:  # on-policy: the next batch waits for this step's training and weight sync
            throughput.append("train.async.force_sync=true")
        if "+alternate" in mode:  # the step has the GPU alone: the engine paused from experience through sync
            throughput += ["train.async.force_sync=true", "train.async.colocated_gpus=alternate"]
        if "+padded" in mode:  # rows padded to their micro-batch's longest, sdpa (the recipe packs otherwise)
            throughput += ["actor.packing=false", "model.attn=sdpa"]
        if "+fixed" in mode:  # every response 256 tokens: the random policy's lengths no longer drift (or collapse)
            throughput += ["rollout.min_new_tokens=256", "ignore.SAMP002=fixed-length responses for a stable tokens/s"]
        tag = mode.replace("+", "-")
        env = None  # `+profile`: the driver under cProfile (tests/gpu/driver_profile): where untimed_s goes
        if "+profile" in mode:
            path = os.pathsep.join(p for p in (str(ROOT / "tests/gpu/driver_profile"), os.environ.get("PYTHONPATH")) if p)
            env = {**os.environ, "MOLT_PROFILE_DRIVER": str(out / f"profile_{tag}"), "PYTHONPATH": path}
        ours = run_loop._run(f"ours_{tag}", out, throughput, 540, env)
        ours.pop("log_tail", None) if ours.get("rc") == 0 else None
        report[f"ours_{mode}"] = ours
        rows_file = out / f"ours_{tag}.metrics.jsonl"
        if ours.get("rc") != 0 or not rows_file.exists():
            print(json.dumps(report, indent=1, default=str))
            return 1
        steps_rows = [json.loads(x) for x in rows_file.read_text().splitlines() if x.strip()]
        steps_rows = [r for r in steps_rows if "timing/step_total" in r]
        warm = steps_rows[1:] if len(steps_rows) > 1 else steps_rows
        mean = lambda k, rows=warm: sum(r.get(k, 0.0) for r in rows) / len(rows)  # noqa: E731
        ours["rollouts"] = int(round(mean("rollout/num_rollouts")))
        ours["response_tokens"] = int(round(mean("rollout/response_length_mean")))
        ours["prompt_tokens"] = int(round(mean("rollout/prompt_length_mean"))) if "rollout/prompt_length_mean" in \
            warm[0] else 64
        ours["tokens_per_s"] = ours["rollouts"] * mean("rollout/response_length_mean") / mean("timing/step_total")
        ours["trainer_phase_s"] = mean("timing/make_experience") + mean("timing/policy_train")
        ours["generation_s"] = mean("timing/generation")
        ours["engine_lock_wait_s"] = mean("timing/engine_lock_wait")  # alternate: waiting on generation
        ours["weight_sync_total_s"] = mean("timing/weight_sync_total")
        ours["engine_pause_s"] = mean("timing/engine_pause")  # alternate: the engines finishing their queued steps
        ours["probe_s"] = mean("timing/probe")
        timed = ("actor_idle_wait", "engine_lock_wait", "engine_pause", "make_experience", "policy_train",
                 "weight_sync_total", "probe", "ckpt")
        ours["untimed_s"] = mean("timing/step_total") - sum(mean(f"timing/{k}") for k in timed)
        # per trained token as well: the random policy's response lengths drift between steps (to 3 tokens in the
        # last steps of one run), while plain trains every step at ours' mean length
        phases = sorted(r["timing/make_experience"] + r["timing/policy_train"] for r in warm)
        ours["trainer_phase_median_s"] = phases[len(phases) // 2]
        ours["trainer_phase_us_per_token"] = 1e6 * sum(phases) / sum(r.get("train/tokens", 0.0) for r in warm)
    first = report[f"ours_{modes[0]}"]
    report["plain"] = plain = plain_loop(big, first["rollouts"], first["prompt_tokens"], first["response_tokens"], 16,
                                         steps)
    for mode in modes:
        ours = report[f"ours_{mode}"]
        report[f"ratio_tokens_per_s_{mode}"] = ours["tokens_per_s"] / plain["tokens_per_s"]
        report[f"ratio_trainer_phase_to_plain_train_{mode}"] = ours["trainer_phase_s"] / plain["train_s"]
        report[f"ratio_trainer_phase_per_token_to_plain_{mode}"] = ours["trainer_phase_us_per_token"] / (
            1e6 * plain["train_s"] / (plain["rows"] * plain["new_tokens"]))
    text = json.dumps(report, indent=1, default=str)
    print(text)
    (out / "bench_loop.json").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
