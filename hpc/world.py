"""The MPI world: rank, size, local rank, one device per rank, and byte-counted collectives.

Ranks are started by ``mpirun`` or ``srun`` (never by this package). Collectives work on numpy
buffers (mpi4py's upper-case, non-pickling calls). Every call adds the payload it delivers to a
per-tag counter, so a run can log exactly what crossed the network:

* ``bcast``: the buffer's bytes (what each receiving rank gets);
* ``allgather`` / ``allgatherv``: the bytes of the gathered result buffer;
* torch.distributed all-reduce (see :mod:`hpc.dist`): the reduced tensor's bytes.

These are payload bytes per rank, not wire bytes; the scaling model turns them into wire time
with an algorithm (ring, tree) and a network model.
"""
from __future__ import annotations

import os
import socket
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from hpc.errors import UserError

_LOCAL_RANK_VARS = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID")
_LOCAL_SIZE_VARS = ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE")


def _mpi():
    from mpi4py import MPI  # imported lazily: MPI_Init happens on first use

    return MPI


@dataclass
class World:
    """This process's place in the job and its byte-counted collectives."""

    comm: object
    rank: int
    size: int
    local_rank: int
    local_size: int
    hostname: str
    bytes_by_tag: dict = field(default_factory=lambda: defaultdict(int))

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    def count(self, tag: str, nbytes: int) -> None:
        self.bytes_by_tag[tag] += int(nbytes)

    def take_bytes(self) -> dict:
        """Return the per-tag byte counts since the last call and reset them."""
        out = dict(self.bytes_by_tag)
        self.bytes_by_tag.clear()
        return out

    def bcast(self, buf: np.ndarray, root: int = 0, tag: str = "bcast") -> np.ndarray:
        """Broadcast ``buf`` (any shape, contiguous) in place from ``root``; returns it."""
        self.comm.Bcast(buf, root=root)
        self.count(tag, buf.nbytes)
        return buf

    def allgather(self, send: np.ndarray, tag: str = "allgather") -> np.ndarray:
        """Gather equal-sized ``send`` arrays (shape S) from all ranks: result (size, *S)."""
        send = np.ascontiguousarray(send)
        recv = np.empty((self.size,) + send.shape, dtype=send.dtype)
        self.comm.Allgather(send, recv)
        self.count(tag, recv.nbytes)
        return recv

    def allgatherv(self, send: np.ndarray, counts: list[int], tag: str = "allgatherv"):
        """Gather 1-D arrays of per-rank lengths ``counts`` into one concatenated 1-D array."""
        send = np.ascontiguousarray(send).ravel()
        if send.size != counts[self.rank]:
            raise ValueError(f"rank {self.rank} sends {send.size} items, counts says "
                             f"{counts[self.rank]}")
        recv = np.empty(int(sum(counts)), dtype=send.dtype)
        displs = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(int)
        mpi_type = _mpi()._typedict[send.dtype.char]
        self.comm.Allgatherv(send, [recv, list(counts), list(displs), mpi_type])
        self.count(tag, recv.nbytes)
        return recv

    def barrier(self) -> None:
        self.comm.Barrier()

    def agree_all(self, ok: bool, tag: str = "control") -> bool:
        """True only if ``ok`` is True on every rank (one small Allgather)."""
        return bool(self.allgather(np.array([1 if ok else 0], dtype=np.int8), tag=tag).all())


_WORLD: World | None = None


def _env_int(names, default):
    for name in names:
        if name in os.environ:
            return int(os.environ[name])
    return default


def get_world() -> World:
    """Initialise MPI once and describe this process (works alone, under mpirun and srun)."""
    global _WORLD
    if _WORLD is None:
        comm = _mpi().COMM_WORLD
        hostname = socket.gethostname()
        local = comm.Split_type(_mpi().COMM_TYPE_SHARED, key=comm.Get_rank())
        local_rank = _env_int(_LOCAL_RANK_VARS, local.Get_rank())
        local_size = local.Get_size()
        local.Free()
        _WORLD = World(comm=comm, rank=comm.Get_rank(), size=comm.Get_size(),
                       local_rank=local_rank, local_size=local_size, hostname=hostname)
    return _WORLD


def select_device(world: World, requested: str = "auto"):
    """The torch device of this rank: ``cuda:<local rank>`` where CUDA is present, else CPU.

    ``requested`` is ``auto``, ``cpu`` or ``cuda``. Asking for CUDA without it, or placing more
    ranks on a node than it has GPUs, is a UserError (unless CPU is asked for).
    """
    import torch

    if requested == "cpu":
        return torch.device("cpu")
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n_gpus == 0:
        if requested == "cuda":
            raise UserError(f"model.device=cuda but no CUDA device is visible on "
                            f"{world.hostname}", same_on_all_ranks=False)
        return torch.device("cpu")
    if world.local_size > n_gpus:
        raise UserError(f"{world.local_size} ranks on node {world.hostname} but only {n_gpus} "
                        f"GPUs: start one rank per GPU, or set model.device=cpu",
                        same_on_all_ranks=False)
    torch.cuda.set_device(world.local_rank)
    return torch.device(f"cuda:{world.local_rank}")


def split_evenly(n_items: int, n_ranks: int) -> list[int]:
    """Counts of ``n_items`` over ``n_ranks``: the first ``n_items % n_ranks`` get one more."""
    base, extra = divmod(n_items, n_ranks)
    return [base + (1 if r < extra else 0) for r in range(n_ranks)]


def my_slice(n_items: int, world: World) -> slice:
    """The contiguous block of item indices owned by this rank under :func:`split_evenly`."""
    counts = split_evenly(n_items, world.size)
    start = sum(counts[: world.rank])
    return slice(start, start + counts[world.rank])
