"""The ESSA training loop, top to bottom: ask, score my members, gather fitness, tell.

Every rank holds an identical optimizer (same seed, same fitness), so each generation only the
fitness vector (8 bytes a member) crosses the network, plus the per-rank phase timings and a
1-byte stop flag. Run files: ``<run.out>/essa.h5``, ``checkpoints/``, ``adapter-mean`` and
``adapter-best`` (peft format).
"""
from __future__ import annotations

import time

import numpy as np
import torch

from essa.config import ESSAJobConfig
from essa.optimizers import make_optimizer
from essa.population import minibatch_indices, owners, score_members
from essa.space import LoraEntrySpace, SingularValueSpace
from hpc.runtime.checkpoint import load_latest, save_checkpoint
from hpc.runtime.errors import UserError, user_errors_exit
from hpc.evaluate import evaluate, log_eval
from hpc.runtime.job import agree_on_resume_step, finish, on_all_ranks, progress_bar, start_job
from hpc.models.loading import load_adapter, load_model
from hpc.runtime.preempt import preempted_exit, should_stop
from hpc.runtime.runstore import RunStore, environment_attrs
from hpc.data.tasks import load_task
from hpc.runtime.timing import PhaseTimer, gather_timings
from hpc.runtime.world import split_evenly

PHASES = ["rebuild", "generate", "reward", "waiting", "communication", "update", "eval",
          "checkpoint"]


def gather_fitness(world, mine: np.ndarray, population: int, timer,
                   timeout_s: float) -> np.ndarray:
    """All members' fitness on every rank (float64 (P,)); time spent waiting for stragglers
    (a barrier with a deadline) is charged apart from the transfer itself."""
    with timer.phase("waiting"):
        world.arrive("fitness exchange", timeout_s)
    with timer.phase("communication"):
        return world.allgatherv(mine, split_evenly(population, world.size), tag="fitness")


def sanitize(fitness: np.ndarray) -> tuple:
    """Replace NaN/inf fitness by the worst finite value minus 1; returns (fitness, n_bad)."""
    bad = ~np.isfinite(fitness)
    if not bad.any():
        return fitness, 0
    worst = fitness[~bad].min() if (~bad).any() else 0.0
    out = fitness.copy()
    out[bad] = worst - 1.0
    return out, int(bad.sum())


def run(job) -> dict:
    """Train ESSA for ``job`` (a :class:`hpc.runtime.job.Job`); returns a summary on every rank."""
    cfg, world = job.cfg, job.world
    e = cfg.essa
    task = on_all_ranks(world, lambda: load_task(cfg.task, cfg.model.path))
    if len(task.train) == 0 or len(task.eval) == 0:
        raise UserError(f"task {cfg.task.name} has an empty training or held-out split")
    base, tok = on_all_ranks(world, lambda: load_model(cfg.model.path, cfg.model.dtype,
                                                       job.device))
    model = on_all_ranks(world, lambda: load_adapter(base, cfg.lora.adapter))
    space_cls = SingularValueSpace if e.space == "sv" else LoraEntrySpace
    space = on_all_ranks(world, lambda: space_cls.from_peft(model, e.alpha, cfg.lora.targets)
                         if e.space == "sv" else space_cls.from_peft(model))
    stds = (np.maximum(space.singular_values(), 1e-3 * space.singular_values().max())
            if e.sigma_scale == "relative" else None)
    opt = make_optimizer(e.optimizer, space.dim, e.population, e.sigma0, cfg.run.seed, e.lr,
                         stds=stds)
    signals = job.signals
    ckpt_dir = f"{job.out_dir}/checkpoints"
    state = load_latest(ckpt_dir, warn=world.is_root) if job.resume else None
    start_gen, elapsed0 = 0, 0.0
    best_x, best_fit = opt.mean.copy(), -np.inf
    if state is not None:
        opt.load_state_dict(state["optimizer"])
        start_gen, elapsed0 = state["generation"], state["elapsed_s"]
        best_x, best_fit = state["best_x"], state["best_fitness"]
    agree_on_resume_step(world, start_gen)
    attrs = dict(environment_attrs(world, job.device), method="essa", config=job.config_text,
                 search_dim=space.dim, population=e.population)
    store = on_all_ranks(world, lambda: RunStore(
        f"{job.out_dir}/essa.h5", world.is_root, attrs, resume=job.resume,
        backup=state.get("run_file") if state else None))
    store.truncate_after(start_gen)
    sync = torch.cuda.synchronize if job.device.type == "cuda" else None
    timer = PhaseTimer(PHASES, sync=sync)
    who = owners(e.population, world.size)
    my_members = np.flatnonzero(who == world.rank)
    max_new = cfg.task.max_new_tokens

    def held_out(x, sampled=False):
        space.apply(model, x)
        return evaluate(model, tok, task, task.eval, cfg.eval, max_new, world,
                        seed=cfg.run.seed, sampled=sampled)

    start_eval = held_out(opt.mean, sampled=True) if start_gen == 0 else None
    if start_eval is not None:
        log_eval(store, -1, start_eval)
    progress = progress_bar(job, e.generations, "essa", initial=start_gen)
    t0 = time.perf_counter() - elapsed0
    gen, preempted = start_gen, False
    world.take_bytes()  # start-up traffic (bootstrap, start evaluation) is not a generation's
    while gen < e.generations:
        with timer.phase("update"):
            X = opt.ask()
        batch = minibatch_indices(len(task.train), e.minibatch, cfg.run.seed, gen)
        prompts = [task.train.prompts[i] for i in batch]
        answers = [task.train.answers[i] for i in batch]
        mine = score_members(model, tok, space, X[my_members], task, prompts, answers,
                             max_new, cfg.eval.batch_size, timer, e.members_per_pass)
        fitness, n_bad = sanitize(gather_fitness(world, mine, e.population, timer,
                                                   cfg.run.collective_timeout_s))
        with timer.phase("update"):
            opt.tell(X, fitness)
        gen += 1
        if fitness.max() > best_fit:
            best_fit, best_x = float(fitness.max()), X[int(fitness.argmax())].copy()
        metrics = {"fitness_mean": fitness.mean(), "fitness_max": fitness.max(),
                   "fitness_min": fitness.min(), "bad_fitness": n_bad,
                   "wall_s": time.perf_counter() - t0}
        if getattr(opt, "sigma", None) is not None:
            metrics["sigma"] = float(opt.sigma)
        store.write_row("essa", gen, flush=False, fitness=fitness, evaluated_by=who)
        reached = False
        if cfg.eval.every and gen % cfg.eval.every == 0 or gen == e.generations:
            with timer.phase("eval"):
                res_mean = held_out(opt.mean)
                res_best = held_out(X[int(fitness.argmax())])
            store.write_row("heldout", gen, flush=False, mean_accuracy=res_mean.accuracy,
                            best_accuracy=res_best.accuracy, wall_s=time.perf_counter() - t0)
            reached = e.target_accuracy > 0 and res_mean.accuracy >= e.target_accuracy
        stop, preempted = should_stop(world, signals, cfg.run.max_time_s > 0 and
                                      time.perf_counter() - t0 >= cfg.run.max_time_s)
        stop = stop or reached
        # The row goes out before the checkpoint: a kill in between leaves a row that the
        # resumed run truncates and recomputes, never a checkpoint without its row.
        store.log_step(gen, metrics=metrics, timings=gather_timings(world, timer),
                       nbytes=world.take_bytes())
        if cfg.run.checkpoint_every and gen % cfg.run.checkpoint_every == 0 or stop or \
                gen == e.generations:
            with timer.phase("checkpoint"):
                if world.is_root:
                    save_checkpoint(ckpt_dir, gen, {"generation": gen,
                                                    "optimizer": opt.state_dict(),
                                                    "elapsed_s": time.perf_counter() - t0,
                                                    "best_x": best_x, "best_fitness": best_fit,
                                                    "run_file": store.snapshot()},
                                    keep=e.keep_checkpoints)
        progress.update(1)
        progress.set_postfix(fit=f"{fitness.mean():.3f}", refresh=False)
        if stop:
            break
    progress.close()
    wall = time.perf_counter() - t0
    if preempted:
        return preempted_exit(world, store, gen, wall)
    final_mean = held_out(opt.mean, sampled=True)
    log_eval(store, gen, final_mean)
    if world.is_root:
        space.export_adapter(model, opt.mean, f"{job.out_dir}/adapter-mean")
        space.export_adapter(model, best_x, f"{job.out_dir}/adapter-best")
    store.write_row("final", gen, mean=opt.mean, best=best_x, best_fitness=best_fit)
    store.set_attrs(generations_done=gen, wall_seconds=wall)
    store.close("complete")
    return {"start": start_eval, "final": final_mean, "steps": gen, "wall_s": wall,
            "preempted": False}


@user_errors_exit
def main(argv=None):
    """``essa [CONFIG.yaml] [key=value ...] [--resume]`` under mpirun/srun (or alone)."""
    job = start_job(ESSAJobConfig, "essa", "essa", argv)
    finish(job, run(job), "sft start", "essa mean")
