"""A toy build's arithmetic, independent of the kernels the caller would choose: the training
runs under torch's baseline kernels and MKL's reproducible mode, in a child Python started
with them.

torch picks its CPU kernels (AVX-512, AVX2 or baseline) and MKL its code path from the CPU it
runs on, and each rounds some sums differently. Under ``PINNED_KERNELS`` a build no longer
depends on them: started under AVX2 or AVX-512 kernels, or under ``ATEN_CPU_CAPABILITY`` and
``MKL_ENABLE_INSTRUCTIONS`` of any value, it is the same bytes. CPUs still differ beyond that:
the same 1,250 pinned steps built a toy of 41.0% held-out accuracy on Intel Xeon and AMD Zen 4
CPUs and one of 100% on an AMD Zen 1. So the toy's build also ends at a held-out accuracy
rather than a step count (:mod:`hpc.toys.toy`), and ``jobscripts/demo.sh`` exports the same
variables for its stages.

The kernels are chosen when torch and MKL start, so a process that already runs torch cannot
switch: :func:`train_pinned` starts ``python -m hpc.toys.pinned`` with the pinned environment
(and ``OMP_WAIT_POLICY=PASSIVE``, so the build's two threads sleep rather than spin while a
shared machine's other jobs hold the cores; it changes no arithmetic).
"""
from __future__ import annotations

import importlib
import os
import subprocess
import sys

from hpc.runtime.errors import EXIT_USER_ERROR, UserError

# torch's baseline kernels (no AVX2/AVX-512 variants); MKL's conditional numerical
# reproducibility (the same results on every Intel and compatible CPU at a fixed thread
# count); oneDNN, should an op reach it, held to SSE4.1 code
PINNED_KERNELS = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE",
                  "ONEDNN_MAX_CPU_ISA": "SSE41"}
ERROR_PREFIX = "error: "


def kernels_pinned() -> bool:
    """Whether this process runs the pinned kernels: its environment had ``PINNED_KERNELS``
    when torch started, and torch reports the baseline capability."""
    if any(os.environ.get(k) != v for k, v in PINNED_KERNELS.items()):
        return False
    import torch

    return torch.backends.cpu.get_cpu_capability() == "DEFAULT"


def pinned_description() -> str:
    """``PINNED_KERNELS`` as ``NAME=value`` words (recorded in ``toy_info.json``)."""
    return " ".join(f"{k}={v}" for k, v in PINNED_KERNELS.items())


def _call(target: str, out_dir: str, steps: int, log) -> None:
    module, name = target.split(":")
    getattr(importlib.import_module(module), name)(out_dir, steps, log)


def train_pinned(target: str, out_dir: str, steps: int, log=print) -> None:
    """Run ``target(out_dir, steps, log)`` (``target``: ``"module:function"``) under the
    pinned kernels: here if this process already runs them, else in a child Python whose
    stdout lines go to ``log``. A UserError in the child is re-raised here (its one line);
    any other failure is a RuntimeError naming the exit code (the child's traceback is on
    stderr). An exception here (Ctrl-C) ends the child first."""
    if kernels_pinned():
        _call(target, out_dir, steps, log)
        return
    env = dict(os.environ, **PINNED_KERNELS, OMP_WAIT_POLICY="PASSIVE", PYTHONUNBUFFERED="1")
    user_error = None
    with subprocess.Popen([sys.executable, "-m", "hpc.toys.pinned", target, out_dir,
                           str(steps)], env=env, stdout=subprocess.PIPE, text=True) as child:
        try:
            for line in child.stdout:
                line = line.rstrip("\n")
                if line.startswith(ERROR_PREFIX):
                    user_error = line[len(ERROR_PREFIX):]
                else:
                    log(line)
            child.wait()
        except BaseException:
            child.kill()
            raise
    if child.returncode == EXIT_USER_ERROR and user_error:
        raise UserError(user_error)
    if child.returncode:
        raise RuntimeError(f"the pinned-kernel build of {target} failed with exit code "
                           f"{child.returncode} (its error is printed above)")


def main(argv: list[str]) -> int:
    """``python -m hpc.toys.pinned MODULE:FUNCTION OUT_DIR STEPS`` (what train_pinned runs)."""
    target, out_dir, steps = argv
    if not kernels_pinned():
        print(f"{ERROR_PREFIX}hpc.toys.pinned must start with {pinned_description()}",
              flush=True)
        return EXIT_USER_ERROR
    try:
        _call(target, out_dir, int(steps), lambda msg: print(msg, flush=True))
    except UserError as err:
        print(f"{ERROR_PREFIX}{err}", flush=True)
        return EXIT_USER_ERROR
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
