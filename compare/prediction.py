"""What ``hpc-scaling`` prints: the prediction (its table, assumptions, per-term breakdown
and, with ``--paper``, the paper comparison) and, with ``--paper`` on the roofline, ESSA
decoding bf16 beside INT8 weights.

Units: seconds.
"""
from __future__ import annotations

import dataclasses

from compare.model import predict
from compare.options import ScalingOptions
from compare.paper import paper_comparison
from compare.setting import build_setting
from compare.tables import aligned, common_assumptions, format_rows, seconds_text, term_breakdown


def print_prediction(o: ScalingOptions) -> None:
    """Print the prediction of the options ``o``, what it assumes and how its steps break
    down; with ``--paper`` then the paper comparison and :func:`quantize_comparison` (each
    printed once computed: a refusal of the latter follows what came before)."""
    s = build_setting(o)
    rows = predict(sorted(o.gpus), s.workload, s.cost, s.network, s.sharding)
    print("predicted per step and to target (GRPO/ESSA > 1: ESSA reaches the target first)")
    print(format_rows(rows))
    print("\nassumptions:")
    for line in s.cost.assumptions() + s.notes + common_assumptions(
            s.workload, o.network, s.network, s.steps_source):
        print(f"- {line}")
    print("\nper-term breakdown:")
    print("\n".join(term_breakdown(rows)))
    if o.paper:
        print()
        print("\n".join(paper_comparison(rows, s.workload, s.cost, s.network, s.sharding,
                                         o.layout)))
        side = quantize_comparison(o)
        if side:
            print()
            print("\n".join(side))


def quantize_comparison(o: ScalingOptions) -> list:
    """Lines: the prediction with ESSA decoding bf16 and INT8 weights side by side, each
    row's ESSA terms (weight read a decode step, the plan's concurrency, generation seconds)
    and the GRPO/ESSA ratio."""
    if o.concurrency != "plan" or o.measured:
        return []
    results = {}
    for q in ("none", "int8"):
        s = build_setting(dataclasses.replace(o, essa_quantize=q))
        results[q] = (s.cost, predict(sorted(o.gpus), s.workload, s.cost, s.network,
                                      s.sharding))
    head = ["GPUs"] + [f"{label} {what}" for label in ("bf16", "INT8")
                       for what in ("ESSA gen s", "ESSA step s", "GRPO/ESSA")]
    table = [head]
    for i, n in enumerate(sorted(o.gpus)):
        row = [str(n)]
        for q in ("none", "int8"):
            r = results[q][1][i]
            row += [seconds_text(r["essa"]["generate"]), seconds_text(r["essa_step"]),
                    f"{r['ratio']:.2f}x"]
        table.append(row)
    lines = ["ESSA's inference in bf16 (the paper's setting) and INT8 (--essa-quantize), "
             "everything else alike:", *aligned(table)]
    for q, label in (("none", "bf16"), ("int8", "INT8")):
        cost = results[q][0]
        fixed, most = cost.terms("essa")
        lines.append(f"- {label}: {cost.decoding['essa'].describe()}; a decode step's weight "
                     f"read {1e3 * fixed:.1f} ms, {cost.tokens_per_s(most, 'essa'):.0f} "
                     f"tokens/s per GPU at {most} sequences")
    lines.append("- INT8 decode steps read the int8 weights once (a fused weight-only kernel); "
                 "the package's eager torchao path also writes and reads each linear's "
                 "dequantised copy, which this model does not charge")
    return lines
