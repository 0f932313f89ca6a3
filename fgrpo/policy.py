"""The policy F-GRPO trains and its reference: building them, and log-probs without gradient
(the sampling policy's for mu > 1 passes, the reference's for the KL term)."""
from __future__ import annotations

import contextlib
import copy

import torch

from hpc.models.loading import attach_lora, load_adapter, load_model
from hpc.models.logprobs import sequence_logprobs
from hpc.models.parallelize import load_dtype
from hpc.models.quantize import attach_generation_copy


def build_model(cfg, device):
    """(policy, reference or None, tokenizer): LoRA (fresh or from lora.adapter) or full FT,
    in fp32 under fgrpo.parallelism=fsdp2 (sharded later; see :mod:`hpc.models.parallelize`).
    With ``model.quantize`` the LoRA policy decodes from a quantised copy of its frozen base
    linears (:func:`hpc.models.quantize.attach_generation_copy`) and trains on its own."""
    model, tok = load_model(cfg.model.path, load_dtype(cfg.fgrpo.parallelism, cfg.model.dtype),
                            device)
    if cfg.fgrpo.full_finetune:
        ref = copy.deepcopy(model).eval() if cfg.fgrpo.beta > 0 else None
        return model, ref, tok
    if cfg.lora.adapter:
        policy = load_adapter(model, cfg.lora.adapter, is_trainable=True)
    else:
        policy = attach_lora(model, cfg.lora.rank, cfg.lora.alpha, cfg.lora.targets, 0.0,
                             seed=cfg.run.seed)
    return attach_generation_copy(policy, cfg.model.quantize), None, tok


@torch.no_grad()
def frozen_logprobs(model, rollouts, micro_batch: int, chunk: int) -> torch.Tensor:
    """Log-probs of all rollouts without gradient: (rows, T-1) float32; ``chunk``: positions
    per LM-head chunk (model.logprob_chunk, 0 = full logits)."""
    parts = [sequence_logprobs(model, *rollouts.rows(s, s + micro_batch)[:2], chunk)[0]
             for s in range(0, rollouts.input_ids.shape[0], micro_batch)]
    return torch.cat(parts)


@contextlib.contextmanager
def reference_model(model, ref_model):
    """The model that computes reference log-probs: ``ref_model`` (full fine-tuning) or, under
    LoRA, ``model`` itself with its adapter disabled for the duration."""
    if ref_model is not None:
        yield ref_model
        return
    with model.disable_adapter():
        yield model
