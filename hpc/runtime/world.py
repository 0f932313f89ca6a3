"""The MPI world: rank, size, local rank, one device per rank, and byte-counted collectives.

Ranks are started by ``mpirun`` or ``srun`` (never by this package). Collectives work on numpy
buffers (mpi4py's upper-case, non-pickling calls). Every call adds the payload it delivers to a
per-tag counter, so a run can log exactly what crossed the network:

* ``bcast``: the buffer's bytes (what each receiving rank gets);
* ``allgather`` / ``allgatherv``: the bytes of the gathered result buffer;
* torch.distributed all-reduce (see :mod:`hpc.runtime.dist`): the reduced tensor's bytes.

These are payload bytes per rank, not wire bytes; the scaling model turns them into wire time
with an algorithm (ring, tree) and a network model.

Every collective (these, and the torch.distributed all-reduce) first waits for every rank's
named arrival (:meth:`World.arrive`, labelled with the collective's tag) with the deadline
``timeout_s``, so a hung, stopped or dead rank is named by rank 0 whichever collective it
misses; the collective itself then has the same deadline. The arrival costs 1 byte per rank
(tag ``control``) and one round trip to rank 0.
"""
from __future__ import annotations

import os
import socket
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from hpc.runtime.errors import PeerFailed, UserError

_LOCAL_RANK_VARS = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID")
_ARRIVE_TAG, _RELEASE_TAG, _PING_TAG, _PONG_TAG = 7301, 7302, 7303, 7304
_PROBE_S = 10.0  # longest wait for the answers to rank 0's "who is still here?" probe


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
    timeout_s: float = 600.0  # deadline of every collective (run.collective_timeout_s)
    rendezvous: object = None  # hpc.runtime.rendezvous.Rendezvous, once the ranks agreed on it
    hosts: list = field(default_factory=list)  # host name of each rank, once known (rendezvous)
    # Called as hook(message, lost_ranks) just before this rank aborts the job (a rank lost):
    # rank 0 marks its run file there (hpc.job.loop).
    abort_hooks: list = field(default_factory=list)

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
        self.arrive(tag, self.timeout_s)
        self._complete(self.comm.Ibcast(buf, root=root), tag)
        self.count(tag, buf.nbytes)
        return buf

    def allgather(self, send: np.ndarray, tag: str = "allgather") -> np.ndarray:
        """Gather equal-sized ``send`` arrays (shape S) from all ranks: result (size, *S)."""
        send = np.ascontiguousarray(send)
        recv = np.empty((self.size,) + send.shape, dtype=send.dtype)
        self.arrive(tag, self.timeout_s)
        self._complete(self.comm.Iallgather(send, recv), tag)
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
        self.arrive(tag, self.timeout_s)
        self._complete(self.comm.Iallgatherv(send, [recv, list(counts), list(displs), mpi_type]),
                       tag)
        self.count(tag, recv.nbytes)
        return recv

    def barrier(self) -> None:
        self.arrive("barrier", self.timeout_s)
        self._complete(self.comm.Ibarrier(), "barrier")

    def _complete(self, request, label: str, poll_s: float = 0.0005) -> None:
        """Wait for a non-blocking collective with the deadline ``timeout_s``.

        Every rank has arrived (see :meth:`arrive`), but one may stop or die right after. So
        while waiting, ranks other than 0 answer rank 0's 1-byte ping; at the deadline rank 0
        pings every rank and aborts the job naming those that do not answer within
        ``_PROBE_S``. A rank whose rank 0 never pings gives up :meth:`_patience` later and
        names rank 0.
        """
        deadline = time.monotonic() + self.timeout_s
        if self.size == 1 or self.is_root:
            while not request.Test():
                if time.monotonic() > deadline:
                    self._abort(*self._unanswered(label))
                time.sleep(poll_s)
            return
        patience = self._patience()
        ping_buf = np.zeros(1, dtype=np.uint8)
        ping = self.comm.Irecv(ping_buf, source=0, tag=_PING_TAG)
        while not request.Test():
            ping = self._answer(ping, ping_buf)
            if time.monotonic() > deadline + patience:
                self._abort(f"collective '{label}' did not complete within "
                            f"{self.timeout_s + patience:.0f} s and rank 0 did not probe the "
                            f"ranks: rank 0 is hung, stopped or dead; aborting the job", [0])
            time.sleep(poll_s)
        ping.Cancel()
        ping.Wait()

    def _unanswered(self, label: str, poll_s: float = 0.001) -> tuple[str, list]:
        """Rank 0, at a collective's deadline: ping every rank; (message, silent ranks)."""
        MPI = _mpi()
        token = np.zeros(1, dtype=np.uint8)
        bufs = [np.zeros(1, dtype=np.uint8) for _ in range(1, self.size)]
        pongs = [self.comm.Irecv(buf, source=r, tag=_PONG_TAG)
                 for r, buf in zip(range(1, self.size), bufs)]
        for r in range(1, self.size):
            self.comm.Isend(token, dest=r, tag=_PING_TAG)
        probe_s = min(_PROBE_S, self.timeout_s)
        until = time.monotonic() + probe_s
        while not MPI.Request.Testall(pongs) and time.monotonic() < until:
            time.sleep(poll_s)
        silent = [r for r, req in zip(range(1, self.size), pongs) if not req.Test()]
        if silent:
            return (f"rank(s) {silent} did not finish '{label}' within {self.timeout_s:.0f} s "
                    f"nor answer within {probe_s:.0f} s (hung, stopped or dead"
                    f"{self._on_hosts(silent)}); aborting the job", silent)
        return (f"collective '{label}' did not complete within {self.timeout_s:.0f} s though "
                f"every rank answers: MPI itself is stuck; aborting the job", [])

    def arrive(self, label: str, timeout_s: float, poll_s: float = 0.001) -> None:
        """A barrier with a deadline that names the ranks that did not arrive.

        Every rank sends rank 0 a 1-byte arrival message and waits for rank 0's release. If
        some rank has not arrived after ``timeout_s`` (hung, stopped or dead), rank 0 probes
        the ranks that did (one may be gone since: its node's link down), prints one line
        naming them all and aborts the whole job (MPI_Abort, exit code 1); a rank that never
        hears back from rank 0 does the same. Tag ``control``, 1 byte per rank.
        """
        MPI = _mpi()
        if self.size == 1:
            return
        deadline = time.monotonic() + timeout_s
        token = np.zeros(1, dtype=np.uint8)
        if self.is_root:
            bufs = [np.zeros(1, dtype=np.uint8) for _ in range(1, self.size)]
            reqs = [self.comm.Irecv(buf, source=r, tag=_ARRIVE_TAG)
                    for r, buf in zip(range(1, self.size), bufs)]
            while not MPI.Request.Testall(reqs):
                if time.monotonic() > deadline:
                    missing = [r for r, req in zip(range(1, self.size), reqs) if not req.Test()]
                    # a rank that arrived may be gone since (its node's link down): probe
                    _, silent = self._unanswered(label)
                    gone = [r for r in silent if r not in missing]
                    lost = sorted(set(missing) | set(silent))
                    also = f"; rank(s) {gone} arrived but answer no more" if gone else ""
                    self._abort(f"rank(s) {missing} did not reach '{label}' within "
                                f"{timeout_s:.0f} s{also} (hung, stopped or dead"
                                f"{self._on_hosts(lost)}); aborting the job", lost)
                time.sleep(poll_s)
            releases = [self.comm.Isend(token, dest=r, tag=_RELEASE_TAG)
                        for r in range(1, self.size)]
            MPI.Request.Waitall(releases)
        else:
            self.comm.Isend(token, dest=0, tag=_ARRIVE_TAG).Wait()
            req = self.comm.Irecv(token, source=0, tag=_RELEASE_TAG)
            patience = self._patience(timeout_s)
            ping_buf = np.zeros(1, dtype=np.uint8)
            ping = self.comm.Irecv(ping_buf, source=0, tag=_PING_TAG)
            while not req.Test():
                ping = self._answer(ping, ping_buf)  # rank 0 probes when another is late
                if time.monotonic() > deadline + patience:
                    self._abort(f"rank 0 did not release '{label}' within "
                                f"{timeout_s + patience:.0f} s (hung, stopped or dead); "
                                f"aborting the job", [0])
                time.sleep(poll_s)
            ping.Cancel()
            ping.Wait()
        self.count("control", self.size - 1 if self.is_root else 1)

    def abort_failed(self, label: str, err: Exception) -> None:
        """A torch.distributed collective ``label`` failed (its timeout, or a peer gone while it
        ran): rank 0 names the ranks that no longer answer and every rank aborts the job."""
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        if self.is_root:
            message, silent = self._unanswered(label)
            self._abort(f"'{label}' failed ({first}); {message}", silent)
        # Leaving first would end rank 0 before it names the lost ranks: answer its probe,
        # then go (rank 0's abort usually ends this rank before that).
        self._answer_pings(min(_PROBE_S, self.timeout_s) + 5.0)
        self._abort(f"'{label}' failed ({first}); rank 0 did not abort the job", [0])

    def _answer_pings(self, seconds: float, poll_s: float = 0.001) -> None:
        """A rank other than 0: answer rank 0's probe pings for ``seconds``."""
        buf = np.zeros(1, dtype=np.uint8)
        ping = self.comm.Irecv(buf, source=0, tag=_PING_TAG)
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            ping = self._answer(ping, buf)
            time.sleep(poll_s)

    def _patience(self, timeout_s: float | None = None) -> float:
        """How long a rank other than 0 waits past its own deadline before it gives rank 0 up:
        rank 0's deadline, its probe, and time to name the lost ranks and abort."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        return timeout_s + min(_PROBE_S, timeout_s) + 5.0

    def _answer(self, ping, buf: np.ndarray):
        """A rank other than 0: answer rank 0's ping if request ``ping`` (into ``buf``) got one;
        returns the request waiting for the next."""
        if not ping.Test():
            return ping
        self.comm.Isend(buf, dest=0, tag=_PONG_TAG).Wait()
        return self.comm.Irecv(buf, source=0, tag=_PING_TAG)

    def _on_hosts(self, ranks: list) -> str:
        """'; on node2' (the hosts of ``ranks``, where known), else ''."""
        hosts = sorted({self.hosts[r] for r in ranks if r < len(self.hosts)})
        return f"; on {', '.join(hosts)}" if hosts else ""

    def _abort(self, message: str, lost: list) -> None:
        """Print ``message``, run the abort hooks with the ranks ``lost``, abort the job."""
        print(f"error (rank {self.rank}): {message}", file=sys.stderr, flush=True)
        for hook in self.abort_hooks:
            try:
                hook(message, list(lost))
            except Exception as err:  # the abort must happen whatever a hook meets
                print(f"error (rank {self.rank}): while aborting: {err}", file=sys.stderr,
                      flush=True)
        self.comm.Abort(1)


def mpi_library() -> str:
    """The first line of the MPI library's own version string (MPI_Get_library_version), e.g.
    'Open MPI v5.0.11, package: ...' or 'MPICH Version: 4.0.2'."""
    return _mpi().Get_library_version().replace("\0", "").strip().splitlines()[0].strip()


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


def stop_together(world: World, err: UserError | None) -> None:
    """Collective: whether a user error ``err`` (None: none here) stops the job, decided by
    every rank alike. When any rank has one, every rank raises: the rank(s) that saw it
    re-raise ``err`` (printed by rank 0 alone where rank 0 saw it too, else each with its
    rank), the others :class:`PeerFailed` (exit 2 without a line); every rank then exits 2
    itself, not killed by the launcher as a peer leaves. One 1-byte Allgather, tag
    ``control``."""
    if world.size > 1:
        failed = world.allgather(np.array([err is not None], dtype=np.int8), tag="control")
        if err is None and failed.any():
            raise PeerFailed()
        if err is not None and not failed[0]:
            err.same_on_all_ranks = False  # rank 0 is fine: this rank must print its own line
    if err is not None:
        err.abort_peers = False  # every rank stops here by agreement
        raise err


def select_device(world: World, requested: str = "auto"):
    """The torch device of this rank: ``cuda:<local rank>`` where CUDA is present, else CPU.

    ``requested`` is ``auto``, ``cpu`` or ``cuda``. Asking for CUDA without it, or placing more
    ranks on a node than it has GPUs, is a UserError (unless CPU is asked for).
    """
    import torch  # here, not at the top: the world (and every --help) must load without torch

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
