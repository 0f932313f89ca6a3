"""What ESSA and F-GRPO share: MPI world, torch.distributed bootstrap, HDF5 run store, config,
models + LoRA, tasks and rewards, generation, evaluation and the LoRA SFT stage."""
import logging

__version__ = "0.1.0"

# Jobs print only what the user asked for. peft and transformers import torchao (extra 'quant')
# whenever it is installed, and its import logs kernels for other GPUs that it cannot load here
# and a torch deprecation notice: silenced before any of them is imported.
for _logger in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_logger).setLevel(logging.ERROR)
