"""The CPU a rank spends before its first step, mostly imports (torch, transformers, peft, cma),
under each given Python: every job module imported in a fresh process, the Pythons interleaved
so that load on a shared machine falls on all alike; ratios to the first Python.

    .venv/bin/python benchmarks/job_start.py [--pythons PY [PY ...]] [--repeats 5]

Each PY is the python of an environment with this package installed (default: this one). On
a 2-core AMD EPYC, Debian's /usr/bin/python3.11 (PGO, LTO, libpython linked in: what `make venv`
takes) against a pyenv-built 3.11 (a shared libpython without PGO): 0.88-0.89x the CPU
(benchmarks/results/job_start-2026-12-05.txt). The test suite starts thousands of ranks, and a
rank of a small job spends most of its CPU here.
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys

from common import REPO, machine

MODULES = ("essa.trainer", "fgrpo.trainer", "sft.trainer")


def cpu_seconds(python: str, module: str) -> float:
    """User + system CPU seconds of ``python -c 'import module'`` (what the finished child
    added to this process's children's rusage)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run([python, "-c", f"import {module}"], cwd=REPO, env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if proc.returncode:
        raise SystemExit(f"{python} could not import {module}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pythons", nargs="+", default=[sys.executable])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    times = {(py, m): [] for py in args.pythons for m in MODULES}
    for _ in range(args.repeats):
        for module in MODULES:
            for python in args.pythons:
                times[(python, module)].append(cpu_seconds(python, module))
    print(f"machine: {machine()}")
    for i, python in enumerate(args.pythons):
        version = subprocess.run([python, "-c", "import sys; print(sys.version.split()[0])"],
                                 capture_output=True, text=True, check=True).stdout.strip()
        print(f"python {i}: {python} ({os.path.realpath(python)}, {version})")
    print(f"{'module':<16}" + "".join(f" {f'python {i} cpu s':>15} {'x python 0':>10}"
                                      for i in range(len(args.pythons))))
    for module in MODULES:
        base = statistics.median(times[(args.pythons[0], module)])
        cells = [statistics.median(times[(py, module)]) for py in args.pythons]
        print(f"{module:<16}" + "".join(f" {c:15.2f} {c / base:10.2f}" for c in cells))


if __name__ == "__main__":
    main()
