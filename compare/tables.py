"""What ``hpc-scaling`` prints of a prediction (:func:`compare.model.predict`'s rows): the
table per GPU count, each step's terms and what drives the ratio, and the assumptions every
cost source shares. The tables name the F-GRPO step "GRPO", the method the paper compares.

Units: seconds unless a cell names another.
"""
from __future__ import annotations

import math

from compare.model import Workload, communication
from compare.network import Network

# the method names the tables print
TABLE_NAMES = {"essa": "ESSA", "fgrpo": "GRPO"}
# the name of each step term (:func:`compare.model.essa_step`, :func:`compare.model.fgrpo_step`)
TERMS = {"generate": "generation", "forward_backward": "forward+backward",
         "allreduce": "gradient all-reduce", "gather_forward": "weight all-gather (forward)",
         "gather_backward": "weight all-gather (backward)",
         "reduce_scatter": "gradient reduce-scatter", "rollout_gather": "rollout weight gather",
         "host_offload": "state to host and back (fgrpo.parallel.offload)",
         "weight_sync": "weight sync into the rollout engine",
         "fixed": "fixed per-step cost (--grpo-fixed-s)",
         "optimizer": "optimizer", "communication": "fitness all-gather",
         "update": "CMA-ES update"}


def seconds_text(x: float) -> str:
    """``x`` seconds in a table cell: 0, 1 or 3 decimals, or exponent notation below 0.01."""
    return "0" if x == 0 else f"{x:.1f}" if x >= 10 else f"{x:.3f}" if x >= 0.01 else \
        f"{x:.2e}"


def duration_text(x: float) -> str:
    """``x`` seconds as hours, minutes, seconds or milliseconds."""
    return f"{x / 3600:.2f} h" if x >= 3600 else f"{x / 60:.1f} min" if x >= 60 else \
        f"{x:.1f} s" if x >= 1 else f"{1e3 * x:.0f} ms"


def aligned(table: list, first_left: bool = False) -> list:
    """Lines of ``table`` (rows of cells) in columns right-aligned to their widest cell (the
    first column left-aligned with ``first_left``)."""
    widths = [max(len(line[i]) for line in table) for i in range(len(table[0]))]
    return ["  ".join(c.ljust(wd) if i == 0 and first_left else c.rjust(wd)
                      for i, (c, wd) in enumerate(zip(line, widths))) for line in table]


def format_rows(rows: list) -> str:
    head = ["GPUs", "ESSA gen s", "ESSA comm s", "ESSA step s", "GRPO gen s", "GRPO f+b s",
            "GRPO comm s", "GRPO step s", "ESSA to target", "GRPO to target", "GRPO/ESSA"]
    lines = [head]
    for r in rows:
        e, g = r["essa"], r["fgrpo"]
        lines.append([str(r["gpus"])] + [seconds_text(x) for x in (
            e["generate"], e["communication"], r["essa_step"], g["generate"],
            g["forward_backward"], communication(r), r["fgrpo_step"])] +
            [duration_text(r["essa_ttt"]), duration_text(r["fgrpo_ttt"]), f"{r['ratio']:.2f}x"])
    return "\n".join(aligned(lines))


def term_breakdown(rows: list) -> list:
    """Lines: seconds of each term of a step per GPU count, and which F-GRPO terms drive the
    ratio (those that shrink least from the smallest to the largest GPU count)."""
    lines = []
    for method in ("fgrpo", "essa"):
        terms = list(rows[0][method])
        head = [f"{TABLE_NAMES[method]} term, s a step"] + [f"{r['gpus']} GPUs" for r in rows]
        table = [head] + [[TERMS.get(t, t)] + [seconds_text(r[method][t]) for r in rows]
                          for t in terms]
        table.append(["step"] + [seconds_text(r[f"{method}_step"]) for r in rows])
        lines += aligned(table, first_left=True)
        lines.append("")
    first, last = rows[0], rows[-1]
    shares = sorted(((last["fgrpo"][t] / last["fgrpo_step"], t) for t in last["fgrpo"]),
                    reverse=True)
    lines.append(f"at {last['gpus']} GPUs the GRPO step is " + ", ".join(
        f"{TERMS.get(t, t)} {share:.0%}" for share, t in shares if share >= 0.005) +
        f"; from {first['gpus']} to {last['gpus']} GPUs " + ", ".join(
        f"{TERMS.get(t, t)} shrinks {first['fgrpo'][t] / last['fgrpo'][t]:.1f}x"
        for _, t in shares if last["fgrpo"][t] > 0) + f", ESSA's step "
        f"{first['essa_step'] / last['essa_step']:.1f}x")
    return lines


def common_assumptions(w: Workload, net_name: str, net: Network, steps_source: str) -> list:
    """The assumption lines of every cost source: the workload, the network, the steps to
    target (from ``steps_source``) and what the model leaves out."""
    intra = "flat network" if net.intra is None else \
        f"NVLink inside nodes of {net.per_node} GPUs, hierarchical all-reduce beyond one node"
    return [
        f"ESSA: population {w.population} x {w.minibatch} greedy completions a generation; "
        f"a member is never split across GPUs, so the busiest GPU scores ceil(P/N) members "
        f"(no speed-up beyond N = P = {w.population}); fitness all-gather of "
        f"{8 * w.population} bytes; CMA-ES update {w.essa_update_s:.3g} s a generation "
        f"(an input: a run's update phase measures it)",
        f"GRPO: {w.fgrpo_batch} prompts x G = {w.fgrpo_generations} completions a step, "
        f"{w.fgrpo_minibatch} prompts an optimizer update (batches counted in prompts, as verl "
        f"counts them; the completions reading is the paper comparison's sensitivity line); "
        f"generation and training are data parallel over prompts and scale with N; "
        f"{math.ceil(w.fgrpo_batch / w.fgrpo_minibatch)} updates a step, each after a gradient "
        f"all-reduce; {w.fgrpo_rounds:.3g} rollout rounds a step (dynamic sampling's refills: "
        f"--grpo-rounds, --filtered-share or the runs' extra_rollouts)",
        f"network: {net_name} between nodes ({net.inter.bandwidth * 8 / 1e9:.0f} Gb/s, "
        f"{net.inter.latency * 1e6:.0f} us), {intra}; ring all-reduce "
        "2 (N-1)/N bytes/bw + 2 (N-1) latency; all-gather (N-1) latency + bytes/bw; "
        "no overlap of communication with compute",
        f"steps to target: ESSA {w.essa_steps} generations, GRPO {w.fgrpo_steps} steps "
        f"({steps_source}); they do not change with N, so the GRPO/ESSA ratio scales with "
        f"their quotient while its growth with N does not depend on them",
        "not modelled: reward computation (CPU, small), evaluation and checkpoints, "
        "start-up and model loading, stragglers and failures; ESSA's per-member adapter "
        "rebuild (LoRA-sized) is taken as free",
        f"GPU counts above {net.per_node} are whole nodes of {net.per_node} identical GPUs",
    ]
