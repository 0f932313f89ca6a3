"""``hpc-sft`` / ``python -m sft``: the SFT stage (see sft.trainer). ``--help`` is answered from
sft.config alone (:func:`hpc.runtime.cli.job_command`), without importing torch."""
from hpc.runtime.cli import JOB_INPUTS, job_command

main = job_command("hpc-sft", "sft.config:SFTJobConfig", "sft.trainer:main",
                   "LoRA SFT stage: writes <run.out>/adapter (peft format) and sft.h5.",
                   check_ref=JOB_INPUTS, method="sft")

if __name__ == "__main__":
    main()
