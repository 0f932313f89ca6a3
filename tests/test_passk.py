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


@pytest.mark.parametrize("n, c, k", [
    (8, 2.5, 1), (8.0, 2, 1), (8, 2, 1.0), (8, 2, 1.5), (True, 0, 1), (8, True, 1),
    (8, 2, np.True_), (8, "2", 1), (8, None, 1), (8, np.float64(2), 1),
])
def test_non_integer_counts_are_refused(n, c, k):
    with pytest.raises(ValueError, match="integer counts"):
        pass_at_k(n, c, k)


def test_numpy_integers_are_counts():
    assert pass_at_k(np.int64(8), np.int32(2), np.uint8(1)) == pytest.approx(2 / 8)


@pytest.mark.parametrize("counts, n", [
    ([1.5, 2], 4), ([1.0, 2.0], 4), ([True, False], 4), ([1, 2], 4.0), ([1, 2], True),
])
def test_curve_refuses_non_integer_counts(counts, n):
    with pytest.raises(ValueError, match="integer"):
        pass_at_k_curve(np.array(counts), n)


def test_curve_takes_numpy_integer_counts_and_checks_their_range():
    assert pass_at_k_curve(np.array([0, 4], dtype=np.int32), np.int64(4))[-1] == 0.5
    with pytest.raises(ValueError, match="0 <= c <= n"):
        pass_at_k_curve(np.array([5]), 4)
