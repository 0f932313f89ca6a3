"""How a job decodes: one frozen :class:`EngineConfig`, built from the ``model`` section."""
from __future__ import annotations

from dataclasses import dataclass

@dataclass(frozen=True)
class EngineConfig:
    """Everything that chooses how decoding runs (``model.*`` keys, docs/config.md).

    ``backend``: the registered backend that decodes (:data:`hpc.engine.backend.BACKENDS`;
    ``model.engine``, ``auto`` resolved at job start); ``cuda_graphs``: replay decode steps from CUDA graphs (on
    CUDA); ``memory_gib``: the engine's budget in GiB (0: derived from the device);
    ``slots``: most rows at once (0: no cap); ``planned_budget``: the memory plan's budget in
    bytes, which takes precedence over ``memory_gib`` (0: none); ``replay``: a
    :class:`hpc.engine.graphs.GraphedDecode` subclass every engine replays its decode steps
    with on any device, self-check included (None: CUDA graphs per ``cuda_graphs``): the hook
    by which tests put a perturbed "captured" step under a whole job."""

    backend: str = "engine"
    cuda_graphs: bool = True
    memory_gib: float = 0.0
    slots: int = 0
    planned_budget: int = 0
    replay: type | None = None

    @classmethod
    def from_model(cls, model_cfg, backend: str, planned_budget: int = 0) -> "EngineConfig":
        """From a job's ``model`` config section, the backend ``model.engine`` resolved to
        (:func:`hpc.engine.backend.resolve_backend`) and the memory plan's budget (bytes)."""
        return cls(backend=backend, cuda_graphs=model_cfg.cuda_graphs,
                   memory_gib=model_cfg.engine_memory_gib, slots=model_cfg.engine_slots,
                   planned_budget=planned_budget)
