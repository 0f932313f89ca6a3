"""The package's decoding engine as a backend (``model.engine=engine``):
:class:`EngineBackend`, the engine's owner, created once by the job (from its
:class:`hpc.engine.config.EngineConfig`) and passed to whoever decodes.

It alone builds, reuses and releases the engine (one at a time: the old one's memory goes
before the new one is allocated), knows whether CUDA graphs are still on (a failed self-check
turns them off for every later engine) and counts the completion tokens it decoded. Nothing of
this lives in a module: two decoders in one process (two jobs, a test beside a job) never see
each other's engine, budget or graph state.

**Memory.** An engine is sized within a byte budget (:meth:`EngineBackend.budget`: ``memory_gib``
when given, else on CUDA :func:`hpc.engine.memory.budget_left` of the device's memory with what
is not free at the decoder's first look as resident (the first engine is built after the load,
so that is what the load left), capped by the memory plan's ``planned_budget``, which the plan
derived the same way from what it expects to be resident: what the plan missed is charged
once, by the device; on CPU ``CPU_ENGINE_MEMORY_GIB``) and at most
``config.slots`` slots, so a call with more requests than slots decodes them in waves through
the slots (continuous batching), and an engine larger than the current phase asks for is
replaced by one of that phase's size.
"""
from __future__ import annotations

import torch

from hpc.engine.architectures import engine_refusal
from hpc.engine.backend import DecodeBackend
from hpc.engine.config import EngineConfig
from hpc.engine.graphs import GraphedDecode
from hpc.engine.memory import (CPU_ENGINE_MEMORY_GIB, GIB, budget_left, bucket, engine_bytes,
                               rounded_length, slots_within)
from hpc.engine.runner import DecodeEngine, adapter_ranks, member_size
from hpc.engine.shape import ModelShape
from hpc.runtime.errors import UserError


class EngineBackend(DecodeBackend):
    """A job's decoding engine and everything about it that outlives one call."""

    name = "engine"
    package = "essa-hpc"

    def __init__(self, config: EngineConfig | None = None):
        super().__init__(config)
        self.engine: DecodeEngine | None = None
        self._derived: dict = {}  # str(device) -> the derived budget, fixed at the first look

    @classmethod
    def refuses(cls, config: dict, max_len: int) -> str:
        return engine_refusal(config, max_len)

    def budget(self, device: torch.device) -> int:
        """The engine's budget in bytes on ``device`` (module docstring)."""
        if self.config.memory_gib > 0:
            return int(self.config.memory_gib * GIB)
        if device.type != "cuda":
            return self.config.planned_budget or int(CPU_ENGINE_MEMORY_GIB * GIB)
        if str(device) not in self._derived:
            free, total = torch.cuda.mem_get_info(device)
            self._derived[str(device)] = budget_left(total, total - free)
        if self.config.planned_budget:
            return min(self.config.planned_budget, self._derived[str(device)])
        return self._derived[str(device)]

    def _replay(self, device: torch.device):
        """What engines built now replay their decode steps with (None: eager)."""
        if self.graph_failure:
            return None
        if self.config.replay is not None:
            return self.config.replay
        return GraphedDecode if self.config.cuda_graphs and device.type == "cuda" else None

    @torch.inference_mode()
    def engine_for(self, model, slots: int, max_len: int, k: int, *,
                   most: int = 0) -> DecodeEngine:
        """The engine for a call on ``model`` that needs ``slots`` rows of ``max_len`` tokens
        with exactly ``k`` members, reused across calls with its cache and CUDA graphs. Built
        in inference mode: its tensors are only ever touched inside it.

        Size: ``bucket(slots)``, at most ``config.slots`` (0 = no cap) and at most the slots
        whose :func:`hpc.engine.memory.engine_bytes` fits :meth:`budget`; max_len rounded up to
        MAX_LEN_STEP. ``most``: the rows of the calling phase (default ``slots``): the engine
        held is reused when it is on the same model with the same members, adapter and replay,
        at least ``max_len`` positions and between the call's size and ``bucket(most)``
        (capped alike) slots; else it is released and one of the call's size built. So a phase
        never holds more slots than it asks for, whatever an earlier phase held."""
        ranks = adapter_ranks(model) if k else {}
        param = next(model.parameters())
        shape = ModelShape.from_config(model.config)
        length = rounded_length(max_len)
        params, elem = member_size(model, ranks)
        budget = self.budget(param.device)
        cap = slots_within(budget, shape, length, k, param.element_size(), params, elem,
                           most=self.config.slots or 1 << 20)
        if cap < 1:
            one = engine_bytes(shape, 1, length, k, param.element_size(), params, elem)
            raise UserError(f"the decoding engine's memory budget ({budget / GIB:.2f} GiB, "
                            f"model.engine_memory_gib) holds no row of {length} tokens (one "
                            f"needs {one / GIB:.2f} GiB): raise model.engine_memory_gib")
        want = min(bucket(slots, 1 << 30), cap)
        top = max(want, min(bucket(most or slots, 1 << 30), cap))
        replay = self._replay(param.device)
        engine = self.engine
        if engine is not None and engine.graphs is not None and self.graph_failure:
            engine.graphs = engine.replay = None  # another rank's check failed: eager here too
        fits = (engine is not None and engine.model is model and engine.k == k
                and engine.ranks == ranks and want <= engine.slots <= top
                and engine.cache.max_len >= max_len and engine.replay == replay)
        if not fits:
            engine = None  # no reference to the old engine may outlive its release
            self.release()  # the old cache, members and graphs go before the new ones come
            self.engine = DecodeEngine(model, want, length, k, ranks, replay)
        return self.engine

    def decode(self, model, requests: list, eos: list, sampling, rows: int,
               members: dict | None = None) -> list:
        """:meth:`hpc.engine.backend.DecodeBackend.decode`: at most ``rows`` at once (fewer when
        the budget or ``config.slots`` holds fewer: the rest wait for free slots), k stacked
        members from ``members``, else the model's own adapter (k = 1) or none."""
        if members is not None:
            k = next(iter(members.values()))[0].shape[0]
        else:
            k = 1 if adapter_ranks(model) else 0
        if not requests:  # a rank with no share of the problems
            return []
        max_len = max(len(r.prompt) + r.max_new for r in requests)
        engine = self.engine_for(model, min(rows, len(requests)), max_len, k, most=rows)
        if k:
            engine.set_members(members)
        out = engine.run(requests, eos, sampling)
        if engine.graph_failure:
            self.disable_graphs(engine.graph_failure)
        self.count_tokens(out)
        return out

    def release(self, above: int = 0) -> bool:
        """Drop the engine (its KV cache, stacked members, buffers and CUDA graphs with their
        memory pool) if it has more than ``above`` slots; True when one went. The graphs refer
        back to the engine, so that cycle is broken here: the memory goes back to the
        allocator now, not at the next garbage collection. Callers must hold no reference to
        the engine."""
        engine = self.engine
        if engine is None or engine.slots <= above:
            return False
        self.engine = None
        engine.graphs = engine.replay = None
        engine.cache = engine.logits = None
        engine.layers = []
        return True

    def end_phase(self, next_rows: int = 0, next_k: int = 1) -> bool:
        """After a phase that decoded (an evaluation): release the engine unless the next
        phase, which decodes ``next_rows`` rows at once with ``next_k`` members (0 rows: none,
        as the export), could reuse it (:meth:`engine_for` reuses an engine of the same members
        and at most ``bucket(next_rows)`` slots). True when it went."""
        keep = self.engine is not None and next_rows and self.engine.k == next_k
        return self.release(above=bucket(next_rows, 1 << 30) if keep else 0)
