"""The job loop every training method runs (SFT, ESSA, F-GRPO): the lifecycle, written once.

A method is a :class:`Method`: its timed phases, a ``step(i)`` returning named metrics, its
state for checkpoints, its evaluation and its export. :func:`run_loop` does the rest, the same
for every method:

1. resume: load the newest intact checkpoint (``--resume``) whose fields all pass their checks
   (:func:`resume_fields`, the method's ``load_state_dict``; else the previous one) and check
   every rank resumes from the same step;
2. run file ``<run.out>/<method>.h5``: open (restored from the checkpoint's copy on resume),
   drop rows after the resumed step (every row when it starts from step 0); its attributes
   name the method's phases, metrics and what a step is called, so readers need not know the
   method; rank 0 sends its scalars to ``run.report_to`` too (TensorBoard, W&B:
   :mod:`hpc.runtime.report_to`);
3. evaluation at the start (not on resume), a held-out evaluation every ``eval.every`` steps
   and at the last step, a final evaluation at the end. A preemption signal during start-up
   (:class:`Method` construction, model loading, the start evaluation) stops the job before
   its first step at the next safe point (:func:`hpc.job.lifecycle.stop_if_preempted`);
4. per step: phase seconds per rank, payload bytes per tag and the loop's metrics (tokens
   generated, training and wall seconds), whether a rank's decoding engine failed its
   CUDA-graph self-check (:func:`share_graph_check`, also after the final evaluation), then
   the stop decision (preemption signal on any
   rank; ``run.max_time_s`` or ``run.max_train_s`` on rank 0's clock; the method's target;
   ``run.max_generated_tokens``),
   then a checkpoint every ``run.checkpoint_every`` steps, on stop and at the end. The step's
   row goes out before its checkpoint: a kill in between leaves a row that the resumed run
   truncates and recomputes, never a checkpoint without its row;
5. preempted: close the run file as ``preempted`` and return (the caller exits 3); else the
   final evaluation, the export (rank 0; every rank for a ``collective_export`` method, whose
   export gathers sharded weights), and the run file closed as ``complete``.

Checkpoints hold ``{"step", "elapsed_s", "overhead_s", "generated_tokens", "run_file",
"method": method.state_dict(), "sharded"}``; a :attr:`Method.sharded` method's sharded state
(FSDP2's DTensors) goes through ``torch.distributed.checkpoint`` into a folder written by every
rank before it (:mod:`hpc.runtime.distckpt`), ``sharded`` its manifest (None: no such state).
The checkpoint commits that folder; on resume its files are verified (a damaged one: the
previous checkpoint) and read resharded over this job's ranks, so every method resumes on any
rank count. The run file's group ``segments`` has one row per start or resume: the step it
started from and its ``world_size``.
"""
from __future__ import annotations

import abc
import json
import sys
import time

import numpy as np
import torch

from hpc.models.loading import model_folder
from hpc.models.quantize import quantized_linears
from hpc.runtime.checkpoint import load_latest, save_checkpoint
from hpc.runtime.distckpt import (check_manifest, load_sharded, prune_sharded, save_sharded,
                                   verify_sharded)
from hpc.runtime.errors import UserError
from hpc.job.lifecycle import (Job, agree_on_resume_step, on_all_ranks, progress_bar,
                             stop_if_preempted)
from hpc.runtime.preempt import pause_after_step, preempted_exit, should_stop
from hpc.runtime.readback import amount, count
from hpc.runtime.report_to import open_reporters
from hpc.runtime.results import EvalResult, log_eval
from hpc.runtime.runstore import RunStore, check_snapshot, environment_attrs
from hpc.runtime.timing import PhaseTimer, gather_timings
from hpc.models.folders import BUILT_IN_MODELS
from hpc.toys.cache import build_words

# What a phase's seconds are spent on, for readers of the run file (hpc-report, hpc-scaling):
PHASE_KINDS = ("rollout",        # producing and scoring completions (decoding, rewards)
               "train",          # forward/backward passes
               "update",         # optimizer step
               "waiting",        # at a barrier for the slowest rank
               "communication",  # in a collective
               "eval", "checkpoint")
LOOP_PHASES = {"eval": "eval", "checkpoint": "checkpoint"}  # the loop's own phases
# The loop's own metrics, cumulative from the start of the run: completion tokens the training
# steps decoded (all ranks), training seconds (wall less evaluations and checkpoints), wall.
LOOP_METRICS = ("generated_tokens", "train_s", "wall_s")


class Method(abc.ABC):
    """What a training method gives :func:`run_loop`. Subclasses set the class attributes and
    the attributes of ``__init__`` and implement the methods that raise here.

    ``__init__`` sets ``model`` (the job's model, whose quantised linears the run file counts)
    and is the first start-up safe point for preemption; a method calls
    :func:`hpc.job.lifecycle.stop_if_preempted` again after each slow stage (model, adapter).

    The loop sets ``store`` (the :class:`RunStore`) and ``timer`` (a :class:`PhaseTimer` of
    :attr:`phases` plus ``eval`` and ``checkpoint``) before the first step; a step times its
    phases with ``self.timer.phase(name)`` and may write rows of its own groups to the store.
    """

    step_name: str = "step"      # what one step is called in the method's own words
    phases: dict = {}            # {phase: kind in PHASE_KINDS}, in the order of a step
    heldout_accuracy: str = "accuracy"  # the held-out column that accuracy curves follow
    metrics: tuple = ()          # names of step()'s metrics, in order
    sharded: bool = False        # part of the state is sharded (sharded_state_dict)
    collective_export: bool = False  # export() runs on every rank (it gathers), writes on 0
    final_evaluation: bool = False  # set by run_loop before the final evaluation

    def __init__(self, job: Job):
        stop_if_preempted(job, "the job's start (world, run folder)")
        self.job = job
        self.total_steps: int = 0
        self.keep_checkpoints: int = 3
        self.store: RunStore | None = None
        self.timer: PhaseTimer | None = None

    def attrs(self) -> dict:
        """Method-specific run-file attributes (sizes of the problem)."""
        return {}

    @abc.abstractmethod
    def step(self, i: int) -> dict:
        """Run step ``i`` (0-based; logged as step i + 1); returns {metric name: float}."""

    @abc.abstractmethod
    def heldout(self) -> dict:
        """The periodic held-out evaluation after a step: {column: value} of group heldout."""

    def target_reached(self, heldout: dict) -> bool:
        """True to stop after this held-out evaluation (a target accuracy)."""
        return False

    def step_decode(self) -> tuple:
        """(rows, members) a step's decoding asks the engine for at once ((0, 1): none)."""
        return (0, 1)

    def next_decode(self) -> tuple:
        """(rows, members) of the decoding after an evaluation, whose engine the evaluation
        may keep (:meth:`hpc.engine.engine_backend.EngineBackend.end_phase`): a step's, or none after the final
        evaluation (the export decodes nothing)."""
        return (0, 1) if self.final_evaluation else self.step_decode()

    @abc.abstractmethod
    def evaluate(self, sampled: bool) -> EvalResult:
        """The full evaluation of the current model (start and end of the run)."""

    @abc.abstractmethod
    def export(self, out_dir: str, step: int) -> None:
        """Write the result after ``step`` steps into ``out_dir`` (rank 0 only; on every rank
        when :attr:`collective_export`, writing on rank 0)."""

    @abc.abstractmethod
    def state_dict(self) -> dict:
        """Everything a resumed run needs, as nested dicts of tensors, arrays and scalars."""

    @abc.abstractmethod
    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned."""

    def sharded_state_dict(self) -> dict:
        """Collective, when :attr:`sharded`: the sharded part of the state as this job holds it
        (nested dicts of DTensors, as ``torch.distributed.checkpoint.state_dict.get_state_dict``
        returns). Saved with DCP; on resume it is the template filled in place, resharded from
        the rank count that wrote it, then given to :meth:`load_sharded_state_dict`."""
        return {}

    def load_sharded_state_dict(self, state: dict) -> None:
        """Collective: restore the filled template of :meth:`sharded_state_dict`."""


def run_attrs(job: Job, method: Method) -> dict:
    """The run file's attributes: environment, config, and the method's own vocabulary."""
    phases = dict(method.phases, **LOOP_PHASES)
    unknown = set(phases.values()) - set(PHASE_KINDS)
    if unknown:
        raise ValueError(f"{job.method}: phase kinds {sorted(unknown)} not in {PHASE_KINDS}")
    return dict(environment_attrs(job.world, job.device), **job.sources.attrs(),
                method=job.method, config=job.config_text, step_name=method.step_name,
                phases=json.dumps(phases), metrics=json.dumps(list(method.metrics) + list(LOOP_METRICS)),
                heldout_accuracy=method.heldout_accuracy, preempted_before_first_step=False,
                model_build=model_build(job.cfg.model.path), **job.plan.attrs(),
                decode_backend=job.decoder.name, decode_backend_version=job.decoder.version(),
                quantized_linears=quantized_linears(method.model), **method.attrs())


def model_build(path: str) -> str:
    """The build of a built-in model (:func:`hpc.toys.cache.build_words` of its cached folder,
    loaded by now), '' for a model of the user's: results files name the toy build they ran."""
    return build_words(model_folder(path)) if path in BUILT_IN_MODELS else ""


def resume_fields(state: dict, path: str) -> dict:
    """The loop's own fields of checkpoint ``path``, each checked for type and range
    (:mod:`hpc.runtime.readback`; fields of earlier versions' checkpoints default to 0)."""
    source = f"checkpoint {path}"
    fields = {"step": count(state["step"], source, "step"),
              "elapsed_s": amount(state["elapsed_s"], source, "elapsed_s"),
              "overhead_s": amount(state.get("overhead_s", 0.0), source, "overhead_s"),
              "generated_tokens": count(state.get("generated_tokens", 0), source,
                                        "generated_tokens", maximum=2 ** 62),
              "shard_ranks": count(state.get("shard_ranks", 0), source, "shard_ranks",
                                   maximum=2 ** 20),
              "sharded": state.get("sharded"),
              "run_file": state.get("run_file")}
    if fields["sharded"] is not None:
        check_manifest(fields["sharded"], source, fields["step"])
    if fields["run_file"] is not None:
        check_snapshot(fields["run_file"], source)
    return fields


def share_graph_check(world, decoder, store: RunStore,
                      failed: np.ndarray | None = None) -> bool:
    """Collective: when the decoding engine's self-check failed on any rank
    (``decoder.graph_failure``, :class:`hpc.engine.engine_backend.EngineBackend`), CUDA graphs go off on
    every rank, rank 0 prints one line and the run file gets the attribute
    ``cuda_graphs_disabled`` (the rank and the reason). ``failed``: each rank's flag (size,)
    when already gathered (the loop sends it with a step's token count), else gathered here.
    Returns whether graphs went off."""
    if failed is None:
        failed = world.allgather(np.array([bool(decoder.graph_failure)], dtype=np.int8),
                                 tag="control")
    if not failed.any():
        return False
    rank = int(np.flatnonzero(failed)[0])
    message = f"rank {rank}: " + world.comm.bcast(decoder.graph_failure, root=rank)  # once
    decoder.disable_graphs(message, replace=True)  # every rank keeps the failing rank's reason
    if world.is_root:
        print(f"warning: the decoding engine's CUDA-graph self-check failed on {message}; CUDA "
              f"graphs are off for the rest of the run (decoding goes on eagerly)",
              file=sys.stderr, flush=True)
    store.set_attrs(cuda_graphs_disabled=message)
    return True


def out_of_budget(run_cfg, wall_s: float, train_s: float) -> bool:
    """Whether ``run.max_time_s`` (wall) or ``run.max_train_s`` (wall less evaluations and
    checkpoints) is spent; the loop asks on rank 0's clock, which decides for every rank."""
    return (0 < run_cfg.max_time_s <= wall_s) or (0 < run_cfg.max_train_s <= train_s)


def _due(every: int, step: int, total: int) -> bool:
    return bool(every) and step % every == 0 or step == total


def _check_parallelism(ckpt_dir: str, method: Method, fields: dict) -> None:
    """One line when checkpoint ``fields`` cannot be resumed by ``method``: another parallelism
    wrote it, or an earlier version's per-rank shards (``shard_ranks``) hold its weights."""
    if fields["shard_ranks"]:
        raise UserError(f"the checkpoint of step {fields['step']} in {ckpt_dir} holds per-rank "
                        f"shards of an earlier version ({fields['shard_ranks']} ranks); resume "
                        f"it with the version that wrote it")
    if (fields["sharded"] is not None) != method.sharded:
        written = "sharded (fsdp2)" if fields["sharded"] else \
            "replicated (ddp)"
        raise UserError(f"the checkpoint of step {fields['step']} in {ckpt_dir} holds a "
                        f"{written} state; resume with the parallelism that wrote it")


class _NoFallback(Exception):
    """Carries the UserError of a checkpoint whose predecessors cannot help either (another
    parallelism wrote the run) past :func:`load_latest`, which tries the previous one."""


def resume(job: Job, method: Method, ckpt_dir: str) -> dict:
    """Collective: the loop's fields of the newest usable checkpoint (step 0 ones without
    any), its method state restored. A checkpoint whose sharded folder fails verification is
    skipped like a damaged one (a warning, then the previous)."""
    world = job.world
    resumed = dict(step=0, elapsed_s=0.0, overhead_s=0.0, generated_tokens=0, shard_ranks=0,
                   sharded=None, run_file=None)
    damaged = {}  # step -> why its sharded folder is unusable

    def accept(state: dict, path: str) -> None:  # a UserError: load_latest tries the previous
        fields = resume_fields(state, path)
        if fields["step"] in damaged:
            raise UserError(f"checkpoint {path}: its sharded state is unusable: "
                            f"{damaged[fields['step']]}")
        try:
            _check_parallelism(ckpt_dir, method, fields)
        except UserError as err:
            raise _NoFallback(err) from None
        method.load_state_dict(state["method"])
        resumed.update(fields)

    if not job.resume:
        return resumed
    while _latest(ckpt_dir, world, accept) is not None and resumed["sharded"] is not None:
        reason = verify_sharded(ckpt_dir, world, resumed["sharded"])
        if reason is None:
            template = method.sharded_state_dict()
            on_all_ranks(world, lambda: load_sharded(ckpt_dir, resumed["sharded"], template,
                                                     resumed["step"]))
            method.load_sharded_state_dict(template)
            break
        damaged[resumed["step"]] = reason  # the next pass warns and tries the previous
    return resumed


def _latest(ckpt_dir: str, world, accept) -> dict | None:
    try:
        return load_latest(ckpt_dir, warn=world.is_root, accept=accept)
    except _NoFallback as stop:
        raise stop.args[0] from None


def save(job: Job, method: Method, ckpt_dir: str, step: int, fields: dict) -> None:
    """Collective: the checkpoint of ``step``, the sharded state (every rank) before the
    checkpoint holding ``fields`` and the method state (rank 0), which commits it; then the
    retention of both formats."""
    world = job.world
    manifest = save_sharded(ckpt_dir, world, step, method.sharded_state_dict()) \
        if method.sharded else None
    if world.is_root:
        save_checkpoint(ckpt_dir, step, dict(fields, method=method.state_dict(),
                                             sharded=manifest),
                        keep=method.keep_checkpoints)
        if method.sharded:
            prune_sharded(ckpt_dir)


def record_device_peaks(job: Job, store: RunStore, attr: str) -> None:
    """Collective on CUDA: every rank's ``torch.cuda.max_memory_allocated`` so far, stored by
    rank 0 as the run file's attribute ``attr`` (JSON list of bytes, rank order), beside the
    job's plan (``plan``); nothing on other devices."""
    if job.device.type != "cuda":
        return
    peaks = job.world.allgather(np.array([torch.cuda.max_memory_allocated(job.device)],
                                         dtype=np.int64), tag="control")
    store.set_attrs(**{attr: json.dumps([int(p) for p in np.ravel(peaks)])})


def run_loop(job: Job, method: Method) -> dict:
    """Run ``method`` for ``job`` (see the module docstring); returns on every rank a summary:
    ``start`` and ``final`` (EvalResult or None), ``steps``, ``wall_s``, ``preempted``."""
    cfg, world, decoder = job.cfg, job.world, job.decoder
    ckpt_dir = f"{job.out_dir}/checkpoints"
    resumed = resume(job, method, ckpt_dir)
    start, elapsed0 = resumed["step"], resumed["elapsed_s"]
    overhead, tokens = resumed["overhead_s"], resumed["generated_tokens"]
    agree_on_resume_step(world, start)
    attrs = run_attrs(job, method)
    store = on_all_ranks(world, lambda: RunStore(
        f"{job.out_dir}/{job.method}.h5", world.is_root, attrs, resume=job.resume,
        backup=resumed["run_file"]))
    store.reporters = on_all_ranks(world, lambda: open_reporters(
        cfg.run.report_to, job.out_dir, job.method, job.config_text,
        start if job.resume else None) if world.is_root else [])
    store.truncate_after(start if start else None)
    if job.resume:
        store.replay()  # the reporters start over from the rows the run file kept
    store.write_row("segments", start, world_size=world.size)
    record_device_peaks(job, store, "memory_load_peak")  # the load is done by now
    # A lost rank (a node gone mid-run): rank 0 names it in the run file before the abort.
    world.abort_hooks.append(lambda message, lost: store.mark_lost(world.hosts, lost, message))
    sync = torch.cuda.synchronize if job.device.type == "cuda" else None
    method.store, method.timer = store, PhaseTimer(list(method.phases) + list(LOOP_PHASES), sync)
    timer = method.timer
    start_eval = method.evaluate(sampled=True) if start == 0 else None
    if start_eval is not None:
        log_eval(store, -1, start_eval)
    stop_if_preempted(job, "resuming" if start_eval is None else "the start evaluation", store)
    total = method.total_steps
    progress = progress_bar(job, total, f"{job.method} [{job.decoder.name}]", initial=start)
    t0 = time.perf_counter() - elapsed0
    step, preempted, graphs_off = start, False, False
    world.take_bytes()  # start-up traffic (bootstrap, start evaluation) is not a step's
    while step < total:
        decoder.take_generated_tokens()  # what evaluations decoded is not a step's
        metrics = method.step(step)
        step += 1
        # with the tokens, whether this rank's engine self-check failed (until graphs are off)
        # and whether a time budget is spent (rank 0's answer decides)
        train_s, wall_s = time.perf_counter() - t0 - overhead, time.perf_counter() - t0
        sent = [decoder.take_generated_tokens(), not graphs_off and bool(decoder.graph_failure),
                out_of_budget(cfg.run, wall_s, train_s)]
        gathered = world.allgather(np.array(sent, dtype=np.int64), tag="control")
        tokens += int(gathered[:, 0].sum())
        graphs_off = graphs_off or share_graph_check(world, decoder, store, gathered[:, 1])
        metrics.update(generated_tokens=tokens, train_s=train_s, wall_s=wall_s)
        # the last step is evaluated whether the step count or a budget ends the run
        last = bool(gathered[0, 2]) or 0 < cfg.run.max_generated_tokens <= tokens
        reached = False
        if _due(cfg.eval.every, step, total) or last:
            begin = time.perf_counter()
            with timer.phase("eval"):
                row = method.heldout()
            overhead += time.perf_counter() - begin
            store.write_row("heldout", step, flush=False, wall_s=time.perf_counter() - t0,
                            train_s=metrics["train_s"], generated_tokens=tokens, **row)
            reached = method.target_reached(row)
        every = cfg.eval.sampled_every
        if every and step % every == 0 and step != total and not last:  # the end's: below
            begin = time.perf_counter()
            with timer.phase("eval"):
                log_eval(store, step, method.evaluate(sampled=True))
            overhead += time.perf_counter() - begin
        stop, preempted = should_stop(world, job.signals, out_of_budget(
            cfg.run, time.perf_counter() - t0, time.perf_counter() - t0 - overhead))
        stop = stop or reached or 0 < cfg.run.max_generated_tokens <= tokens
        store.log_step(step, metrics=metrics, timings=gather_timings(world, timer),
                       nbytes=world.take_bytes())
        pause_after_step(step, world.rank)  # tests only: a kill at a known step
        if _due(cfg.run.checkpoint_every, step, total) or stop:
            begin = time.perf_counter()
            with timer.phase("checkpoint"):
                save(job, method, ckpt_dir, step, {
                    "step": step, "elapsed_s": time.perf_counter() - t0,
                    "overhead_s": overhead + time.perf_counter() - begin,
                    "generated_tokens": tokens, "run_file": store.snapshot()})
            overhead += time.perf_counter() - begin
        progress.update(1)
        progress.set_postfix({name: f"{metrics[name]:.3f}" for name in method.metrics[:1]},
                             refresh=False)
        if stop:
            break
    progress.close()
    wall = time.perf_counter() - t0
    if preempted:
        decoder.close()
        return preempted_exit(world, store, step, wall)
    method.final_evaluation = True  # its engine goes at its end: the export decodes nothing
    final = method.evaluate(sampled=True)
    log_eval(store, step, final)
    if not graphs_off:
        share_graph_check(world, decoder, store)
    if world.is_root or method.collective_export:
        method.export(job.out_dir, step)
    decoder.close()
    store.set_attrs(steps_done=step, wall_seconds=wall)
    record_device_peaks(job, store, "memory_job_peak")
    store.close("complete")
    return {"start": start_eval, "final": final, "steps": step, "wall_s": wall,
            "preempted": False}
