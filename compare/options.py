"""``hpc-scaling``'s options, declared once: :class:`ScalingOptions` holds each with its
default, help and allowed values (:func:`hpc.runtime.config.param`, as a config section
declares its keys); :func:`build_parser` makes the command line of them, and
:func:`parse_options` checks every value against its declaration and the options together
(:meth:`ScalingOptions.validate`): a mistake is one line and exit 2.

A flag is its field's name with dashes; the F-GRPO fields' flags (``--fgrpo-batch``) also take
the spelling of earlier versions (``--grpo-batch``).
"""
from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from dataclasses import dataclass

from compare.network import GPUS, LINKS
from compare.plan_terms import QUANTIZE
from compare.roofline import DECODE_MFU, GEN_BATCH, QWEN25_32B, TRAIN_MFU
from compare.sharding import FGRPO_MODES, MICRO_BATCH
from fgrpo.config import SamplingConfig
from hpc.runtime.cli import EXIT_CODES_HELP, OneLineParser
from hpc.runtime.config import param, rule_text
from hpc.runtime.errors import UserError

M = QWEN25_32B
MANY = 1_000_000_000  # the most of any count (GPUs, prompts, steps, tokens) a flag takes
SHARE = {f.name: f.metadata for f in dataclasses.fields(SamplingConfig)}["filtered_share"]


def _model(default) -> dict:
    return {"help": f"model (default Qwen2.5-32B: {default:g})"}


@dataclass(frozen=True)
class ScalingOptions:
    config_file: str | None = param(
        None, "the job config whose memory plan gives each method's weight bytes and "
        "concurrency (hpc-plan's; the workload flags override it)")
    paper: bool = param(False, "print the paper's figures beside the prediction (the defaults "
                        "are the paper's setting)")
    runs: list[str] | None = param(
        None, "ESSA and F-GRPO run files (at least one of each, any number of seeds; sorted "
        "by their method attribute): steps to target, and the per-completion costs unless "
        "--gpu-check gives them")
    target: float | None = param(None, "with --runs: the held-out accuracy to reach (default: "
                                 "the highest that every run reaches)", min=0.0, max=1.0)
    gpu_check: str | None = param(None, "per-completion costs from this GPU check "
                                  "(benchmarks/gpu_check.py) instead of the runs or the roofline")
    gpu_check_model: str | None = param(None, "with --gpu-check: the model whose figures to "
                                        "use (default: the first)")
    gpus: list[int] = param([16, 32, 64, 128], "GPU counts to predict", min=1, max=MANY)
    network: str = param("infiniband-ndr", "between nodes (nvlink-h100: one NVLink domain, "
                         "flat)", choices=sorted(LINKS))
    intra: str = param("nvlink-h100", "inside a node", choices=["nvlink-h100", "none"])
    gpus_per_node: int = param(8, "GPUs a node", min=1, max=4096)
    gpu: str = param("h100", "the GPU of every rank", choices=sorted(GPUS))
    params: float = param(M.params, **_model(M.params), above=0.0, max=1e15)
    layers: int = param(M.layers, **_model(M.layers), min=1, max=MANY)
    hidden: int = param(M.hidden, **_model(M.hidden), min=1, max=MANY)
    intermediate: int = param(M.intermediate, **_model(M.intermediate), min=1, max=MANY)
    kv_dim: int = param(M.kv_dim, **_model(M.kv_dim), min=1, max=MANY)
    lora_rank: int = param(M.lora_rank, **_model(M.lora_rank), min=1, max=MANY)
    essa_quantize: str | None = param(
        None, "ESSA's weight-only quantised inference (default: model.quantize of --config, "
        "else the package's default, none)", choices=list(QUANTIZE))
    config: str | None = param(None, "the same as CONFIG.yaml")
    concurrency: str = param(
        "plan", "plan: weight bytes and concurrent sequences from the memory plan (hpc-plan's "
        "engine budget); kv: the reference, bf16 weights and a KV cache in what they leave of "
        "the GPU, one figure for both methods", choices=["plan", "kv"])
    fgrpo: str | None = param(
        None, "lora-fsdp: the paper's GRPO (verl: LoRA on an FSDP-sharded frozen base, per "
        "micro-batch all-gathers of the base, LoRA gradient all-reduce, weight sync into the "
        "rollout engine each step; the default with --paper and the roofline); replica: LoRA "
        "on a whole replica per GPU, generating in-process (the default otherwise); full: "
        "full-parameter GRPO sharded over all GPUs (FSDP2), the same as --sharded",
        choices=list(FGRPO_MODES))
    fgrpo_fixed_s: float = param(
        0.0, "GRPO seconds a step that do not shrink with GPUs (mode switches, the "
        "framework's per-step work); --paper prints what the paper's times imply",
        min=0.0, max=1e9)
    weight_sync: str = param(
        "model", "with --grpo lora-fsdp: what the rollout engine is fed each step: the whole "
        "bf16 model with the LoRA folded in (all of it gathered) or the adapter alone",
        choices=["model", "adapter"])
    full_finetune: bool = param(False, "GRPO trains every weight on a whole replica per GPU")
    sharded: bool = param(
        False, "the same as --grpo full: full-parameter GRPO sharded over all GPUs (FSDP2): "
        "weight all-gathers and gradient reduce-scatters instead of the all-reduce")
    micro_batch: int = param(MICRO_BATCH, "with --grpo full or lora-fsdp: sequences per "
                             "forward/backward (one gather each)", min=1, max=MANY)
    reduce_dtype: str = param("float32", "with --grpo full: dtype of the gradient "
                              "reduce-scatter", choices=["float32", "bfloat16"])
    prompt_tokens: int = param(256, "mean prompt length", min=1, max=MANY)
    completion_tokens: int = param(512, "mean completion length", min=1, max=MANY)
    max_new_tokens: int = param(1024, "longest completion", min=1, max=MANY)
    population: int | None = param(None, "ESSA P (paper 128)", min=1, max=MANY)
    minibatch: int | None = param(None, "ESSA prompts per member (paper 256)", min=1, max=MANY)
    fgrpo_batch: int | None = param(None, "GRPO prompts a step (paper 512)", min=1, max=MANY)
    fgrpo_generations: int | None = param(None, "GRPO G (assumed 8)", min=1, max=MANY)
    fgrpo_minibatch: int | None = param(None, "GRPO prompts an optimizer update (paper 64)",
                                        min=1, max=MANY)
    essa_steps: int = param(100, "ESSA generations to target", min=1, max=MANY)
    fgrpo_steps: int = param(100, "GRPO steps to target", min=1, max=MANY)
    essa_update_s: float | None = param(None, "CMA-ES update seconds (assumed 2)", min=0.0,
                                        max=1e9)
    fgrpo_rounds: float | None = param(
        None, "GRPO rollout rounds a step (dynamic sampling; 1 = none; with --runs the runs' "
        "1 + extra_rollouts / (batch x G))", min=1.0, max=1e6)
    filtered_share: float | None = param(
        None, "expected share of groups dynamic sampling filters (fgrpo.sampling."
        "filtered_share): sets --grpo-rounds (whole refill rounds, at most 1 + "
        "fgrpo.sampling.max_refills)", min=SHARE["min"], max=SHARE["max"])
    gen_tps: float | None = param(None, "measured generation tokens/s per GPU ...", above=0.0,
                                  max=1e12)
    gen_batch: int = param(GEN_BATCH, "... at this many concurrent sequences", min=1, max=MANY)
    train_tps: float | None = param(None, "measured forward+backward tokens/s per GPU",
                                    above=0.0, max=1e12)
    decode_mfu: float = param(DECODE_MFU, "MFU of the per-sequence decode FLOPs", above=0.0,
                              max=1.0)
    train_mfu: float = param(TRAIN_MFU, "MFU of training", above=0.0, max=1.0)

    @property
    def measured(self) -> bool:
        """Whether the costs are measured ones (run files or a GPU check), not the roofline."""
        return bool(self.runs or self.gpu_check)

    @property
    def layout(self) -> str:
        """The F-GRPO layout the model describes (:data:`FGRPO_MODES`): --grpo, else full for
        --sharded, else lora-fsdp for --paper on the roofline (the paper's), else replica."""
        if self.fgrpo:
            return self.fgrpo
        if self.sharded:
            return "full"
        return "lora-fsdp" if self.paper and not self.measured and not self.full_finetune \
            else "replica"

    def validate(self) -> None:
        """UserError for options that contradict each other."""
        if self.target is not None and not self.runs:
            raise UserError("--target takes the steps to target from --runs; without runs "
                            "give --essa-steps and --grpo-steps")
        if self.gpu_check_model is not None and self.gpu_check is None:
            raise UserError("--gpu-check-model names a model of --gpu-check, which is missing")
        if self.measured and (self.gen_tps or self.train_tps):
            raise UserError("--gen-tps and --train-tps calibrate the roofline; with --runs or "
                            "--gpu-check the costs are measured ones")
        if self.measured and self.essa_quantize:
            raise UserError("--essa-quantize sets the roofline's ESSA decoding; with --runs or "
                            "--gpu-check the costs are measured ones")
        if self.concurrency == "kv" and self.essa_quantize not in (None, "none"):
            raise UserError("--essa-quantize needs --concurrency plan (the kv reference "
                            "decodes bf16 weights)")
        if self.sharded and self.fgrpo not in (None, "full"):
            raise UserError(f"--sharded is --grpo full; it contradicts --grpo {self.fgrpo}")
        if self.full_finetune and self.fgrpo not in (None, "replica"):
            raise UserError(f"--full-finetune trains every weight of a whole replica; it "
                            f"contradicts --grpo {self.fgrpo} (--grpo full shards it)")
        if self.fgrpo == "lora-fsdp" and self.measured:
            raise UserError("--grpo lora-fsdp models the roofline's base and adapter; with "
                            "--runs or --gpu-check the costs are measured ones (--grpo replica)")


def flags(name: str) -> list:
    """The flags of option ``name``: its name with dashes, and for the F-GRPO options also
    the earlier ``--grpo`` spelling."""
    flag = name.replace("_", "-")
    return [f"--{flag}"] + ([f"--{flag[1:]}"] if flag.startswith("fgrpo") else [])


def _value_type(kind) -> tuple:
    """(item type, whether a list) of a field of type X, X | None, list[X] or list[X] | None."""
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        kind = next(a for a in typing.get_args(kind) if a is not type(None))
    if typing.get_origin(kind) is list:
        return typing.get_args(kind)[0], True
    return kind, False


def build_parser(description: str = "") -> argparse.ArgumentParser:
    """The command line of :class:`ScalingOptions`: CONFIG.yaml first, then a flag per
    option, its help ending with the allowed values."""
    parser = OneLineParser(prog="hpc-scaling", description=description, epilog=EXIT_CODES_HELP,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    types = typing.get_type_hints(ScalingOptions)
    for f in dataclasses.fields(ScalingOptions):
        kind, meta = types[f.name], f.metadata
        rule = rule_text(meta)
        help_text = meta["help"] + (f" [{rule}]" if rule and not meta["choices"] else "")
        if f.name == "config_file":
            parser.add_argument(f.name, nargs="?", metavar="CONFIG.yaml", help=help_text)
        elif kind is bool:
            parser.add_argument(*flags(f.name), action="store_true", help=help_text)
        else:
            item, many = _value_type(kind)
            default = f.default_factory() if many and f.default is dataclasses.MISSING \
                else f.default
            parser.add_argument(*flags(f.name), dest=f.name, type=item,
                                nargs="+" if many else None, default=default,
                                choices=meta["choices"], help=help_text,
                                metavar={"runs": "FILE", "gpu_check": "JSON",
                                         "gpu_check_model": "NAME", "config": "CONFIG.yaml",
                                         "fgrpo_fixed_s": "SECONDS"}.get(f.name))
    return parser


def _check_bounds(name: str, value, meta) -> None:
    """UserError naming the flag where ``value`` is outside its declared range."""
    flag = flags(name)[0]
    for item in value if isinstance(value, list) else [value]:
        if meta["min"] is not None and item < meta["min"]:
            raise UserError(f"{flag}: {item:g} is below the minimum {meta['min']:g}")
        if meta["above"] is not None and not item > meta["above"]:
            raise UserError(f"{flag}: {item:g} must be greater than {meta['above']:g}")
        if meta["max"] is not None and item > meta["max"]:
            raise UserError(f"{flag}: {item:g} is above the maximum {meta['max']:g}")


def parse_options(argv, description: str = "") -> ScalingOptions:
    """The checked options of the command line ``argv`` (None: sys.argv's)."""
    values = vars(build_parser(description).parse_args(argv))
    for f in dataclasses.fields(ScalingOptions):
        if any(meta is not None for meta in (f.metadata["min"], f.metadata["above"],
                                             f.metadata["max"])) and values[f.name] is not None:
            _check_bounds(f.name, values[f.name], f.metadata)
    given, flag = values["config_file"], values["config"]
    if given and flag and given != flag:
        raise UserError(f"hpc-scaling: two configs, {given} and --config {flag}; give one")
    options = ScalingOptions(**dict(values, config=flag or given))
    options.validate()
    return options
