"""How a job decodes: one frozen :class:`EngineConfig`, built from the ``model`` section."""
from __future__ import annotations

from dataclasses import dataclass

PATHS = ("engine", "hf")  # the decoding engine, or Hugging Face generate (the reference)


@dataclass(frozen=True)
class EngineConfig:
    """Everything that chooses how decoding runs (``model.*`` keys, docs/config.md).

    ``path``: ``engine`` or ``hf``; ``cuda_graphs``: replay decode steps from CUDA graphs (on
    CUDA); ``memory_gib``: the engine's budget in GiB (0: derived from the device);
    ``slots``: most rows at once (0: no cap); ``planned_budget``: the memory plan's budget in
    bytes, which takes precedence over ``memory_gib`` (0: none); ``replay``: a
    :class:`hpc.engine.graphs.GraphedDecode` subclass every engine replays its decode steps
    with on any device, self-check included (None: CUDA graphs per ``cuda_graphs``): the hook
    by which tests put a perturbed "captured" step under a whole job."""

    path: str = "engine"
    cuda_graphs: bool = True
    memory_gib: float = 0.0
    slots: int = 0
    planned_budget: int = 0
    replay: type | None = None

    def __post_init__(self):
        if self.path not in PATHS:
            raise ValueError(f"generation path {self.path!r} is not one of {PATHS}")

    @classmethod
    def from_model(cls, model_cfg, planned_budget: int = 0) -> "EngineConfig":
        """From a job's ``model`` config section (and the memory plan's budget, bytes)."""
        return cls(path=model_cfg.engine, cuda_graphs=model_cfg.cuda_graphs,
                   memory_gib=model_cfg.engine_memory_gib, slots=model_cfg.engine_slots,
                   planned_budget=planned_budget)
