"""Training state moved to host memory while the GPU decodes (``fgrpo.parallel.offload``).

A rollout or evaluation under FSDP2 needs the whole model gathered in ``model.dtype`` (61 GiB
at Qwen2.5-32B in bf16) beside whatever training state the rank holds. :class:`HostCopy` moves
the *storage* of some tensors to host memory and back: their bytes are copied into one host
buffer each (pinned on CUDA, so the copies run at PCIe speed), then the device storage is
resized to 0 bytes, which gives its memory back to the allocator (FSDP2 frees its unsharded
parameters the same way). Every tensor, view, DTensor and optimizer-state entry keeps its
identity, so AdamW, FSDP2 and the checkpoint code never notice; touching a moved tensor before
:meth:`HostCopy.restore` is an error, not a silent read of stale memory.

Modes (``fgrpo.parallel.offload``):

* ``none``: nothing moves.
* ``optimizer``: the AdamW moments (8 bytes a trained parameter, FSDP2: of this rank's shard)
  and DDP's fp32 master copies of 16-bit weights.
* ``state``: also FSDP2's fp32 weight shards (of the policy and the reference model). Under
  DDP the weights are what decodes, so ``state`` moves what ``optimizer`` moves.

Gradients are not moved: :meth:`hpc.models.parallelize.TrainedWeights.free_gradients` drops
them after every optimizer step, so none exist during a rollout.
"""
from __future__ import annotations

import torch

OFFLOAD_MODES = ("none", "optimizer", "state")


def host_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """Host memory for ``nbytes`` bytes of a storage on ``device``: pinned for a CUDA one
    (the memory tracker's harness, benchmarks/memory_tracker.py, puts it on ``meta``)."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")


def _bytes_of(storage) -> torch.Tensor:
    """A flat uint8 tensor over all of ``storage``."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class HostCopy:
    """The storages of ``tensors`` (each once, empty ones skipped) moved to host memory until
    :meth:`restore`. ``nbytes``: the device bytes freed."""

    def __init__(self, tensors):
        self._held = []  # (device storage, host buffer, bytes)
        seen = set()
        for t in tensors:
            storage = t.untyped_storage()
            if storage.nbytes() == 0 or storage._cdata in seen:
                continue
            seen.add(storage._cdata)
            host = host_buffer(storage.nbytes(), storage.device)
            host.copy_(_bytes_of(storage), non_blocking=True)
            self._held.append((storage, host, storage.nbytes()))
        # The device-to-host copies are queued on the current stream, before the frees below:
        # the caching allocator hands the freed blocks only to work queued after them.
        for storage, _, _ in self._held:
            storage.resize_(0)
        self.nbytes = sum(n for _, _, n in self._held)

    def restore(self) -> None:
        """Give every storage its bytes back (host-to-device copies on the current stream)."""
        for storage, host, nbytes in self._held:
            storage.resize_(nbytes)
            _bytes_of(storage).copy_(host, non_blocking=True)
        self._held = []
