"""Decoding engine vs HF eager generate on the CPU toy model: ratios, realistic length spread.

    python benchmarks/engine_cpu.py [--rows 32] [--ks 1 4] [--data ../shared/data]

The toy model (fp32, a rank-8 LoRA on q/k/v/o, :mod:`common`) decodes random 8-token prompts;
each row is forced to end at its own length (:mod:`engine_speed`). ``fixed``: every row 48
tokens; ``spread``: GSM8K / MATH-500 solution lengths scaled so their 95th percentile is 48
tokens (the toy holds 64 positions), so the spread keeps its shape. Prints useful tokens/s of
both paths and their ratio (engine / HF); one warm-up call each before the timed ones.
"""
from __future__ import annotations

import argparse
import os
import tempfile

import numpy as np
import torch

from common import REPO, lora_model, machine, model_path
from engine_speed import compare, row_lengths, solution_lengths

from hpc.engine.engine_backend import EngineBackend
from hpc.models.adapter_space import SingularValueSpace

LONGEST = 48


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--data", default=os.path.join(os.path.dirname(REPO), "shared", "data"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as scratch:
        path, what = model_path(scratch)
        model, _, lora = lora_model(path)
    space = SingularValueSpace.from_peft(model)
    pool = solution_lengths(args.data)
    scaled = np.ceil(pool * LONGEST / np.percentile(pool, 95)).astype(np.int64)
    prompts = torch.randint(2, model.config.vocab_size, (args.rows, 8),
                            generator=torch.Generator().manual_seed(0))
    hw = {"bandwidth": 1.0, "peak_flops": 1.0}  # no bound on CPU; only the ratios matter
    decoder = EngineBackend()
    print(f"machine: {machine()}\n{what}, {lora}, {args.rows} rows")
    print(f"{'k':>3} {'lengths':>7} {'mean len':>8} {'engine tok/s':>12} {'HF tok/s':>9} "
          f"{'engine/HF':>9}")
    for k in args.ks:
        for kind in ("fixed", "spread"):
            lengths = row_lengths(kind, args.rows, LONGEST, scaled)
            compare(decoder, model, space, torch.device("cpu"), args.rows, k, kind, lengths,
                    prompts, True, hw)  # warm-up of both paths
            row = compare(decoder, model, space, torch.device("cpu"), args.rows, k, kind,
                          lengths, prompts, True, hw)
            print(f"{k:>3} {kind:>7} {row['mean_length']:>8.1f} "
                  f"{row['engine']['tokens_per_s']:>12.0f} "
                  f"{row['hf_eager']['tokens_per_s']:>9.0f} {row['engine_vs_hf']:>9.2f}")


if __name__ == "__main__":
    main()
