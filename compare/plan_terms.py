"""The scaling model's memory terms, from the memory plan's own functions
(:mod:`essa.plan`, :mod:`fgrpo.plan`, :mod:`hpc.plan.terms`), so ``hpc-scaling`` and
``hpc-plan`` never disagree on what
fits: the weight bytes a decode step reads and the sequences a GPU decodes at once, per method.

The configuration is the plan's (:func:`hpc.job.config.plan_job_class`): ``--config`` (default:
the package's defaults) with the scaling model's workload on top: the model shape, LoRA rank on
all seven linears, prompt and completion lengths, the GPU's memory (``plan.gpu_memory_gib`` =
the GPU's GB, as ``hpc-plan`` is given it for 80 GB GPUs), ESSA's ``model.quantize``, one
member a pass with all its ``minibatch`` prompts asked at once (``model.decode_batch``), and for
GRPO ``fgrpo.full_finetune`` / ``fgrpo.parallel.strategy`` as the scaling model's flags say.
The same plan decides what sharded full-parameter F-GRPO moves to host memory around a rollout
(:func:`host_offload`).
"""
from __future__ import annotations

from dataclasses import dataclass

from essa.plan import plan as essa_plan
from fgrpo.plan import (checkpointing_needed, offload_that_fits, offloaded_bytes,
                        plan as fgrpo_plan)
from hpc.engine.memory import GIB
from hpc.engine.shape import QWEN25, ModelShape
from hpc.plan.terms import engine_slots, weight_bytes
from hpc.runtime.errors import UserError

PLENTY = 1 << 20  # rows asked: the concurrency is what the plan's engine budget holds
HEAD_DIM = 128  # of a shape given by its widths alone (Qwen2.5's)
VOCAB = 152064  # Qwen2.5's (7B and larger)
QUANTIZE = ("none", "int8", "int4")


@dataclass(frozen=True)
class Decoding:
    """One method's decoding on one GPU: ``weight_bytes`` read per decode step (at
    ``quantize``), at most ``concurrency`` sequences at once (the slots of the plan's engine
    within its ``budget`` bytes)."""

    method: str
    quantize: str
    weight_bytes: int
    concurrency: int
    budget: int

    def describe(self) -> str:
        weights = "bf16" if self.quantize == "none" else f"{self.quantize} decoder linears"
        return (f"{self.method}: {self.weight_bytes / 1e9:.1f} GB of weights a decode step "
                f"({weights}), at most {self.concurrency} concurrent sequences (hpc-plan's "
                f"engine in its {self.budget / GIB:.0f} GiB budget)")


def model_shape(layers: int, hidden: int, intermediate: int, kv_dim: int) -> ModelShape:
    """Qwen2.5-32B's own shape when the widths are its; else a Qwen2.5-like shape of these
    widths (head_dim HEAD_DIM, vocabulary VOCAB, q/k/v biases, untied embeddings)."""
    q = QWEN25["32B"]
    if (layers, hidden, intermediate, kv_dim) == (
            q["num_hidden_layers"], q["hidden_size"], q["intermediate_size"],
            q["num_key_value_heads"] * q["hidden_size"] // q["num_attention_heads"]):
        return ModelShape.from_config(dict(q, model_type="qwen2"))
    return ModelShape(hidden=hidden, layers=layers, heads=hidden // HEAD_DIM,
                      kv_heads=max(1, kv_dim // HEAD_DIM), head_dim=HEAD_DIM,
                      intermediate=intermediate, vocab=VOCAB, tied=False, qkv_bias=True)


def plan_config(config: str | None, *, lora_rank: int, prompt: int, max_new: int,
                gpu_gb: float, minibatch: int, essa_quantize: str | None, full: bool,
                sharded: bool, micro_batch: int):
    """The plan's job config of the scaling model's setting (module docstring);
    ``essa_quantize`` None: the config's ``model.quantize``."""
    from hpc.job.config import plan_job_class
    from hpc.runtime.config import load_config

    cfg = load_config(plan_job_class(), config, [
        "model.dtype=bfloat16", f"lora.rank={lora_rank}",
        "lora.targets=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]",
        f"plan.max_prompt_tokens={prompt}", f"task.max_new_tokens={max_new}",
        f"plan.gpu_memory_gib={gpu_gb:g}", f"essa.minibatch={minibatch}",
        "essa.members_per_pass=1", f"model.decode_batch={minibatch}",
        f"fgrpo.full_finetune={str(full or sharded).lower()}",
        f"fgrpo.parallel.strategy={'fsdp2' if sharded else 'ddp'}",
        f"fgrpo.optim.micro_batch={micro_batch}"]
        + ([f"model.quantize={essa_quantize}"] if essa_quantize else []))
    if cfg.model.quantize not in QUANTIZE:
        raise UserError(f"model.quantize={cfg.model.quantize} is not one of {QUANTIZE}")
    return cfg


def resolve_auto(shape: ModelShape, cfg, gpus: int) -> None:
    """``model.activation_checkpointing`` and ``fgrpo.parallel.offload`` left at auto resolved in
    place as a job resolves them (:func:`checkpointing_needed`, :func:`offload_that_fits`),
    which the plan does itself only for a model folder."""
    if cfg.model.activation_checkpointing == "auto":
        cfg.model.activation_checkpointing = (
            "on" if checkpointing_needed(shape, cfg, gpus) else "off")
    if cfg.fgrpo.parallel.offload == "auto":
        cfg.fgrpo.parallel.offload = offload_that_fits(shape, cfg, gpus)


def essa_decoding(shape: ModelShape, cfg, gpus: int) -> Decoding:
    """ESSA's scoring: weights at ``model.quantize`` (:func:`weight_bytes`), the slots of its
    engine (k = 1 member) within the plan's budget (:func:`engine_slots`)."""
    budget = essa_plan(shape, cfg, gpus, advise=False).engine_budget
    return Decoding("ESSA", cfg.model.quantize, weight_bytes(shape, cfg, quantized=True),
                    engine_slots(shape, cfg, PLENTY, 1, budget), budget)


def fgrpo_decoding(shape: ModelShape, cfg, gpus: int) -> Decoding:
    """F-GRPO's rollout: bf16 weights (the gathered model under FSDP2), the slots of its
    engine (its own adapter, or none when every weight trains) within the plan's budget."""
    plain = cfg.model.quantize
    cfg.model.quantize = "none"  # the scaling model's GRPO decodes its bf16 weights
    try:
        resolve_auto(shape, cfg, gpus)
        budget = fgrpo_plan(shape, cfg, gpus, advise=False).engine_budget
        k = 0 if cfg.fgrpo.full_finetune else 1
        return Decoding("F-GRPO", "none", weight_bytes(shape, cfg),
                        engine_slots(shape, cfg, PLENTY, k, budget), budget)
    finally:
        cfg.model.quantize = plain


def host_offload(shape: ModelShape, gpus: list, *, gpu_gb: float, micro_batch: int,
                 batch_prompts: int, generations: int, max_new: int, prompt: int) -> tuple:
    """(((GPUs, seconds a GPU moves its training state to host memory and back around each
    rollout), ...), a note saying so) of sharded full-parameter F-GRPO, as the job's memory
    plan decides it (``fgrpo.parallel.offload=auto``: the first of none, optimizer, state that
    fits ``gpu_gb`` GB), at the plan's ``plan.host_gb_per_s``."""
    from hpc.job.config import plan_job_class
    from hpc.runtime.config import load_config

    cfg = load_config(plan_job_class(), None, [
        "model.dtype=bfloat16", "fgrpo.full_finetune=true", "fgrpo.parallel.strategy=fsdp2",
        "model.activation_checkpointing=on",
        f"fgrpo.optim.micro_batch={micro_batch}", f"fgrpo.batch_prompts={batch_prompts}",
        f"fgrpo.sampling.num_generations={generations}", f"task.max_new_tokens={max_new}",
        f"plan.max_prompt_tokens={prompt}", f"plan.gpu_memory_gib={gpu_gb:g}"])
    bandwidth = cfg.plan.host_gb_per_s * 1e9
    moved, modes = [], []
    for n in sorted(set(gpus)):
        for mode in ("none", "optimizer", "state"):
            cfg.fgrpo.parallel.offload = mode
            if fgrpo_plan(shape, cfg, n, advise=False).fits:
                nbytes = offloaded_bytes(shape, cfg, n, mode)
                moved.append((n, 2 * nbytes / bandwidth))
                modes.append(f"{n} GPUs: {mode} ({nbytes / 2 ** 30:.1f} GiB)")
                break
        else:
            modes.append(f"{n} GPUs: does not fit even with state")
    return tuple(moved), (
        f"host offload (fgrpo.parallel.offload=auto as the job's memory plan picks it on "
        f"{gpu_gb:g} GB with activation checkpointing, the job's other defaults): "
        + "; ".join(modes) + f"; there and back at {cfg.plan.host_gb_per_s:g} GB/s a GPU "
        "(plan.host_gb_per_s)")
