"""Pre-flight memory plan of ESSA and F-GRPO on a real model, from its ``config.json`` alone (no
weights are read), so that a job that cannot fit ends before it loads anything.

Model shape (Qwen2 / Llama family: GQA attention, SwiGLU MLP, RMSNorm): ``hidden_size`` h,
``num_hidden_layers`` L, ``num_attention_heads`` a, ``num_key_value_heads`` g (default a),
``head_dim`` d (default h / a), ``intermediate_size`` I, ``vocab_size`` V,
``tie_word_embeddings`` (default false), q/k/v biases when ``attention_bias`` is true or the
model type is ``qwen2``. Parameters: V*h embeddings, per layer q (h*a*d), k and v (h*g*d each),
o (a*d*h), 3*h*I MLP, 2*h norms (+ a*d + 2*g*d biases), a final h norm, V*h lm_head unless tied.

Memory per GPU by phase, e = bytes per value of ``model.dtype``, a sequence =
``plan.max_prompt_tokens`` + ``task.max_new_tokens`` tokens, GiB = 2**30 bytes; a plan fits
when its largest phase is at most ``USABLE_SHARE`` of ``plan.gpu_memory_gib`` (the rest: CUDA
context, NCCL buffers, allocator fragmentation) and every engine holds a row in its budget:

* the decoding engine (:func:`hpc.engine.memory.engine_memory`: KV cache, stacked members,
  per-slot buffers, a step's transient), sized per phase as the job sizes it: the phase's rows
  bucketed, capped by ``model.engine_slots`` and by its budget (``model.engine_memory_gib``, or
  :func:`hpc.engine.memory.budget_left`: half of what everything resident leaves, whole GiB;
  the job decodes within this same figure, :func:`planned_engine_budget`); larger phases
  decode in waves. Hand-overs: an engine is released before the next is built and an
  evaluation's at its end (unless the next phase reuses it), so no two engines are alive at
  once and no transition peaks above the phases. Under DDP the rollout's engine stays on the
  model through F-GRPO's training where the plan fits so, else it is released after each
  rollout (:func:`rollout_engine_kept`; the plan's notes say which); FSDP2's gathered copy and
  its engine are freed after the rollout.
* ESSA: weights (decoder linears at ``model.quantize``'s bytes with torchao's scales), the
  job's own adapter (fp32), the rank's members' LoRA factors (fp32), and the scoring engine
  of k members x
  ``min(eval.batch_size, essa.minibatch)`` rows; the evaluation phase instead holds the
  evaluation engine (``eval.batch_size x eval.n_samples`` rows asked).
* F-GRPO state (:mod:`hpc.models.parallelize`): DDP LoRA: weights + 16 bytes per LoRA
  parameter (+ the quantised rollout copy of the decoder linears under ``model.quantize``);
  DDP full fine-tuning: 20 bytes a parameter for a 16-bit model (weights, gradients, fp32
  masters and their gradients, fp32 AdamW moments; 16 in fp32), + a flat fp32 gradient copy
  (4 bytes a parameter) in the all-reduce and AdamW step; FSDP2: fp32 weight shards and, for
  full fine-tuning, fp32 gradient and moment shards, 1/ranks each, + the gathered model in
  ``model.dtype`` during rollouts and evaluation, two gathered layers, the root unit and a
  layer's gradients during training. Gradients live from a step's first backward to its
  optimizer step only. While decoding, ``fgrpo.offload`` (:mod:`hpc.models.offload`) moves
  the moments and DDP's masters (optimizer), or also FSDP2's shards (state), to host memory;
  the plan prints the bytes and the seconds a step at ``plan.host_gb_per_s``.
* F-GRPO training, one micro-batch of ``fgrpo.micro_batch`` sequences: without activation
  checkpointing every layer keeps (6h + 2ad + 3I) values a token in 16 bits ((5h + ...) in
  fp32; K and V at all a heads, as transformers' padded path saves them) plus the inputs of
  the LoRA targets in fp32 (not under FSDP2, which gathers the factors in 16 bits; there a
  LoRA layer keeps h values more, measured), or (4h + I) values more with full fine-tuning;
  with it
  (``model.activation_checkpointing``) each layer keeps its input (h values) and one layer is
  recomputed at a time. Log-probs: full-vocabulary logits cost 16 V bytes a position at the
  backward's peak; in chunks (``model.logprob_chunk`` = c) the final norm's input and the
  flattened hidden states stay, and one chunk's 16 c V bytes come and go.
  ``model.activation_checkpointing=auto`` turns checkpointing off only when the plan without
  it fits with a stated margin to spare for what a tensor tracker cannot see
  (:func:`unseen_parts`: CUDA context, cuBLAS workspaces, the fp32 log-softmax scratch, 10% of
  the activations for fragmentation).

These terms were checked against torch's memory tracker running the package's own engine and
F-GRPO step on fake tensors, DDP and FSDP2 (benchmarks/memory_tracker.py,
tests/test_memory_plan.py: within 15% for Qwen2.5-1.5B, 7B and 32B), and over whole jobs in
the package's order (start evaluation, steps, a periodic and the final evaluation, export;
ESSA bf16 and INT8, F-GRPO DDP and FSDP2: within 5%). When a plan does not fit, the advice is the first of a list
of changes (checkpointing, chunked log-probs, smaller micro-batches, FSDP2 over more ranks,
optimizer offload, a smaller engine budget, int8 weights) under which it does.

``hpc-plan [CONFIG.yaml] [section.key=value ...] [--ranks N]`` (:func:`hpc.commands.plan`) prints
:func:`plan_text`, the plan of both methods;
:func:`check_job_memory` is called by every job at start.
"""
from __future__ import annotations

import copy
import json
import math
import os
from dataclasses import dataclass

from hpc.engine.memory import (ENGINE_MEMORY_SHARE, GIB, bucket, budget_left, engine_memory,
                               rounded_length, slots_within)
from hpc.engine.shape import QWEN25, ModelShape
from hpc.runtime.errors import UserError

def bytes_per_parameter(quantize: str, in_features: int, elem: int) -> float:
    """:func:`hpc.models.quantize.bytes_per_parameter`, imported on first use (torch)."""
    from hpc.models.quantize import bytes_per_parameter as per_parameter
    return per_parameter(quantize, in_features, elem)


USABLE_SHARE = 0.9
# what a tensor tracker cannot see on a GPU, kept free by model.activation_checkpointing=auto
# before it turns checkpointing off (unseen_parts)
CUDA_CONTEXT_BYTES = 3 * GIB // 4  # CUDA context, loaded kernels, NCCL communicators
CUBLAS_WORKSPACE_BYTES = GIB // 4  # cuBLAS / cuBLASLt workspaces of the streams in use
FRAGMENTATION_SHARE = 0.10  # of the activations: the caching allocator's rounding and splits
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
LORA_BYTES_PER_PARAM = 4  # peft keeps adapter weights in fp32
LORA_TRAIN_BYTES_PER_PARAM = 16  # fp32 weight + gradient + AdamW exp_avg + exp_avg_sq


def essa_members_per_pass(cfg, ranks: int) -> int:
    """k: the members ESSA decodes in one pass (``essa.members_per_pass``, at most this rank's
    share of the population)."""
    return max(1, min(cfg.essa.members_per_pass, math.ceil(cfg.essa.population / ranks)))


def evaluation_rows(cfg) -> int:
    """Rows the held-out evaluation's sampled pass decodes at once: ``eval.batch_size`` prompts
    x ``eval.n_samples`` samples."""
    return cfg.eval.batch_size * cfg.eval.n_samples


def gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f} GiB"


def _bytes(cfg) -> int:
    return DTYPE_BYTES[cfg.model.dtype]


def _seq(cfg) -> int:
    return cfg.plan.max_prompt_tokens + cfg.task.max_new_tokens


def weight_bytes(shape: ModelShape, cfg, quantized: bool = False) -> int:
    """The base weights in ``model.dtype``; ``quantized``: the decoder layers' linears at
    ``model.quantize``'s bytes a weight (torchao's scales included), the rest unchanged."""
    e = _bytes(cfg)
    if not quantized or cfg.model.quantize == "none":
        return shape.parameters() * e
    linears = sum(shape.layers * i * o * (bytes_per_parameter(cfg.model.quantize, i, e) - e)
                  for i, o in shape.module_shapes().values())
    return int(shape.parameters() * e + linears)


def quantized_copy_bytes(shape: ModelShape, cfg) -> int:
    """F-GRPO's quantised copy of the decoder linears for its rollouts (0 without quantize)."""
    if cfg.model.quantize == "none":
        return 0
    return int(sum(shape.layers * i * o * bytes_per_parameter(cfg.model.quantize, i, _bytes(cfg))
                   for i, o in shape.module_shapes().values()))


def dequantized_linear_bytes(shape: ModelShape, cfg) -> int:
    """torchao's eager weight-only path materialises one linear's weight in the activation
    dtype per call: the largest, transient."""
    if cfg.model.quantize == "none":
        return 0
    return max(i * o for i, o in shape.module_shapes().values()) * _bytes(cfg)


def _max_len(cfg) -> int:
    return rounded_length(_seq(cfg))


def engine_budget(cfg, resident: int) -> int:
    """The engine's budget: ``model.engine_memory_gib``, or :func:`hpc.engine.memory.budget_left`
    of ``plan.gpu_memory_gib`` with ``resident`` bytes (everything the method holds while it
    decodes) resident. A job with a plan decodes within this budget
    (:func:`planned_engine_budget`), so its engines are the plan's."""
    if cfg.model.engine_memory_gib > 0:
        return int(cfg.model.engine_memory_gib * GIB)
    return budget_left(int(cfg.plan.gpu_memory_gib * GIB), resident)


def engine_slots(shape: ModelShape, cfg, rows: int, k: int, budget: int) -> int:
    """Slots of a phase that asks for ``rows`` rows
    (:meth:`hpc.engine.decoder.Decoder.run_requests`): the
    rows bucketed, capped by ``model.engine_slots`` and by what fits ``budget``."""
    n_lora = shape.lora_parameters(cfg.lora.rank, cfg.lora.targets) if k else 0
    within = slots_within(budget, shape, _max_len(cfg), k, _bytes(cfg), n_lora,
                          LORA_BYTES_PER_PARAM)
    return min(bucket(rows, 1 << 30), cfg.model.engine_slots or 1 << 30, within)


def engine_parts(shape: ModelShape, cfg, what: str, rows: int, k: int, budget: int) -> list:
    """(label, bytes) of a phase's engine (:func:`hpc.engine.memory.engine_memory`): what lives with
    it, and its step's transient peak (with a dequantised linear under model.quantize)."""
    slots = engine_slots(shape, cfg, rows, k, budget)
    n_lora = shape.lora_parameters(cfg.lora.rank, cfg.lora.targets) if k else 0
    parts = engine_memory(shape, max(1, slots), _max_len(cfg), k, _bytes(cfg), n_lora,
                          LORA_BYTES_PER_PARAM, prompt_tokens=cfg.plan.max_prompt_tokens)
    if slots < 1:
        label = (f"engine: {what}: NO ROW FITS its budget of {gib(budget)} "
                 f"(model.engine_memory_gib); one row")
    else:
        waves = f" ({rows} rows asked: in waves)" if slots < rows else ""
        label = (f"engine: {what}: {slots} slots x {_max_len(cfg)} positions{waves}: KV cache, "
                 f"members, buffers")
    return [(label, parts["kv_cache"] + parts["members"] + parts["slot_buffers"]),
            ("its prefill or decode-step temporaries",
             parts["step_peak"] + dequantized_linear_bytes(shape, cfg))]


@dataclass
class Phase:
    """One phase of a job on one GPU: what is alive at its peak, (label, bytes) pairs."""

    name: str
    parts: list

    @property
    def peak(self) -> int:
        return sum(b for _, b in self.parts)


@dataclass
class MethodPlan:
    """One method's memory on one GPU: its phases, the peak over them, verdict, advice."""

    method: str
    phases: list
    usable: int
    notes: list
    advice: str = ""
    engine_budget: int = 0  # bytes every engine of the job is sized within

    @property
    def peak(self) -> int:
        return max(p.peak for p in self.phases)

    @property
    def fits(self) -> bool:
        """The peak fits and every engine holds a row within its budget."""
        return self.peak <= self.usable and not any(
            "NO ROW FITS" in label for p in self.phases for label, _ in p.parts)

    def phase(self, name: str) -> Phase:
        return next(p for p in self.phases if p.name == name)

    def lines(self) -> list:
        out = [f"{self.method} per GPU:"]
        for p in self.phases:
            out.append(f"  phase {p.name}: {gib(p.peak)}")
            out += [f"    {label:<74} {gib(nbytes):>11}" for label, nbytes in p.parts]
        verdict = "fits" if self.fits else "DOES NOT FIT"
        out.append(f"  {'peak':<76} {gib(self.peak):>11}  of {gib(self.usable)} usable: "
                   f"{verdict}")
        out += [f"  {note}" for note in self.notes]
        if not self.fits:
            out.append(f"  to fit: {self.advice}")
        return out


def _usable(cfg) -> int:
    return int(USABLE_SHARE * cfg.plan.gpu_memory_gib * GIB)


def _with(cfg, **changes):
    """A copy of ``cfg`` with ``section__key=value`` changes."""
    out = copy.deepcopy(cfg)
    for name, value in changes.items():
        section, key = name.split("__")
        setattr(getattr(out, section), key, value)
    return out


def _smallest_fix(build, shape, cfg, ranks: int, candidates: list) -> str:
    """The first of ``candidates`` ((advice, {section__key: value}, ranks or None)) under
    which ``build``'s plan fits, or ''."""
    for advice, changes, new_ranks in candidates:
        if build(shape, _with(cfg, **changes), new_ranks or ranks, advise=False).fits:
            return advice
    return ""


def evaluation_phase(shape: ModelShape, cfg, resident: list, k: int, budget: int) -> Phase:
    """The held-out evaluation's sampled pass (the larger of its two) on top of ``resident``."""
    return Phase("evaluation", resident + engine_parts(
        shape, cfg, "eval.batch_size x eval.n_samples rows, own adapter", evaluation_rows(cfg),
        k, budget))


def essa_resident(shape: ModelShape, cfg) -> list:
    """ESSA's weights and the job's own LoRA adapter (fp32, peft's), held all job long."""
    n_lora = shape.lora_parameters(cfg.lora.rank, cfg.lora.targets)
    return [(f"weights ({cfg.model.dtype}" + (f", decoder linears {cfg.model.quantize}"
                                              if cfg.model.quantize != "none" else "") + ")",
             weight_bytes(shape, cfg, quantized=True)),
            (f"the job's own LoRA adapter ({n_lora:,} parameters, fp32)",
             n_lora * LORA_BYTES_PER_PARAM)]


def _total(parts: list) -> int:
    return sum(b for _, b in parts)


def essa_scoring_phase(shape: ModelShape, cfg, ranks: int, k: int) -> Phase:
    members = math.ceil(cfg.essa.population / ranks)
    lora = shape.lora_parameters(cfg.lora.rank, cfg.lora.targets) * LORA_BYTES_PER_PARAM
    resident = essa_resident(shape, cfg)
    rows = min(cfg.eval.batch_size, cfg.essa.minibatch) * k
    return Phase("ESSA scoring", resident + [
        (f"LoRA factors of this rank's {members} members (fp32)", members * lora),
        *engine_parts(shape, cfg, f"{k} member(s) x {rows // k} rows", rows, k,
                      engine_budget(cfg, _total(resident)))])


def essa_members_that_fit(shape: ModelShape, cfg, ranks: int) -> int:
    """The most members per pass whose scoring phase fits with every row in one wave (0: not
    even one), at most this rank's members."""
    k, most = 0, math.ceil(cfg.essa.population / ranks)
    rows = min(cfg.eval.batch_size, cfg.essa.minibatch)
    while k < most:
        phase = essa_scoring_phase(shape, cfg, ranks, k + 1)
        if phase.peak > _usable(cfg) or "in waves" in phase.parts[-2][0]:
            break
        k += 1
    return k if k or rows else 0


def essa_plan(shape: ModelShape, cfg, ranks: int, advise: bool = True) -> MethodPlan:
    """ESSA on one GPU: scoring passes of k members (``essa.members_per_pass``), and the
    held-out evaluation (its engine is given back before the next scoring pass)."""
    k = essa_members_per_pass(cfg, ranks)
    resident = essa_resident(shape, cfg)
    budget = engine_budget(cfg, _total(resident))
    phases = [essa_scoring_phase(shape, cfg, ranks, k),
              evaluation_phase(shape, cfg, resident, 1, budget)]
    fit = essa_members_that_fit(shape, cfg, ranks)
    notes = [f"engine budget {gib(budget)} (model.engine_memory_gib="
             f"{cfg.model.engine_memory_gib:g}: 0 = {ENGINE_MEMORY_SHARE:.0%} of the "
             f"memory the weights and the adapter leave, whole GiB)",
             f"members per pass that fit in one wave: {fit} of this rank's "
             f"{math.ceil(cfg.essa.population / ranks)} (essa.members_per_pass="
             f"{cfg.essa.members_per_pass})"]
    plan = MethodPlan("ESSA", phases, _usable(cfg), notes + [HANDOVER_NOTE],
                      engine_budget=budget)
    if advise and not plan.fits:
        plan.advice = _smallest_fix(essa_plan, shape, cfg, ranks, [
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
    return plan


def _checkpointed(cfg, ranks: int) -> bool:
    return activation_checkpointing(cfg, "fgrpo", ranks, "cuda", planned=True)


def training_activation_parts(shape: ModelShape, cfg, ranks: int) -> list:
    """(label, bytes) of one F-GRPO micro-batch's forward/backward at its peak: what the
    forward keeps for the backward plus the larger backward transient."""
    e, f = _bytes(cfg), cfg.fgrpo
    tokens = f.micro_batch * _seq(cfg)
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
    return cfg.fgrpo.parallelism == "fsdp2"


def fgrpo_state(shape: ModelShape, cfg, ranks: int) -> list:
    """(label, bytes, kind) of what F-GRPO holds (hpc.models.parallelize). Kinds: ``weights``
    (DDP: the model in ``model.dtype``; FSDP2: fp32 shards, 1/ranks of the model and of the
    LoRA factors), ``masters`` (DDP, full fine-tuning of a 16-bit model: fp32 copies),
    ``moments`` (fp32 AdamW, of the trained parameters or their shards), ``reference`` (full
    fine-tuning with ``fgrpo.beta`` > 0), ``rollout copy`` (the quantised decoder linears under
    ``model.quantize``), and ``gradients``, which exist only from a step's first backward to
    its optimizer step (:meth:`TrainedWeights.free_gradients`)."""
    f, n, e = cfg.fgrpo, shape.parameters(), _bytes(cfg)
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
        if f.full_finetune and f.beta > 0:
            parts.append(("reference model shards (fgrpo.beta > 0)", 4 * n // ranks,
                          "reference"))
        return parts
    parts = [(f"weights ({n:,} parameters, {cfg.model.dtype})", n * e, "weights")]
    if f.full_finetune:
        if e < 4:
            parts.append(("fp32 master weights", 4 * n, "masters"))
        parts += [("fp32 AdamW moments", 8 * n, "moments"),
                  (f"gradients ({cfg.model.dtype}" + (", and fp32 for the masters)" if e < 4
                                                      else ")"),
                   n * e + (4 * n if e < 4 else 0), "gradients")]
        if f.beta > 0:
            parts.append(("reference model (fgrpo.beta > 0 with full fine-tuning)", n * e,
                          "reference"))
    else:
        parts += [(f"LoRA {n_lora:,} parameters: fp32 weights", 4 * n_lora, "weights"),
                  ("LoRA fp32 AdamW moments", 8 * n_lora, "moments"),
                  ("LoRA fp32 gradients", 4 * n_lora, "gradients")]
    if cfg.model.quantize != "none":
        parts.append((f"{cfg.model.quantize} copy of the decoder linears for rollouts",
                      quantized_copy_bytes(shape, cfg), "rollout copy"))
    return parts


def moved_kinds(cfg, offload: str) -> tuple:
    """The kinds of :func:`fgrpo_state` that ``fgrpo.offload`` (resolved) moves to host memory
    while the GPU decodes (:func:`hpc.models.parallelize.decoding`)."""
    kinds = {"none": (), "optimizer": ("moments", "masters"),
             "state": ("moments", "masters", "weights", "reference")}[offload]
    return kinds if _sharded(cfg) else tuple(k for k in kinds if k in ("moments", "masters"))


def offloaded_bytes(shape: ModelShape, cfg, ranks: int, offload: str) -> int:
    """Bytes a rank moves to host memory (and back) around each rollout and evaluation under
    ``offload`` (``fgrpo.offload`` resolved: none, optimizer or state)."""
    kinds = moved_kinds(cfg, offload)
    return sum(b for _, b, kind in fgrpo_state(shape, cfg, ranks) if kind in kinds)


def rollout_offload(cfg, ranks: int, device_type: str, planned: bool = False) -> str:
    """``fgrpo.offload`` resolved for an F-GRPO job on ``ranks`` ranks: as given, or for auto
    the first of none, optimizer, state under which the plan fits (state when none does),
    on CUDA with a local model folder and ``plan.gpu_memory_gib`` > 0 (when none fits: the
    first with the smallest peak, so nothing moves where the peak is the training); else none.
    ``planned``: for the plan itself, which may assume any model folder."""
    choice = cfg.fgrpo.offload
    if choice != "auto":
        return choice
    path = cfg.model.path
    if ((device_type != "cuda" and not planned) or cfg.plan.gpu_memory_gib <= 0
            or not os.path.isfile(os.path.join(path, "config.json"))):
        return "none"
    return offload_that_fits(ModelShape.from_folder(path), cfg, ranks)


def offload_that_fits(shape: ModelShape, cfg, ranks: int) -> str:
    """``fgrpo.offload=auto`` for a model of ``shape`` (:func:`rollout_offload`)."""
    peaks = {}
    for mode in ("none", "optimizer", "state"):
        plan = fgrpo_plan(shape, _with(cfg, fgrpo__offload=mode), ranks, advise=False)
        if plan.fits:
            return mode
        peaks[mode] = plan.peak
    return min(peaks, key=peaks.get)


def _offload(cfg, ranks: int) -> str:
    return rollout_offload(cfg, ranks, "cuda", planned=True)


def gathered_parts(shape: ModelShape, cfg) -> list:
    """FSDP2's gathered weights during the forward/backward: two decoder layers in the
    compute dtype (one prefetched), the root unit (embeddings, LM head, final norm) kept
    from forward to backward, and a layer's unsharded gradients with their fp32 copy for the
    reduce-scatter (two with overlap)."""
    e, layer = _bytes(cfg), shape.layer_parameters()
    root = shape.parameters() - shape.layers * layer
    grads = 2 * layer * (e + 4) if cfg.fgrpo.full_finetune else 0
    return [("FSDP2: two gathered layers, the gathered root, a layer's gradients for the "
             "reduce-scatter", 2 * layer * e + root * e + grads)]


def fgrpo_rollout_rows(cfg, ranks: int) -> int:
    return min(cfg.eval.batch_size, math.ceil(cfg.fgrpo.batch_prompts / ranks)) * \
        cfg.fgrpo.num_generations


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
    if not f.dynamic_sampling:
        return ""
    rounds = expected_rounds(f.filtered_share, f.max_refills)
    return (f"dynamic sampling: {rounds} rollout rounds a step expected at a filtered share of "
            f"{f.filtered_share:.0%} (fgrpo.filtered_share; a pilot run logs filtered_share), "
            f"{(rounds - 1) * f.batch_prompts * f.num_generations} extra rollouts a step, at most "
            f"{1 + f.max_refills} rounds; each round decodes in the same engine, so the peak "
            f"is the one-round peak plus the kept rollouts' token ids")


def fgrpo_plan(shape: ModelShape, cfg, ranks: int, advise: bool = True,
               keep_engine: bool | None = None) -> MethodPlan:
    """F-GRPO on one GPU: rollout, training (micro-batch forward/backward), the gradient
    reduction and AdamW step, and the held-out evaluation. ``keep_engine``: whether the
    rollout's engine stays on the model through training under DDP (None: as
    :func:`rollout_engine_kept` resolves it)."""
    f, n = cfg.fgrpo, shape.parameters()
    held = fgrpo_state(shape, cfg, ranks)
    state = [(label, b) for label, b, kind in held if kind != "gradients"]
    gradients = [(label, b) for label, b, kind in held if kind == "gradients"]
    offload = _offload(cfg, ranks)
    moved = offloaded_bytes(shape, cfg, ranks, offload)
    k = 0 if f.full_finetune else 1
    rows = fgrpo_rollout_rows(cfg, ranks)
    decoding = list(state)  # the rollout's and the evaluation's
    if moved:
        decoding.append((f"moved to host while decoding (fgrpo.offload={offload})", -moved))
    if _sharded(cfg):
        decoding.append((f"gathered {cfg.model.dtype} model for decoding", n * _bytes(cfg)))
    budget = engine_budget(cfg, sum(b for _, b in decoding))
    rollout_engine = engine_parts(shape, cfg, f"{rows // f.num_generations} prompts x G="
                                  f"{f.num_generations}", rows, k, budget)
    kept_rollouts = []
    if f.dynamic_sampling:  # earlier rounds' kept groups (int64 ids and mask, fp32 mask) wait
        rounds = expected_rounds(f.filtered_share, f.max_refills)
        kept_rollouts = [(f"rollouts kept over {rounds} sampling rounds",
                          rows * _seq(cfg) * 20 * (rounds - 1))]
    rollout = Phase("rollout", decoding + rollout_engine + kept_rollouts)
    if keep_engine is None:
        keep_engine = _engine_kept(shape, cfg, ranks)
    kept = [("rollout engine, kept on the model", rollout_engine[0][1])] if keep_engine else []
    train = Phase(f"training (micro_batch {f.micro_batch})", state + gradients + kept
                  + (gathered_parts(shape, cfg) if _sharded(cfg) else [])
                  + training_activation_parts(shape, cfg, ranks))
    phases = [rollout, train]
    if f.full_finetune:
        extra = (("AdamW foreach temporaries", 4 * n // ranks) if _sharded(cfg) else
                 ("flat fp32 gradient copy of the all-reduce / AdamW foreach temporaries", 4 * n))
        phases.append(Phase("gradient reduction and AdamW step", state + gradients + kept
                            + [extra]))
    phases.append(evaluation_phase(shape, cfg, decoding, k, budget))
    resident = sum(b for _, b in state + gradients)
    chunk = cfg.model.logprob_chunk
    plan = MethodPlan("F-GRPO", phases, _usable(cfg), [
        f"parallelism {f.parallelism} over {ranks} ranks; activation checkpointing "
        f"{'on' if _checkpointed(cfg, ranks) else 'off'} (model.activation_checkpointing="
        f"{cfg.model.activation_checkpointing}); "
        + (f"log-probs in chunks of {chunk} positions" if chunk else
           "full-vocabulary logits (model.logprob_chunk=0)")
        + f"; engine budget {gib(budget)}",
        offload_note(cfg, offload, moved), kept_engine_note(cfg, keep_engine),
        HANDOVER_NOTE] + [n for n in [dynamic_sampling_note(cfg)] if n]
        + (checkpointing_notes(shape, cfg, ranks) if advise else []),
        engine_budget=budget)
    if advise and not plan.fits:
        ckpt, chunked = {"model__activation_checkpointing": "on"}, {"model__logprob_chunk": 1024}
        both = dict(ckpt, **chunked)
        fsdp = dict(both, fgrpo__parallelism="fsdp2")
        plan.advice = _smallest_fix(fgrpo_plan, shape, cfg, ranks, [
            *[(f"set fgrpo.offload={mode}", {"fgrpo__offload": mode}, None)
              for mode in ("optimizer", "state") if f.offload not in ("auto", mode)],
            ("set model.activation_checkpointing=on", ckpt, None),
            ("set model.logprob_chunk=1024", chunked, None),
            ("set model.activation_checkpointing=on and model.logprob_chunk=1024", both, None),
            *[(f"fgrpo.micro_batch={m} with checkpointing and chunked log-probs",
               dict(both, fgrpo__micro_batch=m), None) for m in (4, 2, 1) if m < f.micro_batch],
            *[(f"use {r} ranks with fgrpo.parallelism=fsdp2 (checkpointing, chunked log-probs)",
               fsdp, r) for r in (ranks, 8, 16, 32, 64, 128) if r >= ranks],
            *[(f"use {r} ranks with fgrpo.parallelism=fsdp2, fgrpo.offload=state and "
               f"model.engine_memory_gib={g}",
               dict(fsdp, fgrpo__offload="state", model__engine_memory_gib=float(g)), r)
              for r in (ranks, 16, 32, 64, 128) if r >= ranks for g in (8, 4, 2)],
        ]) or (f"weights and optimizer state alone need {gib(resident)}: "
               + ("train a LoRA (fgrpo.full_finetune=false)" if f.full_finetune else
                  "use GPUs with more memory"))
    return plan


def _engine_kept(shape: ModelShape, cfg, ranks: int) -> bool:
    """DDP: the rollout's engine stays on the model through training (no rebuild, its CUDA
    graphs kept) when the plan fits so; else it is released after each rollout, which the
    training's peak then does without. FSDP2 frees it with the gathered copy, always."""
    if _sharded(cfg):
        return False
    return fgrpo_plan(shape, cfg, ranks, advise=False, keep_engine=True).fits


def rollout_engine_kept(cfg, ranks: int, device_type: str) -> bool:
    """For an F-GRPO job: :func:`_engine_kept` on CUDA with a local model folder and
    ``plan.gpu_memory_gib`` > 0; else (no plan) kept under DDP, as before any plan."""
    if not _job_has_plan(cfg, device_type):
        return not _sharded(cfg)
    return _engine_kept(ModelShape.from_folder(cfg.model.path), cfg, ranks)


def _job_has_plan(cfg, device_type: str) -> bool:
    """A job is planned on CUDA with a local model folder and ``plan.gpu_memory_gib`` > 0."""
    return (device_type == "cuda" and cfg.plan.gpu_memory_gib > 0
            and os.path.isfile(os.path.join(cfg.model.path, "config.json")))


def kept_engine_note(cfg, kept: bool) -> str:
    if _sharded(cfg):
        return "rollout engine: freed with the gathered copy after each rollout (FSDP2)"
    if kept:
        return "rollout engine: kept on the model through training (it fits)"
    return "rollout engine: released after each rollout (the training needs its room)"


HANDOVER_NOTE = ("engine hand-overs: each engine is released before the next is built and an "
                 "evaluation's at its end, so no two are alive at once (no peak beyond the "
                 "phases')")


def offload_note(cfg, offload: str, moved: int) -> str:
    """What ``fgrpo.offload`` moves and what it costs a step at ``plan.host_gb_per_s``."""
    mode = f"fgrpo.offload={offload}" + (" (auto)" if cfg.fgrpo.offload == "auto" else "")
    if not moved:
        return f"{mode}: nothing moves to host memory"
    seconds = 2 * moved / (cfg.plan.host_gb_per_s * 1e9)
    return (f"{mode}: {gib(moved)} to host memory and back around each rollout and evaluation "
            f"(pinned host memory per rank): about {seconds:.1f} s a step at "
            f"plan.host_gb_per_s={cfg.plan.host_gb_per_s:g}")


def model_summary(shape: ModelShape, cfg) -> list:
    n = shape.parameters()
    weights = ", ".join(f"{name} {gib(n * b)}" for name, b in DTYPE_BYTES.items())
    n_lora = shape.lora_parameters(cfg.lora.rank, cfg.lora.targets)
    unknown = [t for t in cfg.lora.targets if t not in shape.module_shapes()]
    return [f"model {cfg.model.path}: {n:,} parameters ({shape.layers} layers, hidden "
            f"{shape.hidden}, {shape.heads} heads / {shape.kv_heads} KV heads of {shape.head_dim}, "
            f"intermediate {shape.intermediate}, vocabulary {shape.vocab}, "
            f"{'tied' if shape.tied else 'untied'} embeddings)",
            f"weights: {weights}",
            f"LoRA rank {cfg.lora.rank} on {', '.join(cfg.lora.targets)}: {n_lora:,} parameters"
            + (f" (not counted, unknown to the plan: {', '.join(unknown)})" if unknown else ""),
            f"sequence: {cfg.plan.max_prompt_tokens} prompt tokens (plan.max_prompt_tokens) + "
            f"{cfg.task.max_new_tokens} new (task.max_new_tokens) = {_seq(cfg)} tokens",
            f"GPU memory assumed: {cfg.plan.gpu_memory_gib:g} GiB (plan.gpu_memory_gib), "
            f"{USABLE_SHARE:.0%} usable"]


PLANS = {"essa": essa_plan, "fgrpo": fgrpo_plan}


def check_job_memory(cfg, method: str, ranks: int, device_type: str) -> None:
    """At job start: UserError (one line) when ``method``'s plan does not fit. Only for ESSA and
    F-GRPO on CUDA with a local model folder and ``plan.gpu_memory_gib`` > 0."""
    path = cfg.model.path
    if (method not in PLANS or device_type != "cuda" or cfg.plan.gpu_memory_gib <= 0
            or not os.path.isfile(os.path.join(path, "config.json"))):
        return
    plan = PLANS[method](ModelShape.from_folder(path), cfg, ranks)
    if not plan.fits:
        raise UserError(f"memory plan: {plan.method} needs {gib(plan.peak)} per GPU, more than "
                        f"{gib(plan.usable)} usable of plan.gpu_memory_gib="
                        f"{cfg.plan.gpu_memory_gib:g}; to fit: {plan.advice} (details: hpc-plan "
                        f"with the same config)")


def planned_engine_budget(cfg, method: str, ranks: int, device_type: str) -> int:
    """The engine budget of ``method``'s plan (:attr:`MethodPlan.engine_budget`) for a job on
    CUDA with a local model folder and ``plan.gpu_memory_gib`` > 0 (0 otherwise: the job
    derives it from the device, :meth:`hpc.engine.decoder.Decoder.budget`). The job's engines
    are so sized within the very figure the plan's phases were checked with."""
    if method not in PLANS or not _job_has_plan(cfg, device_type):
        return 0
    return PLANS[method](ModelShape.from_folder(cfg.model.path), cfg, ranks,
                         advise=False).engine_budget


def activation_checkpointing(cfg, method: str, ranks: int, device_type: str,
                             planned: bool = False) -> bool:
    """``model.activation_checkpointing`` resolved for a job of ``method`` (sft or fgrpo) on
    ``ranks`` ranks: on / off as given; auto = on exactly when, on CUDA with a local model
    folder and ``plan.gpu_memory_gib`` > 0, the job does not fit without it (F-GRPO: its plan
    with checkpointing off; SFT: the weights, the trainable state and ``ceil(sft.batch_size /
    ranks)`` sequences' activations). ``planned``: for the plan itself, which may assume any
    model folder."""
    choice = cfg.model.activation_checkpointing
    if choice != "auto":
        return choice == "on"
    path = cfg.model.path
    if ((device_type != "cuda" and not planned) or cfg.plan.gpu_memory_gib <= 0
            or not os.path.isfile(os.path.join(path, "config.json"))):
        return False
    shape = ModelShape.from_folder(path)
    if method == "fgrpo":
        return checkpointing_needed(shape, cfg, ranks)
    elem = DTYPE_BYTES[cfg.model.dtype]
    state = (shape.parameters() * elem + LORA_TRAIN_BYTES_PER_PARAM
             * shape.lora_parameters(cfg.lora.rank, cfg.lora.targets))
    tokens = math.ceil(cfg.sft.batch_size / ranks) * _seq(cfg)
    train = tokens * shape.training_token_bytes(elem, cfg.lora.targets)
    return state + train + _total(unseen_parts(shape, tokens, 0, train)) > _usable(cfg)


def unseen_parts(shape: ModelShape, tokens: int, chunk: int, activations: int) -> list:
    """(label, bytes) of what torch's tensor trackers cannot see on a GPU, which
    ``model.activation_checkpointing=auto`` keeps free before it turns checkpointing off: the
    CUDA context, cuBLAS workspaces, the fp32 log-softmax scratch of the LM head's positions
    (``chunk`` of the micro-batch's ``tokens``, all of them for 0) and FRAGMENTATION_SHARE of
    the ``activations`` bytes (the caching allocator's rounding and split blocks)."""
    positions = min(chunk, tokens) if chunk else tokens
    return [("CUDA context, kernels, NCCL", CUDA_CONTEXT_BYTES),
            ("cuBLAS workspaces", CUBLAS_WORKSPACE_BYTES),
            (f"fp32 log-softmax scratch of {positions} positions", 4 * positions * shape.vocab),
            (f"fragmentation ({FRAGMENTATION_SHARE:.0%} of the activations)",
             int(FRAGMENTATION_SHARE * activations))]


def _unchecked(cfg):
    return _with(cfg, model__activation_checkpointing="off")


def fgrpo_unseen(shape: ModelShape, cfg, ranks: int) -> list:
    """:func:`unseen_parts` of an F-GRPO micro-batch trained without checkpointing."""
    tokens = cfg.fgrpo.micro_batch * _seq(cfg)
    activations = _total(training_activation_parts(shape, _unchecked(cfg), ranks))
    return unseen_parts(shape, tokens, cfg.model.logprob_chunk, activations)


def checkpointing_needed(shape: ModelShape, cfg, ranks: int) -> bool:
    """``model.activation_checkpointing=auto`` for F-GRPO on a model of ``shape``: on unless
    the plan without it fits with :func:`fgrpo_unseen`'s margin to spare."""
    return not _fits_unchecked(shape, cfg, ranks)


def _fits_unchecked(shape: ModelShape, cfg, ranks: int) -> bool:
    """F-GRPO without checkpointing fits with :func:`fgrpo_unseen`'s margin to spare."""
    plan = fgrpo_plan(shape, _unchecked(cfg), ranks, advise=False)
    return plan.fits and plan.peak + _total(fgrpo_unseen(shape, cfg, ranks)) <= plan.usable


def checkpointing_notes(shape: ModelShape, cfg, ranks: int) -> list:
    """What ``model.activation_checkpointing=auto`` weighed (no line for on or off)."""
    if cfg.model.activation_checkpointing != "auto":
        return []
    plan = fgrpo_plan(shape, _unchecked(cfg), ranks, advise=False)
    unseen = fgrpo_unseen(shape, cfg, ranks)
    terms = ", ".join(f"{label} {gib(b)}" for label, b in unseen)
    verdict = "on" if checkpointing_needed(shape, cfg, ranks) else "off"
    return [f"checkpointing auto -> {verdict}: without it the peak is {gib(plan.peak)}, plus a "
            f"margin of {gib(_total(unseen))} for what trackers cannot see ({terms}), of "
            f"{gib(plan.usable)} usable"]


def plan_text(cfg, ranks: int) -> str:
    """The full plan of both methods for ``cfg`` (a config with essa and fgrpo sections)."""
    shape = ModelShape.from_folder(cfg.model.path)
    lines = model_summary(shape, cfg) + [f"ranks: {ranks}", ""]
    lines += essa_plan(shape, cfg, ranks).lines() + [""]
    lines += fgrpo_plan(shape, cfg, ranks).lines()
    return "\n".join(lines)
