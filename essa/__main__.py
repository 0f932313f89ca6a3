"""``essa`` / ``python -m essa``: the ESSA trainer (see essa.trainer). ``--help`` is answered
from essa.config alone (:func:`hpc.runtime.cli.job_command`), without importing torch."""
from essa.method import METHOD
from hpc.runtime.cli import job_command

main = job_command(METHOD)

if __name__ == "__main__":
    main()
