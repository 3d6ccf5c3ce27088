"""SFT end to end: the demo plan under a real 2-rank torchrun on CPU (FSDP2 over gloo), then a resume.

One run of 32 optimizer steps (1 epoch, checkpoints at 15 and 30, keep 1), then the same plan with
`ckpt.resume: true`, which must continue at step 31 with the restored weights, optimizer and scheduler: its
step-31 loss and LR equal the first run's. And SIGTERM mid-run: a clean stop with a checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from loop_support import ROOT, compile_plan, read_metrics

pytestmark = pytest.mark.slow
NAME = "test-sft-torchrun"
CKPT = ROOT / "ckpt" / NAME
SETS = (f"name={NAME}", "train.max_epochs=1", "ckpt.every=15", "ckpt.keep=1",
        f"ckpt.dir={CKPT / 'state'}", f"ckpt.hf_dir={CKPT / 'hf'}",   # absolute: --set paths follow the cwd
        "logging.wandb={project: molt-test-sft}")


def torchrun_argv(plan, plan_file: Path) -> list[str]:
    from runtime.trainer import free_port

    plan_file.write_text(plan.to_json())
    argv = [a.replace("{node_rank}", "0").replace("{master_addr}", "127.0.0.1").replace("{plan_file}", str(plan_file))
            for a in plan.sft.command]
    argv[argv.index("--master-port") + 1] = str(free_port())   # parallel test runs must not share the port
    assert argv[0] == "torchrun"
    argv[:1] = [sys.executable, "-m", "torch.distributed.run"]
    return argv


ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}


def torchrun(plan, plan_file: Path) -> subprocess.CompletedProcess:
    return subprocess.run(torchrun_argv(plan, plan_file), cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=420)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    for d in (ROOT / "runs" / NAME, CKPT):
        shutil.rmtree(d, ignore_errors=True)
    tmp = tmp_path_factory.mktemp("sft")
    plan = compile_plan("recipes/demo_sft.yaml", *SETS)
    first = torchrun(plan, tmp / "first.plan.json")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    metrics_first = read_metrics(ROOT / plan.sft.logging.out_dir / "metrics.jsonl")
    resumed_plan = compile_plan("recipes/demo_sft.yaml", *SETS, "ckpt.resume=true")
    second = torchrun(resumed_plan, tmp / "second.plan.json")
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    yield plan, first, metrics_first, second, read_metrics(ROOT / plan.sft.logging.out_dir / "metrics.jsonl")
    for d in (ROOT / "runs" / NAME, CKPT):
        shutil.rmtree(d, ignore_errors=True)


def test_two_rank_run_learns_and_reports(runs) -> None:
    plan, first, metrics, _, _ = runs
    assert plan.sft.trainer.world == 2 and plan.sft.trainer.grad_accum == 2
    train = [r for r in metrics if "train/loss" in r]
    assert [r["step"] for r in train] == list(range(1, 33))
    start = sum(r["train/loss"] for r in train[:3]) / 3
    end = sum(r["train/loss"] for r in train[-5:]) / 5
    assert end < 0.5 * start, (start, end)
    assert train[-1]["eval/loss"] < start
    assert "sft finished at step 32" in first.stdout
    assert "dropped {'no_reply': 8}" in first.stdout
    assert (ROOT / plan.sft.logging.out_dir / "loss.png").stat().st_size > 10_000
    saves = sorted(p.name for p in (ROOT / plan.sft.ckpt.dir).glob("step_*"))
    assert saves == ["step_000030"]   # keep 1: step 15 was pruned


def test_hf_export_loads_and_reproduces_the_logged_eval_loss(runs) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from runtime.sft_data import collate, load_examples, reply_logprobs

    plan, _, metrics, _, _ = runs
    hf = ROOT / plan.sft.ckpt.hf_dir
    tok = AutoTokenizer.from_pretrained(hf)
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    d = plan.sft.data
    evals = load_examples([str(ROOT / plan.sft.eval_dataset)], tok, input_key=d.input_key, output_key=d.output_key,
                          max_len=d.max_len, max_samples=d.max_samples, last_turn_only=d.train_on_last_turn_only,
                          split=plan.sft.eval_split)
    ids, attn, mask = collate(evals.examples, tok.pad_token_id)
    with torch.no_grad():
        nll = float(-(reply_logprobs(model, ids, attn) * mask[:, 1:]).sum() / mask[:, 1:].sum())
    logged = [r for r in metrics if "eval/loss" in r][-1]["eval/loss"]
    assert nll == pytest.approx(logged, rel=1e-4)


def test_resume_continues_the_step_count_from_the_dcp_checkpoint(runs) -> None:
    _, _, metrics_first, second, metrics_all = runs
    assert f"resumed from {CKPT / 'state' / 'step_000030'} at step 30" in second.stdout
    assert "sft finished at step 32" in second.stdout
    resumed = metrics_all[len(metrics_first):]
    assert [r["step"] for r in resumed] == [31, 32]
    by_step = {r["step"]: r for r in metrics_first}
    for r in resumed:   # same weights, optimizer moments, LR schedule and data order as the uninterrupted run
        assert r["train/lr"] == pytest.approx(by_step[r["step"]]["train/lr"], rel=1e-9)
        assert r["train/loss"] == pytest.approx(by_step[r["step"]]["train/loss"], rel=1e-4)


def test_sigterm_stops_after_the_step_with_a_checkpoint(tmp_path: Path) -> None:
    """SIGTERM to torchrun (it forwards it to the ranks): both ranks stop after the same step, save it, report."""
    name = "test-sft-sigterm"
    ckpt = ROOT / "ckpt" / name
    for d in (ROOT / "runs" / name, ckpt):
        shutil.rmtree(d, ignore_errors=True)
    plan = compile_plan("recipes/demo_sft.yaml", f"name={name}", "ckpt.every=1000", f"ckpt.dir={ckpt / 'state'}",
                        f"ckpt.hf_dir={ckpt / 'hf'}")
    metrics = ROOT / plan.sft.logging.out_dir / "metrics.jsonl"
    proc = subprocess.Popen(torchrun_argv(plan, tmp_path / "p.json"), cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        while not (metrics.is_file() and len(read_metrics(metrics)) >= 3):
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended or stalled before step 3"
            time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
        last = read_metrics(metrics)[-1]["step"]
        assert 3 <= last < plan.sft.schedule.total_steps
        assert f"sft stopped at step {last}:" in out
        saved = ckpt / "state" / f"step_{last:06d}"
        assert json.loads((saved / "trainer_state.json").read_text())["step"] == last
        assert not (ckpt / "hf").exists()    # a stopped run is resumed, not exported
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for d in (ROOT / "runs" / name, ckpt):
            shutil.rmtree(d, ignore_errors=True)


def test_cli_submit_runs_the_sft_demo_locally_without_the_venv_on_path() -> None:
    """`molt-compile recipes/demo_sft.yaml --submit` with no address: torchrun with the plan's nproc, this
    interpreter's torch (PATH lacks the venv, as when molt-compile is called by its full path)."""
    name = "test-sft-submit"
    ckpt = ROOT / "ckpt" / name
    for d in (ROOT / "runs" / name, ckpt):
        shutil.rmtree(d, ignore_errors=True)
    env = {**ENV, "PATH": "/usr/bin:/bin"}
    env.pop("RAY_ADDRESS", None)
    try:
        run = subprocess.run([str(Path(sys.executable).parent / "molt-compile"), "recipes/demo_sft.yaml",
                              "--set", f"name={name}", "--set", "train.max_epochs=1", "--set", "ckpt.every=-1",
                              "--set", f"ckpt.dir={ckpt / 'state'}", "--set", f"ckpt.hf_dir={ckpt / 'hf'}",
                              "--submit"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=420)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        assert "torch.distributed.run --nnodes 1 --nproc-per-node 2" in run.stdout + run.stderr
        assert "sft finished at step 32" in run.stdout
        assert (ckpt / "hf" / "config.json").is_file()
    finally:
        for d in (ROOT / "runs" / name, ckpt):
            shutil.rmtree(d, ignore_errors=True)


def test_rank_zero_logs_to_wandb_and_the_resume_continues_the_run(runs) -> None:
    from wandb_files import read_run

    plan, _, _, _, metrics = runs
    run_dirs = sorted(p for p in (ROOT / plan.sft.logging.out_dir / "wandb").glob("offline-run-*") if p.is_dir())
    assert len(run_dirs) == 2   # rank 0 only, once per torchrun
    first, resumed = (read_run(p) for p in run_dirs)
    assert (first["project"], first["name"]) == ("molt-test-sft", NAME) and resumed["id"] == first["id"]
    logged = {h["_step"]: h["train/loss"] for r in (first, resumed) for h in r["history"] if "train/loss" in h}
    assert logged == {r["step"]: r["train/loss"] for r in metrics if "train/loss" in r}
