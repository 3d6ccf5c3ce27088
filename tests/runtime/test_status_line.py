"""What a run shows: the per-step status line and summary (runtime.metrics), vLLM's log routing (runtime.logfiles),
and the requeue signal (runtime.loop)."""

import json
import logging
import logging.config
import re

from runtime.logfiles import vllm_logging_env
from runtime.metrics import MetricsSink, StatusLine


def _step(reward: float, trainer_idle: float) -> dict[str, float]:
    return {"rollout/reward_mean": reward, "rollout/pass1": reward, "train/kl": 1e-3, "timing/step_total": 2.0,
            "timing/vllm_idle_wait": 0.1, "timing/actor_idle_wait": trainer_idle}


def test_status_line_names_the_idle_side_and_the_eta():
    s = StatusLine(total_steps=10)
    line = s.update(1, _step(0.2, trainer_idle=1.5))
    assert "reward 0.200" in line and "pass@1 0.20" in line and "kl 1.0e-03" in line
    assert "idle: trainer 1.50s" in line and "eta 0m1" in line  # 9 steps left at ~2 s each
    assert s.update(1, {"eval/pass1": 0.5}) == "eval pass@1 0.500"
    assert "idle: rollout 0.10s" in s.update(2, _step(0.6, trainer_idle=0.0))
    assert "rollout/reward_mean: 0.200 -> 0.600" in s.summary()


def test_without_a_reference_the_line_names_the_engine_whose_kl_it_shows():
    row = {**_step(0.5, 0.0), "train/kl": 0.0, "train/vllm_kl": 2e-4}
    assert "vllm kl 2.0e-04" in StatusLine(3, engine="vllm").update(1, row)
    line = StatusLine(3, engine="hf").update(1, row)
    assert "hf kl 2.0e-04" in line and "vllm" not in line


# The widest values a step line can carry: a long run, negative rewards and KL, slow steps, a long ETA.
WIDE_ROW = {"rollout/reward_mean": -0.123456, "rollout/pass1": 0.125, "eval/pass1": 0.5, "train/kl": 0.0,
            "train/vllm_kl": -1.23456e-05, "timing/step_total": 4321.5, "timing/vllm_idle_wait": 0.5,
            "timing/actor_idle_wait": 1234.5, "train/tokens": 123456.0}
WIDE_EVAL = {"eval/reward_mean": -0.123456, "eval/pass1": 0.125, "eval/pass@4": 0.25}


def test_live_display_keeps_a_line_per_step_under_a_short_bar_within_120_columns(tmp_path):
    from io import StringIO

    from rich.console import Console

    console = Console(file=StringIO(), width=120, force_terminal=True, color_system=None)
    sink = MetricsSink(tmp_path, None, 10000, live=True, append=False, wandb=None, config={}, engine="vllm",
                       console=console)
    sink.status("step 9997: waiting for the first rollout batch after a very long start-up of every engine")
    for step in (9998, 9999):
        sink.log(step, WIDE_ROW)
    sink.log(9999, WIDE_EVAL)
    sink.log(10000, WIDE_ROW)
    sink.close()
    screen = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", console.file.getvalue())  # what the terminal was sent
    lines = [line.rstrip() for line in re.split(r"[\r\n]", screen) if line.strip()]
    history = [line for line in lines if line.startswith(("step 9", "step 10000/", "eval at step")) and "━" not in line]
    assert [line.split("  ")[0] for line in history] == [
        "step 9998/10000", "step 9999/10000", "eval at step 9999/10000", "step 10000/10000"]
    assert "reward -0.123  pass@1 0.12  vllm kl -1.2e-05  time 4322s" in history[0]
    assert "idle: trainer 1234s" in history[0] and "eval pass@1 0.125" in history[2]
    assert max(len(line) for line in lines) <= 120, max(lines, key=len)
    bar = [line for line in lines if "━" in line]
    assert bar and all(len(line) <= 120 for line in bar)  # the live bar: step N/T, a short bar, its status


def test_plain_line_per_step_when_not_a_terminal(tmp_path, capsys):
    sink = MetricsSink(tmp_path, None, 2, live=False, append=False, wandb=None, config={})
    sink.log(1, _step(0.25, 0.0))
    sink.log(2, _step(0.75, 0.0))
    sink.close()
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("step 1/2  reward 0.250") and out[1].startswith("step 2/2  reward 0.750")
    assert out[2].startswith("summary: 2 of 2 steps")


def test_vllm_info_and_warnings_go_to_the_file_errors_also_to_the_terminal(tmp_path, capsys):
    env = vllm_logging_env(tmp_path / "logs", "engine-0")
    logging.config.dictConfig(json.loads(open(env["VLLM_LOGGING_CONFIG_PATH"]).read()))
    log = logging.getLogger("vllm.engine")
    log.info("reloading weights")
    log.warning("The CPU backend does not support chunked prefill; it is disabled")
    log.error("Failed to load weights")
    text = (tmp_path / "logs" / "engine-0.log").read_text()
    assert "reloading weights" in text and "chunked prefill" in text and "Failed to load weights" in text
    err = capsys.readouterr().err
    assert "Failed to load weights" in err and "reloading weights" not in err and "chunked prefill" not in err
    logging.getLogger("vllm").handlers.clear()


def test_sigusr1_asks_the_loop_to_checkpoint_and_stop_for_a_requeue():
    import os
    import signal

    from runtime.supervisor import StopFlag

    stop = StopFlag()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.requested and stop.requeue
        os.kill(os.getpid(), signal.SIGUSR1)  # Slurm may signal again: still a requeue, never an abort
        assert stop.requeue
    finally:
        stop.restore()


def test_the_plot_of_a_two_step_smoke_shows_its_timings():
    """A smoke's metrics: step 1 (phase 1) and step 2 (phase 2, resumed) and an eval round. The timings panel leaves
    step 1 out (start-up) and so has one point per timing: it must still draw them."""
    import matplotlib

    matplotlib.use("Agg")
    from runtime.plot import run_figure

    rows = [{"step": s, **_step(0.0, 0.2), "timing/generation": 3.0, "timing/policy_train": 5.0} for s in (1, 2)]
    fig = run_figure([*rows, {"step": 2, "eval/reward_mean": 0.0, "eval/pass1": 0.0}], "demo-math-smoke")
    timings = fig.axes[1]
    drawn = {line.get_label(): (list(line.get_xdata()), line.get_marker()) for line in timings.get_lines()}
    assert drawn["step_total"] == ([2], ".") and drawn["policy_train"] == ([2], ".")  # a visible point each
    assert timings.get_title() == "timings per step (from step 2)"
    one = run_figure(rows[:1], "one step")  # a single step: its timings, start-up included
    assert [list(line.get_xdata()) for line in one.axes[1].get_lines()][0] == [1]
