"""``essa`` / ``python -m essa``: the ESSA trainer (see essa.trainer). ``--help`` is answered
from essa.config alone (:func:`hpc.runtime.cli.method_command`), without importing torch."""
from essa.method import METHOD
from hpc.runtime.cli import method_command

main = method_command(METHOD)

if __name__ == "__main__":
    main()
