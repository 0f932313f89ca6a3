"""The MPI runtime every job stands on: world, collectives, config, errors, preemption,
timing, checkpoints and the HDF5 run store."""
