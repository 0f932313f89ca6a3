"""Point-to-point traffic at once after MPI_Init, with nothing of this package: each rank sends
one small message to every other rank as soon as MPI_Init returns, then receives one from each.

Run under a launcher (``srun --mpi=pmix ...``, ``mpirun ...``). A rank whose MPI_Init has not
yet finished when a faster rank's message reaches it is the window benchmarks/init_race.py
counts; there it dies with a segmentation fault inside MPI_Init (docs/troubleshooting.md,
"A segfault inside MPI_Init under srun"). Exit 0 and one line from rank 0 when every message
arrived: the MPI library's version."""
import sys

from mpi4py import MPI  # MPI_Init_thread happens here

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
out = [bytearray(rank.to_bytes(4, "little")) for _ in range(size)]
got = [bytearray(4) for _ in range(size)]
peers = [p for p in range(size) if p != rank]
sends = [comm.Isend([out[p], MPI.BYTE], dest=p, tag=11) for p in peers]
recvs = [comm.Irecv([got[p], MPI.BYTE], source=p, tag=11) for p in peers]
MPI.Request.Waitall(sends + recvs)
wrong = [p for p in peers if int.from_bytes(got[p], "little") != p]
if wrong:
    print(f"rank {rank}: wrong message from {wrong}", file=sys.stderr)
    sys.exit(1)
if rank == 0:
    print(MPI.Get_library_version().splitlines()[0].split(",")[0])
