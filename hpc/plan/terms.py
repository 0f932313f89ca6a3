"""The memory plan's terms, shared by every method's plan (``essa/plan.py``,
``fgrpo/plan.py``, ``sft/plan.py``): what a phase holds is a list of (label, bytes) parts, a
:class:`Phase` their sum, a :class:`MethodPlan` a method's phases with the verdict and advice.
Pure arithmetic on the model's :class:`hpc.engine.shape.ModelShape` (its ``config.json``, no
weights) and a job config; this floor knows phases and their parts, never a method.

Memory per GPU, e = bytes per value of ``model.dtype``, a sequence = ``plan.max_prompt_tokens``
+ ``task.max_new_tokens`` tokens, GiB = 2**30 bytes; a plan fits when its largest phase is at
most ``USABLE_SHARE`` of ``plan.gpu_memory_gib`` and every engine holds a row in its budget:

* weights (:func:`weight_bytes`): the decoder linears at ``model.quantize``'s bytes (torchao's
  scales included), the rest in ``model.dtype``;
* the decoding engine (:func:`hpc.engine.memory.engine_memory`: KV cache, stacked members,
  per-slot buffers, a step's transient), sized per phase as the job sizes it
  (:func:`engine_parts`): the phase's rows bucketed, capped by ``model.engine_slots`` and by its
  budget (``model.engine_memory_gib``, or :func:`hpc.engine.memory.budget_left` of what
  everything resident leaves, :func:`engine_budget`); larger phases decode in waves. An engine
  is released before the next is built and an evaluation's at its end (unless the next phase
  reuses it), so no two engines are alive at once; ``model.engine=vllm`` holds instead its whole
  budget as its KV pool and a copy of the base weights of its own, besides a step's transient
  (``auto`` is planned as the package's engine);
* the held-out evaluation (:func:`evaluation_phase`): ``eval.batch_size x eval.n_samples`` rows
  on top of what the method holds while it decodes;
* what trackers cannot see on a GPU (:func:`unseen_parts`), the margin
  ``model.activation_checkpointing=auto`` keeps;
* a reward model (``reward.model``, :mod:`hpc.data.reward_model`): its weights in
  ``model.dtype`` in every phase (:func:`reward_model_weights`, counted on the meta device from
  its config), and one scoring batch's activations in every phase that decodes
  (:func:`reward_model_scoring`);
* the load (:mod:`hpc.models.streaming`), a phase of every plan: what the method holds once its
  weights are in, plus the tensor that is arriving (:func:`arriving_linear_parts` when each
  decoder linear is quantised as it arrives), and in host memory per rank one tensor read and
  cast (:func:`host_load_bytes`); ``model.load=transformers`` holds the whole model first.

The terms were checked against torch's memory tracker running the package's own engine and
steps on fake tensors (benchmarks/memory_tracker.py, tests/test_memory_plan.py).
"""
from __future__ import annotations

import copy
import functools
import json
import os
from dataclasses import dataclass

from hpc.engine.backend import OWN_WEIGHTS_AND_POOL
from hpc.engine.memory import (GIB, bucket, budget_left, engine_memory, rounded_length,
                               slots_within)
from hpc.engine.shape import ModelShape
from hpc.models.folders import check_model_folder
from hpc.models.hub import local_or_cached
from hpc.runtime.config import set_key
from hpc.runtime.errors import UserError, first_line


def bytes_per_parameter(quantize: str, in_features: int, elem: int) -> float:
    """:func:`hpc.models.quantize.bytes_per_parameter`, imported on first use (torch)."""
    from hpc.models.quantize import bytes_per_parameter as per_parameter
    return per_parameter(quantize, in_features, elem)


USABLE_SHARE = 0.9  # of plan.gpu_memory_gib a plan may fill (the rest: CUDA context, NCCL
#   buffers, allocator fragmentation)
# what a tensor tracker cannot see on a GPU, kept free by model.activation_checkpointing=auto
# before it turns checkpointing off (unseen_parts)
CUDA_CONTEXT_BYTES = 3 * GIB // 4  # CUDA context, loaded kernels, NCCL communicators
CUBLAS_WORKSPACE_BYTES = GIB // 4  # cuBLAS / cuBLASLt workspaces of the streams in use
FRAGMENTATION_SHARE = 0.10  # of the activations: the caching allocator's rounding and splits
QUANTIZE_TEMPORARY_BYTES = 8  # a weight, while torchao quantises its linear (two fp32
#   temporaries; torch's tracker on CPU, int8; tests/test_streamed_load.py)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
LORA_BYTES_PER_PARAM = 4  # peft keeps adapter weights in fp32
LORA_TRAIN_BYTES_PER_PARAM = 16  # fp32 weight + gradient + AdamW exp_avg + exp_avg_sq


def evaluation_rows(cfg) -> int:
    """Rows the held-out evaluation's sampled pass decodes at once: ``eval.batch_size`` prompts
    x ``eval.n_samples`` samples."""
    return cfg.eval.batch_size * cfg.eval.n_samples


def gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f} GiB"


def dtype_bytes(cfg) -> int:
    return DTYPE_BYTES[cfg.model.dtype]


def sequence_tokens(cfg) -> int:
    return cfg.plan.max_prompt_tokens + cfg.task.max_new_tokens


def weight_bytes(shape: ModelShape, cfg, quantized: bool = False) -> int:
    """The base weights in ``model.dtype``; ``quantized``: the decoder layers' linears at
    ``model.quantize``'s bytes a weight (torchao's scales included), the rest unchanged."""
    e = dtype_bytes(cfg)
    if not quantized or cfg.model.quantize == "none":
        return shape.parameters() * e
    linears = sum(shape.layers * i * o * (bytes_per_parameter(cfg.model.quantize, i, e) - e)
                  for i, o in shape.module_shapes().values())
    return int(shape.parameters() * e + linears)


def quantized_copy_bytes(shape: ModelShape, cfg) -> int:
    """F-GRPO's quantised copy of the decoder linears for its rollouts (0 without quantize)."""
    if cfg.model.quantize == "none":
        return 0
    return int(sum(shape.layers * i * o * bytes_per_parameter(cfg.model.quantize, i, dtype_bytes(cfg))
                   for i, o in shape.module_shapes().values()))


def dequantized_linear_bytes(shape: ModelShape, cfg) -> int:
    """torchao's eager weight-only path materialises one linear's weight in the activation
    dtype per call: the largest, transient."""
    if cfg.model.quantize == "none":
        return 0
    return max(i * o for i, o in shape.module_shapes().values()) * dtype_bytes(cfg)


def arriving_linear_parts(shape: ModelShape, elem: int) -> list:
    """(label, bytes) of the decoder linear being quantised as it arrives: the largest one's
    weight in ``elem`` bytes (0 where it is counted as a weight already) and torchao's
    temporaries (:data:`QUANTIZE_TEMPORARY_BYTES`)."""
    n = shape.largest_linear()
    return [(f"the arriving decoder linear ({n:,} weights) and its quantisation temporaries",
             n * (elem + QUANTIZE_TEMPORARY_BYTES))]


def search_space_bytes(shape: ModelShape, cfg, space: str, alpha: float) -> int:
    """What :mod:`hpc.models.adapter_space` keeps on the adapter's device: a float64 copy of
    every LoRA factor (8 bytes a LoRA parameter) and, for ``space`` sv, its top
    k = ceil(alpha r) singular triplets (float64 U (rows, k), s (k,), Vh (k, cols)); the thin
    SVD's whole U and Vh of one factor come and go while it is built."""
    from hpc.models.adapter_space import searched_count  # torch: imported on first use
    r = cfg.lora.rank
    k = searched_count(alpha, r) if space == "sv" else 0
    shapes = shape.module_shapes()
    per_layer = sum(8 * r * (i + o) + (8 * k * (r + i + 1) + 8 * k * (o + r + 1) if k else 0)
                    for t in cfg.lora.targets if t in shapes for i, o in [shapes[t]])
    return shape.layers * per_layer


def host_load_bytes(shape: ModelShape, cfg, elem: int, share: int = 1,
                    whole_linears: bool = False) -> int:
    """Host memory a rank holds during the load: ``model.load=streamed``: one tensor read from
    the memory-mapped file (in its stored dtype) and cast to ``elem`` bytes: the largest, or
    1/``share`` of its rows (an FSDP2 shard; ``whole_linears``: a decoder linear is read whole
    for its quantised copy); ``transformers``: the whole model in ``elem`` bytes."""
    if cfg.model.load == "transformers":
        return shape.parameters() * elem
    rows = -(-shape.largest_tensor() // share)
    if whole_linears:
        rows = max(rows, shape.largest_linear())
    return rows * (shape.stored_bytes + elem)


def host_load_note(shape: ModelShape, cfg, per_rank: int) -> str:
    """The plan's line on the load's host memory, per rank and per node."""
    node = cfg.plan.ranks_per_node
    how = ("from_pretrained: the whole model" if cfg.model.load == "transformers" else
           "one tensor read from the memory-mapped checkpoint and cast")
    return (f"load (model.load={cfg.model.load}): host memory {gib(per_rank)} a rank ({how}), "
            f"{gib(per_rank * node)} a node of {node} ranks (plan.ranks_per_node; the "
            f"checkpoint's pages are the page cache's, shared by the node)")


def engine_positions(cfg) -> int:
    return rounded_length(sequence_tokens(cfg))


def engine_budget(cfg, resident: int) -> int:
    """The engine's budget: ``model.engine_memory_gib``, or :func:`hpc.engine.memory.budget_left`
    of ``plan.gpu_memory_gib`` with ``resident`` bytes (everything the method holds while it
    decodes) resident. A job with a plan decodes within this budget
    (:class:`hpc.plan.registry.JobPlan`), so its engines are the plan's."""
    if cfg.model.engine_memory_gib > 0:
        return int(cfg.model.engine_memory_gib * GIB)
    return budget_left(int(cfg.plan.gpu_memory_gib * GIB), resident)


def engine_slots(shape: ModelShape, cfg, rows: int, k: int, budget: int) -> int:
    """Slots of a phase that asks for ``rows`` rows
    (:meth:`hpc.engine.engine_backend.EngineBackend.decode`): the
    rows bucketed, capped by ``model.engine_slots`` and by what fits ``budget``."""
    n_lora = shape.lora_parameters(cfg.lora.rank, cfg.lora.targets) if k else 0
    within = slots_within(budget, shape, engine_positions(cfg), k, dtype_bytes(cfg), n_lora,
                          LORA_BYTES_PER_PARAM)
    return min(bucket(rows, 1 << 30), cfg.model.engine_slots or 1 << 30, within)


def engine_parts(shape: ModelShape, cfg, what: str, rows: int, k: int, budget: int) -> list:
    """(label, bytes) of a phase's engine (:func:`hpc.engine.memory.engine_memory`): what lives with
    it, and its step's transient peak (with a dequantised linear under model.quantize)."""
    slots = engine_slots(shape, cfg, rows, k, budget)
    n_lora = shape.lora_parameters(cfg.lora.rank, cfg.lora.targets) if k else 0
    parts = engine_memory(shape, max(1, slots), engine_positions(cfg), k, dtype_bytes(cfg), n_lora,
                          LORA_BYTES_PER_PARAM, prompt_tokens=cfg.plan.max_prompt_tokens)
    if cfg.model.engine in OWN_WEIGHTS_AND_POOL:  # named: auto is planned as the engine
        return [(f"{cfg.model.engine}: {what}: its KV pool, the whole engine budget", budget),
                (f"{cfg.model.engine}: its own copy of the base weights", weight_bytes(shape, cfg)),
                ("its prefill or decode-step temporaries",
                 parts["step_peak"] + dequantized_linear_bytes(shape, cfg))]
    if slots < 1:
        label = (f"engine: {what}: NO ROW FITS its budget of {gib(budget)} "
                 f"(model.engine_memory_gib); one row")
    else:
        waves = f" ({rows} rows asked: in waves)" if slots < rows else ""
        label = (f"engine: {what}: {slots} slots x {engine_positions(cfg)} positions{waves}: KV cache, "
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
    host_load: int = 0  # host bytes a rank holds during the load (:func:`host_load_bytes`)

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


def usable_bytes(cfg) -> int:
    return int(USABLE_SHARE * cfg.plan.gpu_memory_gib * GIB)


def with_changes(cfg, **changes):
    """A copy of ``cfg`` with ``section__key=value`` changes (``section__nested__key`` for a
    key of a nested section)."""
    out = copy.deepcopy(cfg)
    for name, value in changes.items():
        set_key(out, name.replace("__", "."), value)
    return out


def smallest_fix(build, shape, cfg, ranks: int, candidates: list) -> str:
    """The first of ``candidates`` ((advice, {section__key: value}, ranks or None)) under
    which ``build``'s plan fits, or ''."""
    for advice, changes, new_ranks in candidates:
        if build(shape, with_changes(cfg, **changes), new_ranks or ranks, advise=False).fits:
            return advice
    return ""


def evaluation_phase(shape: ModelShape, cfg, resident: list, k: int, budget: int) -> Phase:
    """The held-out evaluation's sampled pass (the larger of its two) on top of ``resident``,
    with a reward model's scoring batch (:func:`reward_model_scoring`)."""
    return Phase("evaluation", resident + reward_model_scoring(cfg) + engine_parts(
        shape, cfg, "eval.batch_size x eval.n_samples rows, own adapter", evaluation_rows(cfg),
        k, budget))


def total(parts: list) -> int:
    return sum(b for _, b in parts)


def job_has_plan(cfg, device_type: str) -> bool:
    """A job is planned on CUDA with a local model folder and ``plan.gpu_memory_gib`` > 0."""
    return (device_type == "cuda" and cfg.plan.gpu_memory_gib > 0
            and os.path.isfile(os.path.join(cfg.model.path, "config.json")))


HANDOVER_NOTE = ("engine hand-overs: each engine is released before the next is built and an "
                 "evaluation's at its end, so no two are alive at once (no peak beyond the "
                 "phases')")


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
            f"{cfg.task.max_new_tokens} new (task.max_new_tokens) = {sequence_tokens(cfg)} tokens",
            f"GPU memory assumed: {cfg.plan.gpu_memory_gib:g} GiB (plan.gpu_memory_gib), "
            f"{USABLE_SHARE:.0%} usable"]


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


def resolve_checkpointing(cfg, device_type: str, needed, planned: bool = False) -> bool:
    """``model.activation_checkpointing`` resolved: on / off as given; auto = ``needed(shape)``
    (the method's own rule, on the model's :class:`ModelShape`) on CUDA with a local model
    folder and ``plan.gpu_memory_gib`` > 0, else off. ``planned``: for the plan itself, which
    may assume any model folder."""
    choice = cfg.model.activation_checkpointing
    if choice != "auto":
        return choice == "on"
    path = cfg.model.path
    if ((device_type != "cuda" and not planned) or cfg.plan.gpu_memory_gib <= 0
            or not os.path.isfile(os.path.join(path, "config.json"))):
        return False
    return needed(ModelShape.from_folder(path))


REWARD_HEADS = "'score' (one label, or ArmoRM's .score) or 'objective:<i>' (ArmoRM's .rewards)"


def reward_head(head: str) -> int | None:
    """``reward.head`` parsed: None for ``score``, i for ``objective:<i>``; else UserError."""
    name, _, index = head.partition(":")
    if head == "score":
        return None
    if name == "objective" and index.isdigit():
        return int(index)
    raise UserError(f"reward.head={head!r} is not one of {REWARD_HEADS}")


def reward_model_folder(reward) -> tuple:
    """``(folder, config.json as a dict)`` of ``reward.model`` (a folder, or a Hub id's snapshot
    in the local Hugging Face cache), checked without torch: UserError (one line) for a missing
    folder or id, a folder without config.json, weights or tokenizer files, a model whose
    config.json names its own modelling code (``auto_map``) while ``reward.trust_remote_code``
    is off, or a ``reward.head`` of another form."""
    reward_head(reward.head)
    folder = local_or_cached(reward.model, "config key 'reward.model'").path
    check_model_folder(folder, "reward model")
    with open(os.path.join(folder, "config.json")) as fh:
        config = json.load(fh)
    if "auto_map" in config and not reward.trust_remote_code:
        raise UserError(f"the reward model {folder} runs its own modelling code (config.json's "
                        f"auto_map, e.g. ArmoRM's): set reward.trust_remote_code=true to run it")
    return folder, config


@functools.cache
def reward_model_size(folder: str, trust_remote_code: bool) -> tuple:
    """``(parameters, hidden size, intermediate size)`` of the sequence-classification model
    in ``folder``, built from its config on the meta device (no weights read)."""
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification

    try:
        config = AutoConfig.from_pretrained(folder, local_files_only=True,
                                            trust_remote_code=trust_remote_code)
        with torch.device("meta"):
            model = AutoModelForSequenceClassification.from_config(
                config, trust_remote_code=trust_remote_code)
    except Exception as err:  # noqa: BLE001 - any failure is a folder that is no reward model
        raise UserError(f"the reward model {folder} is no sequence-classification model "
                        f"transformers can build: {first_line(err)}") from None
    text = config.get_text_config()
    hidden = text.hidden_size
    return (sum(p.numel() for p in model.parameters()), hidden,
            getattr(text, "intermediate_size", None) or 4 * hidden)


def reward_model_weights(cfg) -> list:
    """(label, bytes) of the reward model's weights in ``model.dtype`` ([] without one)."""
    if not cfg.reward.model:
        return []
    n, _, _ = reward_model_size(reward_model_folder(cfg.reward)[0], cfg.reward.trust_remote_code)
    return [(f"reward model ({n:,} parameters, {cfg.model.dtype})", n * dtype_bytes(cfg))]


def reward_model_scoring(cfg) -> list:
    """(label, bytes) of one scoring forward of the reward model ([] without one), B =
    ``reward.batch_size`` rows of T = ``reward.max_tokens`` tokens in ``model.dtype``: a
    layer's peak under no_grad (its input and normed input, h each, and the MLP's gate, up and
    activated gate, I each: (2h + 3I) values a token) and the (B, 1, T, T) attention mask of
    padded rows."""
    if not cfg.reward.model:
        return []
    r = cfg.reward
    _, h, inter = reward_model_size(reward_model_folder(r)[0], r.trust_remote_code)
    tokens = r.batch_size * r.max_tokens
    return [(f"reward model: a scoring batch of {r.batch_size} x {r.max_tokens} tokens",
             (tokens * (2 * h + 3 * inter) + tokens * r.max_tokens) * dtype_bytes(cfg))]
