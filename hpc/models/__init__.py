"""Models and generation: loading, LoRA adapters, decoding, memory plan (the built-in toy
models are in :mod:`hpc.toys`)."""
