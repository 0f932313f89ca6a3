"""pass@k from any number of samples per prompt, decoded a chunk at a time: the estimator is
1 - C(n-c, k) / C(n, k) to within rounding for n = 1024 (products, never the binomials), and
evaluating with eval.sample_chunk gives exactly the pass@k and avg@n of decoding every sample at
once, holding one chunk's completions at a time."""
import math
from fractions import Fraction

import numpy as np
import pytest

from hpc.evaluate import pass_at_k, pass_at_k_curve, pass_at_k_table


def exact(n: int, c: int, k: int) -> float:
    return float(1 - Fraction(math.comb(n - c, k), math.comb(n, k)))


@pytest.mark.parametrize("k", [1, 8, 64, 256])
def test_the_estimator_is_the_binomial_ratio_at_n_1024(k):
    n, table = 1024, pass_at_k_table(1024)
    for c in range(n + 1):
        want = exact(n, c, k)
        assert pass_at_k(n, c, k) == pytest.approx(want, rel=1e-12, abs=1e-14), c
        assert table[c, k - 1] == pytest.approx(want, rel=1e-12, abs=1e-14), c
    assert table[0, k - 1] == 0.0 and table[n - k + 1, k - 1] == 1.0


def test_the_curve_at_n_1024_is_the_mean_of_the_binomial_ratios():
    counts = np.array([0, 1, 3, 17, 500, 1023, 1024])
    curve = pass_at_k_curve(counts, 1024)
    for k in (1, 8, 64, 256, 1024):
        want = np.mean([exact(1024, c, k) for c in counts])
        assert curve[k - 1] == pytest.approx(want, rel=1e-12)
    assert np.all(np.diff(curve) >= 0) and curve[0] == pytest.approx(counts.sum() / 7 / 1024)


def toy_eval(monkeypatch, chunk: int, n: int = 6) -> tuple:
    """(EvalResult, completions per generate call) of the toy on 10 held-out arith problems,
    ``n`` samples each at temperature 1.5, ``chunk`` of them per decoding call."""
    import torch
    from mpi4py import MPI

    import hpc.engine.generate as generation
    from hpc.data.tasks import arith_task
    from hpc.engine.engine_backend import EngineBackend
    from hpc.evaluate import evaluate
    from hpc.models.loading import load_model
    from hpc.job.config import EvalConfig
    from hpc.runtime.world import World
    from hpc.toys.toy import toy_model_path

    torch.set_num_threads(1)
    sizes, real = [], generation.generate

    def counted(*args, **kw):
        out = real(*args, **kw)
        sizes.append(len(out))
        return out

    monkeypatch.setattr(generation, "generate", counted)
    model, tok = load_model(toy_model_path())
    task = arith_task(n_train=10, n_eval=10, digits=2, ops="+-", seed=5)
    world = World(comm=MPI.COMM_SELF, rank=0, size=1, local_rank=0, local_size=1,
                  hostname="here")
    cfg = EvalConfig(n_samples=n, temperature=1.5, batch_size=4, sample_chunk=chunk)
    result = evaluate(model, tok, task, task.eval, cfg, 8, world, EngineBackend(), seed=9)
    return result, sizes


@pytest.mark.toy
def test_chunked_sampling_gives_the_same_pass_at_k_as_all_at_once(monkeypatch):
    whole, sizes = toy_eval(monkeypatch, 0)
    assert sizes == [10, 60]  # greedy, then all 6 samples of the 10 problems
    assert 0.0 < whole.pass_at_k[0] < whole.pass_at_k[-1] < 1.0  # samples differ
    for chunk in (4, 1):
        chunked, sizes = toy_eval(monkeypatch, chunk)
        assert max(sizes[1:]) == 10 * chunk and sum(sizes[1:]) == 60, sizes
        assert np.array_equal(chunked.pass_at_k, whole.pass_at_k), chunk
        assert chunked.avg_at_n == whole.avg_at_n
        assert np.array_equal(chunked.greedy_correct, whole.greedy_correct)
