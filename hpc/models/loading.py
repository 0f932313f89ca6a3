"""Loading causal LMs and tokenizers from local folders, and LoRA adapters (PEFT format).

Every problem with a user-given folder (missing, incomplete, unloadable, adapter made for another
model) raises :class:`UserError` with one line naming the folder and what is wrong, before or
instead of a library traceback. Nothing is ever downloaded (``local_files_only``).
"""
from __future__ import annotations

import os
import warnings

import torch
import transformers
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
from safetensors import SafetensorError
from transformers import AutoModelForCausalLM, AutoTokenizer

from hpc.models.base_model import record_base
from hpc.models.folders import (ADAPTER_WEIGHT_FILES, BUILT_IN_MODELS, check_adapter_folder,
                                check_model_folder)
from hpc.models.quantize import GenerationCopy, QuantizeInPlace, arrive_all
from hpc.models.streaming import streamed_model
from hpc.runtime.atomic import replaced_dir
from hpc.runtime.errors import UserError, first_line
from hpc.runtime.methods import load_ref

# Jobs print on rank 0 only, and only what the user asked for: no per-rank weight-loading bars
# or library deprecation notices.
transformers.utils.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()
warnings.filterwarnings("ignore", category=FutureWarning, module=r"(transformers|peft)\b")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _resolve_device(device) -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def model_folder(path: str) -> str:
    """The folder for ``model.path``: a built-in model's cached folder (built if absent;
    UserError if its cached build is not the intended one), else ``path`` as it is."""
    return load_ref(BUILT_IN_MODELS[path])() if path in BUILT_IN_MODELS else path


LOADS = ("streamed", "transformers")  # model.load


def load_tokenizer(path: str):
    """The tokenizer of model folder ``path`` (:func:`model_folder`d), with a pad token (eos
    when it has none), padding on the left (generation)."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as err:  # noqa: BLE001 - any loader failure is a bad model folder
        raise UserError(f"cannot load the tokenizer in {path}: {first_line(err)}") from None
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise UserError(f"the tokenizer in {path} has neither a pad nor an eos token")
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def load_model(path: str, dtype: str = "float32", device="cpu", *, load: str = "streamed",
               wrap=None, shard=None, quantize: str = "none", quantized_copy: bool = False):
    """Load ``(model, tokenizer)`` from a local Hugging Face folder or a built-in model's name
    (:func:`model_folder`), in eval mode.

    ``dtype`` is ``float32``, ``bfloat16`` or ``float16``; ``device`` a torch device or
    ``'auto'`` (CUDA if present). ``wrap(model) -> model``: what the job puts around the model
    before its weights count (attaching or loading a LoRA adapter); ``shard(model)``: FSDP2's
    ``fully_shard`` of its units (:func:`hpc.models.parallelize.shard_units`); ``quantize``
    (``model.quantize``): the decoder linears quantised in place, or with ``quantized_copy`` a
    quantised copy of them kept beside the model for rollouts (:mod:`hpc.models.quantize`).

    ``load`` (``model.load``): ``streamed`` (:mod:`hpc.models.streaming`): the model built
    without weights, wrapped, sharded, then its weights streamed in from the memory-mapped
    checkpoint tensor by tensor, each linear quantised as it arrives, so a rank holds its share
    of the weights plus one tensor; ``transformers``, the reference: ``from_pretrained`` whole
    in host memory, moved to the device, wrapped, quantised, sharded. The same tensors either
    way.
    """
    if dtype not in DTYPES:
        raise UserError(f"model dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if load not in LOADS:
        raise UserError(f"model.load {load!r} is not one of {', '.join(LOADS)}")
    path = model_folder(path)
    check_model_folder(path)
    tokenizer = load_tokenizer(path)
    device = _resolve_device(device)
    arrival = QuantizeInPlace if not quantized_copy else GenerationCopy
    if load == "transformers":
        try:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype],
                                                         local_files_only=True)
        except Exception as err:  # noqa: BLE001 - any loader failure is a bad model folder
            raise UserError(f"cannot load the model in {path}: {first_line(err)}") from None
        model = model.to(device).eval()
        model = wrap(model) if wrap else model
        arrive_all(arrival(model, quantize), model)
        if shard:
            shard(model)
    else:
        model = streamed_model(path, DTYPES[dtype], device, wrap, shard,
                               lambda m: arrival(m, quantize))
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def _matches(name: str, target: str) -> bool:
    """PEFT's rule for a list of target names: the module name equals or ends with it."""
    return name == target or name.endswith("." + target)


LORA_LAYER_TYPES = (torch.nn.Linear, torch.nn.Embedding, torch.nn.Conv1d, torch.nn.Conv2d)


def attach_lora(model, rank: int, alpha: float, targets: list[str], dropout: float = 0.0,
                seed: int = 0) -> PeftModel:
    """Wrap ``model`` with fresh LoRA adapters on the modules named ``targets``.

    Adapted weights get ``W + (alpha / rank) * B @ A`` with A (rank, in) random (seeded by
    ``seed``, global RNG untouched) and B (out, rank) zero, so the model is unchanged at first.
    Base weights are frozen. The base model is modified in place.
    """
    modules = dict(model.named_modules())
    linear = sorted({n.rsplit(".", 1)[-1] for n, m in modules.items()
                     if isinstance(m, torch.nn.Linear)})
    for target in targets:
        found = [m for n, m in modules.items() if _matches(n, target)]
        if not found:
            raise UserError(f"LoRA target module {target!r} not found in the model "
                            f"(its linear layers: {', '.join(linear)})")
        if not all(isinstance(m, LORA_LAYER_TYPES) for m in found):
            raise UserError(f"LoRA target module {target!r} is a {type(found[0]).__name__}, "
                            f"not a layer LoRA can adapt (linear layers: {', '.join(linear)})")
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets),
                        lora_dropout=dropout, task_type="CAUSAL_LM")
    device = next(model.parameters()).device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        return get_peft_model(model, config)


def enable_activation_checkpointing(model) -> None:
    """Checkpoint every decoder layer of ``model`` (a transformers causal LM or a peft model
    around one) in training mode: the forward keeps only each layer's input (B, T, h) and the
    backward recomputes the layer, with transformers' per-layer hook and torch's
    non-reentrant :func:`torch.utils.checkpoint.checkpoint` (which needs no input that
    requires grad, so it works under LoRA's frozen base). ``preserve_rng_state``: the recompute
    replays the forward's dropout masks, so gradients and resumed runs stay bitwise."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.activation_checkpointing_enable(
        activation_checkpointing_kwargs={"use_reentrant": False, "preserve_rng_state": True})


def randomize_lora_b(peft_model, std: float, generator: torch.Generator) -> None:
    """Fill every LoRA B (zero when attached) with N(0, std^2) draws from ``generator`` (a CPU
    generator; parameters in name order), so the adapter is non-zero and all its singular
    values are, as after SFT. For tests and benchmarks that have no SFT stage."""
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator).to(p.device) * std)


def _lora_module_names(peft_model) -> list[str]:
    return [name for name, mod in peft_model.named_modules() if hasattr(mod, "lora_A")]


def load_adapter(model, adapter_dir: str, is_trainable: bool = False,
                 targets: list[str] | None = None) -> PeftModel:
    """Wrap ``model`` with the saved PEFT adapter in ``adapter_dir``.

    UserError if the folder or its adapter_config.json / weights are missing, if the adapter
    was made for a model of another shape, or if it does not adapt every module in
    ``targets`` (when given). On error the base model may already hold injected (empty)
    adapter layers; load it again before reuse.
    """
    check_adapter_folder(adapter_dir)
    try:
        peft_model = PeftModel.from_pretrained(model, adapter_dir, is_trainable=is_trainable)
    except (RuntimeError, ValueError, KeyError, OSError, SafetensorError) as err:
        lines = [ln.strip() for ln in str(err).splitlines() if "size mismatch" in ln]
        if lines:
            raise UserError(f"adapter {adapter_dir} was made for a model of another shape: "
                            f"{lines[0]}") from None
        raise UserError(f"cannot load the adapter in {adapter_dir}: "
                        f"{first_line(err)}") from None
    _check_finite(peft_model, adapter_dir)
    adapted = _lora_module_names(peft_model)
    missing = [t for t in targets or [] if not any(_matches(n, t) for n in adapted)]
    if missing:
        raise UserError(f"adapter {adapter_dir} does not adapt {', '.join(missing)} "
                        f"(lora.targets asks for them)")
    return peft_model


def _check_finite(peft_model, adapter_dir: str) -> None:
    """UserError naming the weights file and the first tensor (by its name in the file) that
    holds a NaN or an infinity: ESSA's SVD and F-GRPO's training would fail on it or spread it."""
    for name, tensor in get_peft_model_state_dict(peft_model).items():
        bad = int((~torch.isfinite(tensor)).sum())
        if bad:
            file = next(os.path.join(adapter_dir, f) for f in ADAPTER_WEIGHT_FILES
                        if os.path.isfile(os.path.join(adapter_dir, f)))
            raise UserError(f"adapter weights {file}: tensor {name} holds {bad} NaN or "
                            f"infinite value(s) of {tensor.numel()}")


def save_adapter(peft_model, out_dir: str) -> None:
    """Save the LoRA adapter in standard PEFT format (``adapter_config.json`` +
    ``adapter_model.safetensors``) into ``out_dir``: written to a temporary sibling folder,
    then renamed, so a reader never sees a half-written adapter. Replaces an existing one.
    Beside it, ``base_model.json`` names the model it adapts (:mod:`hpc.models.base_model`)."""
    with replaced_dir(out_dir) as tmp:
        peft_model.save_pretrained(tmp)
        record_base(tmp, peft_model.peft_config[peft_model.active_adapter].base_model_name_or_path)
