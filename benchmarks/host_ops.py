"""Host ops per decoding step: batched ESSA members against plain batched generation.

    python benchmarks/host_ops.py [--model qwen2.5-1.5b qwen2.5-7b] [--ks 1 8] [--prompts 32]
        [--tokens 32] [--repeats 5]

At the batch sizes ESSA decodes with, a GPU waits on the host issuing kernels (on an H200 a
Qwen2.5-1.5B step at 32 rows took 18 ms, the time of ~1,600 host-side ops, not of its math), so
the share of host ops that LoRA adds bounds members/s against pure generation. This counts the
aten ops of one greedy decoding step (``gpu_check.host_ops_per_step``) through a Qwen2 with each
model's layer structure and thin layers (hidden 64: the count does not depend on the widths),
for the three variants of ``gpu_check``: ``base`` (no LoRA), ``lora_fused`` and ``lora_exact``
(:class:`hpc.models.member_lora.MemberLora`). It prints the counts, the ops LoRA adds per layer, the
op ratio base/variant (the throughput ratio a fully host-bound device would show) and, measured
side by side on this CPU, where thin layers make decoding host-bound too, the ratio of
decoding times (best of ``--repeats`` interleaved rounds of ``--tokens`` new tokens).
"""
from __future__ import annotations

import argparse

import numpy as np
import torch

from common import machine
from gpu_check import (SHAPES, VARIANTS, build, host_ops_per_step, seconds_of_greedy,
                       variant_context)


THIN = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
            vocab_size=512)


def measure(shape_name: str, k: int, n_prompts: int, new_tokens: int, repeats: int) -> dict:
    """{variant: (host ops per step, best seconds for ``new_tokens`` tokens)} for k members x
    ``n_prompts`` prompts of 16 random tokens, fp32 on CPU."""
    shape = dict(SHAPES[shape_name], **THIN, tie_word_embeddings=True)
    cpu = torch.device("cpu")
    model, space = build(shape, cpu, torch.float32)
    prompts = torch.randint(1, THIN["vocab_size"], (n_prompts, 16),
                            generator=torch.Generator().manual_seed(0))
    ids = prompts.repeat(k, 1)  # member-major
    factors = space.factors_batch(np.random.default_rng(0).normal(0.0, 0.1, (k, space.dim)))
    ops, best = {}, dict.fromkeys(VARIANTS, float("inf"))
    for name in VARIANTS:
        with variant_context(name, model, space, factors):
            ops[name] = host_ops_per_step(model, ids)
    for _ in range(repeats):
        for name in VARIANTS:
            with variant_context(name, model, space, factors):
                best[name] = min(best[name], seconds_of_greedy(model, ids, new_tokens, cpu))
    return {name: (ops[name], best[name]) for name in VARIANTS}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", nargs="+", default=["qwen2.5-1.5b", "qwen2.5-7b"],
                        choices=[m for m in SHAPES if m != "tiny"])
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompts", type=int, default=32, help="prompts per member")
    parser.add_argument("--tokens", type=int, default=32, help="new tokens per timed call")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"machine: {machine()}")
    print("host ops per decoding step (rank-8 LoRA on q/k/v/o); ratio = base / variant")
    print(f"{'model':<14} {'layers':>6} {'k':>3} {'rows':>5} {'base ops':>9} {'fused ops':>10} "
          f"{'exact ops':>10} {'fused +/layer':>14} {'exact +/layer':>14} "
          f"{'fused op ratio':>15} {'exact op ratio':>15} {'fused CPU ratio':>16} "
          f"{'exact CPU ratio':>16}", flush=True)
    for shape_name in args.model:
        layers = SHAPES[shape_name]["num_hidden_layers"]
        for k in args.ks:
            r = measure(shape_name, k, args.prompts, args.tokens, args.repeats)
            (base_ops, base_s), (fused_ops, fused_s), (exact_ops, exact_s) = (
                r[v] for v in ("base", "lora_fused", "lora_exact"))
            print(f"{shape_name:<14} {layers:>6} {k:>3} {k * args.prompts:>5} {base_ops:>9} "
                  f"{fused_ops:>10} {exact_ops:>10} {(fused_ops - base_ops) / layers:>14.1f} "
                  f"{(exact_ops - base_ops) / layers:>14.1f} {base_ops / fused_ops:>15.3f} "
                  f"{base_ops / exact_ops:>15.3f} {base_s / fused_s:>16.3f} "
                  f"{base_s / exact_s:>16.3f}", flush=True)


if __name__ == "__main__":
    main()
