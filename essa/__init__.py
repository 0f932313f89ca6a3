"""ESSA: evolutionary search over the singular values of an SFT LoRA adapter (arXiv 2507.04453).

Each LoRA factor (A: r x in, B: out x r) is split by SVD into U diag(s) Vh; U and Vh stay fixed
and an evolution strategy searches offsets to the top ceil(alpha * r) singular values
(:mod:`hpc.models.adapter_space`, shared with F-GRPO's ``fgrpo.space=sv``). Optimizers
(:mod:`essa.optimizers`) are deterministic given their seed, so every MPI rank regenerates the
same population and only fitness values cross the network.
"""
