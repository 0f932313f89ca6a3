"""The F-GRPO step, top to bottom: rollout, reward, focal advantages, loss, all-reduce, step.

Data parallel: every rank draws the same global batch of prompts from the shared seed and keeps
its contiguous share, samples G completions per prompt, and computes its groups' advantages
locally (a group never spans ranks). Completions are keyed by (step, the prompt's position in
the global batch, sample index) (:mod:`hpc.models.sampling`), so the rollouts, and with them
the run, do not depend on the rank count up to the order of floating-point sums: a run resumed
on another number of ranks goes on as it would have. The loss follows the normaliser contract of
:mod:`fgrpo.loss`, so the all-reduced gradient equals the single-process gradient on the union
of all ranks' rollouts. ``fgrpo.parallelism`` holds the model replicated (DDP) or sharded
(FSDP2), and the trained weights with fp32 masters (:mod:`hpc.models.parallelize`); under FSDP2
the rollouts decode with the weights gathered for the phase. ``fgrpo.space=sv`` trains only offsets to the SFT adapter's singular
values (ESSA's search space, :mod:`hpc.models.adapter_space`). The job lifecycle is
:func:`hpc.job.loop.run_loop`'s. Run files: ``<run.out>/fgrpo.h5``, ``checkpoints/``,
``adapter`` (LoRA) or ``model`` (full fine-tuning: a ``save_pretrained`` folder).
"""
from __future__ import annotations

import contextlib

import numpy as np
import torch

from fgrpo.advantages import batch_moments, group_advantages, std_from_moments
from fgrpo.config import FGRPOJobConfig
from fgrpo.gradients import accumulate_gradients
from fgrpo.metrics import METRICS, local_sums, step_metrics
from fgrpo.policy import build_model, frozen_logprobs, reference_model
from fgrpo.rollout import sample_rollouts
from hpc.data.tasks import load_task
from hpc.gradient_method import GradientMethod, shared_step_seed
from hpc.models.adapter_space import SingularValueSpace
from hpc.models.engine import release_engine
from hpc.models.memory_plan import fgrpo_rollout_rows, rollout_engine_kept, rollout_offload
from hpc.models.parallelize import (TrainedWeights, decoding, load_sharded_state,
                                    save_full_model, save_gathered_adapter, shard_model,
                                    sharded_state)
from hpc.runtime.dist import init_process_group
from hpc.runtime.errors import UserError, user_errors_exit
from hpc.job.lifecycle import finish, on_all_ranks, start_job, stop_if_preempted
from hpc.job.loop import run_loop
from hpc.runtime.readback import count
from hpc.runtime.world import my_slice

PHASES = {"gather_weights": "communication", "generate": "rollout", "reward": "rollout",
          "forward_backward": "train",
          "waiting": "waiting", "allreduce": "communication", "optimizer": "update"}


class FGRPO(GradientMethod):
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
        torch.manual_seed(cfg.run.seed)
        self.model, self.ref_model, self.tok = on_all_ranks(world, lambda: build_model(
            cfg, job.device))
        stop_if_preempted(job, "model and adapter loading")
        self.checkpointed = self.checkpoint_activations()
        init_process_group(world, job.device)
        self.sharded = f.parallelism == "fsdp2"
        if self.sharded:
            shard_model(self.model, cfg.model.dtype)
            if self.ref_model is not None:
                shard_model(self.ref_model, cfg.model.dtype)
        self.space = None
        if f.space == "sv":  # ESSA's search space, trained by gradient
            self.space = SingularValueSpace.from_peft(self.model, f.alpha, cfg.lora.targets)
            self.params = self.space.parametrize(self.model)
        else:
            self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.weights = TrainedWeights(self.params, f.learning_rate, f.weight_decay)
        self.offload = rollout_offload(cfg, world.size, job.device.type)
        self.keep_engine = rollout_engine_kept(cfg, world.size, job.device.type)
        self.collective_export = f.full_finetune or self.sharded  # gathers, rank 0 writes
        self.total_steps, self.keep_checkpoints, self.skipped = f.steps, f.keep_checkpoints, 0

    def attrs(self) -> dict:
        return {"trainable_parameters": sum(p.numel() for p in self.params),
                "activation_checkpointing": self.checkpointed, "offload": self.offload,
                "rollout_engine_kept": self.keep_engine}

    def step(self, i: int) -> dict:
        cfg, f, world, task, timer = self.job.cfg, self.f, self.job.world, self.task, self.timer
        batch = np.random.default_rng([cfg.run.seed, i]).choice(
            len(task.train), size=min(f.batch_prompts, len(task.train)), replace=False)
        share = my_slice(len(batch), world)
        mine = batch[share]
        self.model.eval()
        with self.decoding():
            rollouts = sample_rollouts(self.model, self.tok, task,
                                       [task.train.prompts[j] for j in mine],
                                       [task.train.answers[j] for j in mine], f,
                                       cfg.task.max_new_tokens, cfg.eval.batch_size,
                                       shared_step_seed(cfg.run.seed, i), timer,
                                       first_index=share.start)
        if not self.keep_engine:  # the plan needs its room for the training
            release_engine(self.model)
        batch_std = None
        if f.scale_rewards == "batch":
            batch_std = std_from_moments(world.allgather(
                batch_moments(rollouts.rewards).numpy(), tag="metrics"))
        adv = group_advantages(rollouts.rewards, f.scale_rewards, f.gamma,
                               eps=f.advantage_epsilon, batch_std=batch_std,
                               success_threshold=f.success_threshold)
        row_adv = adv.advantages.reshape(-1).to(self.job.device)
        with timer.phase("forward_backward"):
            old_logp = frozen_logprobs(self.model, rollouts, f.micro_batch,
                                       cfg.model.logprob_chunk) \
                if f.num_iterations > 1 else None
            ref_logp = None
            if f.beta > 0:
                with reference_model(self.model, self.ref_model) as ref:
                    ref_logp = frozen_logprobs(ref, rollouts, f.micro_batch,
                                               cfg.model.logprob_chunk)
        self.train_mode(i)
        for _ in range(f.num_iterations):
            self.weights.zero_grad()
            with timer.phase("forward_backward"):
                sums = accumulate_gradients(self.model, rollouts, row_adv, cfg, world,
                                            cfg.task.max_new_tokens, old_logp, ref_logp)
            with timer.phase("waiting"):
                world.arrive("gradient all-reduce", cfg.run.collective_timeout_s)
            with timer.phase("allreduce"):  # FSDP2 reduce-scattered during the backward
                self.weights.reduce_gradients(world)
            with timer.phase("optimizer"):
                finite = self.weights.step(f.max_grad_norm)
            if not finite:
                self.skipped += 1
                break
        self.weights.free_gradients()
        return step_metrics(world, local_sums(rollouts, adv, sums, f.success_threshold), adv.focal_weight,
                            self.skipped)

    @contextlib.contextmanager
    def decoding(self, phase: str | None = "gather_weights"):
        """The rollout's or evaluation's weights (:func:`hpc.models.parallelize.decoding`):
        gathered under FSDP2, with the training state ``fgrpo.offload`` names in host memory;
        gathering and offloading, there and back, are timed as ``phase`` (None: the caller's
        phase, as the job loop's ``eval``)."""
        timed = self.timer.phase if phase else lambda _: contextlib.nullcontext()
        with contextlib.ExitStack() as stack:
            with timed(phase):
                stack.enter_context(decoding(self.model, self.weights, self.offload,
                                             self.ref_model))
            yield
            with timed(phase):
                stack.close()

    def step_decode(self) -> tuple:
        """A rollout: min(eval.batch_size, this rank's prompts) x G rows, the own adapter."""
        cfg = self.job.cfg
        return fgrpo_rollout_rows(cfg, self.job.world.size), 0 if self.f.full_finetune else 1

    def evaluate(self, sampled: bool):
        with self.decoding(phase=None):
            return super().evaluate(sampled)

    def export(self, out_dir: str, step: int) -> None:
        """LoRA: the peft adapter ``<out_dir>/adapter``; full fine-tuning: the model
        ``<out_dir>/model``. Full fine-tuning or FSDP2: every rank calls this
        (``collective_export``) to gather the weights, rank 0 writes."""
        is_root = self.job.world.is_root
        if self.f.full_finetune:
            save_full_model(self.model, self.tok, f"{out_dir}/model", self.job.cfg.model.dtype,
                            is_root)
        elif self.sharded:
            save_gathered_adapter(self.model, f"{out_dir}/adapter", is_root)
        elif self.space is not None:
            self.space.save_parametrized(self.model, f"{out_dir}/adapter")
        else:
            super().export(out_dir, step)

    def state_dict(self) -> dict:
        """Replicated state: the step-skip count, and under DDP the trained weights."""
        weights = {} if self.sharded else self.weights.state_dict()
        return dict(weights, skipped=self.skipped)

    def load_state_dict(self, state: dict) -> None:
        skipped = count(state["skipped"], "F-GRPO checkpoint", "skipped")
        if not self.sharded:
            self.weights.load_state_dict(state)
        self.skipped = skipped

    def sharded_state_dict(self) -> dict:
        """FSDP2: the sharded fp32 masters and AdamW moments (saved and resharded by DCP)."""
        return sharded_state(self.model, self.weights)

    def load_sharded_state_dict(self, state: dict) -> None:
        load_sharded_state(self.model, self.weights, state)


@user_errors_exit
def main(argv=None):
    """``fgrpo [CONFIG.yaml] [key=value ...] [--resume]`` under mpirun/srun (or alone)."""
    job = start_job(FGRPOJobConfig, "fgrpo", "fgrpo", argv)
    finish(job, run_loop(job, FGRPO(job)), "start", "f-grpo")
