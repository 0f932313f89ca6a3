"""Decoding: one backend a job creates and passes to whoever decodes, and the package's engine.

* :mod:`hpc.engine.config`: :class:`EngineConfig`, everything that chooses how decoding runs;
* :mod:`hpc.engine.shape`: :class:`ModelShape`, the one shape of a decoder model (the engine,
  the memory plan, ESSA's members per pass and the scaling model read it);
* :mod:`hpc.engine.memory`: what an engine holds, in bytes, and its budget (no torch);
* :mod:`hpc.engine.kv_cache`, :mod:`hpc.engine.runner` (the decode step and the prefill),
  :mod:`hpc.engine.scheduler` (continuous batching), :mod:`hpc.engine.graphs` (CUDA graphs and
  their self-check);
* :mod:`hpc.engine.backend`: the decoding backend interface every decoding call goes through,
  its registry and ``model.engine=auto``; :mod:`hpc.engine.architectures`: which models the
  package's engine runs;
* :mod:`hpc.engine.engine_backend`: :class:`EngineBackend`, the package's engine as a backend:
  it builds, reuses and releases the engine, knows whether CUDA graphs are on and counts the
  tokens it decoded; :mod:`hpc.engine.hf_backend`: Hugging Face ``generate`` (the reference);
* :mod:`hpc.engine.generate`: ``generate`` and ESSA's ``member_completions`` through a backend.

This file imports nothing, so ``hpc.engine.config``, ``shape`` and ``memory`` load without torch.
"""
