"""ESSA optimizers: progress on a sphere, seed determinism, bitwise save/resume."""
import os
import subprocess
import sys

import numpy as np
import pytest

from essa.optimizers import (OPTIMIZERS, CMAES, OpenAIES, Tracked, centered_ranks,
                             make_optimizer)
from hpc.runtime.checkpoint import load_latest, save_checkpoint
from hpc.runtime.errors import UserError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET = np.linspace(-1.0, 1.0, 10)  # sphere optimum; fitness(0) = -sum(TARGET**2) = -4.07


def sphere(xs: np.ndarray) -> np.ndarray:
    """(P, 10) -> (P,) fitness, maximum 0 at TARGET."""
    return -((xs - TARGET) ** 2).sum(axis=1)


def generations(opt, n: int) -> list:
    """Run n generations on the sphere; the asked populations, (P, dim) each."""
    asked = []
    for _ in range(n):
        xs = opt.ask()
        opt.tell(xs, sphere(xs))
        asked.append(xs)
    return asked


@pytest.mark.parametrize("name", ["cma", "sep-cma"])
def test_cma_improves_on_sphere(name):
    opt = make_optimizer(name, dim=10, popsize=10, sigma0=0.5, seed=3)
    best = [sphere(xs).max() for xs in generations(opt, 30)]
    # measured: best -2.94 -> -0.033 (cma) / -0.055 (sep-cma); mean -0.014 / -0.016
    assert best[0] < -2.5
    assert best[-1] - best[0] > 2.8
    assert sphere(opt.mean[None])[0] > -0.05


def test_openai_es_improves_on_sphere():
    opt = make_optimizer("openai-es", dim=10, popsize=20, sigma0=0.1, seed=3, lr=0.05)
    best = [sphere(xs).max() for xs in generations(opt, 60)]
    # measured: best -2.96 -> -0.10, mean -0.076
    assert best[0] < -2.5
    assert best[-1] - best[0] > 2.7
    assert sphere(opt.mean[None])[0] > -0.15


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_same_seed_same_run_whatever_the_global_rng(name):
    a, b, other = (make_optimizer(name, 10, 8, 0.5, seed, lr=0.05) for seed in (7, 7, 8))
    for _ in range(6):
        xa = a.ask()
        np.random.rand(3)  # the caller's use of numpy's global RNG must not matter
        xb = b.ask()
        assert np.array_equal(xa, xb)
        assert not np.array_equal(xa, other.ask())
        for opt in (a, b, other):
            opt.tell(xa, sphere(xa))
        assert np.array_equal(a.mean, b.mean)


def test_cma_leaves_the_global_rng_alone():
    np.random.seed(5)
    expected = np.random.rand(4)
    np.random.seed(5)
    generations(CMAES(10, 4, 0.5, seed=1), 3)
    assert np.array_equal(np.random.rand(4), expected)


def through_checkpoint(state: dict, folder) -> dict:
    """``state`` after a save and load in a checkpoint (safetensors + JSON, no pickle)."""
    save_checkpoint(str(folder), 1, {"optimizer": state})
    return load_latest(str(folder))["optimizer"]


def assert_resumes_bitwise(build, folder, n=10, stop=5):
    reference = build()
    expected = generations(reference, n)
    first = build()
    generations(first, stop)
    state = through_checkpoint(first.state_dict(), folder)
    resumed = build()
    resumed.load_state_dict(state)
    for xs, want in zip(generations(resumed, n - stop), expected[stop:]):
        assert np.array_equal(xs, want)
    assert np.array_equal(resumed.mean, reference.mean)


@pytest.mark.parametrize("popsize", [4, 10])  # popsize < 6: pycma adds mirrored samples
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_resume_is_bitwise(name, popsize, tmp_path):
    assert_resumes_bitwise(lambda: make_optimizer(name, 10, popsize, 0.5, 11, lr=0.05),
                           tmp_path)


RESUME_CHILD = """
import sys
import numpy as np
from essa.optimizers import make_optimizer
from hpc.runtime.checkpoint import load_latest
name, state_dir, out_path = sys.argv[1:]
opt = make_optimizer(name, 10, 6, 0.5, 11)
opt.load_state_dict(load_latest(state_dir)["optimizer"])
asked = []
for _ in range(4):
    xs = opt.ask()
    opt.tell(xs, -((xs - np.linspace(-1, 1, 10)) ** 2).sum(axis=1))
    asked.append(xs)
np.savez(out_path, asked=np.stack(asked), mean=opt.mean)
"""


@pytest.mark.parametrize("name", ["cma", "sep-cma"])
@pytest.mark.subprocess
def test_resume_in_another_process_is_bitwise(name, tmp_path):
    """pycma keys asked solutions by hash(bytes), which each process salts differently."""
    reference = make_optimizer(name, 10, 6, 0.5, 11)
    expected = generations(reference, 7)
    first = make_optimizer(name, 10, 6, 0.5, 11)
    generations(first, 3)
    save_checkpoint(str(tmp_path / "state"), 3, {"optimizer": first.state_dict()})
    env = dict(os.environ, PYTHONHASHSEED="12345", PYTHONPATH=REPO)
    subprocess.run([sys.executable, "-c", RESUME_CHILD, name, str(tmp_path / "state"),
                    str(tmp_path / "out.npz")], check=True, env=env, timeout=60)
    got = np.load(tmp_path / "out.npz")
    assert np.array_equal(got["asked"], np.stack(expected[3:]))
    assert np.array_equal(got["mean"], reference.mean)


def test_cma_state_only_between_generations():
    opt = CMAES(10, 6, 0.5, seed=0)
    opt.ask()
    with pytest.raises(RuntimeError, match="between ask"):
        opt.state_dict()


def test_resume_with_other_settings_is_refused():
    state = CMAES(10, 6, 0.5, seed=0).state_dict()
    with pytest.raises(UserError, match="popsize = 6"):
        CMAES(10, 8, 0.5, seed=0).load_state_dict(state)
    with pytest.raises(UserError, match="kind = 'cma'"):
        CMAES(10, 6, 0.5, seed=0, diagonal=True).load_state_dict(state)


def test_openai_es_members_from_seeds():
    opt = OpenAIES(dim=10, popsize=8, sigma=0.2, lr=0.05, seed=4)
    generations(opt, 2)
    seeds = opt.member_seeds()
    assert seeds.dtype == np.int64 and seeds.shape == (4,) and np.all(seeds >= 0)
    xs = opt.ask()
    assert np.array_equal(opt.ask(), xs)  # asking again within a generation: same members
    for i in range(8):
        assert np.array_equal(opt.member(i), xs[i])
    np.testing.assert_allclose(xs[0::2] + xs[1::2], 2 * opt.mean[None].repeat(4, 0), atol=1e-15)
    opt.tell(xs, sphere(xs))
    assert not np.array_equal(opt.member_seeds(), seeds)


def test_centered_ranks_share_ties():
    np.testing.assert_array_equal(centered_ranks(np.array([3.0, 1.0, 2.0, 2.0])),
                                  [0.5, -0.5, 0.0, 0.0])
    opt = OpenAIES(dim=10, popsize=6, sigma=0.2, lr=0.05, seed=0)
    xs = opt.ask()
    opt.tell(xs, np.array([1.0, 1.0, 0.0, 0.0, 5.0, 5.0]))  # every pair tied: no signal
    assert np.array_equal(opt.mean, np.zeros(10))


def test_bad_settings_are_user_errors():
    with pytest.raises(UserError, match="unknown optimizer 'adam'"):
        make_optimizer("adam", 10, 8, 0.5, 0)
    with pytest.raises(UserError, match="even popsize"):
        make_optimizer("openai-es", 10, 7, 0.5, 0)
    with pytest.raises(UserError, match="sigma0"):
        make_optimizer("cma", 10, 8, 0.0, 0)
    with pytest.raises(ValueError, match="NaN"):
        opt = CMAES(10, 6, 0.5, seed=0)
        opt.tell(opt.ask(), np.full(6, np.nan))


def test_tracked_optimizer_ranks_nan_worst_and_keeps_the_best_member():
    tracked = Tracked(make_optimizer("sep-cma", 3, 4, 0.5, seed=0))
    X = tracked.ask()
    told = tracked.tell(X, np.array([0.2, np.nan, 0.9, 0.1]))
    assert tracked.bad_fitness == 1 and told.tolist() == [0.2, -0.9, 0.9, 0.1]
    assert tracked.best_fitness == 0.9 and np.array_equal(tracked.best_x, X[2])
    tracked.tell(tracked.ask(), np.full(4, 0.5))  # worse: the best stays
    assert tracked.bad_fitness == 0 and np.array_equal(tracked.best_x, X[2])
    again = Tracked(make_optimizer("sep-cma", 3, 4, 0.5, seed=0))
    again.load_state_dict(tracked.state_dict())
    assert np.array_equal(again.ask(), tracked.ask()) and again.best_fitness == 0.9


@pytest.mark.subprocess
def test_the_config_offers_the_registry_without_importing_pycma():
    """essa.optimizer's choices are OPTIMIZERS' keys; the config imports the registry, and
    pycma waits until a CMA-ES is built (essa --help stays fast)."""
    code = ("import sys; from essa.config import ESSAConfig; from essa.optimizers import "
            "OPTIMIZERS; from dataclasses import fields; "
            "choices = {f.name: f.metadata['choices'] for f in fields(ESSAConfig)}['optimizer'];"
            "print(choices is OPTIMIZERS, 'cma' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=REPO), timeout=60)
    assert proc.stdout.split() == ["True", "False"], proc.stderr[-2000:]
