"""The F-GRPO step, top to bottom: rollout, reward, focal advantages, loss, all-reduce, step.

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

from fgrpo.advantages import batch_moments, group_advantages, std_from_moments
from fgrpo.config import FGRPOJobConfig
from fgrpo.gradients import accumulate_gradients
from fgrpo.metrics import METRICS, local_sums, step_metrics
from fgrpo.policy import TrainedPolicy, frozen_logprobs, reference_model
from fgrpo.sampling import sample_step
from hpc.data.tasks import load_task
from hpc.job.lifecycle import finish, on_all_ranks, start_job
from hpc.job.loop import run_loop
from hpc.runtime.errors import UserError, user_errors_exit

PHASES = {"gather_weights": "communication", "generate": "rollout", "reward": "rollout",
          "forward_backward": "train",
          "waiting": "waiting", "allreduce": "communication", "optimizer": "update"}


class FGRPO(TrainedPolicy):
    """GRPO with focal-weighted group advantages, gradients all-reduced over ranks."""

    name, phases, metrics = "fgrpo", PHASES, METRICS

    def __init__(self, job):
        super().__init__(job)
        cfg, world = job.cfg, job.world
        f = self.f = cfg.fgrpo
        self.task = on_all_ranks(world, lambda: load_task(cfg.task, cfg.model.path))
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
        rollouts = batch.train
        # 2. focal-weighted advantages of the shaped rewards, p from the task's rewards
        batch_std = None
        if f.advantage.scale_rewards == "batch":  # moments summed over ranks
            batch_std = std_from_moments(world.allgather(
                batch_moments(rollouts.shaped_rewards).numpy(), tag="metrics"))
        adv = group_advantages(rollouts.shaped_rewards, f.advantage.scale_rewards,
                               f.advantage.gamma, eps=f.advantage.epsilon, batch_std=batch_std,
                               success_threshold=f.reward.success_threshold,
                               task_rewards=rollouts.rewards)
        # 3. the frozen log-probs: the sampling policy's (mu > 1 passes), the reference's (KL)
        with timer.phase("forward_backward"):
            def frozen(model):
                return frozen_logprobs(model, rollouts, f.optim.micro_batch,
                                       cfg.model.logprob_chunk)
            old_logp = frozen(self.model) if f.optim.num_iterations > 1 else None
            ref_logp = None
            if f.loss.beta > 0:
                with reference_model(self.model, self.ref_model) as ref:
                    ref_logp = frozen(ref)
        # 4. mu optimizer passes: loss and backward, all-reduce, AdamW (a NaN/inf step skipped)
        self.train_mode(i)
        row_adv = adv.advantages.reshape(-1).to(self.job.device)
        for _ in range(f.optim.num_iterations):
            self.weights.zero_grad()
            with timer.phase("forward_backward"):
                sums = accumulate_gradients(self.model, rollouts, row_adv, cfg, world,
                                            cfg.task.max_new_tokens, old_logp, ref_logp)
                self.weights.ensure_gradients()  # no rows here: zeros to all-reduce
            with timer.phase("waiting"):
                world.arrive("gradient all-reduce", cfg.run.collective_timeout_s)
            with timer.phase("allreduce"):  # FSDP2 reduce-scattered during the backward
                self.weights.reduce_gradients(world)
            with timer.phase("optimizer"):
                finite = self.weights.step(f.optim.max_grad_norm)
            if not finite:
                self.skipped += 1
                break
        self.weights.free_gradients()
        return step_metrics(world, local_sums(batch, adv, sums, f.reward.success_threshold),
                            adv.focal_weight, self.skipped, batch.stats)


@user_errors_exit
def main(argv=None):
    """``fgrpo [CONFIG.yaml] [key=value ...] [--resume]`` under mpirun/srun (or alone)."""
    job = start_job(FGRPOJobConfig, "fgrpo", "fgrpo", argv)
    finish(job, run_loop(job, FGRPO(job)), "start", "f-grpo")
