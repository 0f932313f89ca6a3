"""F-GRPO's memory plan on one GPU (named by its method's spec, ``method.py``): the rollout,
the training (micro-batch forward/backward), the gradient reduction and AdamW step, and the
held-out evaluation, from the terms of :mod:`hpc.plan.terms`; a reward model (``reward.model``)
adds its weights to every phase and a scoring batch to the rollout and the evaluation.

* state (:mod:`hpc.models.parallelize`): DDP LoRA: weights + 16 bytes per LoRA parameter (+ the
  quantised rollout copy of the decoder linears under ``model.quantize``); DDP full
  fine-tuning: 20 bytes a parameter for a 16-bit model (weights, gradients, fp32 masters and
  their gradients, fp32 AdamW moments; 16 in fp32), + a flat fp32 gradient copy (4 bytes a
  parameter) in the all-reduce and AdamW step; FSDP2: fp32 weight shards and, for full
  fine-tuning, fp32 gradient and moment shards, 1/ranks each, + the gathered model in
  ``model.dtype`` during rollouts and evaluation, two gathered layers, the root unit and a
  layer's gradients during training. Gradients live from a step's first backward to its
  optimizer step only. While decoding, ``fgrpo.parallel.offload`` moves the moments and DDP's
  masters (optimizer), or also FSDP2's shards (state), to host memory.
* the rollout's engine (``min(model.decode_batch, prompts per rank) x G`` rows) stays on the model
  through training under DDP where the plan fits so, else it is released after each rollout
  (:func:`rollout_engine_kept`); FSDP2's gathered copy and its engine are freed after it.
* training, one micro-batch of ``fgrpo.optim.micro_batch`` sequences: without activation
  checkpointing every layer keeps (6h + 2ad + 3I) values a token in 16 bits ((5h + ...) in
  fp32) plus the inputs of the LoRA targets in fp32 (not under FSDP2), or (4h + I) values more
  with full fine-tuning; with it each layer keeps its input and one layer is recomputed at a
  time. Log-probs: full-vocabulary logits cost 16 V bytes a position at the backward's peak; in
  chunks (``model.logprob_chunk`` = c) one chunk's 16 c V bytes come and go.
  ``model.activation_checkpointing=auto`` turns checkpointing off only when the plan without it
  fits with the margin of :func:`hpc.plan.terms.unseen_parts` to spare
  (:func:`checkpointing_needed`).
"""
from __future__ import annotations

import math
import os

from hpc.engine.shape import ModelShape
from hpc.plan.terms import (HANDOVER_NOTE, MethodPlan, Phase, arriving_linear_parts,
                            dtype_bytes, engine_budget, engine_parts, evaluation_phase, gib,
                            host_load_bytes, host_load_note, job_has_plan,
                            quantized_copy_bytes, resolve_checkpointing, reward_model_scoring,
                            reward_model_weights, search_space_bytes, sequence_tokens,
                            smallest_fix, total, unseen_parts, usable_bytes, with_changes)


def _checkpointed(cfg, ranks: int) -> bool:
    """Whether the plan's training keeps only layer inputs (``model.activation_checkpointing``
    resolved by this method's rule, any model folder)."""
    return resolve_checkpointing(cfg, "cuda", lambda shape: checkpointing_needed(shape, cfg, ranks),
                                 planned=True)


def training_activation_parts(shape: ModelShape, cfg, ranks: int) -> list:
    """(label, bytes) of one F-GRPO micro-batch's forward/backward at its peak: what the
    forward keeps for the backward plus the larger backward transient."""
    e, f = dtype_bytes(cfg), cfg.fgrpo
    tokens = f.optim.micro_batch * sequence_tokens(cfg)
    # the LoRA targets' inputs are kept in fp32 where peft casts them up to the fp32 factors;
    # under FSDP2 the factors are gathered in model.dtype like every other weight
    targets = () if f.full_finetune or _sharded(cfg) else cfg.lora.targets
    layer = shape.training_layer_bytes(e, targets, f.full_finetune)
    if _sharded(cfg) and not f.full_finetune:  # measured: one h-wide 16-bit copy a token more
        layer += shape.hidden * e  # (a sharded LoRA layer's input cast to the compute dtype)
    chunk = cfg.model.logprob_chunk
    upcast = 4 if e < 4 else 0
    if chunk:  # the final norm's input (+ fp32 upcast), the flattened hidden, one head chunk
        head = [(f"final norm and hidden for the LM head ({tokens} positions)",
                 tokens * shape.hidden * (2 * e + upcast))]
        head_transient = 16 * min(chunk, tokens) * shape.vocab + 2 * tokens * shape.hidden * e
        head_label = f"one LM-head chunk of {min(chunk, tokens)} positions (model.logprob_chunk)"
    else:  # logits, their fp32 copy and three fp32 backward temporaries
        head, head_transient = [], 16 * tokens * shape.vocab
        head_label = f"full-vocabulary logits of {tokens} positions (model.logprob_chunk=0)"
    if _checkpointed(cfg, ranks):
        kept = [(f"checkpointed layer inputs ({shape.layers} layers x {tokens} tokens)",
                 shape.layers * tokens * shape.hidden * e)]
        layer_transient = tokens * layer + 2 * tokens * shape.hidden * e
    else:
        kept = [(f"activations of {shape.layers} layers x {tokens} tokens (no checkpointing)",
                 shape.layers * tokens * layer)]
        layer_transient = 0
    peak = ((head_label, head_transient) if head_transient >= layer_transient else
            ("one layer's recomputation and its gradients", layer_transient))
    return kept + head + [peak]


def _sharded(cfg) -> bool:
    return cfg.fgrpo.parallel.strategy == "fsdp2"


def fgrpo_state(shape: ModelShape, cfg, ranks: int) -> list:
    """(label, bytes, kind) of what F-GRPO holds (hpc.models.parallelize). Kinds: ``weights``
    (DDP: the model in ``model.dtype``; FSDP2: fp32 shards, 1/ranks of the model and of the
    LoRA factors), ``masters`` (DDP, full fine-tuning of a 16-bit model: fp32 copies),
    ``moments`` (fp32 AdamW, of the trained parameters or their shards), ``reference`` (full
    fine-tuning with ``fgrpo.loss.beta`` > 0), ``rollout copy`` (the quantised decoder linears under
    ``model.quantize``), and ``gradients``, which exist only from a step's first backward to
    its optimizer step (:meth:`TrainedWeights.free_gradients`)."""
    f, n, e = cfg.fgrpo, shape.parameters(), dtype_bytes(cfg)
    n_lora = shape.lora_parameters(cfg.lora.rank, cfg.lora.targets)
    trained = n if f.full_finetune else n_lora
    if _sharded(cfg):
        parts = [(f"fp32 weight shards ({n:,} parameters / {ranks} ranks)", 4 * n // ranks,
                  "weights")]
        if not f.full_finetune:
            parts.append((f"LoRA {n_lora:,} parameters / {ranks} ranks: fp32 weight shards",
                          4 * n_lora // ranks, "weights"))
        parts += [("fp32 AdamW moment shards", 8 * trained // ranks, "moments"),
                  ("fp32 gradient shards", 4 * trained // ranks, "gradients")]
        if f.full_finetune and f.loss.beta > 0:
            parts.append(("reference model shards (fgrpo.loss.beta > 0)", 4 * n // ranks,
                          "reference"))
        return parts + _extra_state(shape, cfg)
    parts = [(f"weights ({n:,} parameters, {cfg.model.dtype})", n * e, "weights")]
    if f.full_finetune:
        if e < 4:
            parts.append(("fp32 master weights", 4 * n, "masters"))
        parts += [("fp32 AdamW moments", 8 * n, "moments"),
                  (f"gradients ({cfg.model.dtype}" + (", and fp32 for the masters)" if e < 4
                                                      else ")"),
                   n * e + (4 * n if e < 4 else 0), "gradients")]
        if f.loss.beta > 0:
            parts.append(("reference model (fgrpo.loss.beta > 0 with full fine-tuning)", n * e,
                          "reference"))
    else:
        parts += [(f"LoRA {n_lora:,} parameters: fp32 weights", 4 * n_lora, "weights"),
                  ("LoRA fp32 AdamW moments", 8 * n_lora, "moments"),
                  ("LoRA fp32 gradients", 4 * n_lora, "gradients")]
    return parts + _extra_state(shape, cfg)


def _extra_state(shape: ModelShape, cfg) -> list:
    """(label, bytes, kind) held beside the weights whatever the parallelism: the quantised
    rollout copy of the decoder linears (whole on every rank, made from the whole weights as
    they arrive) and ``fgrpo.space=sv``'s float64 search space."""
    parts = []
    if cfg.model.quantize != "none":
        parts.append((f"{cfg.model.quantize} copy of the decoder linears for rollouts",
                      quantized_copy_bytes(shape, cfg), "rollout copy"))
    if cfg.fgrpo.space == "sv":
        parts.append(("search space fgrpo.space=sv: float64 adapter copy and SVD",
                      search_space_bytes(shape, cfg, "sv", cfg.fgrpo.alpha), "space"))
    return parts


LOADED_KINDS = ("weights", "reference", "rollout copy")  # what the load itself makes


def load_phase(shape: ModelShape, cfg, ranks: int) -> Phase:
    """The load (:func:`hpc.models.loading.load_model`): the weights, the reference and the
    rollout copy as they arrive (the optimizer's state comes later), plus what is arriving:
    DDP: nothing beyond (a tensor arrives as its parameter); FSDP2 (``model.load=streamed``):
    the arriving tensor's rows on this rank in fp32, or the settling forward's gathered units
    (:func:`settle_part`), the larger; under ``model.quantize`` a whole decoder linear with its
    quantisation temporaries (its rollout copy). ``model.load=transformers`` under FSDP2
    holds the whole fp32 model (and LoRA) before ``fully_shard``."""
    f, n = cfg.fgrpo, shape.parameters()
    parts = [(label, b) for label, b, kind in fgrpo_state(shape, cfg, ranks)
             if kind in LOADED_KINDS]
    # a decoder linear's rollout copy: from the whole fp32 tensor read for it (FSDP2), or from
    # the weight itself, which is already counted (DDP)
    arriving = arriving_linear_parts(shape, 4 if _sharded(cfg) else 0) \
        if cfg.model.quantize != "none" else []
    if _sharded(cfg) and cfg.model.load == "transformers":
        whole = [("the whole fp32 model before fully_shard (model.load=transformers)", 4 * n)]
        if not f.full_finetune:
            n_lora = shape.lora_parameters(cfg.lora.rank, cfg.lora.targets)
            whole.append((f"LoRA {n_lora:,} parameters, whole, fp32", 4 * n_lora))
        parts = [(label, b) for label, b in parts if "shards" not in label] + whole
    elif _sharded(cfg):  # the largest of what comes and goes, one after the other
        rows = -(-shape.largest_tensor() // ranks)
        arriving = [max([(f"the arriving tensor's rows on this rank ({rows:,} values, fp32)",
                          rows * 4),
                         settle_part(shape, cfg)] + arriving,
                        key=lambda part: part[1])]
    return Phase("load", parts + arriving + reward_model_weights(cfg))


def moved_kinds(cfg, offload: str) -> tuple:
    """The kinds of :func:`fgrpo_state` that ``fgrpo.parallel.offload`` (resolved) moves to host
    memory while the GPU decodes (:func:`hpc.models.parallelize.decoding`)."""
    kinds = {"none": (), "optimizer": ("moments", "masters"),
             "state": ("moments", "masters", "weights", "reference")}[offload]
    return kinds if _sharded(cfg) else tuple(k for k in kinds if k in ("moments", "masters"))


def offloaded_bytes(shape: ModelShape, cfg, ranks: int, offload: str) -> int:
    """Bytes a rank moves to host memory (and back) around each rollout and evaluation under
    ``offload`` (``fgrpo.parallel.offload`` resolved: none, optimizer or state)."""
    kinds = moved_kinds(cfg, offload)
    return sum(b for _, b, kind in fgrpo_state(shape, cfg, ranks) if kind in kinds)


def rollout_offload(cfg, ranks: int, device_type: str, planned: bool = False) -> str:
    """``fgrpo.parallel.offload`` resolved for an F-GRPO job on ``ranks`` ranks: as given, or for
    auto the first of none, optimizer, state under which the plan fits (state when none does),
    on CUDA with a local model folder and ``plan.gpu_memory_gib`` > 0 (when none fits: the
    first with the smallest peak, so nothing moves where the peak is the training); else none.
    ``planned``: for the plan itself, which may assume any model folder."""
    choice = cfg.fgrpo.parallel.offload
    if choice != "auto":
        return choice
    path = cfg.model.path
    if ((device_type != "cuda" and not planned) or cfg.plan.gpu_memory_gib <= 0
            or not os.path.isfile(os.path.join(path, "config.json"))):
        return "none"
    return offload_that_fits(ModelShape.from_folder(path), cfg, ranks)


def offload_that_fits(shape: ModelShape, cfg, ranks: int) -> str:
    """``fgrpo.parallel.offload=auto`` for a model of ``shape`` (:func:`rollout_offload`)."""
    peaks = {}
    for mode in ("none", "optimizer", "state"):
        result = plan(shape, with_changes(cfg, fgrpo__parallel__offload=mode), ranks, advise=False)
        if result.fits:
            return mode
        peaks[mode] = result.peak
    return min(peaks, key=peaks.get)


def _offload(cfg, ranks: int) -> str:
    return rollout_offload(cfg, ranks, "cuda", planned=True)


def settle_part(shape: ModelShape, cfg) -> tuple:
    """(label, bytes) of FSDP2's settling forward at the end of the load
    (:func:`hpc.models.parallelize.settle`), in the compute dtype: a unit's all-gather output
    lives beside its unsharded copy, so the root (embeddings, LM head, final norm) counts twice
    while the first layers gather, then once beside three layers (the one computing, the
    next one's all-gather output and its copy): the larger of 2 root + 2 layers and root + 3
    layers (torch's tracker over the real load on 2 and 4 gloo ranks, a small and a large
    root: tests/test_streamed_load.py, tests/mpi/load_check.py)."""
    e, layer = dtype_bytes(cfg), shape.layer_parameters()
    root = shape.parameters() - shape.layers * layer
    return ("the settling forward: the gathered root and layers",
            max(2 * root + 2 * layer, root + 3 * layer) * e)


def gathered_parts(shape: ModelShape, cfg) -> list:
    """FSDP2's gathered weights during the forward/backward: two decoder layers in the
    compute dtype (one prefetched), the root unit (embeddings, LM head, final norm) kept
    from forward to backward, and a layer's unsharded gradients with their fp32 copy for the
    reduce-scatter (two with overlap)."""
    e, layer = dtype_bytes(cfg), shape.layer_parameters()
    root = shape.parameters() - shape.layers * layer
    grads = 2 * layer * (e + 4) if cfg.fgrpo.full_finetune else 0
    return [("FSDP2: two gathered layers, the gathered root, a layer's gradients for the "
             "reduce-scatter", 2 * layer * e + root * e + grads)]


def held_rollout_parts(cfg, ranks: int) -> list:
    """(label, bytes) of what a rank holds from its rollouts through training
    (:func:`fgrpo.step.train_on_rollouts`): the step's rows (``ceil(batch_prompts / ranks)``
    x G) of token ids, attention mask (int64) and completion mask (fp32), 20 bytes a
    position; the frozen log-probs, (rows, T - 1) fp32 each: the sampling policy's where an
    update is off-policy (``num_iterations`` > 1 or more than one mini-batch), the
    reference's where ``loss.beta`` > 0; and, with mini-batches, an update's copy of its
    rows of all of them."""
    f, T = cfg.fgrpo, sequence_tokens(cfg)
    rows = math.ceil(f.batch_prompts / ranks) * f.sampling.num_generations
    updates = f.batch_prompts // (f.optim.mini_batch_prompts or f.batch_prompts)
    frozen = int(f.optim.num_iterations > 1 or updates > 1) + int(f.loss.beta > 0)
    row_bytes = 20 * T + frozen * 4 * (T - 1)
    parts = [(f"the step's {rows} rollouts (ids, masks) with {frozen} frozen fp32 log-prob "
              f"rows each", rows * row_bytes)]
    if updates > 1:
        parts.append((f"an update's copy of its rows ({updates} mini-batches)",
                      math.ceil(rows / updates) * row_bytes))
    return parts


def fgrpo_rollout_rows(cfg, ranks: int) -> int:
    """Rows of a rollout's engine pass: min(model.decode_batch, prompts per rank) x G."""
    return min(cfg.model.decode_batch, math.ceil(cfg.fgrpo.batch_prompts / ranks)) * \
        cfg.fgrpo.sampling.num_generations


def expected_rounds(filtered_share: float, max_refills: int) -> int:
    """Sampling rounds a dynamic-sampling step expects when a share ``filtered_share`` of
    groups is uniform: each round of ``fgrpo.batch_prompts`` prompts yields (1 - share) of them
    informative, a refill is a whole round (verl's generation batches), at most
    1 + ``max_refills``. 1 without filtering."""
    if filtered_share <= 0.0:
        return 1
    return min(1 + max_refills, math.ceil(1.0 / (1.0 - filtered_share) - 1e-9))


def dynamic_sampling_note(cfg) -> str:
    """The plan's line on dynamic sampling's extra rollouts ('' when it is off)."""
    f = cfg.fgrpo
    if not f.sampling.dynamic_sampling:
        return ""
    rounds = expected_rounds(f.sampling.filtered_share, f.sampling.max_refills)
    return (f"dynamic sampling: {rounds} rollout rounds a step expected at a filtered share of "
            f"{f.sampling.filtered_share:.0%} (fgrpo.sampling.filtered_share; a pilot run logs "
            f"filtered_share), {(rounds - 1) * f.batch_prompts * f.sampling.num_generations} "
            f"extra rollouts a step, at most {1 + f.sampling.max_refills} rounds; each round "
            f"decodes in the same engine, so the peak is the one-round peak plus the kept "
            f"rollouts' token ids")


def plan(shape: ModelShape, cfg, ranks: int, advise: bool = True,
               keep_engine: bool | None = None) -> MethodPlan:
    """F-GRPO on one GPU: rollout, training (micro-batch forward/backward), the gradient
    reduction and AdamW step, and the held-out evaluation. ``keep_engine``: whether the
    rollout's engine stays on the model through training under DDP (None: as
    :func:`rollout_engine_kept` resolves it)."""
    f, n = cfg.fgrpo, shape.parameters()
    held = fgrpo_state(shape, cfg, ranks)
    state = [(label, b) for label, b, kind in held if kind != "gradients"] + \
        reward_model_weights(cfg)
    gradients = [(label, b) for label, b, kind in held if kind == "gradients"]
    offload = _offload(cfg, ranks)
    moved = offloaded_bytes(shape, cfg, ranks, offload)
    k = 0 if f.full_finetune else 1
    rows = fgrpo_rollout_rows(cfg, ranks)
    decoding = list(state)  # the rollout's and the evaluation's
    if moved:
        decoding.append((f"moved to host while decoding (fgrpo.parallel.offload={offload})",
                         -moved))
    if _sharded(cfg):
        decoding.append((f"gathered {cfg.model.dtype} model for decoding", n * dtype_bytes(cfg)))
    budget = engine_budget(cfg, sum(b for _, b in decoding))
    rollout_engine = engine_parts(shape, cfg, f"{rows // f.sampling.num_generations} prompts x G="
                                  f"{f.sampling.num_generations}", rows, k, budget)
    kept_rollouts = []
    if f.sampling.dynamic_sampling:
        # earlier rounds' kept groups (int64 ids and mask, fp32 mask) wait
        rounds = expected_rounds(f.sampling.filtered_share, f.sampling.max_refills)
        kept_rollouts = [(f"rollouts kept over {rounds} sampling rounds",
                          rows * sequence_tokens(cfg) * 20 * (rounds - 1))]
    rollout = Phase("rollout", decoding + reward_model_scoring(cfg) + rollout_engine
                    + kept_rollouts)
    if keep_engine is None:
        keep_engine = _engine_kept(shape, cfg, ranks)
    kept = [("rollout engine, kept on the model", rollout_engine[0][1])] if keep_engine else []
    train = Phase(f"training (micro_batch {f.optim.micro_batch})", state + gradients + kept
                  + (gathered_parts(shape, cfg) if _sharded(cfg) else [])
                  + held_rollout_parts(cfg, ranks)
                  + training_activation_parts(shape, cfg, ranks))
    phases = [load_phase(shape, cfg, ranks), rollout, train]
    if f.full_finetune:
        extra = (("AdamW foreach temporaries", 4 * n // ranks) if _sharded(cfg) else
                 ("flat fp32 gradient copy of the all-reduce / AdamW foreach temporaries", 4 * n))
        phases.append(Phase("gradient reduction and AdamW step", state + gradients + kept
                            + [extra]))
    phases.append(evaluation_phase(shape, cfg, decoding, k, budget))
    resident = sum(b for _, b in state + gradients)
    chunk = cfg.model.logprob_chunk
    host = host_load_bytes(shape, cfg, 4 if _sharded(cfg) else dtype_bytes(cfg),
                           ranks if _sharded(cfg) else 1,
                           whole_linears=cfg.model.quantize != "none")
    result = MethodPlan("F-GRPO", phases, usable_bytes(cfg), [
        f"parallelism {f.parallel.strategy} over {ranks} ranks; activation checkpointing "
        f"{'on' if _checkpointed(cfg, ranks) else 'off'} (model.activation_checkpointing="
        f"{cfg.model.activation_checkpointing}); "
        + (f"log-probs in chunks of {chunk} positions" if chunk else
           "full-vocabulary logits (model.logprob_chunk=0)")
        + f"; engine budget {gib(budget)}",
        offload_note(cfg, offload, moved), kept_engine_note(cfg, keep_engine),
        HANDOVER_NOTE] + [n for n in [dynamic_sampling_note(cfg)] if n]
        + (checkpointing_notes(shape, cfg, ranks) if advise else [])
        + [host_load_note(shape, cfg, host)],
        engine_budget=budget, host_load=host)
    if advise and not result.fits:
        ckpt, chunked = {"model__activation_checkpointing": "on"}, {"model__logprob_chunk": 1024}
        both = dict(ckpt, **chunked)
        fsdp = dict(both, fgrpo__parallel__strategy="fsdp2")
        result.advice = smallest_fix(plan, shape, cfg, ranks, [
            *[(f"set fgrpo.parallel.offload={mode}", {"fgrpo__parallel__offload": mode}, None)
              for mode in ("optimizer", "state") if f.parallel.offload not in ("auto", mode)],
            ("set model.activation_checkpointing=on", ckpt, None),
            ("set model.logprob_chunk=1024", chunked, None),
            ("set model.activation_checkpointing=on and model.logprob_chunk=1024", both, None),
            *[(f"fgrpo.optim.micro_batch={m} with checkpointing and chunked log-probs",
               dict(both, fgrpo__optim__micro_batch=m), None)
              for m in (4, 2, 1) if m < f.optim.micro_batch],
            *[(f"use {r} ranks with fgrpo.parallel.strategy=fsdp2 (checkpointing, chunked "
               f"log-probs)",
               fsdp, r) for r in (ranks, 8, 16, 32, 64, 128) if r >= ranks],
            *[(f"use {r} ranks with fgrpo.parallel.strategy=fsdp2, fgrpo.parallel.offload=state "
               f"and model.engine_memory_gib={g}",
               dict(fsdp, fgrpo__parallel__offload="state", model__engine_memory_gib=float(g)), r)
              for r in (ranks, 16, 32, 64, 128) if r >= ranks for g in (8, 4, 2)],
        ]) or (f"weights and optimizer state alone need {gib(resident)}: "
               + ("train a LoRA (fgrpo.full_finetune=false)" if f.full_finetune else
                  "use GPUs with more memory"))
    return result


def _engine_kept(shape: ModelShape, cfg, ranks: int) -> bool:
    """DDP: the rollout's engine stays on the model through training (no rebuild, its CUDA
    graphs kept) when the plan fits so; else it is released after each rollout, which the
    training's peak then does without. FSDP2 frees it with the gathered copy, always."""
    if _sharded(cfg):
        return False
    return plan(shape, cfg, ranks, advise=False, keep_engine=True).fits


def choices(cfg, ranks: int, device_type: str) -> dict:
    """The decisions of F-GRPO's plan for a job (:func:`hpc.plan.registry.job_plan`): what
    ``fgrpo.parallel.offload`` moves and whether the rollout's engine is kept."""
    return {"offload": rollout_offload(cfg, ranks, device_type),
            "rollout_engine_kept": rollout_engine_kept(cfg, ranks, device_type)}


def rollout_engine_kept(cfg, ranks: int, device_type: str) -> bool:
    """For an F-GRPO job: :func:`_engine_kept` on CUDA with a local model folder and
    ``plan.gpu_memory_gib`` > 0; else (no plan) kept under DDP, as before any plan."""
    if not job_has_plan(cfg, device_type):
        return not _sharded(cfg)
    return _engine_kept(ModelShape.from_folder(cfg.model.path), cfg, ranks)


def kept_engine_note(cfg, kept: bool) -> str:
    if _sharded(cfg):
        return "rollout engine: freed with the gathered copy after each rollout (FSDP2)"
    if kept:
        return "rollout engine: kept on the model through training (it fits)"
    return "rollout engine: released after each rollout (the training needs its room)"


def offload_note(cfg, offload: str, moved: int) -> str:
    """What ``fgrpo.parallel.offload`` moves and what it costs a step at ``plan.host_gb_per_s``."""
    mode = f"fgrpo.parallel.offload={offload}" + (" (auto)" if cfg.fgrpo.parallel.offload == "auto"
                                                  else "")
    if not moved:
        return f"{mode}: nothing moves to host memory"
    seconds = 2 * moved / (cfg.plan.host_gb_per_s * 1e9)
    return (f"{mode}: {gib(moved)} to host memory and back around each rollout and evaluation "
            f"(pinned host memory per rank): about {seconds:.1f} s a step at "
            f"plan.host_gb_per_s={cfg.plan.host_gb_per_s:g}")


def _unchecked(cfg):
    return with_changes(cfg, model__activation_checkpointing="off")


def fgrpo_unseen(shape: ModelShape, cfg, ranks: int) -> list:
    """:func:`unseen_parts` of an F-GRPO micro-batch trained without checkpointing."""
    tokens = cfg.fgrpo.optim.micro_batch * sequence_tokens(cfg)
    activations = total(training_activation_parts(shape, _unchecked(cfg), ranks))
    return unseen_parts(shape, tokens, cfg.model.logprob_chunk, activations)


def checkpointing_needed(shape: ModelShape, cfg, ranks: int) -> bool:
    """``model.activation_checkpointing=auto`` for F-GRPO on a model of ``shape``: on unless
    the plan without it fits with :func:`fgrpo_unseen`'s margin to spare."""
    return not _fits_unchecked(shape, cfg, ranks)


def _fits_unchecked(shape: ModelShape, cfg, ranks: int) -> bool:
    """F-GRPO without checkpointing fits with :func:`fgrpo_unseen`'s margin to spare."""
    result = plan(shape, _unchecked(cfg), ranks, advise=False)
    return result.fits and result.peak + total(fgrpo_unseen(shape, cfg, ranks)) <= result.usable


def checkpointing_notes(shape: ModelShape, cfg, ranks: int) -> list:
    """What ``model.activation_checkpointing=auto`` weighed (no line for on or off)."""
    if cfg.model.activation_checkpointing != "auto":
        return []
    result = plan(shape, _unchecked(cfg), ranks, advise=False)
    unseen = fgrpo_unseen(shape, cfg, ranks)
    terms = ", ".join(f"{label} {gib(b)}" for label, b in unseen)
    verdict = "on" if checkpointing_needed(shape, cfg, ranks) else "off"
    return [f"checkpointing auto -> {verdict}: without it the peak is {gib(result.peak)}, plus a "
            f"margin of {gib(total(unseen))} for what trackers cannot see ({terms}), of "
            f"{gib(result.usable)} usable"]
