"""``hpc-sft`` / ``python -m sft``: the SFT stage (see sft.trainer). ``--help`` is answered
from sft.config alone (:func:`hpc.runtime.cli.job_command`), without importing torch."""
from sft.method import METHOD
from hpc.runtime.cli import job_command

main = job_command(METHOD)

if __name__ == "__main__":
    main()
