"""hpc-sft job configuration (the ``sft`` section plus the shared sections); torch-free, so
``hpc-sft --help`` answers without loading torch."""
from __future__ import annotations

from dataclasses import dataclass, field

from hpc.runtime.config import JobConfig, param
from hpc.runtime.errors import UserError


@dataclass
class SFTConfig:
    steps: int = param(40, "optimizer steps", min=1)
    batch_size: int = param(32, "global batch (prompts per step, split over ranks)", min=1)
    lr: float = param(3e-3, "AdamW learning rate", min=0.0)
    weight_decay: float = param(0.0, "AdamW weight decay", min=0.0)
    grad_clip: float = param(1.0, "max gradient norm (0 = off)", min=0.0)


@dataclass
class SFTJobConfig(JobConfig):
    sft: SFTConfig = field(default_factory=SFTConfig)

    def validate_world(self, world):
        if self.sft.batch_size < world.size:
            raise UserError(f"sft.batch_size={self.sft.batch_size} is smaller than the "
                            f"{world.size} ranks")
