"""``hpc-doctor``: the preflight of a cluster, run under ``srun`` / ``mpirun`` exactly as a job.

Every rank answers the questions a first job would otherwise answer after hours: its host,
ranks, device and library versions (:mod:`hpc.doctor.ranks`); whether MPI and
torch.distributed all-reduce correctly and how fast (:mod:`hpc.doctor.bandwidth`); whether the
run root is writable, the same folder on every node, large enough and fit for HDF5's file
locks (:mod:`hpc.doctor.storage`); whether the model folder and data files are present and
identical on every node, and what the memory plan says (:mod:`hpc.doctor.inputs`). Rank 0
prints one table and one line per failed check naming the node and the fix
(:mod:`hpc.doctor.findings`); :mod:`hpc.doctor.command` is the entry point.
"""
