"""The decoding engine: one object a job creates and passes to whoever decodes.

* :mod:`hpc.engine.config`: :class:`EngineConfig`, everything that chooses how decoding runs;
* :mod:`hpc.engine.shape`: :class:`ModelShape`, the one shape of a decoder model (the engine,
  the memory plan, ESSA's members per pass and the scaling model read it);
* :mod:`hpc.engine.memory`: what an engine holds, in bytes, and its budget (no torch);
* :mod:`hpc.engine.kv_cache`, :mod:`hpc.engine.runner` (the decode step and the prefill),
  :mod:`hpc.engine.scheduler` (continuous batching), :mod:`hpc.engine.graphs` (CUDA graphs and
  their self-check);
* :mod:`hpc.engine.decoder`: :class:`Decoder`, the engine's owner: it builds, reuses and
  releases the engine, knows whether CUDA graphs are on and counts the tokens it decoded;
* :mod:`hpc.engine.generate`: ``generate`` on the engine or on Hugging Face ``generate`` (the
  reference path, ``model.engine=hf``).

This file imports nothing, so ``hpc.engine.config``, ``shape`` and ``memory`` load without torch.
"""
