"""Reward preprocessing and advantage estimators against hand-computed values, plus property checks."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.algo.advantages import (
    broadcast,
    compute_advantages,
    discounted_returns,
    dr_grpo,
    gae,
    grpo,
    on_policy_distill,
    on_policy_distill_from_logprobs,
    reinforce,
    reinforce_baseline,
    rloo,
    token_rewards,
)
from runtime.algo.reward import (
    RolloutRewards,
    merge_rollout_rewards,
    per_sample_rewards,
    prepare_rewards,
    whiten,
)

T = torch.tensor

# Three groups: g0 = [1, 0, 0.5], g1 = [2, 4], g2 = [3] (a singleton).
REWARDS = T([1.0, 0.0, 0.5, 2.0, 4.0, 3.0])
GROUPS = T([0, 0, 0, 1, 1, 2])


def close(a, b, tol=1e-6):
    return torch.allclose(torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32), atol=tol)


# --------------------------------------------------------------------------------------------------- group scalars
def test_reinforce_baseline_and_dr_grpo_subtract_the_group_mean():
    # group means: g0 = 1.5/3 = 0.5, g1 = 6/2 = 3, g2 = 3
    # a = [1-.5, 0-.5, .5-.5, 2-3, 4-3, 3-3]
    expected = [0.5, -0.5, 0.0, -1.0, 1.0, 0.0]
    assert close(reinforce_baseline(REWARDS, GROUPS), expected)
    assert close(dr_grpo(REWARDS, GROUPS), expected)


def test_grpo_uses_unbiased_std_and_zero_for_singletons():
    # g0: deviations (.5, -.5, 0), Σd² = .5, unbiased var = .5/2 = .25, std = .5 -> (1, -1, 0)
    # g1: deviations (-1, 1), Σd² = 2, var = 2/1, std = √2 -> (-1/√2, 1/√2)
    # g2: singleton, std 0 -> 0 / (0 + 1e-9) = 0
    s = 1 / math.sqrt(2)
    assert close(grpo(REWARDS, GROUPS), [1.0, -1.0, 0.0, -s, s, 0.0])


def test_grpo_group_of_identical_rewards_is_exactly_zero():
    # fp32 rounding of the mean once gave ±0.81 here (noise of 1e-7 divided by std + 1e-9)
    rewards = T([1.7562158107757568] * 3 + [0.1] * 7)
    assert torch.equal(grpo(rewards, T([0] * 3 + [1] * 7)), torch.zeros(10))


def test_rloo_leave_one_out_baseline():
    # g0: n=3, Σ=1.5: 1-(1.5-1)/2 = .75; 0-(1.5-0)/2 = -.75; .5-(1.5-.5)/2 = 0
    # g1: 2-4 = -2; 4-2 = 2.   g2 singleton keeps its raw reward 3.
    assert close(rloo(REWARDS, GROUPS), [0.75, -0.75, 0.0, -2.0, 2.0, 3.0])


def test_broadcast_puts_the_scalar_on_action_tokens_only():
    mask = T([[0, 1, 1, 0], [1, 0, 1, 1]])
    # sample 0 -> rollout 1 (a = -0.5), sample 1 -> rollout 0 (a = 2)
    out = broadcast(T([2.0, -0.5]), T([1, 0]), mask)
    assert close(out, [[0, -0.5, -0.5, 0], [2, 0, 2, 2]])


# --------------------------------------------------------------------------------------------------- reward prep
def test_merge_rollout_rewards_first_sample_wins_groups_first_seen():
    # A has two step-samples, B one (both prompt g0); C two (prompt g1)
    merged = merge_rollout_rewards(T([1.0, 1.0, 0.0, 0.5, 0.5]), ["A", "A", "B", "C", "C"],
                                   ["g0", "g0", "g0", "g1", "g1"])
    assert close(merged.rewards, [1.0, 0.0, 0.5])
    assert merged.group_index.tolist() == [0, 0, 1]
    assert merged.sample_to_rollout.tolist() == [0, 0, 1, 2, 2]
    assert merged.num_groups == 2


def test_merge_rejects_length_mismatch():
    with pytest.raises(ValueError, match="2 rewards, 3 rollout_ids"):
        merge_rollout_rewards(T([1.0, 2.0]), ["a", "b", "c"], ["g", "g", "g"])


def test_prepare_rewards_merges_only_for_group_estimators_and_clips():
    rewards = T([5.0, 5.0, -3.0, 0.5])
    rids, gids = ["A", "A", "B", "C"], ["g", "g", "g", "g"]
    grouped = prepare_rewards("rloo", rewards, rids, gids, (-1.0, 2.0))
    # merged [5, -3, .5] then clipped to [-1, 2] -> [2, -1, .5]
    assert close(grouped.rewards, [2.0, -1.0, 0.5]) and grouped.sample_to_rollout.tolist() == [0, 0, 1, 2]
    single = prepare_rewards("reinforce", rewards, rids, gids, (-1.0, 2.0))
    assert close(single.rewards, [2.0, 2.0, -1.0, 0.5])
    assert single.group_index.tolist() == [0, 1, 2, 3] and single.sample_to_rollout.tolist() == [0, 1, 2, 3]


def test_multi_turn_steps_count_once_in_the_group_baseline():
    # rollout A (reward 1) arrives as 3 step-samples, B (reward 0) as 1. Merged, the group mean is .5, so
    # every step of A gets +.5 and B gets -.5. Unmerged it would be .75 and A would get only +.25.
    rollouts = prepare_rewards("dr_grpo", T([1.0, 1.0, 1.0, 0.0]), ["A", "A", "A", "B"], ["g"] * 4, (-10, 10))
    mask = torch.ones(4, 2)
    out = compute_advantages("dr_grpo", rollouts, mask)
    assert close(out.advantages, [[0.5, 0.5]] * 3 + [[-0.5, -0.5]])


def test_whiten_over_action_tokens_only():
    adv = T([[1.0, 99.0, 2.0], [3.0, 6.0, -50.0]])
    mask = T([[1, 0, 1], [1, 1, 0]])
    # action values 1, 2, 3, 6: mean 3, population var (4+1+0+9)/4 = 3.5
    out = whiten(adv, mask)
    s = math.sqrt(3.5)
    assert close(out[mask.bool()], [-2 / s, -1 / s, 0.0, 3 / s], tol=1e-5)


def test_whiten_degenerate_batches():
    assert close(whiten(T([[1.0, 2.0]]), T([[0, 0]])), [[0.0, 0.0]])  # no action tokens -> zeros
    assert close(whiten(T([[4.0, 4.0]]), T([[1, 1]])), [[0.0, 0.0]])  # zero variance -> zeros, not NaN


# --------------------------------------------------------------------------------------------------- token estimators
MASK_GAP = T([[0, 1, 1, 0, 1]])  # a tool-observation token at t=3 between two action spans
KL = T([[0.1, 0.2, 0.3, 0.4, 0.5]])


def test_token_rewards_kl_penalty_and_reward_on_last_action():
    # β = .5: r = -.5·kl on actions -> t1 -.1, t2 -.15, t4 -.25 + R(1) = .75; t0, t3 masked -> 0
    r = token_rewards(T([1.0]), MASK_GAP, KL, 0.5)
    assert close(r, [[0.0, -0.1, -0.15, 0.0, 0.75]])


def test_reinforce_gamma_one_is_reverse_cumsum():
    # reverse cumsum of [0, -.1, -.15, 0, .75] = [.5, .5, .6, .75, .75]
    assert close(reinforce(T([1.0]), MASK_GAP, KL, 0.5, 1.0), [[0.5, 0.5, 0.6, 0.75, 0.75]])


def test_reinforce_discount_runs_across_masked_gaps():
    # γ = .5: G4 = .75; G3 = 0 + .5·.75 = .375; G2 = -.15 + .5·.375 = .0375;
    # G1 = -.1 + .5·.0375 = -.08125; G0 = .5·(-.08125) = -.040625
    assert close(reinforce(T([1.0]), MASK_GAP, KL, 0.5, 0.5), [[-0.040625, -0.08125, 0.0375, 0.375, 0.75]])


def test_reinforce_through_dispatch_without_whitening_masks_the_gap():
    out = compute_advantages("reinforce", per_sample_rewards(T([1.0])), MASK_GAP, kl=KL, kl_coef=0.5, gamma=0.5,
                             whiten_advantages=False)
    assert close(out.advantages, [[0.0, -0.08125, 0.0375, 0.0, 0.75]])
    assert close(out.returns, [[-0.040625, -0.08125, 0.0375, 0.375, 0.75]])


def test_reinforce_row_without_actions_gets_nothing():
    r = token_rewards(T([1.0, 7.0]), T([[1, 1], [0, 0]]), None, 0.0)
    assert close(r, [[0.0, 1.0], [0.0, 0.0]])


def test_gae_hand_computed_with_transparent_gap():
    # mask [1,1,0,1], R=1 on t3, V = [.5, .2, 9 (masked, ignored), .4], γ=.9, λ=.5
    # t3: δ = 1 + .9·0 − .4 = .6, A3 = .6
    # t2 masked: carries V_next = .4, A_next = .6
    # t1: δ = 0 + .9·.4 − .2 = .16, A1 = .16 + .9·.5·.6 = .43
    # t0: δ = 0 + .9·.2 − .5 = −.32, A0 = −.32 + .45·.43 = −.1265
    adv, ret = gae(T([1.0]), T([[0.5, 0.2, 9.0, 0.4]]), T([[1, 1, 0, 1]]), None, 0.0, 0.9, 0.5)
    assert close(adv, [[-0.1265, 0.43, 0.0, 0.6]])
    assert close(ret, [[-0.1265 + 0.5, 0.43 + 0.2, 0.0, 0.6 + 0.4]])


def test_on_policy_distill_from_student_and_teacher_logprobs():
    # k1 = log π_s − log π_t = [-1 - (-1.5), -2 - (-1)] = [.5, -1]; β = .5 -> A = [-.25, .5]: the student is pushed
    # up where the teacher is more likely (t1) and down where it is less likely (t0)
    student, teacher = T([[-1.0, -2.0, -3.0]]), T([[-1.5, -1.0, -0.1]])
    assert close(on_policy_distill_from_logprobs(student, teacher, T([[1, 1, 0]]), 0.5), [[-0.25, 0.5, 0.0]])


def test_gae_requires_values():
    with pytest.raises(ValueError, match="gae needs the critic's values"):
        compute_advantages("gae", per_sample_rewards(T([1.0])), T([[1]]))


def test_on_policy_distill_is_negative_scaled_kl():
    # β = 2, kl = [.2, -.4, 1 (masked)] -> [-.4, .8, 0]
    assert close(on_policy_distill(T([[0.2, -0.4, 1.0]]), T([[1, 1, 0]]), 2.0), [[-0.4, 0.8, 0.0]])
    out = compute_advantages("on_policy_distill", per_sample_rewards(T([5.0])), T([[1, 1, 0]]),
                             kl=T([[0.2, -0.4, 1.0]]), kl_coef=2.0, whiten_advantages=True)
    assert close(out.advantages, [[-0.4, 0.8, 0.0]])  # never whitened, task reward ignored


def test_unknown_estimator():
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'"):
        compute_advantages("ppo", per_sample_rewards(T([1.0])), T([[1]]))


@pytest.mark.parametrize(("estimator", "whitened"), [
    ("reinforce_baseline", True), ("dr_grpo", False), ("grpo", False), ("rloo", False)])
def test_which_group_estimators_whiten(estimator, whitened):
    rollouts = RolloutRewards(rewards=T([1.0, 0.0, 3.0, 1.0]), group_index=T([0, 0, 1, 1]),
                              sample_to_rollout=T([0, 1, 2, 3]))
    mask = T([[1, 1], [1, 0], [1, 1], [1, 1]])
    out = compute_advantages(estimator, rollouts, mask, whiten_advantages=True)
    raw = compute_advantages(estimator, rollouts, mask, whiten_advantages=False)
    assert close(out.returns, raw.returns)
    if whitened:
        acts = out.advantages[mask.bool()]
        assert abs(acts.mean().item()) < 1e-6 and abs(acts.pow(2).mean().item() - 1) < 1e-5
    else:
        assert close(out.advantages, raw.advantages)


# --------------------------------------------------------------------------------------------------- properties
group_rewards = st.lists(st.lists(st.floats(-5, 5, allow_nan=False, width=32), min_size=1, max_size=6),
                         min_size=1, max_size=5)


def flatten(groups):
    rewards = T([r for g in groups for r in g])
    index = T([i for i, g in enumerate(groups) for _ in g])
    return rewards, index


@settings(max_examples=60, deadline=None)
@given(group_rewards)
def test_grpo_is_zero_mean_unit_std_per_group(groups):
    rewards, index = flatten(groups)
    adv = grpo(rewards, index)
    for i, g in enumerate(groups):
        a = adv[index == i]
        assert abs(a.mean().item()) < 1e-3
        if len(g) > 1 and T(g).std().item() > 1e-2:
            assert abs(a.std().item() - 1) < 1e-3
        if len(g) == 1:
            assert a.item() == 0.0


@settings(max_examples=60, deadline=None)
@given(group_rewards, st.floats(-3, 3, allow_nan=False))
def test_rloo_baseline_excludes_self(groups, delta):
    rewards, index = flatten(groups)
    base = rloo(rewards, index)
    bumped = rewards.clone()
    bumped[0] += delta
    after = rloo(bumped, index)
    n = len(groups[0])
    # own advantage moves by exactly Δ (its baseline does not contain itself) ...
    assert abs((after[0] - base[0]).item() - delta) < 1e-4
    # ... and every other member's baseline moves by Δ/(n-1)
    for j in range(1, n):
        assert abs((after[j] - base[j]).item() + delta / (n - 1)) < 1e-4
    # other groups are untouched
    assert torch.equal(after[index != 0], base[index != 0])


@settings(max_examples=60, deadline=None)
@given(group_rewards)
def test_group_mean_baselines_sum_to_zero_per_group(groups):
    rewards, index = flatten(groups)
    adv = reinforce_baseline(rewards, index)
    for i in range(len(groups)):
        assert abs(adv[index == i].sum().item()) < 1e-3


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4), st.integers(2, 8), st.floats(0.0, 1.0), st.integers(0, 10_000))
def test_gae_with_lambda_one_gamma_one_is_return_minus_value(B, T_len, dummy, seed):
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(B, T_len, generator=g) > 0.3).float()
    values = torch.randn(B, T_len, generator=g)
    kl = torch.randn(B, T_len, generator=g) * 0.1
    rewards = torch.randn(B, generator=g)
    adv, ret = gae(rewards, values, mask, kl, 0.3, 1.0, 1.0)
    G = discounted_returns(token_rewards(rewards, mask, kl, 0.3), 1.0)
    assert torch.allclose(adv, (G - values) * mask, atol=1e-5)
    assert torch.allclose(ret, G * mask, atol=1e-5)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 5), st.integers(1, 6), st.integers(0, 10_000))
def test_estimators_are_zero_off_the_action_mask(B, T_len, seed):
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(B, T_len, generator=g) > 0.5).float()
    rollouts = per_sample_rewards(torch.randn(B, generator=g))
    for est in ("reinforce", "on_policy_distill"):
        out = compute_advantages(est, rollouts, mask, kl=torch.randn(B, T_len, generator=g), kl_coef=0.1)
        assert torch.all(out.advantages[mask == 0] == 0)
    out = compute_advantages("gae", rollouts, mask, values=torch.randn(B, T_len, generator=g))
    assert torch.all(out.advantages[mask == 0] == 0) and torch.all(out.returns[mask == 0] == 0)
