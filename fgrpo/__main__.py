"""``fgrpo`` / ``python -m fgrpo``: the F-GRPO trainer (see fgrpo.trainer). ``--help`` is
answered from fgrpo.config alone (:func:`hpc.runtime.cli.job_command`), without importing torch."""
from hpc.runtime.cli import JOB_INPUTS, job_command

main = job_command("fgrpo", "fgrpo.config:FGRPOJobConfig", "fgrpo.trainer:main",
                   "F-GRPO: GRPO with focal-weighted group advantages, LoRA or full fine-tuning, "
                   "data parallel; writes fgrpo.h5, adapter and checkpoints/.",
                   check_ref=JOB_INPUTS, method="fgrpo")

if __name__ == "__main__":
    main()
