"""Pure RL algorithm functions (no Ray, no models): rewards, advantages, KL, IS correction, losses.

One module per concern: `reward` (grouping, length shaping, clipping, whitening), `advantages` (the eight
estimators, with Molt 0.2.1's flash_reinforce), `kl` (k1/k2/k3 against a model or the rollout policy, and the
coefficient controllers), `is_correction` (level × mode × gating), `losses` (PPO/GSPO/CISPO, value, SFT),
`aggregation` (token-, seq- and prompt-mean over an optimizer step's window), `penalties` (DAPO overlong, ProRL
stop-properly), `score_centering` (the top-k head correction), `mismatch` (train–inference mismatch metrics). Shapes: (B, T) per-token tensors on the action axis with an `action_mask`.
"""

from runtime.algo.advantages import ESTIMATORS, Advantages, compute_advantages
from runtime.algo.is_correction import IsCorrection, is_correction, masked_mean
from runtime.algo.kl import AdaptiveKLController, FixedKLController, kl_estimate, make_kl_controller
from runtime.algo.losses import (
    ActorLossOutput,
    PolicyLossOutput,
    actor_loss,
    entropy_from_logits,
    global_token_mean,
    policy_loss,
    sft_loss,
    value_loss,
)
from runtime.algo.reward import GROUP_ESTIMATORS, RolloutRewards, clip_rewards, prepare_rewards, whiten

__all__ = [
    "ESTIMATORS", "GROUP_ESTIMATORS", "ActorLossOutput", "AdaptiveKLController", "Advantages", "FixedKLController",
    "IsCorrection", "PolicyLossOutput", "RolloutRewards", "actor_loss", "clip_rewards", "compute_advantages",
    "entropy_from_logits", "global_token_mean", "is_correction", "kl_estimate", "make_kl_controller", "masked_mean",
    "policy_loss", "prepare_rewards", "sft_loss", "value_loss", "whiten",
]
