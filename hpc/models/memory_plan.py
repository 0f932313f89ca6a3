"""Pre-flight memory plan of ESSA and F-GRPO on a real model, from its ``config.json`` alone (no
weights, no torch), so that a job that cannot fit ends before it loads anything.

Model shape (Qwen2 / Llama family: GQA attention, SwiGLU MLP, RMSNorm): ``hidden_size`` h,
``num_hidden_layers`` L, ``num_attention_heads`` a, ``num_key_value_heads`` g (default a),
``head_dim`` d (default h / a), ``intermediate_size`` I, ``vocab_size`` V,
``tie_word_embeddings`` (default false), q/k/v biases when ``attention_bias`` is true or the
model type is ``qwen2``. Parameters: V*h embeddings, per layer q (h*a*d), k and v (h*g*d each),
o (a*d*h), 3*h*I MLP, 2*h norms (+ a*d + 2*g*d biases), a final h norm, V*h lm_head unless tied.

Memory per GPU, e = bytes per value of ``model.dtype``, a sequence = ``plan.max_prompt_tokens``
+ ``task.max_new_tokens`` tokens, GiB = 2**30 bytes; a plan fits when its peak is at most
``USABLE_SHARE`` of ``plan.gpu_memory_gib`` (the rest: CUDA context, NCCL buffers, allocator
fragmentation):

* ESSA: weights + the LoRA factors of the rank's members (peft keeps them in fp32) + one pass
  of k members, each generating ``min(eval.batch_size, essa.minibatch)`` rows: per token the
  KV cache (2*L*g*d values) and one layer's activations (4*h + 3*I values), per row fp32 logits
  (4*V bytes) -- the rule of :func:`essa.batched.members_that_fit`, which caps k at run time.
* F-GRPO: weights + the reference model (a second copy of the weights only for full
  fine-tuning with ``fgrpo.beta`` > 0; under LoRA the reference is the base with the adapter
  off) + trainable state (LoRA: fp32 weight, gradient and two AdamW moments, 16 bytes a
  parameter; full: gradient and two AdamW moments in the model dtype, 3*e bytes a parameter)
  + the larger of the rollout phase (``min(eval.batch_size, prompts per rank) * G`` rows, as
  ESSA's pass) and the training phase: ``fgrpo.micro_batch`` sequences whose activations are
  kept for backward (no activation checkpointing), per token and layer (5*h + 2*g*d + 3*I)
  values in fp32, (6*h + 2*g*d + 3*I) in 16-bit dtypes (the RMSNorms upcast), plus the input
  of every LoRA target in fp32 under a 16-bit model (peft casts it to the adapter's dtype),
  or with full fine-tuning (3*h + I) values more, (4*h + I) in 16 bits (the inputs of the
  trained linear layers),
  plus per token the logits and their fp32 copy (V*(e + 4) bytes). These coefficients were
  measured with autograd's saved-tensor hooks on Qwen2 layers with SDPA attention and are
  checked that way by tests/test_memory_plan.py.

``hpc-plan [CONFIG.yaml] [section.key=value ...] [--ranks N]`` prints the plan of both methods;
:func:`check_job_memory` is called by every job at start.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
from dataclasses import dataclass

from hpc.runtime.cli import EXIT_CODES_HELP
from hpc.runtime.config import JobConfig, load_config
from hpc.runtime.errors import UserError, user_errors_exit

GIB = 2 ** 30
USABLE_SHARE = 0.9
ESSA_MEMBER_SHARE = 0.5  # essa.batched.MEMORY_SHARE: the share of free memory k may fill
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
LORA_BYTES_PER_PARAM = 4  # peft keeps adapter weights in fp32
LORA_TRAIN_BYTES_PER_PARAM = 16  # fp32 weight + gradient + AdamW exp_avg + exp_avg_sq
PLANNED_METHODS = ("essa", "fgrpo")


@dataclass(frozen=True)
class ModelShape:
    """The figures of a decoder-only model's ``config.json`` that memory depends on."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    qkv_bias: bool

    @classmethod
    def from_config(cls, config: dict, source: str = "config.json") -> "ModelShape":
        def need(key):
            if not isinstance(config.get(key), int):
                raise UserError(f"{source}: missing integer '{key}', needed for the memory plan")
            return config[key]

        hidden, heads = need("hidden_size"), need("num_attention_heads")
        return cls(hidden=hidden, layers=need("num_hidden_layers"), heads=heads,
                   kv_heads=config.get("num_key_value_heads") or heads,
                   head_dim=config.get("head_dim") or hidden // heads,
                   intermediate=need("intermediate_size"), vocab=need("vocab_size"),
                   tied=bool(config.get("tie_word_embeddings", False)),
                   qkv_bias=bool(config.get("attention_bias",
                                            config.get("model_type") == "qwen2")))

    @classmethod
    def from_folder(cls, path: str) -> "ModelShape":
        file = os.path.join(path, "config.json")
        try:
            with open(file) as fh:
                return cls.from_config(json.load(fh), file)
        except (OSError, json.JSONDecodeError) as err:
            raise UserError(f"cannot read {file} for the memory plan: {err}") from None

    def module_shapes(self) -> dict:
        """(in_features, out_features) of each linear layer of a decoder layer."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return {"q_proj": (self.hidden, q), "k_proj": (self.hidden, kv),
                "v_proj": (self.hidden, kv), "o_proj": (q, self.hidden),
                "gate_proj": (self.hidden, self.intermediate),
                "up_proj": (self.hidden, self.intermediate),
                "down_proj": (self.intermediate, self.hidden)}

    def layer_parameters(self) -> int:
        weights = sum(i * o for i, o in self.module_shapes().values())
        bias = (self.heads + 2 * self.kv_heads) * self.head_dim if self.qkv_bias else 0
        return weights + bias + 2 * self.hidden

    def parameters(self) -> int:
        embeddings = self.vocab * self.hidden
        return (embeddings * (1 if self.tied else 2) + self.layers * self.layer_parameters()
                + self.hidden)

    def lora_parameters(self, rank: int, targets: list) -> int:
        shapes = self.module_shapes()
        return self.layers * sum(rank * sum(shapes[t]) for t in targets if t in shapes)

    def inference_token_bytes(self, elem: int) -> int:
        """KV cache of all layers + one layer's activations, per generated-or-prompt token."""
        return (2 * self.layers * self.kv_heads * self.head_dim + 4 * self.hidden
                + 3 * self.intermediate) * elem

    def training_layer_bytes(self, elem: int, lora_targets: list = (), full: bool = False) -> int:
        """Activations one decoder layer keeps for backward, per token (see the module doc);
        ``full``: every weight trains, so the inputs of the linear layers are kept too."""
        h_coef = 5 if elem == 4 else 6  # the RMSNorms' fp32 upcasts cost one more h in 16 bits
        kv = self.kv_heads * self.head_dim
        values = h_coef * self.hidden + 2 * kv + 3 * self.intermediate
        if full:  # measured: (3*h + I) more in fp32, (4*h + I) in 16 bits
            values += (h_coef - 2) * self.hidden + self.intermediate
        shapes = self.module_shapes()
        upcast = sum(shapes[t][0] for t in lora_targets if t in shapes) * 4 if elem < 4 else 0
        return values * elem + upcast

    def training_token_bytes(self, elem: int, lora_targets: list = (), full: bool = False) -> int:
        """Activations kept for backward over all layers + the logits, per token."""
        return (self.layers * self.training_layer_bytes(elem, lora_targets, full)
                + self.vocab * (elem + 4))


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


@dataclass
class MethodPlan:
    """One method's memory on one GPU: named parts (bytes), the peak, verdict, advice."""

    method: str
    parts: list  # (label, bytes)
    peak: int
    usable: int
    notes: list
    advice: str = ""

    @property
    def fits(self) -> bool:
        return self.peak <= self.usable

    def lines(self) -> list:
        out = [f"{self.method} per GPU:"]
        out += [f"  {label:<72} {gib(nbytes):>11}" for label, nbytes in self.parts]
        verdict = "fits" if self.fits else "DOES NOT FIT"
        out.append(f"  {'peak':<72} {gib(self.peak):>11}  of {gib(self.usable)} usable: {verdict}")
        out += [f"  {note}" for note in self.notes]
        if not self.fits:
            out.append(f"  to fit: {self.advice}")
        return out


def _rows_that_fit(room: float, row_bytes: int) -> int:
    return max(0, int(room // row_bytes))


def essa_plan(shape: ModelShape, cfg, essa, ranks: int) -> MethodPlan:
    """ESSA on one GPU (``cfg``: a job config; ``essa``: its essa section)."""
    elem = DTYPE_BYTES[cfg.model.dtype]
    usable = int(USABLE_SHARE * cfg.plan.gpu_memory_gib * GIB)
    seq = cfg.plan.max_prompt_tokens + cfg.task.max_new_tokens
    weights = shape.parameters() * elem
    members = math.ceil(essa.population / ranks)
    lora = shape.lora_parameters(cfg.lora.rank, cfg.lora.targets) * LORA_BYTES_PER_PARAM
    rows = min(cfg.eval.batch_size, essa.minibatch)
    row_bytes = seq * shape.inference_token_bytes(elem) + 4 * shape.vocab
    member_pass = rows * row_bytes
    free = usable - weights
    fit = max(0, int((ESSA_MEMBER_SHARE * free - members * lora) // member_pass))
    k = max(1, min(essa.members_per_pass, members, fit))
    parts = [(f"weights ({shape.parameters():,} parameters, {cfg.model.dtype})", weights),
             (f"LoRA factors of this rank's {members} members (fp32)", members * lora),
             (f"{k} member(s) per pass x {rows} rows x {seq} tokens (KV, activations, logits)",
              k * member_pass)]
    peak = sum(b for _, b in parts)
    notes = [f"one member's pass: {gib(member_pass)} (KV cache "
             f"{gib(rows * seq * 2 * shape.layers * shape.kv_heads * shape.head_dim * elem)}); "
             f"members that fit per pass: {fit} (essa.members_per_pass={essa.members_per_pass}; "
             f"run time caps k at {ESSA_MEMBER_SHARE:.0%} of the free memory)"]
    room = usable - weights - members * lora
    if weights > usable:
        advice = (f"the weights alone need {gib(weights)}: use GPUs with more memory"
                  + (" or model.dtype=bfloat16" if elem == 4 else ""))
    else:
        advice = (f"lower eval.batch_size to {_rows_that_fit(room, row_bytes)} (rows per pass) "
                  f"or shorten plan.max_prompt_tokens / task.max_new_tokens")
    return MethodPlan("ESSA", parts, peak, usable, notes, advice)


def fgrpo_plan(shape: ModelShape, cfg, fgrpo, ranks: int) -> MethodPlan:
    """F-GRPO on one GPU (``cfg``: a job config; ``fgrpo``: its fgrpo section)."""
    elem = DTYPE_BYTES[cfg.model.dtype]
    usable = int(USABLE_SHARE * cfg.plan.gpu_memory_gib * GIB)
    seq = cfg.plan.max_prompt_tokens + cfg.task.max_new_tokens
    n_params = shape.parameters()
    weights = n_params * elem
    parts = [(f"weights ({n_params:,} parameters, {cfg.model.dtype})", weights)]
    if fgrpo.full_finetune:
        parts.append(("gradients + AdamW moments, every weight (model dtype)", 3 * elem * n_params))
        if fgrpo.beta > 0:
            parts.append(("reference model (fgrpo.beta > 0 with full fine-tuning)", weights))
    else:
        n_lora = shape.lora_parameters(cfg.lora.rank, cfg.lora.targets)
        parts.append((f"LoRA {n_lora:,} parameters: fp32 weights, gradients, AdamW",
                      n_lora * LORA_TRAIN_BYTES_PER_PARAM))
    state = sum(b for _, b in parts)
    prompts = min(cfg.eval.batch_size, math.ceil(fgrpo.batch_prompts / ranks))
    rollout_rows = prompts * fgrpo.num_generations
    rollout_row = seq * shape.inference_token_bytes(elem) + 4 * shape.vocab
    lora_targets = () if fgrpo.full_finetune else cfg.lora.targets
    train_row = seq * shape.training_token_bytes(elem, lora_targets, fgrpo.full_finetune)
    rollout, train = rollout_rows * rollout_row, fgrpo.micro_batch * train_row
    parts.append((f"rollout: {prompts} prompts x G={fgrpo.num_generations} rows x {seq} tokens"
                  if rollout >= train else
                  f"training: micro_batch {fgrpo.micro_batch} x {seq} tokens (activations, "
                  f"logits)", max(rollout, train)))
    other = (f"training phase (micro_batch {fgrpo.micro_batch}): {gib(train)}" if rollout >= train
             else f"rollout phase ({rollout_rows} rows): {gib(rollout)}")
    room = usable - state
    if state > usable:
        advice = (f"weights and optimizer state alone need {gib(state)}: "
                  + ("train a LoRA (fgrpo.full_finetune=false)" if fgrpo.full_finetune else
                     "use GPUs with more memory") + (" or model.dtype=bfloat16" if elem == 4 else ""))
    else:
        fixes = []
        for what, total, row, key in (("training sequence", train, train_row, "fgrpo.micro_batch"),
                                      ("rollout row", rollout, rollout_row, "eval.batch_size")):
            if total <= room:
                continue
            n = _rows_that_fit(room, row)
            if key == "eval.batch_size":
                n //= fgrpo.num_generations
            fixes.append(f"{key}={n}" if n else
                         f"one {what} alone needs {gib(row)} with {gib(room)} left (no "
                         f"activation checkpointing or model sharding here): GPUs with more "
                         f"memory")
        advice = ", ".join(fixes + ["or shorten plan.max_prompt_tokens / task.max_new_tokens"])
    return MethodPlan("F-GRPO", parts, state + max(rollout, train), usable, [other], advice)


def model_summary(shape: ModelShape, cfg) -> list:
    n = shape.parameters()
    seq = cfg.plan.max_prompt_tokens + cfg.task.max_new_tokens
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
            f"{cfg.task.max_new_tokens} new (task.max_new_tokens) = {seq} tokens",
            f"GPU memory assumed: {cfg.plan.gpu_memory_gib:g} GiB (plan.gpu_memory_gib), "
            f"{USABLE_SHARE:.0%} usable"]


def check_job_memory(cfg, method: str, ranks: int, device_type: str) -> None:
    """At job start: UserError (one line) when ``method``'s plan does not fit. Only for ESSA and
    F-GRPO on CUDA with a local model folder and ``plan.gpu_memory_gib`` > 0."""
    path = cfg.model.path
    if (method not in PLANNED_METHODS or device_type != "cuda" or cfg.plan.gpu_memory_gib <= 0
            or not os.path.isfile(os.path.join(path, "config.json"))):
        return
    shape = ModelShape.from_folder(path)
    build = essa_plan if method == "essa" else fgrpo_plan
    plan = build(shape, cfg, getattr(cfg, method), ranks)
    if not plan.fits:
        raise UserError(f"memory plan: {plan.method} needs {gib(plan.peak)} per GPU, more than "
                        f"{gib(plan.usable)} usable of plan.gpu_memory_gib="
                        f"{cfg.plan.gpu_memory_gib:g}; to fit: {plan.advice} (details: hpc-plan "
                        f"with the same config)")


def activation_checkpointing(cfg, method: str, ranks: int, device_type: str) -> bool:
    """``model.activation_checkpointing`` resolved for a job of ``method`` (sft or fgrpo) on
    ``ranks`` ranks: on / off as given; auto = on exactly when, on CUDA with a local model
    folder and ``plan.gpu_memory_gib`` > 0, the weights, the trainable state and one
    micro-batch's activations kept without checkpointing (sft: ``ceil(sft.batch_size /
    ranks)`` sequences, fgrpo: ``fgrpo.micro_batch``; a sequence = ``plan.max_prompt_tokens``
    + ``task.max_new_tokens`` tokens) exceed the usable memory."""
    choice = cfg.model.activation_checkpointing
    if choice != "auto":
        return choice == "on"
    path = cfg.model.path
    if (device_type != "cuda" or cfg.plan.gpu_memory_gib <= 0
            or not os.path.isfile(os.path.join(path, "config.json"))):
        return False
    shape = ModelShape.from_folder(path)
    elem = DTYPE_BYTES[cfg.model.dtype]
    full = method == "fgrpo" and cfg.fgrpo.full_finetune
    if full:
        state = shape.parameters() * elem * 4  # weights, gradients, two AdamW moments
    else:
        state = (shape.parameters() * elem + LORA_TRAIN_BYTES_PER_PARAM
                 * shape.lora_parameters(cfg.lora.rank, cfg.lora.targets))
    rows = cfg.fgrpo.micro_batch if method == "fgrpo" else math.ceil(cfg.sft.batch_size / ranks)
    seq = cfg.plan.max_prompt_tokens + cfg.task.max_new_tokens
    targets = () if full else cfg.lora.targets
    train = rows * seq * shape.training_token_bytes(elem, targets, full)
    return state + train > USABLE_SHARE * cfg.plan.gpu_memory_gib * GIB


def plan_text(cfg, ranks: int) -> str:
    """The full plan of both methods for ``cfg`` (a config with essa and fgrpo sections)."""
    shape = ModelShape.from_folder(cfg.model.path)
    lines = model_summary(shape, cfg) + [f"ranks: {ranks}", ""]
    lines += essa_plan(shape, cfg, cfg.essa, ranks).lines() + [""]
    lines += fgrpo_plan(shape, cfg, cfg.fgrpo, ranks).lines()
    return "\n".join(lines)


def plan_job_class():
    """A job config with the sections of both methods. Imported here, when the command runs:
    hpc stands below essa and fgrpo, which it never imports at module level."""
    from essa.config import ESSAConfig
    from fgrpo.config import FGRPOConfig

    return dataclasses.make_dataclass(
        "PlanJobConfig", [("essa", ESSAConfig, dataclasses.field(default_factory=ESSAConfig)),
                          ("fgrpo", FGRPOConfig, dataclasses.field(default_factory=FGRPOConfig))],
        bases=(JobConfig,))


@user_errors_exit
def main(argv=None):
    """``hpc-plan``: print the memory plan of a config's model for ESSA and F-GRPO."""
    parser = argparse.ArgumentParser(
        prog="hpc-plan", epilog=EXIT_CODES_HELP, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Memory per GPU of ESSA and F-GRPO for model.path, from its config.json "
                    "alone (no weights are read).\nKeys used: model.path, model.dtype, lora.rank, "
                    "lora.targets, task.max_new_tokens, eval.batch_size,\nplan.gpu_memory_gib, "
                    "plan.max_prompt_tokens, essa.population, essa.minibatch,\n"
                    "essa.members_per_pass, fgrpo.batch_prompts, fgrpo.num_generations, "
                    "fgrpo.micro_batch,\nfgrpo.full_finetune, fgrpo.beta.")
    parser.add_argument("items", nargs="*", metavar="CONFIG.yaml | section.key=value")
    parser.add_argument("--ranks", type=int, default=1,
                        help="ranks of the job (ESSA members and F-GRPO prompts per rank)")
    args = parser.parse_args(argv)
    if args.ranks < 1:
        raise UserError(f"--ranks must be >= 1, got {args.ranks}")
    config_path = next((i for i in args.items if "=" not in i), None)
    cfg = load_config(plan_job_class(), config_path, [i for i in args.items if "=" in i])
    if not os.path.isfile(os.path.join(cfg.model.path, "config.json")):
        raise UserError(f"model.path={cfg.model.path!r} is not a folder with a config.json")
    print(plan_text(cfg, args.ranks))


if __name__ == "__main__":
    main()
