"""The job lifecycle, the floor above models and toys: :mod:`hpc.job.lifecycle` starts a job
(config, world, run folder, memory check, toy cache) and finishes it; :mod:`hpc.job.loop` runs a
method's steps with evaluation, checkpoints, preemption and per-rank timings. The methods
(``sft``, ``hpc.evaluate``, ``essa``, ``fgrpo``) stand on it."""
