"""``fgrpo`` / ``python -m fgrpo``: the F-GRPO trainer (see fgrpo.trainer). ``--help`` is answered
from fgrpo.config alone (:func:`hpc.runtime.cli.job_command`), without importing torch."""
from fgrpo.method import METHOD
from hpc.runtime.cli import job_command

main = job_command(METHOD)

if __name__ == "__main__":
    main()
