"""Log-probabilities of a sequence's tokens and the entropy of the next-token distribution,
with or without the (B, T, V) logits of the whole micro-batch.

Two paths, chosen by ``model.logprob_chunk`` (``chunk`` below):

* ``chunk = 0``, the reference: the model's own forward returns the logits (B, T, V) in the
  model dtype; :func:`token_logprobs` upcasts them to fp32 and autograd keeps that fp32 copy
  for the backward (logsumexp saves its input), so the micro-batch holds
  B*T*V*(e + 4) bytes of logits at the peak, e = bytes per value of the model dtype.
* ``chunk > 0``: the model's forward runs with no logits (``logits_to_keep`` empty), its
  decoder's last hidden states (B, T, h) are taken, and the LM head is applied
  to ``chunk`` positions at a time (batch and time flattened) under non-reentrant
  :func:`torch.utils.checkpoint.checkpoint`: each chunk's logits are freed as soon as its
  log-probs and entropies are taken and recomputed in the backward. What is alive for the head
  is then the hidden states (B, T, h) plus ONE chunk's logits (chunk, V) in the model dtype,
  its fp32 copy and softmax temporaries of the same size (fp32), whatever the vocabulary. The
  LM head's own parameters (full fine-tuning, tied embeddings, a LoRA on ``lm_head``) get their
  gradient through the recompute. Logits are ``lm_head(last hidden state)`` as in the Qwen2 and
  Llama families (no logit scaling or soft-capping).
"""
from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint


def token_logprobs(logits: Tensor, tokens: Tensor) -> Tensor:
    """(..., ) log-probabilities (nats, float32) of ``tokens`` (...) under ``logits`` (..., V).

    Equals ``log_softmax(logits.float(), -1).gather(-1, tokens)``, computed as gathered logit
    minus logsumexp so no log-softmax tensor of the logits' size is kept. Differentiable.
    """
    lf = logits.float()
    picked = lf.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(lf, dim=-1)


@torch.no_grad()
def token_entropy(logits: Tensor) -> Tensor:
    """(..., ) entropy (nats, float32) of softmax(``logits`` (..., V)); 0 log 0 = 0. No grad."""
    return torch.special.entr(torch.softmax(logits.float(), dim=-1)).sum(dim=-1)


def masked_mean(values: Tensor, mask: Tensor) -> float:
    """Mean of ``values`` (B, T) over the true entries of ``mask`` (B, T); padding may hold nan."""
    valid = mask.bool()
    total = torch.where(valid, values, torch.zeros_like(values)).sum()
    return float(total / valid.sum().clamp(min=1))


def decoder_and_head(model):
    """(decoder, lm_head) of a transformers causal LM or a peft model around one: the module
    that returns the last hidden states, and the output projection to the vocabulary. LoRA
    layers peft injected stay in place (and follow ``disable_adapter``)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.get_decoder(), base.get_output_embeddings()


def _chunk_logprobs(head, hidden: Tensor, tokens: Tensor, with_entropy: bool):
    """Log-probs (n,) and entropies (n,) (None without ``with_entropy``) of ``tokens`` (n,)
    under ``head(hidden)``, ``hidden`` (n, h); the (n, V) logits die on return. The backward's
    recompute takes the entropies again (a softmax of the chunk, no memory kept)."""
    logits = head(hidden)
    return token_logprobs(logits, tokens), token_entropy(logits) if with_entropy else None


def chunked_logprobs(head, hidden: Tensor, tokens: Tensor, chunk: int,
                     with_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
    """Log-probs (B, T) float32 of ``tokens`` (B, T) under ``head(hidden)``, ``hidden``
    (B, T, h), ``chunk`` positions at a time, each chunk recomputed in the backward; with
    ``with_entropy`` also the entropies (B, T) float32 (no grad), else None."""
    flat, ids = hidden.reshape(-1, hidden.shape[-1]), tokens.reshape(-1)
    recompute = torch.is_grad_enabled()
    logps, entropies = [], []
    for start in range(0, flat.shape[0], chunk):
        args = (head, flat[start:start + chunk], ids[start:start + chunk], with_entropy)
        logp, entropy = (checkpoint(_chunk_logprobs, *args, use_reentrant=False)
                         if recompute else _chunk_logprobs(*args))
        logps.append(logp)
        entropies.append(entropy)
    logp = torch.cat(logps).view(tokens.shape)
    return logp, torch.cat(entropies).view(tokens.shape) if with_entropy else None


def sequence_logprobs(model, input_ids: Tensor, attention_mask: Tensor, chunk: int = 0,
                      with_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
    """Log-probabilities (B, T-1) float32 (nats) of tokens 1..T-1 of ``input_ids`` (B, T) given
    their prefix, and with ``with_entropy`` the entropy (B, T-1) float32 (nats, no grad) of the
    next-token distribution at those positions (else None). ``chunk``: 0 = the reference path
    through the model's full logits, > 0 = positions per chunk through the LM head (module
    docstring)."""
    tokens = input_ids[:, 1:]
    if chunk == 0:
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
        return token_logprobs(logits, tokens), token_entropy(logits) if with_entropy else None
    hidden = last_hidden_states(model, input_ids, attention_mask)[:, :-1]
    return chunked_logprobs(decoder_and_head(model)[1], hidden, tokens, chunk, with_entropy)


def last_hidden_states(model, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """The decoder's last hidden states (B, T, h) (after the final norm), from the model's OWN
    forward asked for no logits (``logits_to_keep`` = no position): the call goes through the
    outermost module, so FSDP2's root unit (embeddings, final norm, LM head) is gathered for it
    and kept gathered until the backward, as for the reference path; the head is then applied
    in chunks by :func:`chunked_logprobs`."""
    decoder = decoder_and_head(model)[0]
    captured = []
    hook = decoder.register_forward_hook(
        lambda _module, _args, out: captured.append(out.last_hidden_state))
    try:
        model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
              logits_to_keep=torch.zeros(0, dtype=torch.long, device=input_ids.device))
    finally:
        hook.remove()
    return captured[0]
