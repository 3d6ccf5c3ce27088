"""Timing of the algorithm functions on a large batch, to check they never become the step's bottleneck.

    python -m runtime.algo.bench [--prompts 1280] [--n 8] [--tokens 1024] [--repeat 3]

Defaults: 1280 prompt groups × 8 samples = 10,240 samples of 1024 action-axis positions (DESIGN §8's "10k-sample
batches"), with ragged action masks. Prints the best of `--repeat` wall times per function, on CPU.
"""

from __future__ import annotations

import argparse
import time

import torch

from runtime.algo import advantages as adv_mod
from runtime.algo.is_correction import is_correction
from runtime.algo.kl import kl_estimate
from runtime.algo.losses import policy_loss
from runtime.algo.reward import prepare_rewards, whiten


def best_of(repeat: int, fn) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=1280)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)

    g = torch.Generator().manual_seed(0)
    B, T = args.prompts * args.n, args.tokens
    lengths = torch.randint(T // 8, T, (B,), generator=g)
    mask = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).float()  # (B, T) ragged right padding
    rewards = torch.randint(0, 2, (B,), generator=g).float()
    rollout_ids = [f"r{i}" for i in range(B)]
    group_ids = [f"g{i // args.n}" for i in range(B)]
    logp = -torch.rand(B, T, generator=g)
    old = logp + 0.01 * torch.randn(B, T, generator=g)
    rollout = old + 0.01 * torch.randn(B, T, generator=g)
    values = torch.randn(B, T, generator=g)
    kl = kl_estimate(old, rollout, "k1", mask)
    grouped = prepare_rewards("grpo", rewards, rollout_ids, group_ids, (-10.0, 10.0))
    single = prepare_rewards("reinforce", rewards, rollout_ids, group_ids, (-10.0, 10.0))

    def loss_fwd_bwd():
        x = logp.clone().requires_grad_(True)
        out = policy_loss(x, old, values, mask, mode="ppo", clip_low=0.2, clip_high=0.28, dual_clip=3.0,
                          global_num_tokens=mask.sum())
        out.loss.backward()

    cases = {
        "prepare_rewards (merge by rollout_id + clip)": lambda: prepare_rewards("grpo", rewards, rollout_ids,
                                                                                group_ids, (-10.0, 10.0)),
        "grpo advantages": lambda: adv_mod.compute_advantages("grpo", grouped, mask),
        "rloo advantages": lambda: adv_mod.compute_advantages("rloo", grouped, mask),
        "reinforce_baseline advantages (whitened)": lambda: adv_mod.compute_advantages("reinforce_baseline", grouped,
                                                                                       mask),
        "reinforce γ=1 (KL reward, whitened)": lambda: adv_mod.compute_advantages("reinforce", single, mask, kl=kl,
                                                                                  kl_coef=0.01),
        "reinforce γ=0.99 (loop over T)": lambda: adv_mod.compute_advantages("reinforce", single, mask, kl=kl,
                                                                             kl_coef=0.01, gamma=0.99),
        "gae γ=1 λ=0.95 (loop over T)": lambda: adv_mod.compute_advantages("gae", single, mask, values=values,
                                                                          lam=0.95),
        "whiten": lambda: whiten(values, mask),
        "kl_estimate k3": lambda: kl_estimate(logp, old, "k3", mask),
        "is_correction geo/mask": lambda: is_correction(old, rollout, mask, level="geo", mode="mask", low=0.5,
                                                        high=2.0),
        "is_correction token/trunc": lambda: is_correction(old, rollout, mask, level="token", mode="trunc",
                                                           low=0.5, high=2.0),
        "ppo policy_loss forward + backward": loss_fwd_bwd,
    }
    print(f"batch: {B} samples x {T} positions ({int(mask.sum())} action tokens), torch threads "
          f"{torch.get_num_threads()}")
    for name, fn in cases.items():
        print(f"  {name:<48} {best_of(args.repeat, fn) * 1000:9.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
