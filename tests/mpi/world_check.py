"""Run under mpirun: checks rank/device mapping, counted collectives and the gloo bootstrap.

Rank 0 writes a JSON report to argv[1].
"""
import json
import os
import sys

import numpy as np
import torch

from hpc.runtime.dist import all_reduce_mean_, init_process_group
from hpc.runtime.world import get_world, select_device, split_evenly

world = get_world()
device = select_device(world, "auto")

buf = np.arange(10, dtype=np.float64) if world.is_root else np.zeros(10)
world.bcast(buf, tag="seeds")
gathered = world.allgather(np.array([world.rank, world.rank * 10], dtype=np.int64), tag="fit")
counts = split_evenly(7, world.size)
mine = np.full(counts[world.rank], world.rank, dtype=np.float32)
gv = world.allgatherv(mine, counts, tag="fitv")

init_process_group(world, device)
t = torch.full((5,), float(world.rank + 1))
all_reduce_mean_([t], world, tag="grads")

report = {
    "rank": world.rank, "size": world.size, "local_rank": world.local_rank,
    "env_local_rank": os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK"),
    "device": str(device),
    "bcast_ok": bool(np.array_equal(buf, np.arange(10))),
    "allgather": gathered.tolist(),
    "allgatherv": gv.tolist(),
    "allreduce": t.tolist(),
    "backend": torch.distributed.get_backend(),
    "bytes": world.take_bytes(),
}
reports = world.comm.gather(report, root=0)
if world.is_root:
    with open(sys.argv[1], "w") as fh:
        json.dump(reports, fh)
