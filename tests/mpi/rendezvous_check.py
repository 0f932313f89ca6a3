"""Run on several nodes (srun or mpirun): the torch.distributed bootstrap and the local ranks.

Prints one JSON line per rank: host, rank, size, local rank and size (the package's and the
launcher's), the rendezvous address and interface, and the mean of an all-reduce."""
import json
import os

import torch

from hpc.runtime.dist import all_reduce_mean_, init_process_group
from hpc.runtime.errors import user_errors_exit
from hpc.runtime.world import get_world


@user_errors_exit
def main():
    world = get_world()
    init_process_group(world, torch.device("cpu"))  # agrees on the rendezvous
    t = torch.tensor([float(world.rank)])
    all_reduce_mean_([t], world)
    launcher_local = (os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK") or
                      os.environ.get("SLURM_LOCALID"))
    launcher_size = (os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE") or
                     os.environ.get("SLURM_NTASKS_PER_NODE"))
    print(json.dumps(dict(host=world.hostname, rank=world.rank, size=world.size,
                          local_rank=world.local_rank, local_size=world.local_size,
                          launcher_local_rank=launcher_local, launcher_local_size=launcher_size,
                          addr=world.rendezvous.addr if world.rendezvous else None,
                          gloo_ifname=os.environ.get("GLOO_SOCKET_IFNAME"),
                          mean=t.item())), flush=True)


main()
