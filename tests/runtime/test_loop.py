"""Fast checks of the loop's pieces that need no cluster: token-first Experience, micro-batch windows, the metric
table, checkpoint bookkeeping."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import torch

from runtime import ckpt, microbatch
from runtime.experience import concat, from_token_lists, pad_batch_to_multiple
from runtime.metrics import METRICS, is_documented


def test_experience_masks_follow_action_ranges_shifted_by_one():
    # tokens:      p p a a f a      (p prompt, a action, f feedback)
    tokens = [[10, 11, 12, 13, 14, 15], [20, 21, 22]]
    ranges = [[(2, 4), (5, 6)], [(1, 3)]]
    logps = [[0, 0, -0.5, -0.25, 0, -1.0], [0, -2.0, -3.0]]
    exp = from_token_lists(tokens, ranges, logps, pad_id=0)
    assert exp.sequences.tolist() == [[10, 11, 12, 13, 14, 15], [20, 21, 22, 0, 0, 0]]
    assert exp.attention_mask.tolist() == [[True] * 6, [True] * 3 + [False] * 3]
    # position t scores token t+1: tokens 2,3,5 of row 0 -> positions 1,2,4; tokens 1,2 of row 1 -> positions 0,1
    assert exp.action_mask.int().tolist() == [[0, 1, 1, 0, 1], [1, 1, 0, 0, 0]]
    assert exp.rollout_log_probs.tolist() == [[0, -0.5, -0.25, 0, -1.0], [-2.0, -3.0, 0, 0, 0]]
    assert exp.response_length.tolist() == [3, 2]


def test_empty_logprob_lists_mean_zeros():
    exp = from_token_lists([[1, 2, 3]], [[(1, 3)]], [[]], pad_id=0)
    assert exp.rollout_log_probs.tolist() == [[0.0, 0.0]]


def test_concat_pads_to_the_widest_and_padding_rows_train_on_nothing():
    a = from_token_lists([[1, 2]], [[(1, 2)]], [[0, -1.0]], pad_id=9)
    b = from_token_lists([[1, 2, 3, 4]], [[(1, 4)]], [[0, -1.0, -1.0, -1.0]], pad_id=9)
    for e, g in ((a, 0), (b, 1)):
        e.rewards, e.group_ids = torch.tensor([float(g)]), torch.tensor([g])
    both = concat([a, b], pad_id=9)
    assert both.sequences.tolist() == [[1, 2, 9, 9], [1, 2, 3, 4]]
    padded = pad_batch_to_multiple(both, 4)
    assert padded.batch_size == 4
    assert padded.action_mask[2:].sum() == 0 and padded.action_mask[:2].sum() == 4
    shards = [padded.shard(r, 2) for r in range(2)]
    assert [s.batch_size for s in shards] == [2, 2]
    assert torch.equal(torch.cat([s.sequences for s in shards]), padded.sequences)


def test_micro_batch_windows():
    # 10 rows, micro 2, accum 2 -> windows of 4 rows: [0:2, 2:4], [4:6, 6:8], [8:10]
    windows = microbatch.windows(10, 4)
    assert [microbatch.fixed_micro_batches(w, 2) for w in windows] == [[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[8, 9]]]
    assert [microbatch.fixed_micro_batches(w, 2) for w in microbatch.windows(3, 2)] == [[[0, 1]], [[2]]]


def test_length_grouped_micro_batches_keep_windows_and_sizes_and_pad_least():
    import itertools

    lengths = torch.tensor([5, 40, 6, 38, 7, 9, 30, 8, 50, 4])

    def padded(batches):
        return sum(len(b) * int(lengths[b].max()) for b in batches)

    for window in microbatch.windows(10, 7):  # [0:7] and [7:10], micro 3: sizes 3, 3, 1 and 3
        fixed = microbatch.fixed_micro_batches(window, 3)
        grouped = microbatch.micro_batches(window, lengths, 3, None, by_length=True)
        assert sorted(map(len, grouped)) == sorted(map(len, fixed))  # as many micro-batches, as large
        assert sorted(i for b in grouped for i in b) == list(window)  # the window's rows, each once
        assert microbatch.micro_batches(window, lengths, 3, None, by_length=False) == fixed
    first = microbatch.length_grouped_micro_batches(range(7), lengths, 3)
    # 40, 38, 30 together; the short micro-batch (9) between them and the shortest three pads least here
    assert first == [[1, 3, 6], [5], [0, 2, 4]]
    assert padded(first) == 150 < padded(microbatch.fixed_micro_batches(range(7), 3)) == 264
    best = min(padded([list(p[:3]), list(p[3:6]), list(p[6:])]) for p in itertools.permutations(range(7)))
    assert padded(first) == best  # no grouping into sizes 3, 3, 1 pads less


def test_token_budget_micro_batches_first_fit_decreasing():
    lengths = torch.tensor([5, 9, 3, 7, 4, 30])
    bins = microbatch.token_budget_micro_batches(range(6), lengths, max_tokens=12)
    # longest first: 30 alone (over the cap), 9+3, 7+5, 4
    assert bins == [[5], [1, 2], [0, 3], [4]]
    assert all(int(lengths[b].sum()) <= 12 for b in bins if len(b) > 1)
    assert sorted(i for b in bins for i in b) == list(range(6))
    assert microbatch.pad_to(bins, 6)[4:] == [None, None]


def test_rank_rows_balance_tokens_with_equal_counts():
    lengths = torch.tensor([100, 90, 80, 70, 10, 20, 30, 40])
    contiguous = microbatch.rank_rows(lengths, 2, balanced=False)
    assert [r.tolist() for r in contiguous] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    balanced = microbatch.rank_rows(lengths, 2, balanced=True)
    assert [len(r) for r in balanced] == [4, 4]
    assert sorted(torch.cat(balanced).tolist()) == list(range(8))
    loads = [int(lengths[r].sum()) for r in balanced]
    assert max(loads) - min(loads) <= 20, loads  # contiguous: 340 vs 100


def test_metric_table_patterns():
    assert is_documented("rollout/dropped/agent_error")
    assert is_documented("prompts/dropped/run_ended")
    assert is_documented("rollout/info/answered_number")
    assert is_documented("timing/vllm_idle_wait") and is_documented("timing/actor_idle_wait")
    assert not is_documented("rollout/dropped/Bad Reason")
    assert not is_documented("timing/made_up")
    assert all(doc.strip() for doc in METRICS.values())


def test_checkpoint_latest_ignores_incomplete_saves_and_prune_keeps_newest(tmp_path):
    for step in (5, 10, 15):
        d = ckpt.step_dir(tmp_path, step)
        d.mkdir(parents=True)
        if step != 15:  # step 15 is being written: no trainer_state.json yet
            ckpt.write_state(d, {"step": step, "prompts_consumed": step * 8, "kl_coef": 0.0})
    path, state = ckpt.latest(tmp_path)
    assert path.name == "step_000010" and state["prompts_consumed"] == 80
    ckpt.prune(tmp_path, keep=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000010", "step_000015"]


def test_batched_but_untrained_prompts_end_as_run_ended():
    from runtime.loop import settle_accounting

    # stopped with two batches of 8 groups still queued: 24 batched, 8 trained
    acc = settle_accounting({"prompts/consumed": 30, "prompts/batched": 24, "prompts/dropped/run_ended": 6}, 8)
    assert acc == {"prompts/consumed": 30, "prompts/trained": 8, "prompts/dropped/run_ended": 22}
    assert settle_accounting({"prompts/consumed": 8, "prompts/batched": 8}, 8) == {"prompts/consumed": 8,
                                                                                  "prompts/trained": 8}


def test_batch_metrics_count_a_multi_sample_rollout_once():
    from runtime.batch_stats import batch_metrics

    # rollout 5 (group 0) arrives as two step-samples, rollouts 6 (group 0) and 9 (group 1) as one each
    exp = from_token_lists([[1, 2, 3], [1, 2, 3, 4], [1, 2], [1, 2, 3]], [[(1, 3)], [(2, 4)], [(1, 2)], [(2, 3)]],
                           [[], [], [], []], pad_id=0)
    exp.rollout_ids = torch.tensor([5, 5, 6, 9])
    exp.group_ids = torch.tensor([0, 0, 0, 1])
    exp.rewards = torch.tensor([1.0, 1.0, 0.0, 0.5])
    exp.scores = torch.tensor([1.0, 1.0, 0.0, 0.5])
    exp.truncated = torch.tensor([False, True, False, False])
    m = batch_metrics(exp, torch.zeros(4, 3), torch.zeros(4, 3))
    assert m["rollout/num_rollouts"] == 3 and m["rollout/num_samples"] == 4 and m["rollout/num_prompt_groups"] == 2
    assert m["rollout/reward_mean"] == 0.5  # (1 + 0 + 0.5) / 3, not (1 + 1 + 0 + 0.5) / 4
    assert m["rollout/response_length_mean"] == (4 + 1 + 1) / 3
    assert abs(m["rollout/truncated_rate"] - 1 / 3) < 1e-6
    assert m["rollout/group_reward_std"] == (0.5 + 0.0) / 2
    assert "train/logprob_diff_max" in m
    assert "train/logprob_diff_max" not in batch_metrics(exp, torch.zeros(4, 3), None)  # no old-logprob pass


def test_force_on_policy_windows_are_the_whole_shard():
    # 10 rows on a rank: micro 2 x accum 3 -> windows of 6 rows; a local batch of 4 under dynamic batching
    for accum, local, rows in ((3, None, 6), (1, 4, 4)):
        assert microbatch.window_rows(10, 2, accum, local, force_on_policy=False) == rows
        assert len(microbatch.windows(10, rows)) == (2 if rows == 6 else 3)
        assert microbatch.window_rows(10, 2, accum, local, force_on_policy=True) == 10  # one step per batch
    assert microbatch.windows(10, microbatch.window_rows(10, 2, 3, None, True)) == [range(0, 10)]
    assert microbatch.window_rows(0, 2, 3, None, True) == 1  # an empty shard: one empty window, no zero step


def test_best_checkpoint_selection_and_pruning_never_removes_it(tmp_path):
    """Higher is better, the first eval carrying the key saves, ties keep the older; rounds without the key save
    nothing. `<dir>/best` sits next to the step saves and `prune` (ckpt.keep, the disk budget) leaves it alone."""
    assert ckpt.improves({"eval/pass1": 0.25}, "eval/pass1", None)
    assert ckpt.improves({"eval/pass1": 0.5}, "eval/pass1", 0.25)
    assert not ckpt.improves({"eval/pass1": 0.25}, "eval/pass1", 0.25)
    assert not ckpt.improves({"eval/pass1": 0.1}, "eval/pass1", 0.25)
    assert not ckpt.improves({"eval/reward_mean": 1.0}, "eval/pass1", None)
    assert ckpt.best_record(tmp_path) is None
    best = tmp_path / ckpt.BEST_DIR
    best.mkdir()
    ckpt.write_state(best, {"step": 3, "best_metric_key": "eval/pass1", "best_metric": 0.5})
    for step in (5, 10, 15):
        ckpt.step_dir(tmp_path, step).mkdir()
        ckpt.write_state(ckpt.step_dir(tmp_path, step), {"step": step})
    ckpt.prune(tmp_path, keep=1, max_disk_gb=0.0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best", "step_000015"]
    assert ckpt.latest(tmp_path)[0].name == "step_000015"  # resume takes the newest step save, not the best
    assert ckpt.best_record(tmp_path) == {"step": 3, "best_metric_key": "eval/pass1", "best_metric": 0.5}
    shutil.rmtree(ckpt.step_dir(tmp_path, 15))
    assert ckpt.latest(tmp_path) == (best, ckpt.best_record(tmp_path))  # no step save left: resume from the best
    (best / ckpt.STATE_FILE).unlink()
    assert ckpt.latest(tmp_path) is None  # an incomplete best is no checkpoint


def test_every_metric_key_the_runtime_names_is_documented():
    """Static, over every runtime module: each metric-key literal, and each timed phase (`sup.phase(name, actor,
    key, timings)` logs `timing/<name>`), is in the one table (the e2e runs check the keys built at run time)."""
    import ast

    key = re.compile(r"^(rollout|train|eval|timing|critic|weight_sync|queue|prompts)/[A-Za-z0-9_@]*[A-Za-z0-9_]$")
    named: set[str] = set()
    for path in (Path(__file__).parents[2] / "runtime").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and key.match(node.value):
                named.add(node.value)
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "phase"
                    and len(node.args) == 4 and isinstance(node.args[0], ast.Constant)):
                named.add(f"timing/{node.args[0].value}")
    assert {"timing/make_experience", "timing/policy_train", "train/loss", "eval/loss"} <= named
    named.discard("prompts/batched")  # the generator's accounting, settled (runtime.loop.settle_accounting): not logged
    assert sorted(k for k in named if not is_documented(k)) == []
