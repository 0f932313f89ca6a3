"""SFT's memory rule (named by its method's spec, ``method.py``): when
``model.activation_checkpointing=auto`` turns checkpointing on for the SFT stage."""
from __future__ import annotations

import math

from hpc.engine.shape import ModelShape
from hpc.plan.terms import (DTYPE_BYTES, LORA_TRAIN_BYTES_PER_PARAM, sequence_tokens, total,
                            unseen_parts, usable_bytes)


def checkpointing_needed(shape: ModelShape, cfg, ranks: int) -> bool:
    """On when the weights, the LoRA's training state (16 bytes a parameter) and the
    activations of ``ceil(sft.batch_size / ranks)`` full sequences, with the margin of what
    trackers cannot see (:func:`hpc.plan.terms.unseen_parts`), exceed the usable memory."""
    elem = DTYPE_BYTES[cfg.model.dtype]
    state = (shape.parameters() * elem + LORA_TRAIN_BYTES_PER_PARAM
             * shape.lora_parameters(cfg.lora.rank, cfg.lora.targets))
    tokens = math.ceil(cfg.sft.batch_size / ranks) * sequence_tokens(cfg)
    train = tokens * shape.training_token_bytes(elem, cfg.lora.targets)
    return state + train + total(unseen_parts(shape, tokens, 0, train)) > usable_bytes(cfg)
