"""Models and generation: loading, LoRA adapters, the toy model, decoding."""
