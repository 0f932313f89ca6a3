"""The ``lora`` config section: the LoRA adapter a job trains or starts from (the ``model``
section, which also says how a job decodes, is :class:`hpc.engine.config.ModelConfig`).
Torch-free: ``--help`` reads it without importing torch."""
from __future__ import annotations

from dataclasses import dataclass

from hpc.runtime.config import param

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
