"""The ESSA step, top to bottom: ask, score my members, gather fitness, tell.

Every rank holds an identical optimizer (same seed, same fitness), so each generation only the
fitness vector (8 bytes a member) crosses the network, plus the per-rank phase timings and a
1-byte stop flag. The job lifecycle (resume, run file, evaluations, checkpoints, preemption)
is :func:`hpc.job.loop.run_loop`'s. Run files: ``<run.out>/essa.h5``, ``checkpoints/``,
``adapter-mean`` and ``adapter-best`` (peft format).
"""
from __future__ import annotations

import numpy as np

from essa.method import METHOD
from essa.optimizers import Tracked, make_optimizer
from essa.population import ScoringRequest, minibatch_indices, owners, score_members
from hpc.models.adapter_space import LoraEntrySpace, SingularValueSpace
from hpc.data.tasks import job_task
from hpc.evaluate import evaluate
from hpc.models.loading import load_adapter, load_model
from hpc.runtime.errors import UserError, user_errors_exit
from hpc.job.lifecycle import finish, on_all_ranks, start_job, stop_if_preempted
from hpc.job.loop import Method, run_loop
from hpc.runtime.world import split_evenly

PHASES = {"rebuild": "rollout", "generate": "rollout", "reward": "rollout",
          "waiting": "waiting", "communication": "communication", "update": "update"}


def gather_fitness(world, mine: np.ndarray, population: int, timer,
                   timeout_s: float = 600.0) -> np.ndarray:
    """All members' fitness on every rank (float64 (P,)); time spent waiting for stragglers
    (a barrier with a deadline) is charged apart from the transfer itself."""
    with timer.phase("waiting"):
        world.arrive("fitness exchange", timeout_s)
    with timer.phase("communication"):
        return world.allgatherv(mine, split_evenly(population, world.size), tag="fitness")


class ESSA(Method):
    """CMA-ES (or OpenAI-ES) over the adapter's singular values; a step is a generation."""

    step_name, phases, heldout_accuracy = "generation", PHASES, "mean_accuracy"

    def __init__(self, job):
        super().__init__(job)
        cfg, world = job.cfg, job.world
        e = self.e = cfg.essa
        self.task = on_all_ranks(world, lambda: job_task(cfg, job.device))
        if len(self.task.train) == 0 or len(self.task.eval) == 0:
            raise UserError(f"task {cfg.task.name} has an empty training or held-out split")
        self.model, self.tok = on_all_ranks(world, lambda: load_model(
            cfg.model.path, cfg.model.dtype, job.device, load=cfg.model.load,
            wrap=lambda base: load_adapter(base, cfg.lora.adapter), quantize=cfg.model.quantize))
        stop_if_preempted(job, "model and adapter loading")
        self.space = on_all_ranks(world, lambda: SingularValueSpace.from_peft(
            self.model, e.alpha, cfg.lora.targets) if e.space == "sv" else
            LoraEntrySpace.from_peft(self.model))
        sv = self.space.singular_values() if e.sigma_scale == "relative" else None
        stds = None if sv is None else np.maximum(sv, 1e-3 * sv.max())
        self.opt = Tracked(make_optimizer(e.optimizer, self.space.dim, e.population, e.sigma0,
                                          cfg.run.seed, e.lr, stds=stds))
        self.who = owners(e.population, world.size)
        self.my_members = np.flatnonzero(self.who == world.rank)
        self.metrics = ("fitness_mean", "fitness_max", "fitness_min", "bad_fitness") + (
            ("sigma",) if self.opt.sigma is not None else ())
        self.total_steps, self.keep_checkpoints = e.generations, e.keep_checkpoints
        self.best_of_generation = self.opt.mean

    def attrs(self) -> dict:
        return {"search_dim": self.space.dim, "population": self.e.population}

    def step(self, i: int) -> dict:
        cfg, task, timer = self.job.cfg, self.task, self.timer
        with timer.phase("update"):
            X = self.opt.ask()
        batch = minibatch_indices(len(task.train), self.e.minibatch, cfg.run.seed, i)
        request = ScoringRequest(X[self.my_members], [task.train.prompts[j] for j in batch],
                                 [task.train.answers[j] for j in batch],
                                 cfg.task.max_new_tokens, cfg.model.decode_batch,
                                 self.e.members_per_pass)
        mine = score_members(self.model, self.tok, self.space, task, request,
                             decoder=self.job.decoder, timer=timer)
        fitness = gather_fitness(self.job.world, mine, self.e.population, timer,
                                 cfg.run.collective_timeout_s)
        with timer.phase("update"):
            fitness = self.opt.tell(X, fitness)
        self.best_of_generation = X[int(fitness.argmax())]
        self.store.write_row("essa", i + 1, flush=False, fitness=fitness, evaluated_by=self.who)
        metrics = {"fitness_mean": fitness.mean(), "fitness_max": fitness.max(),
                   "fitness_min": fitness.min(), "bad_fitness": self.opt.bad_fitness}
        if self.opt.sigma is not None:
            metrics["sigma"] = float(self.opt.sigma)
        return metrics

    def _evaluate(self, x: np.ndarray, sampled: bool):
        cfg = self.job.cfg
        self.space.apply(self.model, x)
        return evaluate(self.model, self.tok, self.task, self.task.eval, cfg.eval,
                        cfg.task.max_new_tokens, self.job.world, self.job.decoder,
                        seed=cfg.run.seed, sampled=sampled, next_decode=self.next_decode())

    def step_decode(self) -> tuple:
        """A scoring pass: k members x min(model.decode_batch, essa.minibatch) rows."""
        k = max(1, min(self.e.members_per_pass, len(self.my_members)))
        return min(self.job.cfg.model.decode_batch, self.e.minibatch) * k, k

    def evaluate(self, sampled: bool):
        return self._evaluate(self.opt.mean, sampled)

    def heldout(self) -> dict:
        return {"mean_accuracy": self._evaluate(self.opt.mean, False).accuracy,
                "best_accuracy": self._evaluate(self.best_of_generation, False).accuracy}

    def target_reached(self, heldout: dict) -> bool:
        return 0 < self.e.target_accuracy <= heldout["mean_accuracy"]

    def export(self, out_dir: str, step: int) -> None:
        self.space.export_adapter(self.model, self.opt.mean, f"{out_dir}/adapter-mean")
        self.space.export_adapter(self.model, self.opt.best_x, f"{out_dir}/adapter-best")
        self.store.write_row("final", step, mean=self.opt.mean,
                             best=self.opt.best_x, best_fitness=self.opt.best_fitness)

    def state_dict(self) -> dict:
        return self.opt.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.opt.load_state_dict(state)


@user_errors_exit
def main(argv=None):
    """``essa [CONFIG.yaml] [key=value ...] [--resume]`` under mpirun/srun (or alone)."""
    job = start_job(METHOD, argv)
    finish(job, run_loop(job, ESSA(job)), "sft start", "essa mean")
