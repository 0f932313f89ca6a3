"""ESSA's memory plan on one GPU (named by its method's spec, ``method.py``): its scoring
passes of k members (``essa.members_per_pass``) and the held-out evaluation, from the terms of
:mod:`hpc.plan.terms`.

* the load (:mod:`hpc.models.streaming`): the weights and the adapter as they arrive, under
  ``model.quantize`` one decoder linear in ``model.dtype`` with its quantisation temporaries at
  a time (``model.load=transformers``: the whole model in ``model.dtype`` first);
* resident all job long: the weights (decoder linears at ``model.quantize``), the job's own
  adapter (fp32), a reward model's weights (``reward.model``) and the search space's float64
  copies of the adapter (and its SVD);
* scoring: the LoRA factors of this rank's members (fp32), a reward model's scoring batch and
  an engine of k members x ``min(model.decode_batch, essa.minibatch)`` rows;
* evaluation: an engine of ``eval.batch_size x eval.n_samples`` rows on the job's own adapter;
  the scoring engine is given back first.
"""
from __future__ import annotations

import math

from hpc.engine.memory import ENGINE_MEMORY_SHARE
from hpc.engine.shape import ModelShape
from hpc.plan.terms import (HANDOVER_NOTE, LORA_BYTES_PER_PARAM, MethodPlan, Phase,
                            arriving_linear_parts, dtype_bytes, engine_budget, engine_parts,
                            evaluation_phase, gib, host_load_bytes, host_load_note,
                            reward_model_scoring, reward_model_weights, search_space_bytes,
                            smallest_fix, total, usable_bytes, weight_bytes)


def members_per_pass(cfg, ranks: int) -> int:
    """k: the members ESSA decodes in one pass (``essa.members_per_pass``, at most this rank's
    share of the population)."""
    return max(1, min(cfg.essa.members_per_pass, math.ceil(cfg.essa.population / ranks)))


def loaded_parts(shape: ModelShape, cfg) -> list:
    """ESSA's weights and the job's own LoRA adapter (fp32, peft's): what the load leaves."""
    n_lora = shape.lora_parameters(cfg.lora.rank, cfg.lora.targets)
    return [(f"weights ({cfg.model.dtype}" + (f", decoder linears {cfg.model.quantize}"
                                              if cfg.model.quantize != "none" else "") + ")",
             weight_bytes(shape, cfg, quantized=True)),
            (f"the job's own LoRA adapter ({n_lora:,} parameters, fp32)",
             n_lora * LORA_BYTES_PER_PARAM)] + reward_model_weights(cfg)


def resident_parts(shape: ModelShape, cfg) -> list:
    """What ESSA holds all job long: :func:`loaded_parts` and its search space's float64
    copies (:func:`hpc.plan.terms.search_space_bytes`)."""
    return loaded_parts(shape, cfg) + [
        (f"search space essa.space={cfg.essa.space}: float64 adapter copy"
         + (" and SVD" if cfg.essa.space == "sv" else ""),
         search_space_bytes(shape, cfg, cfg.essa.space, cfg.essa.alpha))]


def load_phase(shape: ModelShape, cfg) -> Phase:
    """The load: :func:`loaded_parts` as they arrive, each decoder linear quantised as it
    arrives under ``model.quantize``; ``model.load=transformers`` holds the whole model in
    ``model.dtype`` before it quantises."""
    parts = loaded_parts(shape, cfg)
    if cfg.model.quantize != "none":
        if cfg.model.load == "transformers":
            parts[0] = (f"weights, whole in {cfg.model.dtype} before quantisation "
                        f"(model.load=transformers)", weight_bytes(shape, cfg))
        parts += arriving_linear_parts(shape, dtype_bytes(cfg))
    return Phase("load", parts)


def scoring_phase(shape: ModelShape, cfg, ranks: int, k: int) -> Phase:
    members = math.ceil(cfg.essa.population / ranks)
    lora = shape.lora_parameters(cfg.lora.rank, cfg.lora.targets) * LORA_BYTES_PER_PARAM
    resident = resident_parts(shape, cfg)
    rows = min(cfg.model.decode_batch, cfg.essa.minibatch) * k
    return Phase("ESSA scoring", resident + [
        (f"LoRA factors of this rank's {members} members (fp32)", members * lora),
        *reward_model_scoring(cfg),
        *engine_parts(shape, cfg, f"{k} member(s) x {rows // k} rows", rows, k,
                      engine_budget(cfg, total(resident)))])


def members_that_fit(shape: ModelShape, cfg, ranks: int) -> int:
    """The most members per pass whose scoring phase fits with every row in one wave (0: not
    even one), at most this rank's members."""
    k, most = 0, math.ceil(cfg.essa.population / ranks)
    rows = min(cfg.model.decode_batch, cfg.essa.minibatch)
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
    phases = [load_phase(shape, cfg), scoring_phase(shape, cfg, ranks, k),
              evaluation_phase(shape, cfg, resident, 1, budget)]
    fit = members_that_fit(shape, cfg, ranks)
    notes = [f"engine budget {gib(budget)} (model.engine_memory_gib="
             f"{cfg.model.engine_memory_gib:g}: 0 = {ENGINE_MEMORY_SHARE:.0%} of the "
             f"memory the weights, the adapter and the search space leave, whole GiB)",
             f"members per pass that fit in one wave: {fit} of this rank's "
             f"{math.ceil(cfg.essa.population / ranks)} (essa.members_per_pass="
             f"{cfg.essa.members_per_pass})"]
    host = host_load_bytes(shape, cfg, dtype_bytes(cfg))
    result = MethodPlan("ESSA", phases, usable_bytes(cfg), notes + [
        HANDOVER_NOTE, host_load_note(shape, cfg, host)], engine_budget=budget, host_load=host)
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
