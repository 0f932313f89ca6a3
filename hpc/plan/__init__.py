"""The memory plan: what every phase of a job holds on one GPU, from the model's
``config.json`` alone, checked before a job loads anything (``hpc-plan`` prints it)."""
