"""All-reduce checks: MPI's (ESSA's fitness vectors, every job's control messages) and
torch.distributed's on the job's backend (F-GRPO's and SFT's gradients, FSDP2's shards), each
over a range of message sizes; the sums are checked and the time measured.

Per size, every rank runs one checked all-reduce (float32 sums of ``rank + 1``, exact), a
barrier, then the timed all-reduces, as many as move about MOVED_BYTES and take about SIZE_S at
the pace of rank 0's checked one (at least MIN_ITERATIONS, at most MAX_ITERATIONS; rank 0
decides, so every rank runs as many), and records its mean time per all-reduce (on CUDA after
a device synchronisation). The time of a size is the slowest rank's
mean, and that rank is named. algbw = bytes / time; busbw = algbw x 2(n-1)/n, nccl-tests'
definition for all-reduce (what each rank sends and receives in a bandwidth-optimal ring, so
busbw compares across rank counts and with a link's speed). GB/s are 10^9 bytes a second.
"""
from __future__ import annotations

import time

import numpy as np
import torch
import torch.distributed as dist

from hpc.doctor.findings import Finding

GPU_SIZES = [1 << k for k in range(10, 27, 2)]  # 1 KiB .. 64 MiB
CPU_SIZES = [1 << k for k in range(10, 23, 2)]  # 1 KiB .. 4 MiB: gloo on CPU is slow
MOVED_BYTES = 64 << 20  # each size moves at most about this many bytes...
SIZE_S = 0.5  # ...and takes about this long (a slow network must not make the preflight slow)
MIN_ITERATIONS, MAX_ITERATIONS = 3, 50


def iterations(nbytes: int, first_s: float) -> int:
    """Timed all-reduces of ``nbytes`` after a first one that took ``first_s`` seconds."""
    wanted = min(MOVED_BYTES // nbytes, int(SIZE_S / max(first_s, 1e-9)))
    return int(min(MAX_ITERATIONS, max(MIN_ITERATIONS, wanted)))


def agreed_iterations(world, nbytes: int, first_s: float) -> int:
    """Rank 0's :func:`iterations`, on every rank (a deadline-checked broadcast)."""
    return int(world.bcast(np.array([iterations(nbytes, first_s)], dtype=np.int64),
                           tag="doctor")[0])


def bus_factor(ranks: int) -> float:
    """nccl-tests' busbw / algbw for all-reduce: 2(n-1)/n."""
    return 2.0 * (ranks - 1) / ranks


def _expected(ranks: int) -> float:
    return ranks * (ranks + 1) / 2.0


def mpi_allreduce(world, sizes: list) -> tuple:
    """(mean seconds per all-reduce for each of ``sizes`` (bytes), findings) on this rank."""
    comm, findings, times = world.comm, [], []
    for nbytes in sizes:
        send = np.full(nbytes // 4, world.rank + 1, dtype=np.float32)
        recv = np.empty_like(send)
        world.arrive("doctor: MPI all-reduce", world.timeout_s)
        start = time.perf_counter()
        comm.Allreduce(send, recv)
        k = agreed_iterations(world, nbytes, time.perf_counter() - start)
        if not np.all(recv == _expected(world.size)) and not findings:
            findings.append(Finding("MPI all-reduce", f"wrong sums at {human(nbytes)}",
                                    "check the MPI library and its network settings"))
        comm.Barrier()
        start = time.perf_counter()
        for _ in range(k):
            comm.Allreduce(send, recv)
        times.append((time.perf_counter() - start) / k)
    return times, findings


def _synchronize(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def torch_allreduce(world, device, sizes: list) -> tuple:
    """(mean seconds per all-reduce for each of ``sizes`` (bytes), findings) on this rank, over
    the default process group; a collective that fails or times out ends the job naming the
    ranks that no longer answer (:meth:`hpc.runtime.world.World.abort_failed`)."""
    findings, times, label = [], [], "doctor: torch.distributed all-reduce"
    for nbytes in sizes:
        checked = torch.full((nbytes // 4,), float(world.rank + 1), device=device)
        timed = torch.zeros_like(checked)  # sums of zeros stay finite however many rounds
        world.arrive(label, world.timeout_s)
        try:
            start = time.perf_counter()
            dist.all_reduce(checked)
            _synchronize(device)
            k = agreed_iterations(world, nbytes, time.perf_counter() - start)
            world.comm.Barrier()
            start = time.perf_counter()
            for _ in range(k):
                dist.all_reduce(timed)
            _synchronize(device)
        except (RuntimeError, dist.DistError) as err:
            world.abort_failed(label, err)
        times.append((time.perf_counter() - start) / k)
        if not bool((checked == _expected(world.size)).all()) and not findings:
            findings.append(Finding("torch.distributed all-reduce",
                                    f"wrong sums at {human(nbytes)} on {dist.get_backend()}",
                                    "check NCCL's transport (NCCL_DEBUG=INFO) and the device"))
    return times, findings


def human(nbytes: float) -> str:
    """'64 MiB', '1 KiB', '512 B'."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= size:
            return f"{nbytes / size:g} {unit}"
    return f"{nbytes:g} B"


def slowest(per_rank: list) -> list:
    """For each size, (the slowest rank's mean seconds, that rank), from every rank's list."""
    table = np.array(per_rank)  # (ranks, sizes)
    return [(float(table[:, i].max()), int(table[:, i].argmax()))
            for i in range(table.shape[1])]


def bandwidth_rows(sizes: list, columns: dict, ranks: int, hosts: list) -> tuple:
    """(head, rows) of the all-reduce table: per size, for each of ``columns`` ({name: the
    slowest (seconds, rank) per size}), time in microseconds, algbw and busbw in GB/s and the
    slowest rank's host."""
    head = ["size"]
    for name in columns:
        head += [f"{name} us", "algbw GB/s", "busbw GB/s", "slowest"]
    rows = []
    for i, nbytes in enumerate(sizes):
        row = [human(nbytes)]
        for per_size in columns.values():
            seconds, rank = per_size[i]
            algbw = nbytes / seconds / 1e9
            row += [f"{seconds * 1e6:.1f}", f"{algbw:.3f}", f"{algbw * bus_factor(ranks):.3f}",
                    f"{rank} ({hosts[rank]})"]
        rows.append(row)
    return head, rows
