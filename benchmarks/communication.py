"""ESSA bytes and communication time per generation vs F-GRPO per step, at 2 and 4 ranks.

    python benchmarks/communication.py [--ranks 2 4] [--population 96] [--repeats 30]

(``--ranks 1 2 --population 4 --repeats 2`` is the smoke size tests/test_benchmarks.py runs.)

Launches itself under ``mpirun -n N`` for each N (CPU, gloo for torch.distributed) and prints
one table. Per rank and generation, ESSA sends what ``essa.trainer`` sends: the fitness
exchange (``gather_fitness``: a deadline barrier of 1 byte a rank, with the default
``run.collective_timeout_s``, then the Allgatherv of 8 bytes a member), the phase timings
Allgather and the 1-byte stop flag. Per rank and step, F-GRPO all-reduces the LoRA gradients
(``hpc.runtime.dist.all_reduce_mean_``, fp32; nothing at 1 rank) and gathers two small metric
vectors. Bytes are the payload counted by :class:`hpc.runtime.world.World`; times are the
slowest rank's per round (each after a barrier), min and median over ``--repeats`` rounds;
ratios use the minimum, the least disturbed by other processes on a shared machine. Gradients
come from the benchmark model's adapter (toy model, LoRA r=8 on q/k/v/o) and, without building
the models, from rank-8 q/k/v/o adapters of Qwen2.5-1.5B and -7B shapes (fp32 gradient tensors
of those shapes).
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import numpy as np

from common import TARGETS, cpu_model, launch_mpi

# Qwen2.5 shapes: (hidden, layers, attention heads, kv heads)
QWEN_SHAPES = {"qwen2.5-1.5b": (1536, 28, 12, 2), "qwen2.5-7b": (3584, 28, 28, 4)}
FGRPO_METRICS = (2, 17)  # float64 lengths of fgrpo.trainer's per-step metric Allgathers


def lora_grad_shapes(hidden: int, layers: int, heads: int, kv_heads: int, rank: int = 8):
    """Shapes of the A (r, in) and B (out, r) gradients of a q/k/v/o LoRA on a Qwen2 model."""
    kv = hidden // heads * kv_heads
    outs = {"q_proj": hidden, "k_proj": kv, "v_proj": kv, "o_proj": hidden}
    return [s for _ in range(layers) for t in TARGETS for s in ((rank, hidden), (outs[t], rank))]


def _slowest(world, seconds: list) -> list:
    """[min, median] over rounds of the slowest rank's seconds per round."""
    slowest = world.allgather(np.array(seconds), tag="bench").max(axis=0)  # (rounds,)
    return [float(slowest.min()), float(np.median(slowest))]


def worker(out_path: str, population: int, repeats: int) -> None:
    """Under mpirun: measure both methods; rank 0 writes a JSON report to ``out_path``."""
    import torch

    from common import lora_model, model_path
    from essa.trainer import PHASES, gather_fitness
    from hpc.job.config import RunConfig
    from hpc.runtime.dist import all_reduce_mean_, init_process_group
    from hpc.runtime.timing import PhaseTimer, gather_timings
    from hpc.runtime.world import get_world, split_evenly

    world = get_world()
    init_process_group(world, torch.device("cpu"))
    with tempfile.TemporaryDirectory(prefix="communication-") as scratch:
        model, _, lora = lora_model(model_path(scratch)[0])
    adapters = {"benchmark model (" + lora + ")":
                [p.shape for n, p in model.named_parameters() if "lora_" in n]}
    adapters.update({f"{name} shape, LoRA r=8 on q/k/v/o": lora_grad_shapes(*dims)
                     for name, dims in QWEN_SHAPES.items()})
    timer = PhaseTimer(PHASES)
    timeout_s = RunConfig().collective_timeout_s  # as essa.trainer with the default config
    mine = np.random.default_rng(world.rank).random(split_evenly(population, world.size)
                                                    [world.rank])

    def essa_generation():
        gather_fitness(world, mine, population, timer, timeout_s)
        gather_timings(world, timer)
        world.bcast(np.zeros(1, dtype=np.int8), tag="control")

    def timed(fn) -> tuple:
        world.barrier()
        world.take_bytes()
        seconds = []
        for _ in range(repeats):
            world.barrier()
            start = time.perf_counter()
            fn()
            seconds.append(time.perf_counter() - start)
        nbytes = {tag: n // repeats for tag, n in world.take_bytes().items()}
        return _slowest(world, seconds), nbytes

    report = {"ranks": world.size, "population": population,
              "essa": timed(essa_generation), "fgrpo": {}}
    for name, shapes in adapters.items():
        grads = [torch.randn(s) for s in shapes]

        def fgrpo_step():
            world.allgather(np.zeros(FGRPO_METRICS[0]), tag="metrics")
            all_reduce_mean_(grads, world, tag="grad_allreduce")
            world.allgather(np.zeros(FGRPO_METRICS[1]), tag="metrics")

        allreduce = timed(lambda: all_reduce_mean_(grads, world, tag="grad_allreduce"))
        report["fgrpo"][name] = {"allreduce": allreduce, "step": timed(fgrpo_step),
                                 "parameters": int(sum(g.numel() for g in grads))}
    if world.is_root:
        with open(out_path, "w") as fh:
            json.dump(report, fh)


def _run(n: int, population: int, repeats: int, scratch: str) -> dict:
    out = os.path.join(scratch, f"n{n}.json")
    launch_mpi(n, [os.path.abspath(__file__), "--worker", out, "--population", population,
                   "--repeats", repeats])
    with open(out) as fh:
        return json.load(fh)


def _ms(seconds: list) -> str:
    return " / ".join(f"{s * 1e3:.2f}" for s in seconds)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--population", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--worker", metavar="OUT_JSON", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args.population, args.repeats)
        return
    with tempfile.TemporaryDirectory(prefix="communication-") as scratch:
        print_table(args, scratch)


def print_table(args, scratch: str) -> None:
    """Launch the workers (their JSON goes under ``scratch``) and print the table."""
    import torch

    print(f"machine: {cpu_model()}, {len(os.sched_getaffinity(0))} cores visible, one node, "
          f"ranks on loopback (gloo all-reduce, Open MPI collectives), 1 thread per rank, "
          f"torch {torch.__version__}; ESSA population {args.population}; payload bytes per "
          f"rank; times: slowest rank, min / median of {args.repeats} rounds")
    for n in args.ranks:
        rep = _run(n, args.population, args.repeats, scratch)
        essa_s, essa_b = rep["essa"]
        essa_total = sum(essa_b.values())
        print(f"\n{n} ranks. ESSA per generation: {essa_total} B "
              f"({', '.join(f'{t} {b}' for t, b in essa_b.items())}), "
              f"{_ms(essa_s)} ms")
        print(f"  {'F-GRPO per step, adapter':<58} {'params':>9} {'all-reduce B':>13} "
              f"{'all-reduce ms':>15} {'B / ESSA':>9} {'ms / ESSA':>10} {'step B':>10} "
              f"{'step ms':>15}")
        for name, f in rep["fgrpo"].items():
            ar_s, ar_b = f["allreduce"]
            step_s, step_b = f["step"]
            reduced = ar_b.get("grad_allreduce", 0)  # one rank: nothing to all-reduce
            print(f"  {name:<58} {f['parameters']:>9} {reduced:>13} "
                  f"{_ms(ar_s):>15} {reduced / max(essa_total, 1):>9.0f} "
                  f"{ar_s[0] / essa_s[0]:>10.0f} {sum(step_b.values()):>10} "
                  f"{_ms(step_s):>15}")


if __name__ == "__main__":
    main()
