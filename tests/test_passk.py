"""pass@k agrees with exhaustive enumeration of k-subsets."""
import itertools

import numpy as np
import pytest

from hpc.evaluate import pass_at_k, pass_at_k_curve


@pytest.mark.parametrize("n", [1, 2, 3, 5, 7])
def test_pass_at_k_equals_enumeration(n):
    for c in range(n + 1):
        outcomes = [1] * c + [0] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(outcomes, k))
            exact = sum(any(s) for s in subsets) / len(subsets)
            assert pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-12)


def test_large_n_is_stable():
    assert pass_at_k(256, 1, 256) == 1.0
    assert pass_at_k(256, 0, 1) == 0.0
    assert pass_at_k(256, 3, 1) == pytest.approx(3 / 256)
    assert 0.0 < pass_at_k(1000, 1, 500) <= 1.0


def test_curve_is_mean_and_monotone():
    counts = np.array([0, 1, 4])
    curve = pass_at_k_curve(counts, 4)
    assert curve[0] == pytest.approx((0 + 0.25 + 1.0) / 3)
    assert curve[-1] == pytest.approx(2 / 3)
    assert np.all(np.diff(curve) >= 0)


def test_k_out_of_range():
    with pytest.raises(ValueError):
        pass_at_k(3, 1, 4)


@pytest.mark.parametrize("c", [-1, 4, 100])
def test_correct_count_out_of_range(c):
    with pytest.raises(ValueError, match=f"0 <= c <= n.*c={c}, n=3"):
        pass_at_k(3, c, 1)
