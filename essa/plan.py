"""ESSA's memory plan on one GPU (registered in setup.py's ``hpc.method_plans``): its scoring
passes of k members (``essa.members_per_pass``) and the held-out evaluation, from the terms of
:mod:`hpc.plan.terms`.

* resident all job long: the weights (decoder linears at ``model.quantize``) and the job's own
  adapter (fp32);
* scoring: the LoRA factors of this rank's members (fp32) and an engine of k members x
  ``min(eval.batch_size, essa.minibatch)`` rows;
* evaluation: an engine of ``eval.batch_size x eval.n_samples`` rows on the job's own adapter;
  the scoring engine is given back first.
"""
from __future__ import annotations

import math

from hpc.engine.memory import ENGINE_MEMORY_SHARE
from hpc.engine.shape import ModelShape
from hpc.plan.terms import (HANDOVER_NOTE, LORA_BYTES_PER_PARAM, MethodPlan, Phase, engine_budget,
                            engine_parts, evaluation_phase, gib, smallest_fix, total,
                            usable_bytes, weight_bytes)


def members_per_pass(cfg, ranks: int) -> int:
    """k: the members ESSA decodes in one pass (``essa.members_per_pass``, at most this rank's
    share of the population)."""
    return max(1, min(cfg.essa.members_per_pass, math.ceil(cfg.essa.population / ranks)))


def resident_parts(shape: ModelShape, cfg) -> list:
    """ESSA's weights and the job's own LoRA adapter (fp32, peft's), held all job long."""
    n_lora = shape.lora_parameters(cfg.lora.rank, cfg.lora.targets)
    return [(f"weights ({cfg.model.dtype}" + (f", decoder linears {cfg.model.quantize}"
                                              if cfg.model.quantize != "none" else "") + ")",
             weight_bytes(shape, cfg, quantized=True)),
            (f"the job's own LoRA adapter ({n_lora:,} parameters, fp32)",
             n_lora * LORA_BYTES_PER_PARAM)]


def scoring_phase(shape: ModelShape, cfg, ranks: int, k: int) -> Phase:
    members = math.ceil(cfg.essa.population / ranks)
    lora = shape.lora_parameters(cfg.lora.rank, cfg.lora.targets) * LORA_BYTES_PER_PARAM
    resident = resident_parts(shape, cfg)
    rows = min(cfg.eval.batch_size, cfg.essa.minibatch) * k
    return Phase("ESSA scoring", resident + [
        (f"LoRA factors of this rank's {members} members (fp32)", members * lora),
        *engine_parts(shape, cfg, f"{k} member(s) x {rows // k} rows", rows, k,
                      engine_budget(cfg, total(resident)))])


def members_that_fit(shape: ModelShape, cfg, ranks: int) -> int:
    """The most members per pass whose scoring phase fits with every row in one wave (0: not
    even one), at most this rank's members."""
    k, most = 0, math.ceil(cfg.essa.population / ranks)
    rows = min(cfg.eval.batch_size, cfg.essa.minibatch)
    while k < most:
        phase = scoring_phase(shape, cfg, ranks, k + 1)
        if phase.peak > usable_bytes(cfg) or "in waves" in phase.parts[-2][0]:
            break
        k += 1
    return k if k or rows else 0


def plan(shape: ModelShape, cfg, ranks: int, advise: bool = True) -> MethodPlan:
    """ESSA on one GPU: scoring passes of k members (``essa.members_per_pass``), and the
    held-out evaluation (its engine is given back before the next scoring pass)."""
    k = members_per_pass(cfg, ranks)
    resident = resident_parts(shape, cfg)
    budget = engine_budget(cfg, total(resident))
    phases = [scoring_phase(shape, cfg, ranks, k),
              evaluation_phase(shape, cfg, resident, 1, budget)]
    fit = members_that_fit(shape, cfg, ranks)
    notes = [f"engine budget {gib(budget)} (model.engine_memory_gib="
             f"{cfg.model.engine_memory_gib:g}: 0 = {ENGINE_MEMORY_SHARE:.0%} of the "
             f"memory the weights and the adapter leave, whole GiB)",
             f"members per pass that fit in one wave: {fit} of this rank's "
             f"{math.ceil(cfg.essa.population / ranks)} (essa.members_per_pass="
             f"{cfg.essa.members_per_pass})"]
    result = MethodPlan("ESSA", phases, usable_bytes(cfg), notes + [HANDOVER_NOTE],
                        engine_budget=budget)
    if advise and not result.fits:
        result.advice = smallest_fix(plan, shape, cfg, ranks, [
            *[(f"essa.members_per_pass={k2}", {"essa__members_per_pass": k2}, None)
              for k2 in range(k - 1, 0, -1)],
            *[(f"model.engine_memory_gib={g}", {"model__engine_memory_gib": float(g)}, None)
              for g in (32, 16, 8, 4)],
            *([("model.quantize=int8", {"model__quantize": "int8"}, None),
               ("model.quantize=int8 and model.engine_memory_gib=8",
                {"model__quantize": "int8", "model__engine_memory_gib": 8.0}, None)]
              if cfg.model.quantize == "none" else []),
        ]) or (f"the weights alone need {gib(resident[0][1])}: use GPUs with more memory"
               + (" or model.quantize=int8" if cfg.model.quantize == "none" else ""))
    return result
