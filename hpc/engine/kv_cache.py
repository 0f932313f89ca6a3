"""The engine's KV cache: allocated once per engine, never resized."""
from __future__ import annotations

import torch


class KVCache:
    """Keys and values of every slot: two tensors [layers, slots, kv_heads, max_len, head_dim]
    in the model's dtype, allocated once."""

    def __init__(self, layers, slots, kv_heads, max_len, head_dim, dtype, device):
        shape = (layers, slots, kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.slots, self.max_len = slots, max_len

    def move(self, src: torch.Tensor, dst: torch.Tensor, length: int) -> None:
        """Copy the first ``length`` positions of slots ``src`` (n,) into slots ``dst`` (n,)."""
        for t in (self.k, self.v):
            t[:, dst, :, :length] = t[:, src, :, :length]

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes
