"""LoRA SFT stage: supervised fine-tuning of a fresh LoRA on task solutions (ESSA starts here).

Data parallel over torch.distributed when there are several ranks: every rank draws the same
global batch of indices from the shared seed, keeps its contiguous share, and LoRA gradients are
averaged with one flat all-reduce per step; the trained weights, their AdamW state and the
all-reduce are F-GRPO's own (:class:`hpc.models.parallelize.TrainedWeights`), so a step whose
gradient holds NaN or inf leaves the weights as they were. The loss is the mean over every rank's labelled
tokens (each rank's mean weighted by its share of them), so the run does not depend on the rank
count up to the order of floating-point sums, and resumes on any count. The job lifecycle
(resume, preemption, evaluations, checkpoints of the LoRA weights, optimizer and data
position) is :func:`hpc.job.loop.run_loop`'s. Writes ``<run.out>/adapter`` (peft format),
``<run.out>/sft.h5`` and ``checkpoints/``. Command: ``hpc-sft [CONFIG.yaml] [key=value ...]
[--resume]``.
"""
from __future__ import annotations


import numpy as np
import torch

from hpc.data.tasks import load_task
from hpc.gradient_method import GradientMethod
from hpc.models.loading import attach_lora, load_model
from hpc.models.logprobs import sequence_logprobs
from hpc.models.parallelize import TrainedWeights
from hpc.runtime.dist import init_process_group
from hpc.data.prompts import completion_batch
from hpc.runtime.errors import UserError, user_errors_exit
from hpc.job.lifecycle import finish, on_all_ranks, start_job, stop_if_preempted
from hpc.job.loop import run_loop
from hpc.runtime.readback import bad_field
from hpc.runtime.world import my_slice
from sft.method import METHOD

PHASES = {"forward_backward": "train", "allreduce": "communication", "optimizer": "update"}


class SFT(GradientMethod):
    """Completion-only cross-entropy on ``task.train`` solutions, a fresh LoRA trained."""

    phases, metrics = PHASES, ("loss",)

    def __init__(self, job):
        super().__init__(job)
        cfg, world = job.cfg, job.world
        self.task = on_all_ranks(world, lambda: load_task(cfg.task, cfg.model.path, "held"))
        if len(self.task.train) < cfg.sft.batch_size:
            raise UserError(f"the training set has {len(self.task.train)} problems, fewer than "
                            f"sft.batch_size={cfg.sft.batch_size}")
        torch.manual_seed(cfg.run.seed)
        self.model, self.tok = on_all_ranks(world, lambda: load_model(
            cfg.model.path, cfg.model.dtype, job.device, load=cfg.model.load,
            wrap=lambda base: attach_lora(base, cfg.lora.rank, cfg.lora.alpha, cfg.lora.targets,
                                          cfg.lora.dropout, seed=cfg.run.seed),
            quantize=cfg.model.quantize, quantized_copy=True))
        stop_if_preempted(job, "model loading")
        self.checkpointed = self.checkpoint_activations()
        init_process_group(world, job.device)
        self.weights = TrainedWeights([p for p in self.model.parameters() if p.requires_grad],
                                      cfg.sft.lr, cfg.sft.weight_decay)
        self.data_rng = np.random.default_rng(cfg.run.seed)  # one batch drawn per step
        self.steps_per_epoch = -(-len(self.task.train) // cfg.sft.batch_size)
        self.total_steps = (cfg.sft.epochs * self.steps_per_epoch if cfg.sft.epochs
                            else cfg.sft.steps)

    def step(self, i: int) -> dict:
        cfg, world, train, timer = self.job.cfg, self.job.world, self.task.train, self.timer
        if cfg.sft.epochs:
            batch = epoch_batch(len(train), cfg.sft.batch_size, i, self.steps_per_epoch,
                                cfg.run.seed)
        else:
            batch = self.data_rng.choice(len(train), size=cfg.sft.batch_size, replace=False)
        mine = batch[my_slice(len(batch), world)]
        self.train_mode(i)
        with timer.phase("forward_backward"):
            ids, mask, labels = completion_batch(self.tok, [train.prompts[j] for j in mine],
                                                 [train.solutions[j] for j in mine],
                                                 self.job.device, chat=self.task.chat)
            mean = completion_loss(self.model, ids, mask, labels, cfg.model.logprob_chunk)
            # this rank's share of the mean over every rank's labelled tokens: after the MEAN
            # all-reduce the gradient is the whole batch's, whatever the rank count (1 rank:
            # a factor of exactly 1)
            tokens = int((labels[:, 1:] != -100).sum())
            share = tokens * world.size / max(int(world.allgather(
                np.array([tokens]), tag="metrics").sum()), 1)
            loss = mean * share
            self.weights.zero_grad()
            loss.backward()
        with timer.phase("allreduce"):
            self.weights.reduce_gradients(world)
        with timer.phase("optimizer"):
            self.weights.step(cfg.sft.grad_clip)
        return {"loss": float(world.allgather(np.array([loss.item()]), tag="metrics").mean())}

    def attrs(self) -> dict:
        return {"activation_checkpointing": self.checkpointed}

    def state_dict(self) -> dict:
        """LoRA weights, AdamW state and the data position (the batch generator's state)."""
        return dict(super().state_dict(), data_rng=self.data_rng.bit_generator.state)

    def load_state_dict(self, state: dict) -> None:
        outer = self.data_rng.bit_generator.state
        try:
            self.data_rng.bit_generator.state = state["data_rng"]
        except (ValueError, KeyError, TypeError) as err:
            self.data_rng.bit_generator.state = outer
            raise bad_field("checkpoint", "data_rng", f"is not a {outer['bit_generator']} state "
                            f"of the data generator ({err})") from None
        super().load_state_dict(state)


def epoch_batch(n: int, batch_size: int, step: int, steps_per_epoch: int, seed: int):
    """Step ``step``'s batch when SFT runs by epochs: batch ``step % steps_per_epoch`` of the
    epoch's permutation of ``n`` problems, drawn from ``seed`` and the epoch alone (so a resumed
    run draws the same batches); the last batch of an epoch is filled up from the permutation's
    start."""
    epoch, k = divmod(step, steps_per_epoch)
    order = np.random.default_rng([seed, epoch]).permutation(n)
    return np.concatenate([order, order[:batch_size]])[k * batch_size:(k + 1) * batch_size]


def completion_loss(model, input_ids, attention_mask, labels, chunk: int):
    """Mean cross-entropy (nats) of the labelled tokens: ``input_ids``, ``attention_mask``,
    ``labels`` (B, T), labels -100 where not learned. ``chunk`` 0: transformers' own loss over
    the full logits (the reference); > 0: log-probs through the LM head in chunks of positions
    (:mod:`hpc.models.logprobs`), the same value without (B, T, V) logits."""
    if chunk == 0:
        return model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
    logp, _ = sequence_logprobs(model, input_ids, attention_mask, chunk)
    learned = labels[:, 1:] != -100
    return -torch.where(learned, logp, torch.zeros_like(logp)).sum() / learned.sum().clamp(min=1)


@user_errors_exit
def main(argv=None):
    """``hpc-sft [CONFIG.yaml] [key=value ...] [--resume]`` under mpirun/srun (or alone)."""
    job = start_job(METHOD, argv)
    finish(job, run_loop(job, SFT(job)), "base", "sft")
    if job.world.is_root:
        print(f"adapter: {job.out_dir}/adapter")


if __name__ == "__main__":
    main()
