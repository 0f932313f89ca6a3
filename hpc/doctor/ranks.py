"""Each rank's place and software: host, global and local rank, its device (the job's choice:
:func:`hpc.runtime.world.select_device`), the torch, CUDA and NCCL versions and the MPI
library's own version string."""
from __future__ import annotations

import torch

from hpc.doctor.findings import Finding
from hpc.runtime.errors import UserError
from hpc.runtime.world import mpi_library, select_device

GIB = 2 ** 30


def pick_device(world, requested: str) -> tuple:
    """(device, findings): the job's device for ``model.device`` = ``requested``; where the job
    would refuse it (no CUDA, more ranks than GPUs), the CPU and that refusal."""
    try:
        return select_device(world, requested), []
    except UserError as err:
        return torch.device("cpu"), [Finding("device", str(err), "")]


def describe_device(device) -> str:
    """'NVIDIA H100 80GB HBM3, 79.1 GiB (cuda:3)' or 'cpu'."""
    if device.type != "cuda":
        return "cpu"
    props = torch.cuda.get_device_properties(device)
    return f"{props.name}, {props.total_memory / GIB:.1f} GiB (cuda:{device.index})"


def nccl_version() -> str:
    """NCCL's version as torch was built with it ('2.21.5'), '-' without CUDA."""
    if not (torch.cuda.is_available() and torch.distributed.is_nccl_available()):
        return "-"
    version = torch.cuda.nccl.version()
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def rank_facts(world, device) -> dict:
    """This rank's row of the table."""
    return {"rank": world.rank, "host": world.hostname,
            "local": f"{world.local_rank}/{world.local_size}", "device": describe_device(device),
            "device_type": device.type, "torch": torch.__version__,
            "cuda": torch.version.cuda or "-", "nccl": nccl_version(), "mpi": mpi_library()}


RANK_COLUMNS = (("rank", "rank"), ("host", "host"), ("local", "local"), ("device", "device"),
                ("torch", "torch"), ("CUDA", "cuda"), ("NCCL", "nccl"),
                ("interface", "interface"), ("MPI library", "mpi"))


def rank_rows(facts: list) -> tuple:
    """(head, rows) of the per-rank table from every rank's facts."""
    head = [title for title, _ in RANK_COLUMNS]
    return head, [[str(f.get(key, "-")) for _, key in RANK_COLUMNS] for f in facts]
