"""Evolution strategies behind one ask/tell interface, MAXIMISING fitness, with savable state.

Every optimizer is a deterministic function of its seed and of the fitness values told: MPI
ranks that build one with the same seed and tell it the same (all-gathered) fitness hold
bitwise identical state, so solutions never cross the network. ``state_dict()`` holds numpy
arrays, Python scalars, strings and containers of these only (no pickle, so a checkpoint
cannot carry code); after ``load_state_dict`` in any process, ask/tell
continue bitwise as if never stopped. Save between generations (after tell, before ask).

:data:`OPTIMIZERS` names them (``essa.optimizer`` chooses among its keys): a new optimizer is
its class, in a file of its own, and its line there. The config imports this module, so pycma
is imported only when a CMA-ES is built (``essa --help`` stays fast).
"""
import contextlib
from typing import Protocol

import numpy as np

from hpc.runtime.errors import UserError
from hpc.runtime.readback import amount, array, bad_field, count, finite


class Optimizer(Protocol):
    """The ask/tell interface. P = popsize members, dim = search space length. A registered
    optimizer is built as ``OPTIMIZERS[name](dim, popsize, sigma0, seed, lr=, stds=)``:
    sigma0 the initial step size, lr a learning rate (essa.lr) and stds None or the (dim,)
    per-coordinate scale of the initial distribution (essa.sigma_scale=relative), each used by
    the optimizers that have such a setting."""

    popsize: int
    dim: int

    @property
    def mean(self) -> np.ndarray:
        """(dim,) float64 centre of the search distribution."""

    def ask(self) -> np.ndarray:
        """(P, dim) float64 members of the current generation."""

    def tell(self, solutions: np.ndarray, fitness: np.ndarray) -> None:
        """Finish the generation: solutions (P, dim) from ask, fitness (P,), higher is better."""

    def state_dict(self) -> dict:
        """Everything needed to resume bitwise."""

    def load_state_dict(self, state: dict) -> None:
        """Resume from ``state_dict()`` output."""


def _check_config(dim: int, popsize: int, sigma: float) -> None:
    if dim < 1:
        raise UserError(f"the search space is empty (dim = {dim})")
    if popsize < 2:
        raise UserError(f"popsize must be at least 2, got {popsize}")
    if not sigma > 0:
        raise UserError(f"sigma0 must be positive, got {sigma}")


def _check_tell(solutions, fitness, popsize: int, dim: int):
    solutions = np.asarray(solutions, dtype=np.float64)
    fitness = np.asarray(fitness, dtype=np.float64)
    if solutions.shape != (popsize, dim) or fitness.shape != (popsize,):
        raise ValueError(f"tell needs solutions ({popsize}, {dim}) and fitness ({popsize},), "
                         f"got {solutions.shape} and {fitness.shape}")
    if not np.all(np.isfinite(fitness)):
        raise ValueError(f"fitness holds NaN or infinite values: {fitness}")
    return solutions, fitness


def _check_state(state: dict, **expected) -> None:
    for key, value in expected.items():
        if type(state[key]) is not type(value) or state[key] != value:
            raise UserError(f"optimizer checkpoint has {key} = {state[key]!r}, but this run "
                            f"uses {value!r}; resume with the original settings")


def _randn(*shape) -> np.ndarray:
    """numpy's global randn, looked up at each call: pycma keeps this function, and the
    ``np.random.set_state`` swaps in CMAES._own_rng act on the global RNG it reaches."""
    return np.random.randn(*shape)


class CMAES:
    """pycma's CMA-ES (``diagonal=True``: separable sep-CMA-ES) from x0 = 0, maximising.

    pycma draws from numpy's GLOBAL RNG (samples, and stochastic rounding of mirrored samples
    for popsize < 6). Each call into pycma swaps in this object's own MT19937 state and swaps
    it back out, so instances never disturb each other or the caller (not thread-safe).
    """

    def __init__(self, dim: int, popsize: int, sigma0: float, seed: int, diagonal: bool = False,
                 stds: np.ndarray | None = None):
        """``stds`` (dim,): per-coordinate scale of the initial search distribution (pycma's
        ``CMA_stds``); the initial std of coordinate i is ``sigma0 * stds[i]``."""
        _check_config(dim, popsize, sigma0)
        self.dim, self.popsize, self.diagonal = dim, popsize, diagonal
        self._rng_state = np.random.RandomState(seed).get_state()
        self._asked = False
        options = {"popsize": popsize, "seed": np.nan, "randn": _randn,
                   "CMA_diagonal": True if diagonal else 0, "bounds": [None, None],
                   "verbose": -9, "verb_log": 0, "verb_disp": 0}
        if stds is not None:
            options["CMA_stds"] = np.asarray(stds, dtype=np.float64)
        from essa.cma_import import cma

        with self._own_rng():
            self._es = cma.CMAEvolutionStrategy(np.zeros(dim), sigma0, options)

    @contextlib.contextmanager
    def _own_rng(self):
        outer = np.random.get_state()
        np.random.set_state(self._rng_state)
        try:
            yield
        finally:
            self._rng_state = np.random.get_state()
            np.random.set_state(outer)

    @property
    def mean(self) -> np.ndarray:
        """(dim,) float64 distribution mean."""
        return np.array(self._es.mean, dtype=np.float64)

    @property
    def sigma(self) -> float:
        """Current global step size."""
        return float(self._es.sigma)

    def ask(self) -> np.ndarray:
        """(P, dim) float64 new members; each call draws a fresh population."""
        with self._own_rng():
            population = np.array(self._es.ask(), dtype=np.float64)
        self._asked = True
        return population

    def tell(self, solutions: np.ndarray, fitness: np.ndarray) -> None:
        """Update from the asked solutions (P, dim) and their fitness (P,), higher is better."""
        solutions, fitness = _check_tell(solutions, fitness, self.popsize, self.dim)
        with self._own_rng():
            self._es.tell(list(solutions), list(-fitness))
        self._asked = False

    def state_dict(self) -> dict:
        """pycma's arrays and counters (:mod:`essa.cma_state`) + RNG state. Only between
        generations: pycma files asked members under ``hash(bytes)``, which differs between
        processes, so a pending generation could not be told after a restart."""
        if self._asked:
            raise RuntimeError("CMAES.state_dict() between ask() and tell(); save after tell()")
        from essa.cma_state import es_state

        _, keys, pos, has_gauss, cached = self._rng_state
        return {"kind": "sep-cma" if self.diagonal else "cma", "dim": self.dim,
                "popsize": self.popsize, "es": es_state(self._es),
                "rng_keys": np.array(keys, dtype=np.uint32), "rng_pos": int(pos),
                "rng_has_gauss": int(has_gauss), "rng_cached_gaussian": float(cached)}

    def load_state_dict(self, state: dict) -> None:
        """Resume into this object, which must be built with the original arguments."""
        _check_state(state, kind="sep-cma" if self.diagonal else "cma", dim=self.dim,
                     popsize=self.popsize)
        source = "CMA-ES checkpoint"
        rng_state = ("MT19937", array(state["rng_keys"], source, "rng_keys", (624,), "u"),
                     count(state["rng_pos"], source, "rng_pos", maximum=624),
                     count(state["rng_has_gauss"], source, "rng_has_gauss", maximum=1),
                     amount(state["rng_cached_gaussian"], source, "rng_cached_gaussian",
                            minimum=-np.inf))
        if not rng_state[1].any():  # MT19937 never leaves the all-zero state: a hang
            raise bad_field(source, "rng_keys", "is all zeros, which MT19937 never reaches")
        from essa.cma_state import restore_es_state

        restore_es_state(self._es, state["es"])
        self._rng_state = rng_state
        self._asked = False


def centered_ranks(fitness: np.ndarray) -> np.ndarray:
    """(P,) fitness -> (P,) weights in [-0.5, 0.5] by rank; tied values share their mean rank,
    so an antithetic pair with equal fitness contributes nothing."""
    order = np.argsort(fitness, kind="stable")
    ranks = np.empty(len(fitness))
    ranks[order] = np.arange(len(fitness))
    _, tie, counts = np.unique(fitness, return_inverse=True, return_counts=True)
    ranks = np.bincount(tie, weights=ranks)[tie] / counts[tie]
    return ranks / (len(fitness) - 1) - 0.5


class OpenAIES:
    """OpenAI-ES (Salimans et al. 2017): antithetic pairs, centered ranks, Adam on the mean.

    Generation g has P/2 integer seeds drawn from SeedSequence([seed, g]); pair j's noise is
    eps_j = standard normal (dim,) from Philox(seed_j), member 2j = mean + sigma eps_j and
    member 2j+1 = mean - sigma eps_j. Any rank rebuilds any member from (seed_j, sign), and tell
    regenerates the noise pair by pair: O(dim) memory however large P is.
    """

    def __init__(self, dim: int, popsize: int, sigma: float, lr: float, seed: int,
                 betas: tuple = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0):
        _check_config(dim, popsize, sigma)
        if popsize % 2:
            raise UserError(f"openai-es needs an even popsize (antithetic pairs), got {popsize}")
        if not lr > 0:
            raise UserError(f"lr must be positive, got {lr}")
        if seed < 0:
            raise UserError(f"seed must be non-negative, got {seed}")
        self.dim, self.popsize, self.sigma, self.lr = dim, popsize, sigma, lr
        self.betas, self.eps, self.weight_decay = betas, eps, weight_decay
        self.seed, self.generation = seed, 0
        self._mean, self._m, self._v = np.zeros(dim), np.zeros(dim), np.zeros(dim)

    @property
    def mean(self) -> np.ndarray:
        """(dim,) float64 distribution mean."""
        return self._mean.copy()

    def member_seeds(self) -> np.ndarray:
        """(P/2,) int64 noise seeds of the current generation (identical on every rank)."""
        state = np.random.SeedSequence([self.seed, self.generation]).generate_state(
            self.popsize // 2, dtype=np.uint64)
        return (state >> np.uint64(1)).astype(np.int64)

    def _noise(self, seed) -> np.ndarray:
        return np.random.Generator(np.random.Philox(int(seed))).standard_normal(self.dim)

    def member(self, i: int) -> np.ndarray:
        """(dim,) member i of the current generation, rebuilt from its seed alone."""
        sign = 1.0 if i % 2 == 0 else -1.0
        return self._mean + sign * self.sigma * self._noise(self.member_seeds()[i // 2])

    def ask(self) -> np.ndarray:
        """(P, dim) float64 members; the same array until tell() ends the generation."""
        population = np.empty((self.popsize, self.dim))
        for j, seed in enumerate(self.member_seeds()):
            step = self.sigma * self._noise(seed)
            population[2 * j] = self._mean + step
            population[2 * j + 1] = self._mean - step
        return population

    def tell(self, solutions: np.ndarray, fitness: np.ndarray) -> None:
        """One Adam ascent step along the rank-shaped gradient estimate
        g = sum_j (w_2j - w_2j+1) eps_j / (P sigma) - weight_decay * mean."""
        _, fitness = _check_tell(solutions, fitness, self.popsize, self.dim)
        weights = centered_ranks(fitness)
        grad = np.zeros(self.dim)
        for j, seed in enumerate(self.member_seeds()):
            grad += (weights[2 * j] - weights[2 * j + 1]) * self._noise(seed)
        grad = grad / (self.popsize * self.sigma) - self.weight_decay * self._mean
        beta1, beta2 = self.betas
        self.generation += 1
        self._m = beta1 * self._m + (1 - beta1) * grad
        self._v = beta2 * self._v + (1 - beta2) * grad ** 2
        m_hat = self._m / (1 - beta1 ** self.generation)
        v_hat = self._v / (1 - beta2 ** self.generation)
        self._mean = self._mean + self.lr * m_hat / (np.sqrt(v_hat) + self.eps)

    def state_dict(self) -> dict:
        return {"kind": "openai-es", "dim": self.dim, "popsize": self.popsize,
                "seed": self.seed, "generation": self.generation, "mean": self._mean.copy(),
                "adam_m": self._m.copy(), "adam_v": self._v.copy()}

    def load_state_dict(self, state: dict) -> None:
        _check_state(state, kind="openai-es", dim=self.dim, popsize=self.popsize)
        source = "OpenAI-ES checkpoint"
        vectors = [finite(array(state[key], source, key, (self.dim,), "f"), source, key
                          ).astype(np.float64) for key in ("mean", "adam_m", "adam_v")]
        if (vectors[2] < 0).any():
            raise bad_field(source, "adam_v", "holds negative values (a mean of squares)")
        self.seed = count(state["seed"], source, "seed", maximum=2 ** 63 - 1)
        self.generation = count(state["generation"], source, "generation")
        self._mean, self._m, self._v = vectors


def cma_es(dim: int, popsize: int, sigma0: float, seed: int, lr: float,
           stds: np.ndarray | None) -> CMAES:
    """Full-covariance CMA-ES; it adapts its own step size (no lr)."""
    return CMAES(dim, popsize, sigma0, seed, stds=stds)


def sep_cma_es(dim: int, popsize: int, sigma0: float, seed: int, lr: float,
               stds: np.ndarray | None) -> CMAES:
    """Separable (diagonal) CMA-ES, O(dim) memory per member."""
    return CMAES(dim, popsize, sigma0, seed, diagonal=True, stds=stds)


def openai_es(dim: int, popsize: int, sigma0: float, seed: int, lr: float,
              stds: np.ndarray | None) -> OpenAIES:
    """OpenAI-ES with Adam at ``lr``; its noise is isotropic (no stds: the config refuses
    essa.sigma_scale=relative with it)."""
    return OpenAIES(dim, popsize, sigma0, lr, seed)


# essa.optimizer's choices: name -> what builds it (a class or function called as
# Optimizer's docstring says). A new optimizer: its file and one line here.
OPTIMIZERS = {"cma": cma_es, "sep-cma": sep_cma_es, "openai-es": openai_es}


def make_optimizer(name: str, dim: int, popsize: int, sigma0: float, seed: int,
                   lr: float = 0.01, stds: np.ndarray | None = None) -> Optimizer:
    """The optimizer registered as ``name`` in :data:`OPTIMIZERS`."""
    if name not in OPTIMIZERS:
        raise UserError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}")
    return OPTIMIZERS[name](dim, popsize, sigma0, seed, lr=lr, stds=stds)


def sanitize(fitness: np.ndarray) -> tuple:
    """Replace NaN/inf fitness by the worst finite value minus 1; returns (fitness, n_bad)."""
    bad = ~np.isfinite(fitness)
    if not bad.any():
        return fitness, 0
    worst = fitness[~bad].min() if (~bad).any() else 0.0
    out = fitness.copy()
    out[bad] = worst - 1.0
    return out, int(bad.sum())


class Tracked:
    """An optimizer as a training run uses it: ``tell`` accepts NaN/inf fitness (a member whose
    completions could not be scored counts as the worst, see :func:`sanitize`) and the best
    member told so far is remembered (it is exported beside the mean)."""

    def __init__(self, optimizer: Optimizer):
        self.optimizer = optimizer
        self.best_x = optimizer.mean.copy()  # (dim,) float64
        self.best_fitness = -np.inf
        self.bad_fitness = 0  # NaN/inf fitness values in the last tell

    @property
    def mean(self) -> np.ndarray:
        return self.optimizer.mean

    @property
    def sigma(self) -> float | None:
        """The global step size, for the optimizers that have one (None for others)."""
        return getattr(self.optimizer, "sigma", None)

    def ask(self) -> np.ndarray:
        return self.optimizer.ask()

    def tell(self, solutions: np.ndarray, fitness: np.ndarray) -> np.ndarray:
        """Tell the sanitised fitness (P,); returns it."""
        fitness, self.bad_fitness = sanitize(fitness)
        self.optimizer.tell(solutions, fitness)
        if fitness.max() > self.best_fitness:
            self.best_fitness = float(fitness.max())
            self.best_x = solutions[int(fitness.argmax())].copy()
        return fitness

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "best_x": self.best_x,
                "best_fitness": self.best_fitness}

    def load_state_dict(self, state: dict) -> None:
        best_x = finite(array(state["best_x"], "ESSA checkpoint", "best_x",
                              (self.optimizer.dim,), "f"), "ESSA checkpoint", "best_x")
        best_fitness = state["best_fitness"]
        if not isinstance(best_fitness, float) or not -np.inf <= best_fitness < np.inf:
            raise bad_field("ESSA checkpoint", "best_fitness", f"is {best_fitness!r}, not a "
                                                               f"number or -inf (none yet)")
        self.optimizer.load_state_dict(state["optimizer"])
        self.best_x, self.best_fitness = best_x, best_fitness
