"""What ESSA and F-GRPO share: MPI world, torch.distributed bootstrap, HDF5 run store, config,
models + LoRA, tasks and rewards, generation, evaluation and the LoRA SFT stage."""

__version__ = "0.1.0"
