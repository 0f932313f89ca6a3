"""How fast every console command answers ``--help``, as a ratio to ``python -c pass`` timed
in the same run (the interpreter's own start), interleaved so that load on a shared machine
falls on both alike.

    .venv/bin/python benchmarks/cli_help.py [--repeats 5]

Prints per command the median seconds and the ratio (benchmarks/results/cli_help-2026-12-03.txt:
every --help in 0.13-0.20 s on a 2-core Xeon, 6-9x python -c pass); a command is over budget when its median
exceeds 1 s.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time

from common import REPO, machine

BUDGET_S = 1.0


def console_scripts() -> list:
    """The console scripts setup.py declares, as they are installed beside this Python."""
    with open(os.path.join(REPO, "setup.py")) as fh:
        block = re.search(r'"console_scripts": \[(.*?)\]', fh.read(), re.S).group(1)
    return re.findall(r'"([\w-]+)=', block)


def seconds(argv: list) -> float:
    begin = time.perf_counter()
    subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    return time.perf_counter() - begin


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    bin_dir = os.path.dirname(sys.executable)
    commands = {name: [os.path.join(bin_dir, name), "--help"] for name in console_scripts()}
    times = {name: [] for name in ["python -c pass", *commands]}
    for _ in range(args.repeats):
        for name, argv in commands.items():
            times["python -c pass"].append(seconds([sys.executable, "-c", "pass"]))
            times[name].append(seconds(argv))
    base = statistics.median(times["python -c pass"])
    print(f"machine: {machine()}")
    print(f"{'command':<16} {'median s':>9} {'x python':>9}")
    for name, values in times.items():
        median = statistics.median(values)
        flag = "  over 1 s" if median > BUDGET_S else ""
        print(f"{name:<16} {median:9.2f} {median / base:9.1f}{flag}")


if __name__ == "__main__":
    main()
