"""Run on several nodes (srun or mpirun) as ``rendezvous_check.py OUT``: the torch.distributed
bootstrap and the local ranks.

Each rank writes OUT/rank-N.json: host, rank, size, local rank and size (the package's and the
launcher's), the rendezvous address and interface, the mean of an all-reduce, its exit code
and the seconds from the start of the bootstrap (MPI included) to its exit."""
import json
import os
import sys
import time

import torch

from hpc.runtime.dist import all_reduce_mean_, init_process_group
from hpc.runtime.errors import user_errors_exit
from hpc.runtime.world import get_world

REPORT = {}


@user_errors_exit
def main():
    world = get_world()
    REPORT.update(rank=world.rank, host=world.hostname)
    init_process_group(world, torch.device("cpu"))  # agrees on the rendezvous
    t = torch.tensor([float(world.rank)])
    all_reduce_mean_([t], world)
    REPORT.update(size=world.size, local_rank=world.local_rank, local_size=world.local_size,
                  launcher_local_rank=(os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK") or
                                       os.environ.get("SLURM_LOCALID")),
                  launcher_local_size=(os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE") or
                                       os.environ.get("SLURM_NTASKS_PER_NODE")),
                  addr=world.rendezvous.addr, gloo_ifname=os.environ.get("GLOO_SOCKET_IFNAME"),
                  mean=t.item())


def write_report(out: str, code: int, t0: float) -> None:
    REPORT.update(exit_code=code, bootstrap_s=time.monotonic() - t0)
    with open(os.path.join(out, f"rank-{REPORT['rank']}.json"), "w") as fh:
        json.dump(REPORT, fh)


if __name__ == "__main__":
    start, code = time.monotonic(), 0
    leave = os._exit  # a rank of an agreed exit leaves through it (hpc.runtime.errors._leave_now)
    os._exit = lambda status: (write_report(sys.argv[1], status, start), leave(status))
    try:
        main()
    except SystemExit as done:
        code = done.code
        raise
    finally:
        write_report(sys.argv[1], code, start)
