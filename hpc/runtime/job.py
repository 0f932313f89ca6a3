"""Common start of every job (SFT, ESSA, F-GRPO, evaluation): arguments, config, world,
device, output folder, task and model, all validated on every rank before any GPU work and
before the run file exists, so a user mistake leaves nothing half-written.

Command line of every job: ``PROG [CONFIG.yaml] [section.key=value ...] [--resume]``.
"""
from __future__ import annotations

import argparse
import datetime
import os
import shutil
import sys
from dataclasses import dataclass

import numpy as np

from hpc.models.generation import configure as configure_generation
from hpc.runtime.config import config_to_yaml, load_config
from hpc.runtime.errors import EXIT_USER_ERROR, UserError
from hpc.runtime.world import World, get_world, select_device


class PeerFailed(SystemExit):
    """Another rank reported a user error; this rank exits 2 without printing."""

    def __init__(self):
        super().__init__(EXIT_USER_ERROR)


def on_all_ranks(world: World, fn):
    """Run ``fn()`` on every rank; if it raises UserError on any rank, every rank stops.

    The rank(s) that saw the error re-raise it (printed as one line by the entry point); the
    others raise :class:`PeerFailed`. One 1-byte Allgather, tag ``control``.
    """
    err = None
    result = None
    try:
        result = fn()
    except UserError as caught:
        err = caught
    if world.size > 1:
        failed = world.allgather(np.array([err is not None], dtype=np.int8), tag="control")
        if err is None and failed.any():
            raise PeerFailed()
        if err is not None and not failed[0]:
            err.same_on_all_ranks = False  # rank 0 is fine: this rank must print its own line
    if err is not None:
        err.abort_peers = False  # every rank stops here by agreement
        raise err
    return result


def parse_args(prog: str, argv=None, description: str = ""):
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("items", nargs="*", metavar="CONFIG.yaml | section.key=value",
                        help="an optional YAML config file, then overrides")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the last checkpoint in run.out")
    args = parser.parse_args(argv)
    config_path = None
    overrides = []
    for item in args.items:
        if "=" not in item and item.endswith((".yaml", ".yml")) and config_path is None:
            config_path = item
        else:
            overrides.append(item)
    return config_path, overrides, args.resume


def _job_id(world: World) -> str:
    if os.environ.get("SLURM_JOB_ID"):
        return os.environ["SLURM_JOB_ID"]
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S") if world.is_root else None
    return world.comm.bcast(stamp, root=0)  # once per job, not a hot path


def _check_writable(out_dir: str, min_free_mb: float) -> None:
    try:
        os.makedirs(out_dir, exist_ok=True)
        probe = os.path.join(out_dir, ".write-test")
        with open(probe, "w") as fh:
            fh.write("ok")
        os.remove(probe)
    except OSError as err:
        raise UserError(f"output folder {out_dir} is not writable: {err.strerror or err}")
    free_mb = shutil.disk_usage(out_dir).free / 2 ** 20
    if free_mb < min_free_mb:
        raise UserError(f"the disk of {out_dir} has {free_mb:.0f} MiB free, less than "
                        f"run.min_free_mb={min_free_mb:.0f}: free space or write elsewhere")


def progress_bar(job: "Job", total: int, desc: str, initial: int = 0):
    """tqdm bar on rank 0 only (``run.progress``). Into a file (a Slurm log) it redraws every
    30 s instead of every step, so logs stay readable."""
    from tqdm import tqdm

    enabled = job.world.is_root and job.cfg.run.progress
    interactive = sys.stderr.isatty()
    return tqdm(total=total, initial=initial, desc=desc, disable=not enabled,
                mininterval=0.1 if interactive else 30.0, ascii=not interactive)


@dataclass
class Job:
    cfg: object
    world: World
    device: object
    out_dir: str
    resume: bool
    config_text: str
    method: str
    signals: object  # hpc.runtime.preempt.StopSignals, installed before any loading


def start_job(job_cls, method: str, prog: str, argv=None) -> Job:
    """Parse, validate and prepare a job on every rank (see the module docstring)."""
    from hpc.runtime.preempt import StopSignals

    # First of all: a preemption signal during start-up (model loading can take minutes) must
    # not kill the ranks; it is honoured at the end of the first step.
    signals = StopSignals()
    config_path, overrides, resume = parse_args(prog, argv)
    cfg = load_config(job_cls, config_path, overrides)
    configure_generation(cfg.model)
    world = get_world()
    world.timeout_s = cfg.run.collective_timeout_s
    if hasattr(cfg, "validate_world"):
        cfg.validate_world(world)
    device = on_all_ranks(world, lambda: select_device(world, cfg.model.device))
    try:
        out_dir = cfg.run.out.format(method=method, jobid=_job_id(world))
    except (KeyError, IndexError, ValueError) as err:
        raise UserError(f"config key 'run.out': {cfg.run.out!r} may only use the fields "
                        f"{{method}} and {{jobid}} ({err!r})") from None
    on_all_ranks(world, lambda: _check_writable(out_dir, cfg.run.min_free_mb)
                 if world.is_root else None)
    if resume and not os.path.isdir(out_dir):
        raise UserError(f"--resume: no run folder {out_dir}")
    return Job(cfg=cfg, world=world, device=device, out_dir=out_dir, resume=resume,
               config_text=config_to_yaml(cfg), method=method, signals=signals)


def finish(job: Job, summary: dict, start_label: str, end_label: str) -> None:
    """End a training job: exit 3 if it was preempted, else print (rank 0) the held-out table
    of the start and the end of the run and the run folder."""
    from hpc.evaluate import format_table
    from hpc.runtime.preempt import EXIT_PREEMPTED

    if summary["preempted"]:
        sys.exit(EXIT_PREEMPTED)
    if job.world.is_root:
        rows = [(start_label, summary["start"], {})] if summary["start"] is not None else []
        rows.append((end_label, summary["final"], {"steps": summary["steps"],
                                                   "wall s": f"{summary['wall_s']:.0f}"}))
        print(format_table(rows))
        print(f"run: {job.out_dir}")


def agree_on_resume_step(world, step: int) -> None:
    """Every rank must resume from the same checkpoint (a rank that cannot read the shared run
    folder, or reads an older checkpoint, would desynchronise the collectives)."""
    steps = world.allgather(np.array([step], dtype=np.int64), tag="control")
    if (steps != steps[0]).any():
        raise UserError(f"ranks would resume from different checkpoints (steps by rank: "
                        f"{steps.tolist()}): the run folder must be on a file system every "
                        f"rank sees", same_on_all_ranks=False)
