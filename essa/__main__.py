"""``essa`` / ``python -m essa``: the ESSA trainer (see essa.trainer). ``--help`` is answered
from essa.config alone (:func:`hpc.runtime.cli.job_command`), without importing torch."""
from hpc.runtime.cli import JOB_INPUTS, job_command

main = job_command("essa", "essa.config:ESSAJobConfig", "essa.trainer:main",
                   "ESSA: CMA-ES over the singular values of an SFT LoRA adapter (lora.adapter); "
                   "writes essa.h5, adapter-mean, adapter-best and checkpoints/.",
                   check_ref=JOB_INPUTS, method="essa")

if __name__ == "__main__":
    main()
