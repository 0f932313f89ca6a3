"""Whether the launcher's PMIx fences are barriers: the last rank sleeps DELAY seconds before
MPI_Finalize, whose PMIx fence carries no data, and every rank prints the seconds its
MPI_Finalize took, one line each: ``rank R finalize S``.

    fence_check.py DELAY

Where that fence is a barrier across the nodes every rank's MPI_Finalize lasts about DELAY;
where it only gathers the ranks of each node (Slurm's tree collective when TreeWidth exceeds
the step's node count), a rank on another node than the last returns at once, and so does
MPI_Init's closing barrier, which is what lets a rank die inside MPI_Init
(docs/troubleshooting.md)."""
import sys
import time

from mpi4py import MPI

delay = float(sys.argv[1])
comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
comm.Barrier()  # every rank is past MPI_Init before the last one starts its sleep
if rank == size - 1:
    time.sleep(delay)
start = time.monotonic()
MPI.Finalize()
print(f"rank {rank} finalize {time.monotonic() - start:.3f}", flush=True)
