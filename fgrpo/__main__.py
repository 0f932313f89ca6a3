"""``fgrpo`` / ``python -m fgrpo``: the F-GRPO trainer (see fgrpo.trainer). ``--help`` is answered
from fgrpo.config alone (:func:`hpc.runtime.cli.method_command`), without importing torch."""
from fgrpo.method import METHOD
from hpc.runtime.cli import method_command

main = method_command(METHOD)

if __name__ == "__main__":
    main()
