"""pass@k with the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models Trained on Code", §2.1):
from n samples of a prompt of which c are correct,

    pass@k = 1 − C(n − c, k) / C(n, k)

the probability that at least one of k samples drawn without replacement from the n is correct, computed as a product
(numerically stable for large n), then averaged over prompts. Taking the fraction of prompts whose first k samples
contain a correct one instead would be noisier and, for k < n, biased by the order of the samples.
"""

from __future__ import annotations

import math


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with `c` correct out of `n` samples (k <= n)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def mean_pass_at_k(correct: list[int], n: int, ks: list[int] | tuple[int, ...]) -> dict[int, float]:
    """{k: mean over prompts of pass@k}, each prompt with `correct[i]` correct out of `n` samples."""
    return {k: sum(pass_at_k(n, c, k) for c in correct) / max(len(correct), 1) for k in ks}
