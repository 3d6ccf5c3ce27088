"""Exact resume (issue 13.3) without a cluster: the prompt books a checkpoint records, the data order a resumed
generator follows, atomic saves under a real SIGKILL, and metrics records not duplicated."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

from loop_support import ROOT

from runtime import ckpt
from runtime.books import Books
from runtime.generator import Generator
from runtime.messages import RolloutBatch
from runtime.metrics import drop_records_after


def _batch(trained: list[int], dropped: dict[str, list[int]], consumed: int) -> RolloutBatch:
    return RolloutBatch(experience=None, policy_version=0, metrics={}, generation_s=0.0, vllm_idle_wait_s=0.0,
                        prompts_consumed=consumed, slot_acquired_at=0.0, prompt_positions=trained,
                        dropped_positions=dropped)


def _stream(rows: int, seed: int, skip: set[int]) -> list[int]:
    rl = SimpleNamespace(generator=SimpleNamespace(episodes=2, seed=seed),
                         data=SimpleNamespace(probs=None, max_samples=rows * 2))
    fake = SimpleNamespace(rl=rl, sources=[[(f"p{i}", None, None) for i in range(rows)]], images=[])
    return [pos for pos, _ in Generator._prompt_stream(fake, skip)]


def test_books_keep_prompts_in_flight_at_the_save_for_the_resume():
    # Positions 0..7 dispatched; batch 1 trained {0, 1, 2, 4}, 6 was dropped; 3, 5 and 7 were still in flight when the
    # checkpoint was taken. The old state (prompts consumed = 8) skipped them on resume: never trained nor counted.
    books = Books()
    msg = _batch([0, 1, 2, 4], {"all_rollouts_dropped": [6]}, consumed=8)
    books.seen(msg)
    books.trained_batch(msg)
    state = json.loads(json.dumps({"prompts": books.state()}))
    assert state["prompts"] == {"done_below": 3, "done_above": [4, 6], "trained": 4,
                                "dropped": {"all_rollouts_dropped": 1}}
    resumed = Books.from_state(state)
    assert resumed.done_positions() == [0, 1, 2, 4, 6] and resumed.trained == 4
    # the resumed generator sends the in-flight ones first, then continues the same seeded order
    assert _stream(8, seed=3, skip=set(resumed.done_positions())) == [3, 5, 7, *range(8, 16)]


def test_data_order_depends_only_on_the_seed_and_spans_episodes():
    full = _stream(10, seed=7, skip=set())
    assert full == list(range(20)) and _stream(10, seed=7, skip={0, 1}) == full[2:]
    order = list(range(10))
    random.Random(7).shuffle(order)
    rl = SimpleNamespace(generator=SimpleNamespace(episodes=1, seed=7),
                         data=SimpleNamespace(probs=None, max_samples=10))
    fake = SimpleNamespace(rl=rl, sources=[[(f"p{i}", None, None) for i in range(10)]], images=[])
    assert [row[0] for _, (row, _images) in Generator._prompt_stream(fake, set())] == [f"p{i}" for i in order]


def test_a_kill_during_a_save_leaves_the_previous_checkpoint_usable(tmp_path):
    done = ckpt.begin_save(tmp_path, 10)
    (done / "shard.distcp").write_bytes(b"x" * 1000)
    ckpt.write_state(done, {"step": 10})
    ckpt.publish(done)
    # A real process writing the step-12 save, killed with SIGKILL half way through its shard.
    writer = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from runtime import ckpt\n"
        f"tmp = ckpt.begin_save({str(tmp_path)!r}, 12)\n"
        "f = open(tmp / 'shard.distcp', 'wb'); f.write(b'y' * 500); f.flush(); print('writing', flush=True)\n"
        "time.sleep(60)\n")], cwd=ROOT, stdout=subprocess.PIPE, text=True, env={"PYTHONPATH": str(ROOT)})
    assert writer.stdout.readline().strip() == "writing"
    writer.send_signal(signal.SIGKILL)
    writer.wait(timeout=30)
    assert (tmp_path / "step_000012.tmp").is_dir()           # the torn save is there ...
    path, state = ckpt.latest(tmp_path)
    assert path.name == "step_000010" and state == {"step": 10}  # ... and invisible
    ckpt.prune(tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000010"]


def test_resumed_run_drops_the_records_it_will_log_again(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "time": time.time()}) + "\n" for s in (0, 1, 2, 3, 4, 5)))
    drop_records_after(path, 3)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [0, 1, 2, 3]
    drop_records_after(tmp_path / "absent.jsonl", 3)  # a first run has none


def test_disk_cap_removes_the_oldest_saves_until_the_rest_fit(tmp_path):
    for step in (2, 4, 6, 8):
        d = ckpt.begin_save(tmp_path, step)
        (d / "shard.distcp").write_bytes(b"z" * 400_000)   # 0.4 MB each
        ckpt.write_state(d, {"step": step})
        ckpt.publish(d)
    ckpt.prune(tmp_path, keep=0, max_disk_gb=0.001)          # 1 MB: two saves fit
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000006", "step_000008"]
    ckpt.prune(tmp_path, keep=0, max_disk_gb=0.0001)         # the newest alone is over: it stays
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000008"]


def test_interleaved_prompts_stream_the_rows_the_compiler_counted(tmp_path):
    """data.prompt_probs: the generator streams Molt's blend (datasets.interleave_datasets, all_exhausted, the
    generator's seed = train.seed), as many rows per episode as the compiler counted, shuffled per episode."""
    from schemas.schedule import count_rows

    files = []
    for name, n in (("a.jsonl", 30), ("b.jsonl", 8)):
        path = tmp_path / name
        path.write_text("".join(json.dumps({"prompt": f"{name[0]}{i}"}) + "\n" for i in range(n)))
        files.append(str(path))
    sources = [[(f"a{i}", None, None) for i in range(30)], [(f"b{i}", None, None) for i in range(8)]]
    rl = SimpleNamespace(generator=SimpleNamespace(episodes=2, seed=5),
                         data=SimpleNamespace(probs=[0.6, 0.4], max_samples=1000))
    fake = SimpleNamespace(rl=rl, sources=sources, images=[])
    stream = [row[0] for _, (row, _images) in Generator._prompt_stream(fake, set())]
    per_episode = len(stream) // 2
    first, second = stream[:per_episode], stream[per_episode:]
    assert sorted(first) == sorted(second) and first != second  # the same blend, reshuffled per episode
    assert {f"a{i}" for i in range(30)} | {f"b{i}" for i in range(8)} == set(first)
    assert first.count("b0") > 1  # the short source wraps around until the long one is drawn through
    assert per_episode == count_rows(files, 1000, [0.6, 0.4], "train", seed=5)[0]
