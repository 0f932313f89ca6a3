"""Members per second against k, and the share of ESSA wall time spent outside generation.

    python benchmarks/members_per_second.py [--ks 1 2 4 8 16] [--minibatches 32 256]
        [--members 16] [--repeats 3] [--population 96] [--generations 4] [--threads N]

Part 1 scores the same ``--members`` members with ``essa.population.score_members`` at each k
(k members per batched generation; fp32, greedy, 8 new tokens, chunks of 64 prompts as with
``model.decode_batch``) and prints members/s and the ratio to k = 1 for each minibatch size. Each
figure is the best of ``--repeats`` rounds; the k values are interleaved within a round so
that load from other processes hits them alike.

Part 2 runs real ESSA generations (``python -m essa``: the trainer with its PhaseTimer and
HDF5 run file) for each minibatch size with the fastest k of part 1, and prints each phase's
share of the generation loop's wall time, the untimed rest (``ask``, logging) and the share
outside generation. Generation 1 (one-off warm-up) is left out.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

from common import REPO, lora_model, machine, model_path

from essa.population import ScoringRequest, score_members  # common.py put the repo on sys.path
from hpc.engine.engine_backend import EngineBackend
from hpc.models.adapter_space import SingularValueSpace
from hpc.models.loading import save_adapter
from hpc.runtime.runstore import RunFile
from hpc.data.tasks import arith_task
from hpc.runtime.timing import PhaseTimer

MAX_NEW_TOKENS = 8  # task.max_new_tokens default
CHUNK = 64  # model.decode_batch default: prompts per generate call and member
LOOP_PHASES = ["rebuild", "generate", "reward", "waiting", "communication", "update"]


def members_per_second(model, tok, space, members, task, n_prompts, ks, repeats) -> dict:
    """{k: members per second} on the first ``n_prompts`` training prompts of ``task``, best
    of ``repeats`` interleaved rounds."""
    prompts, answers = task.train.prompts[:n_prompts], task.train.answers[:n_prompts]
    best = dict.fromkeys(ks, float("inf"))
    decoder = EngineBackend()  # one engine kept across the rounds, as a job keeps it
    for _ in range(repeats):
        for k in ks:
            timer = PhaseTimer(["rebuild", "generate", "reward"])
            start = time.perf_counter()
            request = ScoringRequest(members, prompts, answers, MAX_NEW_TOKENS, CHUNK, k)
            score_members(model, tok, space, task, request, decoder=decoder, timer=timer)
            best[k] = min(best[k], time.perf_counter() - start)
    return {k: len(members) / t for k, t in best.items()}


def essa_phase_shares(model_dir, adapter, minibatch, k, population, generations, threads,
                      scratch) -> tuple:
    """Run ESSA; returns ({phase: share of loop wall time}, loop seconds, generations timed)."""
    out = os.path.join(scratch, f"essa-m{minibatch}-k{k}")
    env = dict(os.environ, PYTHONPATH=REPO, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    cmd = [sys.executable, "-m", "essa", f"model.path={model_dir}", f"lora.adapter={adapter}",
           "model.device=cpu", "task.n_eval=16", f"essa.population={population}",
           f"essa.minibatch={minibatch}", f"essa.generations={generations}",
           f"essa.members_per_pass={k}", "eval.every=0", "eval.n_samples=1",
           f"model.decode_batch={CHUNK}", f"task.max_new_tokens={MAX_NEW_TOKENS}",
           "run.progress=false", f"run.out={out}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    if proc.returncode != 0:
        raise RuntimeError(f"essa failed:\n{proc.stderr[-3000:]}")
    run = RunFile(os.path.join(out, "essa.h5"))
    wall = run.group("metrics")["wall_s"]
    loop = float(wall[-1] - wall[0])  # generations 2..G; eval/checkpoint come after wall_s
    timings = run.group("timings")
    shares = {p: float(timings[p][1:, 0].sum()) / loop for p in LOOP_PHASES}
    shares["untimed (ask, logging)"] = 1.0 - sum(shares.values())
    return shares, loop, len(wall) - 1


def run(args, scratch: str) -> None:
    """Both parts (module docstring); model, adapter and run files go under ``scratch``."""
    path, source = model_path(scratch)
    model, tok, lora = lora_model(path)
    space = SingularValueSpace.from_peft(model)
    members = np.random.default_rng(0).normal(0.0, 0.1, (args.members, space.dim))
    task = arith_task(max(args.minibatches), 1)
    print(f"machine: {machine()}")
    print(f"model: {source}, {lora}; search dim {space.dim}; fp32 greedy, {MAX_NEW_TOKENS} new "
          f"tokens, chunks of {CHUNK} prompts; best of {args.repeats} rounds")
    best_k = {}
    for m in args.minibatches:
        rate = members_per_second(model, tok, space, members, task, m, args.ks, args.repeats)
        print(f"\nminibatch {m} prompts, {args.members} members:")
        print(f"{'k':>4} {'rows/call':>10} {'members/s':>10} {'x k=1':>7}")
        for k in args.ks:
            print(f"{k:>4} {k * min(m, CHUNK):>10} {rate[k]:>10.2f} "
                  f"{rate[k] / rate[args.ks[0]]:>7.2f}")
        best_k[m] = max(rate, key=rate.get)
    adapter = os.path.join(scratch, "adapter")
    save_adapter(model, adapter)
    print(f"\nESSA runs (python -m essa, population {args.population}, "
          f"{args.generations} generations, 1 rank): share of loop wall time")
    for m in args.minibatches:
        shares, loop, n = essa_phase_shares(path, adapter, m, best_k[m], args.population,
                                            args.generations, args.threads, scratch)
        parts = ", ".join(f"{p} {s:.1%}" for p, s in shares.items() if p != "generate")
        print(f"minibatch {m}, k={best_k[m]}: {loop / n:.2f} s/generation; generate "
              f"{shares['generate']:.1%}; OUTSIDE GENERATION {1 - shares['generate']:.2%} "
              f"({parts})")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--minibatches", type=int, nargs="+", default=[32, 256])
    parser.add_argument("--members", type=int, default=16, help="members scored per figure")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--population", type=int, default=96, help="ESSA run of part 2")
    parser.add_argument("--generations", type=int, default=4, help="ESSA run of part 2")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="members-per-second-") as scratch:
        run(args, scratch)


if __name__ == "__main__":
    main()
