"""ESSA's optimizer step (``ask`` + ``tell``) per generation against the search dimension.

    python benchmarks/optimizer_cost.py [--dims 256 1792 3136] [--population 96]
        [--generations 24]

Every rank runs the same optimizer step on the gathered fitness (``essa.trainer``'s ``update``
phase), so its time does not shrink with more GPUs while generation does: at scale it is the
serial part. For each optimizer of ``essa.optimizers`` and each dimension this times
``--generations`` steps (random fitness, after one warm-up step) and prints the mean and the
slowest step in ms. pycma's full CMA-ES decomposes its covariance matrix (O(dim^3)) every few
generations, inside ``ask``: the mean hides those spikes, the maximum shows them. Dimensions: 256
is the toy model's (rank-8 LoRA on q/k/v/o, 4 layers), 1792 a rank-8 q/k/v/o adapter on the
28 layers of Qwen2.5-1.5B or -7B, 3136 rank 8 on all seven linear layers of those. BLAS
threads are numpy's default (set OMP_NUM_THREADS to change them).
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from common import machine

from essa.optimizers import OPTIMIZERS, make_optimizer  # common.py put the repo on sys.path


def step_ms(name: str, dim: int, population: int, generations: int) -> np.ndarray:
    """Milliseconds of ``generations`` ask + tell steps (after a warm-up step), (generations,)."""
    opt = make_optimizer(name, dim, population, 0.3, 0, stds=np.full(dim, 0.1))
    fitness = np.random.default_rng(0)
    times = []
    for g in range(generations + 1):
        start = time.perf_counter()
        members = opt.ask()
        opt.tell(members, fitness.random(population))
        if g:
            times.append((time.perf_counter() - start) * 1e3)
    return np.array(times)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", type=int, nargs="+", default=[256, 1792, 3136])
    parser.add_argument("--population", type=int, default=96)
    parser.add_argument("--generations", type=int, default=24)
    args = parser.parse_args(argv)
    print(f"machine: {machine()}")
    print(f"optimizer step (ask + tell) per generation, population {args.population}, "
          f"{args.generations} generations: mean / slowest ms")
    print(f"{'dim':>6} " + " ".join(f"{name:>18}" for name in OPTIMIZERS))
    for dim in args.dims:
        cells = []
        for name in OPTIMIZERS:
            ms = step_ms(name, dim, args.population, args.generations)
            cells.append(f"{ms.mean():>8.1f} / {ms.max():>7.1f}")
        print(f"{dim:>6} " + " ".join(f"{c:>18}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
