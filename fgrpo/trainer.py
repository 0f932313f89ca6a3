"""The F-GRPO step, top to bottom: rollout, reward, then :func:`fgrpo.step.train_on_rollouts`
(focal advantages, PPO epochs of mini-batch updates: loss, all-reduce, AdamW).

Data parallel: every rank draws the same global batch of prompts from the shared seed and keeps
its contiguous share, samples G completions per prompt (DAPO's dynamic sampling refills the
batch, :mod:`fgrpo.sampling`), and computes its groups' advantages locally (a group never
spans ranks). Completions are keyed by (step, sampling round, the prompt's position in the
round's global batch, sample index) (:mod:`hpc.models.sampling`), so the rollouts, and with
them the run, do not depend on the rank count up to the order of floating-point sums: a run
resumed on another number of ranks goes on as it would have. The loss follows the normaliser contract of
:mod:`fgrpo.loss`, so the all-reduced gradient equals the single-process gradient on the union
of all ranks' rollouts. Building, sharding, decoding, exporting and checkpointing the policy is
:class:`fgrpo.policy.TrainedPolicy`'s; the job lifecycle is :func:`hpc.job.loop.run_loop`'s.
Run files: ``<run.out>/fgrpo.h5``, ``checkpoints/``, ``adapter`` (LoRA) or ``model`` (full
fine-tuning: a ``save_pretrained`` folder).
"""
from __future__ import annotations

from fgrpo.method import METHOD
from fgrpo.metrics import METRICS, local_sums, step_metrics
from fgrpo.policy import TrainedPolicy
from fgrpo.sampling import sample_step
from fgrpo.step import train_on_rollouts
from hpc.gradient_method import step_seed
from hpc.data.tasks import job_task
from hpc.job.lifecycle import finish, on_all_ranks, start_job
from hpc.job.loop import run_loop
from hpc.runtime.errors import UserError, user_errors_exit

PHASES = {"gather_weights": "communication", "generate": "rollout", "reward": "rollout",
          "forward_backward": "train",
          "waiting": "waiting", "allreduce": "communication", "optimizer": "update"}


class FGRPO(TrainedPolicy):
    """GRPO with focal-weighted group advantages, gradients all-reduced over ranks."""

    phases, metrics = PHASES, METRICS

    def __init__(self, job):
        super().__init__(job)
        cfg, world = job.cfg, job.world
        f = self.f = cfg.fgrpo
        self.task = on_all_ranks(world, lambda: job_task(cfg, job.device))
        if min(f.batch_prompts, len(self.task.train)) < world.size:
            raise UserError(f"{len(self.task.train)} training prompts and fgrpo.batch_prompts="
                            f"{f.batch_prompts} leave some of the {world.size} ranks without a "
                            f"prompt")
        self.build_policy()
        self.total_steps, self.keep_checkpoints, self.skipped = f.steps, f.keep_checkpoints, 0

    def attrs(self) -> dict:
        return {"trainable_parameters": sum(p.numel() for p in self.params),
                "activation_checkpointing": self.checkpointed, "offload": self.offload,
                "rollout_engine_kept": self.keep_engine}

    def step(self, i: int) -> dict:
        cfg, f, world, task, timer = self.job.cfg, self.f, self.job.world, self.task, self.timer
        # 1. rollouts: G completions of each of my prompts (refilled: dynamic sampling)
        self.model.eval()
        with self.decoding():
            batch = sample_step(self.model, self.tok, task, cfg, world, i, timer,
                                self.job.decoder)
        if not self.keep_engine:  # the plan needs its room for the training
            self.job.decoder.release()
        # 2-4. advantages, frozen log-probs, PPO epochs of mini-batch updates (fgrpo.step)
        update = train_on_rollouts(self.model, self.weights, batch, cfg, world, i,
                                   step_seed(cfg.run.seed, i, world.rank), timer=timer,
                                   ref_model=self.ref_model)
        self.skipped += not update.finite
        return step_metrics(world, local_sums(batch, update.advantages, update.sums,
                                              f.reward.success_threshold),
                            update.advantages.focal_weight, self.skipped, batch.stats,
                            update.updates)


@user_errors_exit
def main(argv=None):
    """``fgrpo [CONFIG.yaml] [key=value ...] [--resume]`` under mpirun/srun (or alone)."""
    job = start_job(METHOD, argv)
    finish(job, run_loop(job, FGRPO(job)), "start", "f-grpo")
