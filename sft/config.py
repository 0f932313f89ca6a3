"""hpc-sft job configuration (the ``sft`` section plus the shared sections); torch-free, so
``hpc-sft --help`` answers without loading torch."""
from __future__ import annotations

from dataclasses import dataclass, field

from hpc.job.config import JobConfig
from hpc.runtime.config import param


@dataclass
class SFTConfig:
    steps: int = param(40, "optimizer steps (unless sft.epochs is set)", min=1, max=1_000_000)
    epochs: int = param(0, "train whole epochs of the training set (of task.sft_split's part "
                        "when set) instead of sft.steps, which it then replaces: ceil(problems "
                        "/ sft.batch_size) steps an epoch, each problem once an epoch, the last "
                        "batch filled up from the epoch's first (0 = sft.steps)",
                        min=0, max=100_000)
    batch_size: int = param(32, "global batch (prompts per step, split over ranks)",
                            min=1, max=1_000_000)
    lr: float = param(3e-3, "AdamW learning rate", min=0.0, max=10.0)
    weight_decay: float = param(0.0, "AdamW weight decay", min=0.0, max=10.0)
    grad_clip: float = param(1.0, "max gradient norm (0 = off)", min=0.0, max=1e6)


@dataclass
class SFTJobConfig(JobConfig):
    per_rank_key = "sft.batch_size"
    sft: SFTConfig = field(default_factory=SFTConfig)
