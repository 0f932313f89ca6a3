"""The scaling model itself: the workload of both methods, the seconds of an ESSA generation
and an F-GRPO step on n GPUs by phase, and the prediction over GPU counts.

A cost source (:mod:`compare.roofline`, :mod:`compare.measured`, :mod:`compare.gpu_check`)
gives one GPU's seconds: ``essa_generate(n)`` and ``fgrpo_generate(n)`` for n completions,
``train(n)`` for n completions' forward and backward, ``optimizer_s`` an update, and
``grad_bytes`` all-reduced an update. Units: seconds, bytes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from compare.network import Network
from compare.sharding import LoraFsdp, Sharding


@dataclass(frozen=True)
class Workload:
    population: int         # ESSA P
    minibatch: int          # ESSA M prompts per member, greedy
    fgrpo_batch: int        # F-GRPO prompts per step (global)
    fgrpo_generations: int  # G completions per prompt
    fgrpo_minibatch: int    # prompts per optimizer step (batch / this = updates per step)
    essa_steps: int         # generations to target (input)
    fgrpo_steps: int        # F-GRPO steps to target (input)
    essa_update_s: float    # CMA-ES tell, seconds a generation
    fgrpo_rounds: float = 1.0  # rollout rounds a step (dynamic sampling's refills)
    fgrpo_fixed_s: float = 0.0  # seconds a step that do not shrink with GPUs


class LinearCosts:
    """Per-completion costs on one GPU, scaled linearly in the completions a GPU does.

    Subclasses set ``s_essa`` (seconds per scored ESSA completion), ``s_gen`` (seconds per
    sampled F-GRPO completion, rewards included), ``s_train`` (forward+backward seconds per
    F-GRPO completion), ``optimizer_s`` (seconds per optimizer update) and ``grad_bytes``
    (bytes all-reduced per optimizer update)."""

    s_essa: float
    s_gen: float
    s_train: float
    optimizer_s: float
    grad_bytes: float

    def essa_generate(self, n: int) -> float:
        return n * self.s_essa

    def fgrpo_generate(self, n: int) -> float:
        return n * self.s_gen

    def train(self, n: int) -> float:
        return n * self.s_train


def essa_step(n: int, w: Workload, cost, net: Network) -> dict:
    """Seconds per ESSA generation by phase on ``n`` GPUs: a member is never split, so the
    busiest GPU scores ceil(P/n) members x M prompts; then the fitness all-gather."""
    return {"generate": math.ceil(w.population / n) * cost.essa_generate(w.minibatch),
            "communication": net.allgather(8.0 * w.population, n),
            "update": w.essa_update_s}


def fgrpo_step(n: int, w: Workload, cost, net: Network,
               sharding: Sharding | LoraFsdp | None = None) -> dict:
    """Seconds per F-GRPO step by phase on ``n`` GPUs: data parallel over prompts (a group of
    G never spans GPUs); batch / mini-batch optimizer updates, each after one all-reduce, or
    with ``sharding`` the sharded model's gathers and reduce-scatters (:class:`Sharding`), or
    the frozen base's gathers, the LoRA all-reduce and the weight sync (:class:`LoraFsdp`),
    and an optimizer step on 1/n of the state; plus ``w.fgrpo_fixed_s`` a step whatever n.
    Dynamic sampling decodes ``fgrpo_rounds`` rounds of the batch and trains on one batch of
    groups."""
    seqs = math.ceil(w.fgrpo_batch / n) * w.fgrpo_generations
    updates = math.ceil(w.fgrpo_batch / w.fgrpo_minibatch)
    phases = {"generate": w.fgrpo_rounds * cost.fgrpo_generate(seqs),
              "forward_backward": cost.train(seqs)}
    fixed = {"fixed": w.fgrpo_fixed_s} if w.fgrpo_fixed_s else {}
    if sharding is None:
        return dict(phases, allreduce=updates * net.allreduce(cost.grad_bytes, n),
                    optimizer=updates * cost.optimizer_s, **fixed)
    return dict(phases, **sharding.step(n, w, net), optimizer=updates * cost.optimizer_s / n,
                **fixed)


# the F-GRPO step's communication terms, of every layout
COMMUNICATION = ("allreduce", "gather_forward", "gather_backward", "reduce_scatter",
                 "rollout_gather", "host_offload", "weight_sync")


def predict(gpus: list, w: Workload, cost, net: Network,
            sharding: Sharding | LoraFsdp | None = None) -> list:
    """One dict per GPU count: phases ("essa", "fgrpo"), step seconds ("essa_step",
    "fgrpo_step"), time to target ("essa_ttt", "fgrpo_ttt") and the F-GRPO/ESSA ratio."""
    rows = []
    for n in gpus:
        e, g = essa_step(n, w, cost, net), fgrpo_step(n, w, cost, net, sharding)
        row = {"gpus": n, "essa": e, "fgrpo": g, "essa_step": sum(e.values()),
               "fgrpo_step": sum(g.values())}
        row["essa_ttt"] = w.essa_steps * row["essa_step"]
        row["fgrpo_ttt"] = w.fgrpo_steps * row["fgrpo_step"]
        row["ratio"] = row["fgrpo_ttt"] / row["essa_ttt"]
        rows.append(row)
    return rows


def communication(row: dict) -> float:
    """F-GRPO communication seconds of one step in a :func:`predict` row."""
    return sum(row["fgrpo"].get(k, 0.0) for k in COMMUNICATION)
