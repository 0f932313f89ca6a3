"""Peak memory of one training micro-batch (log-probs + entropy + backward) at the Qwen2.5 shapes,
with and without activation checkpointing and chunked log-probs, on fake tensors (no weights, no
GPU: seconds on a laptop).

    python benchmarks/training_memory.py [--models 1.5b 7b 32b] [--micro-batch 8]
        [--tokens 1024] [--chunk 1024]

The package's own path (:func:`hpc.models.logprobs.sequence_logprobs`,
:func:`hpc.models.loading.enable_activation_checkpointing`) runs a bf16 Qwen2 built from the
shape under torch's FakeTensorMode on the ``cpu`` device; :class:`LiveTensorBytes` counts the
bytes of every tensor storage created inside and alive at once (the weights excluded). The base
weights are frozen and only the input RMSNorms train, so the gradient flows through every layer
as under LoRA; LoRA's own fp32 adapter inputs (a few hundred MiB at 7B) are not in the figure,
nor are weights, optimizer state, CUDA context or allocator fragmentation.
"""
from __future__ import annotations

import argparse
import warnings
import weakref

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import Qwen2Config, Qwen2ForCausalLM

from common import machine  # also puts the repository on sys.path

from hpc.models.loading import enable_activation_checkpointing
from hpc.models.logprobs import sequence_logprobs
from hpc.engine.shape import QWEN25

GIB = 2 ** 30
SHAPES = {"tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,  # smoke test
                      num_key_value_heads=2, intermediate_size=128, vocab_size=4096,
                      tie_word_embeddings=True),
          **{size.lower(): shape for size, shape in QWEN25.items()}}


class LiveTensorBytes(TorchDispatchMode):
    """Bytes of the tensor storages created by ops inside the mode and alive at once: ``peak``
    (the most at any time) and ``now``. Storages of ``existing`` tensors (weights) are never
    counted, also when an op returns a view of them. Works on real and on fake tensors."""

    def __init__(self, existing=()):
        super().__init__()
        self.live = {id(t.untyped_storage()): 0 for t in existing}
        self.now = self.peak = 0

    def _free(self, key):
        self.now -= self.live.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key, size = id(storage), storage.nbytes()
                if size and key not in self.live:
                    self.live[key] = size
                    self.now += size
                    self.peak = max(self.peak, self.now)
                    weakref.finalize(storage, self._free, key)
        return out


def micro_batch_peak(shape: dict, rows: int, tokens: int, chunk: int, checkpointed: bool) -> int:
    """Peak bytes of one micro-batch (``rows`` x ``tokens``) of a bf16 model of ``shape``."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            model = Qwen2ForCausalLM(Qwen2Config(**shape))
        finally:
            torch.set_default_dtype(default)
        for name, p in model.named_parameters():
            p.requires_grad_("input_layernorm" in name)
        if checkpointed:
            enable_activation_checkpointing(model)
        model.train()
        ids = torch.zeros((rows, tokens), dtype=torch.long)
        with LiveTensorBytes(list(model.parameters()) + list(model.buffers())) as tracker:
            logp, _ = sequence_logprobs(model, ids, torch.ones_like(ids), chunk,
                                        with_entropy=True)
            logp.sum().backward()
    return tracker.peak


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["1.5b", "7b", "32b"], choices=SHAPES)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--chunk", type=int, default=1024, help="model.logprob_chunk")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    variants = [("off", 0), ("on", 0), ("off", args.chunk), ("on", args.chunk)]
    print(f"machine: {machine()}")
    print(f"one micro-batch of {args.micro_batch} x {args.tokens} tokens, bf16, gradient "
          f"through every layer: peak GiB of activations + logits")
    print(f"{'model':<6} " + "  ".join(f"ckpt {c:<3} chunk {k:<5}" for c, k in variants))
    for name in args.models:
        peaks = [micro_batch_peak(SHAPES[name], args.micro_batch, args.tokens, k, c == "on")
                 for c, k in variants]
        print(f"{name:<6} " + "  ".join(f"{p / GIB:>20.2f}" for p in peaks), flush=True)


if __name__ == "__main__":
    main()
