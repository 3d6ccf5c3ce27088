"""The unbiased pass@k estimator (Chen et al. 2021) against its definition: over every k-subset of the n samples,
the fraction that holds a correct one."""

from __future__ import annotations

import itertools
import math

import pytest

from molt_compile.lower.rl import _pass_ks
from runtime.passk import mean_pass_at_k, pass_at_k


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_is_the_fraction_of_k_subsets_with_a_correct_sample(n):
    for c in range(n + 1):
        samples = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(samples, k))
            expected = sum(any(s) for s in subsets) / len(subsets)
            assert math.isclose(pass_at_k(n, c, k), expected, abs_tol=1e-12), (n, c, k)


def test_pass_at_1_is_the_fraction_correct_and_large_n_is_stable():
    assert pass_at_k(8, 3, 1) == pytest.approx(3 / 8)
    assert pass_at_k(1000, 1, 1) == pytest.approx(1e-3)
    assert pass_at_k(1000, 1, 1000) == 1.0
    assert mean_pass_at_k([0, 8, 4], 8, [1, 8]) == pytest.approx({1: (0 + 1 + 0.5) / 3, 8: 2 / 3})
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)


def test_plan_reports_powers_of_two_and_n():
    assert _pass_ks(1) == [1]
    assert _pass_ks(8) == [1, 2, 4, 8]
    assert _pass_ks(12) == [1, 2, 4, 8, 12]
