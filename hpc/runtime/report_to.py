"""``run.report_to``: the run file's scalars, also in TensorBoard and/or Weights & Biases.

The run file stays the record; a reporter receives each scalar (0-d) value of every row rank 0
writes to it (:meth:`hpc.runtime.runstore.RunStore.write_row`), as ``<group>/<name>`` at the
row's step: ``metrics/loss`` at step 3, ``heldout/accuracy``, ``eval/accuracy`` (step -1: the
start evaluation), ``bytes/<tag>``, ``segments/world_size``. Per-rank and per-member arrays
(``timings/*``, ``essa/fitness``) stay in the run file alone.

A resumed job's reporters start over from the run file: every row it kept is sent again
(:meth:`hpc.runtime.runstore.RunStore.replay`), then the new ones, so what they show is what
the run file holds, rows a killed job wrote after its last checkpoint included out.

- ``tensorboard``: event files in ``<run.out>/tensorboard`` (``tensorboard --logdir runs``); a
  resumed job's event file first purges every earlier event.
- ``wandb``: offline unless ``WANDB_MODE`` says otherwise (compute nodes seldom reach the
  internet), its folder in ``<run.out>/wandb``; ``wandb sync <run.out>/wandb/offline-run-*``
  uploads it from a login node. Project ``WANDB_PROJECT`` (default ``essa-hpc``), run group the
  run folder's name (a resumed job is a run of its own in that group, ``<name>-from-step-<n>``,
  holding the whole history), the job's config as the run's config, ``step`` as every
  metric's x axis.

Each is an optional extra of the package (``pip install 'essa-hpc[tensorboard]'``);
:func:`check_report_to` names a missing one before the job imports torch.
"""
from __future__ import annotations

import importlib.util
import os

import numpy as np
import yaml

from hpc.runtime.errors import UserError

# run.report_to name -> the package it needs (and the package extra of the same name)
PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}
W_AND_B_PROJECT = "essa-hpc"


def check_report_to(targets: list) -> None:
    """UserError for 'none' beside another target, or a target whose package is missing."""
    if "none" in targets and len(targets) > 1:
        raise UserError(f"config key 'run.report_to': 'none' cannot go with "
                        f"{', '.join(t for t in targets if t != 'none')}")
    for target in targets:
        if target in PACKAGES and importlib.util.find_spec(PACKAGES[target]) is None:
            raise UserError(f"config key 'run.report_to': {target} needs the "
                            f"{PACKAGES[target]} package, which is not installed: pip install "
                            f"'essa-hpc[{target}]'")


def scalars(values: dict) -> dict:
    """``{name: int or float}`` of the 0-d numeric values of a run-file row."""
    out = {}
    for name, value in values.items():
        arr = np.asarray(value)
        if arr.ndim == 0 and arr.dtype.kind in "iubf":
            out[name] = arr.item() if arr.dtype.kind == "f" else int(arr)
    return out


class TensorBoard:
    """Event files in ``<out_dir>/tensorboard`` (torch's SummaryWriter, float32 scalars as
    TensorBoard stores them). A resumed run (``first_step`` not None) writes a new event file
    that starts by purging every earlier event (a TensorBoard restart marker at step -1, below
    every step), then holds the run file's rows replayed (:meth:`RunStore.replay`) and the new
    ones: the folder shows what the run file holds, whatever the killed job had written."""

    def __init__(self, out_dir: str, first_step: int | None):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(os.path.join(out_dir, "tensorboard"),
                                    purge_step=None if first_step is None else -1)

    def add(self, group: str, step: int, values: dict) -> None:
        for name, value in values.items():
            self.writer.add_scalar(f"{group}/{name}", value, step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self, status: str) -> None:
        self.writer.close()


class WandB:
    """One W&B run in ``<out_dir>/wandb`` (offline unless WANDB_MODE says otherwise)."""

    def __init__(self, out_dir: str, method: str, config_text: str, first_step: int | None):
        import wandb

        name = os.path.basename(os.path.abspath(out_dir))
        try:
            self.run = wandb.init(
                dir=out_dir, mode=os.environ.get("WANDB_MODE") or "offline",
                project=os.environ.get("WANDB_PROJECT") or W_AND_B_PROJECT, group=name,
                name=name if not first_step else f"{name}-from-step-{first_step}",
                job_type=method, config=yaml.safe_load(config_text),
                settings=wandb.Settings(console="off", silent=True))
        except Exception as err:  # noqa: BLE001 - W&B's own errors (usage, settings, service)
            lines = str(err).strip().splitlines()
            raise UserError(f"run.report_to=wandb: W&B did not start: "
                            f"{lines[0] if lines else type(err).__name__}") from None
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")
        mode, folder = self.run.settings.mode, os.path.dirname(self.run.dir)
        upload = f" (upload it with: wandb sync {folder})" if mode == "offline" else ""
        print(f"run.report_to=wandb: {mode} run in {folder}{upload}", flush=True)

    def add(self, group: str, step: int, values: dict) -> None:
        self.run.log({**{f"{group}/{name}": value for name, value in values.items()},
                      "step": step})

    def flush(self) -> None:
        """W&B's service writes each logged row itself."""

    def close(self, status: str) -> None:
        self.run.finish(exit_code=0 if status == "complete" else 1)


def open_reporters(targets: list, out_dir: str, method: str, config_text: str,
                   first_step: int | None) -> list:
    """The reporters ``targets`` (run.report_to) name, for rank 0 of a run in ``out_dir``;
    ``first_step``: the step a resumed run continues from (None: a fresh run)."""
    reporters = []
    if "tensorboard" in targets:
        reporters.append(TensorBoard(out_dir, first_step))
    if "wandb" in targets:
        reporters.append(WandB(out_dir, method, config_text, first_step))
    return reporters
