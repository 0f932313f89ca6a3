"""Reports over run files.

``hpc-report compare FILE.h5 ...`` prints one table comparing the start and end of each run:
held-out accuracy, pass@k, wall time and bytes communicated.

``hpc-report summary FILE.h5 ... [--csv OUT.csv] [--plots DIR] [--target ACC]`` prints, per
run, where the time of a step goes (seconds, per phase), the payload bytes, the share spent
communicating or waiting, the straggler spread across ranks, the best held-out accuracy and
the wall-clock seconds to a target accuracy; writes the same table as CSV and draws PNG plots.
Both work on files of jobs still running (rows not yet complete are skipped).

``hpc-report reproduce ROOT [--plots DIR] [--json OUT.json] [--checkpoint final|paper]``
summarises the papers' reproduction experiment (jobscripts/reproduce.sh).
"""
# The hpc-report command (its docstring is its --help): hpc.analysis.report's subcommands,
# which read any run file, and compare.reproduce's, which reads ESSA's and F-GRPO's side by
# side (the shared floor, hpc/, names no method and so cannot hold it).
from __future__ import annotations

from compare import reproduce
from hpc.analysis import report
from hpc.runtime.cli import tool_parser
from hpc.runtime.errors import user_errors_exit


@user_errors_exit
def main(argv=None):
    parser, sub = tool_parser("hpc-report", __doc__)
    report.add_commands(sub)  # compare, summary
    reproduce.add_command(sub)
    args = parser.parse_args(argv)
    if args.command == "reproduce":
        reproduce.main(args)
    else:
        report.run(args)


if __name__ == "__main__":
    main()
