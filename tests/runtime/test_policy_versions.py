"""Per-token policy versions (partial rollout), without a cluster: the trajectory records them, Experience keeps them
token-aligned through its ops, the metrics count what crossed a sync, vLLM's spans become one version per token."""

from __future__ import annotations

import pytest
import torch

from runtime.agents.base import Trajectory
from runtime.engines.vllm_engine import token_versions
from runtime.experience import concat, from_token_lists, pad_batch_to_multiple, partial_rollout_metrics
from runtime.metrics import is_documented

# tokens:  p p a a f a a   (p prompt, a action, f feedback); row 0's second turn crossed a sync (v3 -> v4)
TOKENS = [[10, 11, 12, 13, 14, 15, 16], [20, 21, 22]]
RANGES = [[(2, 4), (5, 7)], [(1, 3)]]
LOGPS = [[0, 0, -0.5, -0.25, 0, -1.0, -2.0], [0, -2.0, -3.0]]
VERSIONS = [[-1, -1, 3, 3, -1, 3, 4], [-1, 4, 4]]


def experience():
    exp = from_token_lists(TOKENS, RANGES, LOGPS, pad_id=0, policy_versions=VERSIONS)
    exp.rewards, exp.group_ids = torch.tensor([1.0, 0.0]), torch.tensor([0, 1])
    return exp


def test_versions_are_aligned_like_the_rollout_log_probs():
    exp = experience()
    # position t scores token t+1, as rollout_log_probs; -1 off the action mask and on padding
    assert exp.policy_versions.tolist() == [[-1, 3, 3, -1, 3, 4], [4, 4, -1, -1, -1, -1]]
    assert exp.rollout_log_probs.tolist() == [[0, -0.5, -0.25, 0, -1.0, -2.0], [-2.0, -3.0, 0, 0, 0, 0]]
    assert ((exp.policy_versions >= 0) == exp.action_mask).all()


def test_unknown_version_is_one_value_on_both_sides():
    from runtime import experience
    from runtime.agents import types

    assert experience.UNKNOWN_VERSION == types.UNKNOWN_VERSION == -1


def test_unknown_versions_and_no_versions():
    exp = from_token_lists([[1, 2, 3]], [[(1, 3)]], [[]], pad_id=0, policy_versions=[[]])
    assert exp.policy_versions.tolist() == [[-1, -1]]
    assert partial_rollout_metrics(exp, trained_version=0) == {}
    assert from_token_lists([[1, 2, 3]], [[(1, 3)]], [[]], pad_id=0).policy_versions is None


def test_select_concat_pad_trim_keep_versions_with_their_tokens():
    exp = experience()
    assert exp.select(torch.tensor([1, 0])).policy_versions.tolist() == [[4, 4, -1, -1, -1, -1],
                                                                         [-1, 3, 3, -1, 3, 4]]
    wide = from_token_lists([[1, 2, 3, 4, 5, 6, 7, 8, 9]], [[(1, 9)]], [[0.0] * 9], pad_id=0,
                            policy_versions=[[-1] + [5] * 8])
    wide.rewards, wide.group_ids = torch.tensor([0.0]), torch.tensor([2])
    both = concat([exp, wide], pad_id=0)
    assert both.policy_versions.shape == both.action_mask.shape == (3, 8)
    assert both.policy_versions[0].tolist() == [-1, 3, 3, -1, 3, 4, -1, -1]  # padded with -1, not version 0
    assert both.policy_versions[2].tolist() == [5] * 8
    assert both.select(torch.tensor([0, 1])).trim().policy_versions.tolist() == exp.policy_versions.tolist()
    padded = pad_batch_to_multiple(both, 4)
    assert padded.policy_versions[3].tolist() == [-1] * 8  # a filler row trains on nothing and has no version
    assert both.shard(1, 3).policy_versions.tolist() == [both.policy_versions[1].tolist()]


def test_metrics_count_the_tokens_and_samples_that_crossed_a_sync():
    m = partial_rollout_metrics(experience(), trained_version=4)
    assert m["rollout/partial_samples_frac"] == 0.5  # row 0 spans versions 3 and 4, row 1 only 4
    assert m["rollout/partial_tokens_frac"] == pytest.approx(3 / 6)  # row 0's three v3 tokens of 6 action tokens
    assert m["rollout/policy_version_min"] == 3 and m["rollout/policy_version_max"] == 4
    assert m["rollout/policy_version_lag_mean"] == pytest.approx(3 / 6) and m["rollout/policy_version_lag_max"] == 1
    assert m["rollout/tokens_at_lag/1"] == 3 and m["rollout/tokens_at_lag/0"] == 3
    assert all(is_documented(k) for k in m)


def test_trajectory_records_the_engines_versions_off_actions_minus_one():
    traj = Trajectory(prompt="", label=None, observation_text="", token_ids=[1, 2], rollout_log_probs=[0.0, 0.0])
    traj.append_action([3, 4], [-0.1, -0.2], [0, 1])
    traj.append_feedback("x", [5])
    traj.append_action([6], [-0.3], [])  # a client that does not say: unknown
    assert traj.policy_versions == [-1, -1, 0, 1, -1, -1]
    assert len(traj.policy_versions) == len(traj.token_ids) == len(traj.rollout_log_probs)


class _Span:
    def __init__(self, version, start, end):
        self.version, self.start, self.end = version, start, end


def test_vllm_weight_version_spans_become_one_version_per_token():
    # vLLM labels the checkpoint's weights "default" until the first finish_weight_update(weight_version=...)
    assert token_versions([_Span("default", 0, 2), _Span("7", 2, 5)], 5) == [0, 0, 7, 7, 7]
    assert token_versions(None, 2) == [-1, -1]
    with pytest.raises(RuntimeError, match="cover 2 of 3"):
        token_versions([_Span("1", 0, 2)], 3)


def test_chat_segments_record_the_versions_of_each_turn():
    from agents_fakes import ByteTokenizer

    from runtime.agents import SamplingParams
    from runtime.agents.chat_server import Session, _record
    from runtime.agents.types import GenerateOutput

    session = Session("s", SamplingParams(max_tokens=4), 64, ByteTokenizer(), client=None)
    _record(session, None, [1, 2], [], GenerateOutput([3, 4], [-0.1, -0.2], policy_versions=[2, 3]))
    _record(session, session.segments[0], [1, 2, 3, 4, 9], [9], GenerateOutput([5], [-0.3], policy_versions=[3]))
    seg = session.segments[0]
    assert seg.policy_versions == [-1, -1, 2, 3, -1, 3]
    assert len(seg.policy_versions) == len(seg.token_ids) == len(seg.rollout_log_probs)


def test_widths_round_up_to_the_plans_multiple_and_keep_every_token():
    """GPU plans pad batches and micro-batches to a multiple of 8 positions (`fsdp.width_multiple`): the SDPA mask
    alignment, which compiled layers recompile on. The rounding adds padding only: tokens, masks and versions of the
    real positions stay, and a micro-batch never outgrows its batch."""
    exp = experience()  # rows of 7 and 3 tokens
    batch = concat([exp], pad_id=0, width_multiple=8)
    assert batch.sequences.shape == (2, 8) and batch.action_mask.shape == (2, 7)
    assert batch.sequences[:, :7].tolist() == exp.sequences.tolist() and batch.sequences[:, 7].tolist() == [0, 0]
    assert batch.policy_versions[:, :6].tolist() == exp.policy_versions.tolist()
    assert batch.policy_versions[:, 6].tolist() == [-1, -1] and batch.action_mask[:, 6].tolist() == [0, 0]
    short = batch.select(torch.tensor([1])).trim(8)  # 3 tokens: 8 positions, not 3
    assert short.sequences.shape == (1, 8) and short.sequences[0, :3].tolist() == TOKENS[1]
    assert batch.select(torch.tensor([1])).trim(1).sequences.shape == (1, 3)  # CPU plans: the longest row
    assert batch.trim(8).sequences.shape == (2, 8)  # the longest row (7) rounds to the batch's own width
