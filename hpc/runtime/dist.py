"""torch.distributed bootstrapped from the MPI world, with byte-counted all-reduce.

The ranks agree over MPI on an address of rank 0 that every rank reaches and on the store's
port (:func:`hpc.runtime.rendezvous.agree`: addresses, never host names, cross ranks), then join
the default process group: NCCL when the rank's device is CUDA, gloo otherwise. This works the
same under ``mpirun`` and ``srun`` because the rendezvous goes through MPI, not through
launcher-specific variables.
"""
from __future__ import annotations

import atexit
import datetime
import gc

import torch
import torch.distributed as dist

from hpc.runtime.rendezvous import agree
from hpc.runtime.world import World


def init_process_group(world: World, device: torch.device) -> str:
    """Join (or create) the default process group for ``world``; returns the backend name.

    The rendezvous agreed at start-up (``world.rendezvous``, see :func:`hpc.job.lifecycle.
    start_job`) is used, else agreed here. Its collectives time out after ``world.timeout_s``
    (``run.collective_timeout_s``)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if dist.is_initialized():
        return dist.get_backend()
    meet = world.rendezvous = world.rendezvous or agree(world, backend)
    # Tear the group down before interpreter shutdown: a gloo worker thread still holding a
    # tensor then aborts the process ("terminate called without an active exception").
    atexit.register(destroy_process_group)
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{meet.addr}:{meet.port}",
        rank=world.rank,
        world_size=world.size,
        timeout=datetime.timedelta(seconds=world.timeout_s),
        device_id=device if device.type == "cuda" else None,
    )
    return backend


def all_reduce_mean_(tensors: list[torch.Tensor], world: World, tag: str = "allreduce") -> None:
    """Average ``tensors`` in place across ranks (one flat all-reduce) and count its bytes.

    Every rank first arrives by name (:meth:`World.arrive`, label ``tag``), so a rank that
    never gets here is named instead of the all-reduce timing out anonymously; one lost while
    it runs is named too (:meth:`World.abort_failed`)."""
    if world.size == 1 or not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    world.arrive(tag, world.timeout_s)
    try:
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    except (RuntimeError, dist.DistError) as err:  # its timeout, or a peer lost while it ran
        world.abort_failed(tag, err)
    flat /= world.size
    world.count(tag, flat.numel() * flat.element_size())
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset:offset + n].view_as(t))
        offset += n


def destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    # FSDP2's modules and device mesh keep the group alive through reference cycles; free them
    # now, so its gloo worker threads are joined while the interpreter can still serve them.
    gc.collect()
