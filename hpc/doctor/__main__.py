"""``python -m hpc.doctor``: the same as ``hpc-doctor`` (:mod:`hpc.doctor.command`)."""
from hpc.doctor.command import main

main()
