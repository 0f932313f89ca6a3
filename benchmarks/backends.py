"""The decoding backends side by side on the same work: tokens/s, ratios to the package's engine
and how many completions equal the engine's, in one run.

    python benchmarks/backends.py [--repeats 3] [--json OUT] [--model FOLDER]  # engine, hf
    .venv-vllm/bin/python benchmarks/backends.py [...]                         # and vllm

Every backend of the registry (:data:`hpc.engine.backend.BACKENDS`) installed in this
interpreter's environment decodes, on the toy model with a rank-8 LoRA (:mod:`common`; fp32,
one torch thread, 2-digit additions, at most 8 new tokens):

* ``essa``: one ESSA pass, 16 members x 256 prompts, greedy, members per row (one call);
* ``fgrpo``: F-GRPO rollouts, 32 prompts x 8 samples at temperature 1 (keyed), the adapter;
* ``eval``: held-out greedy evaluation, 256 prompts, the adapter.

(``--members``, ``--prompts``, ``--rollouts`` change the 16, the 256s and the 32.)

Each workload and backend gets one untimed call first (vLLM's start and first adapter loads,
the engine's first build), then the fastest of ``--repeats`` timed calls. Useful tokens are the
completions' own (through eos). On a GPU the same script runs on CUDA
(``benchmarks/gpu_acceptance.py`` calls it).
"""
from __future__ import annotations

import argparse
import json
import random
import tempfile
import time

import torch

from common import lora_model, machine, model_path

from hpc.engine.backend import BACKENDS, backend_class, make_backend
from hpc.engine.generate import eos_ids
from hpc.engine.scheduler import Request
from hpc.models.adapter_space import SingularValueSpace
from hpc.models.sampling import Sampling

MAX_NEW = 8


def prompts(tok, n: int, seed: int) -> list:
    """``n`` 2-digit addition prompts' token ids."""
    rng = random.Random(seed)
    return [tok(f"{rng.randint(10, 99)}+{rng.randint(10, 99)}=")["input_ids"] for _ in range(n)]


def workloads(model, tok, k: int, n: int, rollouts: int) -> dict:
    """{name: (requests, sampling, rows, members)} of the three workloads: ``k`` members x
    ``n`` prompts, ``rollouts`` prompts x 8 samples, ``n`` prompts."""
    space = SingularValueSpace.from_peft(model)
    gen = torch.Generator().manual_seed(0)
    offsets = torch.randn((k, space.dim), generator=gen, dtype=torch.float64).numpy() * 0.3
    members = space.factors_batch(offsets * space.singular_values())
    scoring = prompts(tok, n, 1)
    rollout = prompts(tok, rollouts, 2)
    held_out = prompts(tok, n, 3)
    return {
        "essa": ([Request(p, MAX_NEW, m, i) for m in range(k) for i, p in enumerate(scoring)],
                 None, 64 * k, members),
        "fgrpo": ([Request(p, MAX_NEW, 0, i, j) for i, p in enumerate(rollout) for j in range(8)],
                  Sampling(1.0, 1.0, 7), 256, None),
        "eval": ([Request(p, MAX_NEW, 0, i) for i, p in enumerate(held_out)], None, 256, None),
    }


def measure(backend, model, eos, work, repeats: int) -> tuple:
    """(completions, seconds of the fastest timed call) of one workload on ``backend``."""
    requests, sampling, rows, members = work
    out = backend.decode(model, requests, eos, sampling, rows, members=members)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        out = backend.decode(model, requests, eos, sampling, rows, members=members)
        best = min(best, time.perf_counter() - start)
    return out, best


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--model", help="a model folder (default: the cached toy model)")
    parser.add_argument("--members", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--rollouts", type=int, default=32)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as scratch:
        path, what = (args.model, args.model) if args.model else model_path(scratch)
        model, tok, lora = lora_model(path, "cuda" if torch.cuda.is_available() else "cpu")
    eos = eos_ids(model, tok)
    names = [n for n in BACKENDS if backend_class(n).installed()]
    work = workloads(model, tok, args.members, args.prompts, args.rollouts)
    print(f"machine: {machine()}\n{what}, {lora}; backends: "
          f"{', '.join(backend_class(n).version() for n in names)}")
    result = {"machine": machine(), "model": what, "backends": {}}
    reference = {}
    print(f"{'work':>6} {'backend':>7} {'tokens':>7} {'s':>7} {'tokens/s':>9} {'vs engine':>9} "
          f"{'= engine':>9}")
    for name in names:
        backend = make_backend(name)
        rows = {}
        for label, job in work.items():
            out, seconds = measure(backend, model, eos, job, args.repeats)
            reference.setdefault(label, out)
            tokens = sum(len(c) for c in out)
            same = sum(a == b for a, b in zip(out, reference[label]))
            rows[label] = {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
                           "equal_to_engine": same, "completions": len(out)}
            ratio = rows[label]["tokens_per_s"] / result["backends"].get(
                "engine", rows)[label]["tokens_per_s"]
            print(f"{label:>6} {name:>7} {tokens:>7} {seconds:>7.3f} "
                  f"{rows[label]['tokens_per_s']:>9.0f} {ratio:>9.2f} {same:>4}/{len(out)}")
        backend.close()
        result["backends"][name] = rows
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    return result


if __name__ == "__main__":
    main()
