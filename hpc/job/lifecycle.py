"""Common start of every job (SFT, ESSA, F-GRPO, evaluation): arguments, config, world,
device, output folder, task and model, all validated on every rank before any GPU work and
before the run file exists, so a user mistake leaves nothing half-written.

Command line of every job: ``PROG [CONFIG.yaml] [section.key=value ...] [--resume]``.
"""
from __future__ import annotations

import datetime
import os
import sys
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

from hpc.engine.backend import DecodeBackend, make_backend, resolve_backend
from hpc.engine.config import EngineConfig
from hpc.job.inputs import InputSources, recorded_sources, resolve_sources, resume_notes
from hpc.job.run_folder import (check_resumable, check_writable, lock_run_folder,
                                 newest_unfinished, run_folder)
from hpc.models.base_model import check_base
from hpc.models.loading import model_folder
from hpc.plan.registry import JobPlan, job_plan
from hpc.plan.terms import sequence_tokens
from hpc.models.quantize import check_quantize
from hpc.runtime.cli import parse_args
from hpc.runtime.config import config_to_yaml, load_config
from hpc.runtime.methods import MethodSpec
from hpc.runtime.errors import UserError
from hpc.runtime.preempt import EXIT_PREEMPTED, any_rank_signalled, startup_delay, stop_signals
from hpc.runtime.readback import run_folder_entries
from hpc.runtime.rendezvous import agree
from hpc.runtime.results import format_table
from hpc.runtime.runstore import RunStore, environment_attrs, readable
from hpc.runtime.world import World, get_world, select_device, stop_together
from hpc.toys.builtin import check_cached


def on_all_ranks(world: World, fn):
    """Run ``fn()`` on every rank; if it raises UserError on any rank, every rank stops
    (:func:`hpc.runtime.world.stop_together`: the rank(s) that saw the error re-raise it,
    printed as one line by the entry point; the others raise :class:`hpc.runtime.errors.PeerFailed`). One 1-byte
    Allgather, tag ``control``.
    """
    err = None
    result = None
    try:
        result = fn()
    except UserError as caught:
        err = caught
    stop_together(world, err)
    return result


def _job_id(world: World) -> str:
    if os.environ.get("SLURM_JOB_ID"):
        return os.environ["SLURM_JOB_ID"]
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S") if world.is_root else None
    return world.comm.bcast(stamp, root=0)  # once per job, not a hot path


def progress_bar(job: "Job", total: int, desc: str, initial: int = 0):
    """tqdm bar on rank 0 only (``run.progress``). Into a file (a Slurm log) it redraws every
    30 s instead of every step, so logs stay readable."""
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
    decoder: DecodeBackend  # the job's decoding backend, passed to whoever decodes
    sources: InputSources  # where model.path and lora.adapter lie (Hub ids resolved)
    plan: JobPlan  # the memory plan and its decisions, computed once at the start

    @property
    def run_file(self) -> str:
        return os.path.join(self.out_dir, f"{self.method}.h5")


def start_job(spec: MethodSpec, argv=None) -> Job:
    """Parse, validate and prepare a job of the method ``spec`` describes on every rank (see
    the module docstring)."""
    job_cls, method, prog = spec.job_class(), spec.name, spec.command
    # First of all (if the entry point has not already): a preemption signal during start-up
    # (model loading can take minutes) must not kill the ranks; stop_if_preempted honours it.
    signals = stop_signals()
    config_path, overrides, resume = parse_args(prog, argv)
    renamed = []  # a line per key the config gave by its old name
    cfg = load_config(job_cls, config_path, overrides, notes=renamed)
    config_text = config_to_yaml(cfg)  # as the user gave it: a Hub id, not its snapshot
    world = get_world()
    for note in renamed if world.is_root else ():
        print(note, flush=True)
    world.timeout_s = cfg.run.collective_timeout_s
    cfg.validate_world(world)
    job_id = _job_id(world)
    out_dir = run_folder(cfg.run.out, method, job_id)
    if resume and "{jobid}" in cfg.run.out and not os.environ.get("SLURM_JOB_ID"):
        # a job id of this start's time names no earlier run: take the newest unfinished one
        out_dir = world.comm.bcast(on_all_ranks(world, lambda: newest_unfinished(
            cfg.run.out, method) if world.is_root else None), root=0)
        if world.is_root:
            print(f"--resume: the newest unfinished {method} run is {out_dir}", flush=True)
    # rank 0 looks Hub ids up, so every rank loads the snapshot it found (a download on the
    # login node may move refs/main while the ranks start); a resumed run keeps its snapshot
    sources = world.comm.bcast(on_all_ranks(world, lambda: resolve_sources(
        cfg, recorded_sources(os.path.join(out_dir, f"{method}.h5")) if resume else None)
        if world.is_root else None), root=0)
    for note in sources.notes if world.is_root else ():
        print(note, flush=True)
    for note in resume_notes(os.path.join(out_dir, f"{method}.h5"), config_text) if (
            resume and world.is_root) else ():
        print(note, flush=True)
    sources.apply(cfg)
    device = on_all_ranks(world, lambda: select_device(world, cfg.model.device))
    if world.size > 1:  # before any GPU work: a bootstrap that cannot connect ends here
        world.rendezvous = agree(world, "nccl" if device.type == "cuda" else "gloo")
    on_all_ranks(world, lambda: check_quantize(cfg.model.quantize, cfg.model.dtype, device))
    on_all_ranks(world, lambda: check_cached(cfg.model.path))
    on_all_ranks(world, lambda: check_base(cfg.lora.adapter, sources.model.given,
                                           lambda _: model_folder(cfg.model.path),
                                           cfg.lora.allow_other_base))
    # the job's one plan, before any weight loads: its verdict and every decision it takes
    plan = on_all_ranks(world, lambda: job_plan(cfg, method, world.size, device.type))
    backend = on_all_ranks(world, lambda: resolve_backend(
        cfg.model.engine, cfg.model.path, sequence_tokens(cfg), cfg.model.quantize))
    decoder = make_backend(EngineConfig.from_model(cfg.model, backend, plan.engine_budget))

    def claim_folder():
        run_folder_entries(out_dir, method)  # every rank: the folder is shared
        if world.is_root:
            if resume:
                check_resumable(out_dir, method)
            check_writable(out_dir, cfg.run.min_free_mb)
            lock_run_folder(out_dir, job_id)

    on_all_ranks(world, claim_folder)
    return Job(cfg=cfg, world=world, device=device, out_dir=out_dir, resume=resume,
               config_text=config_text, method=method, signals=signals, decoder=decoder,
               sources=sources, plan=plan)


def stop_if_preempted(job: Job, after: str, store: RunStore | None = None) -> None:
    """A safe point of start-up, after ``after`` (e.g. ``"model loading"``); collective.

    If a preemption signal reached any rank since the job started, the job stops here before
    its first step: rank 0 marks the run file (``store`` once the loop has opened it, else
    ``<run.out>/<method>.h5``, created afresh unless ``--resume`` finds one) ``preempted`` with the attribute
    ``preempted_before_first_step`` true, and every rank exits with code 3, so the job is
    requeued and ``--resume`` starts it again (from its last checkpoint, or from step 0). No
    checkpoint is written: no step ran since the last one. A damaged run file is left as it
    is (the resumed run restores it from the checkpoint, or says it is damaged).
    """
    world = job.world
    startup_delay()
    if not any_rank_signalled(world, job.signals):
        return
    attrs = (dict(environment_attrs(world, job.device), **job.sources.attrs(),
                  method=job.method, config=job.config_text) if store is None else {})

    def mark_run_file():
        if not world.is_root:
            return
        marked = store
        if marked is None:
            resume = job.resume and os.path.exists(job.run_file)
            if resume and not readable(job.run_file):
                return
            marked = RunStore(job.run_file, True, attrs, resume=resume)
        marked.set_attrs(preempted_before_first_step=True)
        marked.close("preempted")

    # Its agreement also keeps every rank here until the file is written: a launcher kills
    # the other ranks as soon as one exits non-zero.
    on_all_ranks(world, mark_run_file)
    if world.is_root:
        print(f"preempted during start-up, after {after}, before the first step: run file "
              f"marked; exiting with code {EXIT_PREEMPTED} so the job is requeued and resumes",
              flush=True)
    sys.exit(EXIT_PREEMPTED)


def finish(job: Job, summary: dict, start_label: str, end_label: str) -> None:
    """End a training job: exit 3 if it was preempted, else print (rank 0) the held-out table
    of the start and the end of the run and the run folder."""
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
