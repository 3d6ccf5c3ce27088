"""What a run shows: the per-step status line and summary (runtime.metrics), vLLM's log routing (runtime.logfiles),
and the requeue signal (runtime.loop)."""

import json
import logging
import logging.config

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
    assert "eval pass@1 0.50" in s.update(3, _step(0.6, 0.0))
    assert "rollout/reward_mean: 0.200 -> 0.600" in s.summary()


def test_without_a_reference_the_line_shows_the_engine_trainer_kl():
    line = StatusLine(3).update(1, {**_step(0.5, 0.0), "train/kl": 0.0, "train/vllm_kl": 2e-4})
    assert "vllm kl 2.0e-04" in line


def test_plain_line_per_step_when_not_a_terminal(tmp_path, capsys):
    sink = MetricsSink(tmp_path, None, 2, live=False, append=False, wandb=None, config={})
    sink.log(1, _step(0.25, 0.0))
    sink.log(2, _step(0.75, 0.0))
    sink.close()
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("step 1/2  reward 0.250") and out[1].startswith("step 2/2  reward 0.750")
    assert out[2].startswith("summary: 2 of 2 steps")


def test_vllm_info_goes_to_the_file_warnings_to_the_terminal(tmp_path, capsys):
    env = vllm_logging_env(tmp_path / "logs", "engine-0")
    logging.config.dictConfig(json.loads(open(env["VLLM_LOGGING_CONFIG_PATH"]).read()))
    log = logging.getLogger("vllm.engine")
    log.info("reloading weights")
    log.warning("Failed to load weights")
    text = (tmp_path / "logs" / "engine-0.log").read_text()
    assert "reloading weights" in text and "Failed to load weights" in text
    err = capsys.readouterr().err
    assert "Failed to load weights" in err and "reloading weights" not in err
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
