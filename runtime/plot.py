"""End-of-run PNG: reward (train and eval) and per-step timings, from metrics.jsonl. Matplotlib, Agg backend."""

from __future__ import annotations

from pathlib import Path

from runtime.metrics import read_jsonl

TIMINGS = ("timing/step_total", "timing/generation", "timing/policy_train", "timing/weight_sync_total",
           "timing/actor_idle_wait", "timing/vllm_idle_wait")


def plot_run(metrics_path: Path, out_png: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = run_figure(read_jsonl(metrics_path), title)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png


def timing_points(train: list[dict]) -> tuple[dict[str, list[tuple[int, float]]], int]:
    """Each TIMINGS key's (step, seconds) points and the first step they start at. The first step also waits for the
    engines' and the trainer's start-up and would flatten the curves: it is left out when later steps exist."""
    rows = train[1:] if len(train) > 1 else train
    points = {key: [(r["step"], r[key]) for r in rows if key in r] for key in TIMINGS}
    return {k: v for k, v in points.items() if v}, rows[0]["step"] if rows else 1


def run_figure(records: list[dict], title: str):
    """The reward panel and the timings panel of one run's metrics records (a matplotlib Figure)."""
    import matplotlib.pyplot as plt

    train = [r for r in records if "rollout/reward_mean" in r]
    evals = [r for r in records if "eval/reward_mean" in r]
    fig, (ax_r, ax_t) = plt.subplots(1, 2, figsize=(12, 4.5))
    if train:
        steps = [r["step"] for r in train]
        ax_r.plot(steps, [r["rollout/reward_mean"] for r in train], ".-", label="train reward (mean)", color="C0")
        ax_r.plot(steps, _smooth([r["rollout/reward_mean"] for r in train]), color="C0", alpha=0.4, lw=3,
                  label="train reward (smoothed)")
    if evals:
        ax_r.plot([r["step"] for r in evals], [r["eval/reward_mean"] for r in evals], "o-", color="C3",
                  label="eval reward")
    ax_r.set(xlabel="step", ylabel="reward", title="reward")
    ax_r.legend(loc="lower right")
    ax_r.grid(alpha=0.3)
    points, first = timing_points(train)
    for i, key in enumerate(TIMINGS):
        if key in points:  # markers: a short run (a smoke's one timed step) has single points, which lines hide
            ax_t.plot(*zip(*points[key], strict=True), ".-", label=key.removeprefix("timing/"), color=f"C{i}")
    ax_t.set(xlabel="step", ylabel="seconds", title=f"timings per step (from step {first})")
    if points:
        ax_t.legend(loc="upper right", fontsize=8)
    ax_t.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def _smooth(values: list[float], k: int = 5) -> list[float]:
    out = []
    for i in range(len(values)):
        window = values[max(0, i - k + 1): i + 1]
        out.append(sum(window) / len(window))
    return out
