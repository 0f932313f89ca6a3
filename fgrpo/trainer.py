"""The F-GRPO training loop, top to bottom: sample, reward, focal advantages, clipped loss,
all-reduce gradients, step.

Data parallel: every rank draws the same global batch of prompts from the shared seed and keeps
its contiguous share, samples G completions per prompt, and computes its groups' advantages
locally (a group never spans ranks). The loss follows the normaliser contract of
:mod:`fgrpo.loss`, so the all-reduced gradient equals the single-process gradient on the union
of all ranks' rollouts. Run files: ``<run.out>/fgrpo.h5``, ``checkpoints/``, ``adapter``.
"""
from __future__ import annotations

import contextlib
import copy
import time

import numpy as np
import torch

from fgrpo.advantages import batch_moments, group_advantages, std_from_moments
from fgrpo.config import FGRPOJobConfig
from fgrpo.loss import entropy_from_logits, policy_loss
from fgrpo.rollout import sample_rollouts, sequence_logprobs
from hpc.runtime.checkpoint import load_latest, save_checkpoint
from hpc.runtime.dist import all_reduce_mean_, init_process_group
from hpc.runtime.errors import UserError, user_errors_exit
from hpc.evaluate import evaluate, log_eval
from hpc.runtime.job import agree_on_resume_step, finish, on_all_ranks, progress_bar, start_job
from hpc.models.loading import attach_lora, load_adapter, load_model, save_adapter
from hpc.runtime.preempt import preempted_exit, should_stop
from hpc.runtime.runstore import RunStore, environment_attrs
from hpc.data.tasks import load_task
from hpc.runtime.timing import PhaseTimer, gather_timings
from hpc.runtime.world import my_slice

PHASES = ["generation", "reward", "forward_backward", "waiting", "allreduce", "optimizer",
          "eval", "checkpoint"]


def step_seed(seed: int, step: int, rank: int) -> int:
    """Sampling seed of one rank's rollouts at one step (independent of resumes)."""
    return int(np.random.default_rng([seed, step, rank]).integers(2 ** 31))


def reference_context(model, ref_model):
    """Context in which ``model`` (or ``ref_model``) computes reference log-probs."""
    if ref_model is not None:
        return contextlib.nullcontext(ref_model)
    return _disabled_adapter(model)


@contextlib.contextmanager
def _disabled_adapter(model):
    with model.disable_adapter():
        yield model


def accumulate_gradients(model, rollouts, advantages: torch.Tensor, cfg, world,
                         max_new_tokens: int, old_logp=None, ref_logp=None):
    """Forward/backward over ``rollouts`` in micro-batches; gradients are left SUMMED-ready.

    ``advantages``: (n*G,). Denominators are global (all ranks) per the loss contract, and
    pre-divided by the world size so a MEAN all-reduce yields the full-batch gradient.
    Returns stats summed over micro-batches, weighted by valid tokens.
    """
    f = cfg.fgrpo
    rows = rollouts.input_ids.shape[0]
    cmask = rollouts.completion_mask[:, 1:]
    local = torch.tensor([float(cmask.sum()), float(rows)], dtype=torch.float64)
    counts = world.allgather(local.numpy(), tag="metrics").sum(axis=0)
    normalizer = (counts[0] if f.loss_type == "token-mean" else counts[1]) / world.size
    totals = {"clip_fraction": 0.0, "kl": 0.0, "entropy": 0.0, "loss": 0.0, "tokens": 0.0}
    for start in range(0, rows, f.micro_batch):
        stop = min(start + f.micro_batch, rows)
        ids, attn, cm = rollouts.rows(start, stop)
        logp, logits = sequence_logprobs(model, ids, attn, with_logits=True)
        old = logp.detach() if old_logp is None else old_logp[start:stop]
        ref = None if ref_logp is None else ref_logp[start:stop]
        loss, stats = policy_loss(logp, old, advantages[start:stop], cm[:, 1:], f.loss_type,
                                  f.epsilon, f.epsilon_high, f.beta, ref,
                                  max_completion_length=max_new_tokens, normalizer=normalizer)
        loss.backward()
        n = stats["valid_tokens"]
        totals["tokens"] += n
        for key in ("clip_fraction", "kl"):
            totals[key] += stats[key] * n
        totals["entropy"] += entropy_from_logits(logits, cm[:, 1:]) * n
        totals["loss"] += float(loss.detach())
    return totals


def optimizer_step(params, opt, max_grad_norm: float) -> bool:
    """Clip and step, unless a gradient holds NaN or inf: then leave the weights and the
    optimizer state untouched and return False (the caller counts a skipped step). Gradients
    are all-reduced first, so every rank takes the same decision."""
    if not all(torch.isfinite(p.grad).all() for p in params):
        return False
    if max_grad_norm > 0:
        torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    opt.step()
    return True


@torch.no_grad()
def frozen_logprobs(model, rollouts, micro_batch: int):
    """Log-probs of all rollouts without gradient: (rows, T-1) float32."""
    parts = [sequence_logprobs(model, *rollouts.rows(s, s + micro_batch)[:2])
             for s in range(0, rollouts.input_ids.shape[0], micro_batch)]
    return torch.cat(parts)


def build_model(cfg, device):
    """(policy, reference or None, tokenizer): LoRA (fresh or from lora.adapter) or full FT."""
    model, tok = load_model(cfg.model.path, cfg.model.dtype, device)
    if cfg.fgrpo.full_finetune:
        ref = copy.deepcopy(model).eval() if cfg.fgrpo.beta > 0 else None
        return model, ref, tok
    if cfg.lora.adapter:
        return load_adapter(model, cfg.lora.adapter, is_trainable=True), None, tok
    return attach_lora(model, cfg.lora.rank, cfg.lora.alpha, cfg.lora.targets, 0.0,
                       seed=cfg.run.seed), None, tok


def run(job) -> dict:
    """Train F-GRPO for ``job``; returns a summary on every rank."""
    cfg, world = job.cfg, job.world
    f = cfg.fgrpo
    task = on_all_ranks(world, lambda: load_task(cfg.task, cfg.model.path))
    if min(f.batch_prompts, len(task.train)) < world.size:
        raise UserError(f"{len(task.train)} training prompts and fgrpo.batch_prompts="
                        f"{f.batch_prompts} leave some of the {world.size} ranks without a prompt")
    torch.manual_seed(cfg.run.seed)
    model, ref_model, tok = on_all_ranks(world, lambda: build_model(cfg, job.device))
    init_process_group(world, job.device)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=f.learning_rate, weight_decay=f.weight_decay)
    signals = job.signals
    ckpt_dir = f"{job.out_dir}/checkpoints"
    state = load_latest(ckpt_dir, warn=world.is_root) if job.resume else None
    start_step, elapsed0, skipped = 0, 0.0, 0
    if state is not None:
        with torch.no_grad():
            for p, saved in zip(params, state["params"]):
                p.copy_(saved)
        opt.load_state_dict(state["optimizer"])
        start_step, elapsed0, skipped = state["step"], state["elapsed_s"], state["skipped"]
    agree_on_resume_step(world, start_step)
    attrs = dict(environment_attrs(world, job.device), method="fgrpo", config=job.config_text,
                 trainable_parameters=sum(p.numel() for p in params))
    store = on_all_ranks(world, lambda: RunStore(
        f"{job.out_dir}/fgrpo.h5", world.is_root, attrs, resume=job.resume,
        backup=state.get("run_file") if state else None))
    store.truncate_after(start_step)
    sync = torch.cuda.synchronize if job.device.type == "cuda" else None
    timer = PhaseTimer(PHASES, sync=sync)
    max_new = cfg.task.max_new_tokens

    def held_out(sampled=False):
        return evaluate(model, tok, task, task.eval, cfg.eval, max_new, world,
                        seed=cfg.run.seed, sampled=sampled)

    start_eval = held_out(sampled=True) if start_step == 0 else None
    if start_eval is not None:
        log_eval(store, -1, start_eval)
    progress = progress_bar(job, f.steps, "fgrpo", initial=start_step)
    t0 = time.perf_counter() - elapsed0
    step, preempted = start_step, False
    world.take_bytes()  # start-up traffic (bootstrap, start evaluation) is not a step's
    while step < f.steps:
        batch = np.random.default_rng([cfg.run.seed, step]).choice(
            len(task.train), size=min(f.batch_prompts, len(task.train)), replace=False)
        mine = batch[my_slice(len(batch), world)]
        model.eval()
        rollouts = sample_rollouts(model, tok, task, [task.train.prompts[i] for i in mine],
                                   [task.train.answers[i] for i in mine], f, max_new,
                                   cfg.eval.batch_size, step_seed(cfg.run.seed, step, world.rank),
                                   timer)
        batch_std = None
        if f.scale_rewards == "batch":
            batch_std = std_from_moments(world.allgather(
                batch_moments(rollouts.rewards).numpy(), tag="metrics"))
        adv = group_advantages(rollouts.rewards, f.scale_rewards, f.gamma, batch_std=batch_std)
        row_adv = adv.advantages.reshape(-1).to(job.device)
        with timer.phase("forward_backward"):
            old_logp = frozen_logprobs(model, rollouts, f.micro_batch) \
                if f.num_iterations > 1 else None
            ref_logp = None
            if f.beta > 0:
                with reference_context(model, ref_model) as ref:
                    ref_logp = frozen_logprobs(ref, rollouts, f.micro_batch)
        model.train()
        sums = {}
        finite = True
        for _ in range(f.num_iterations):
            opt.zero_grad(set_to_none=False)
            with timer.phase("forward_backward"):
                sums = accumulate_gradients(model, rollouts, row_adv, cfg, world,
                                            max_new, old_logp, ref_logp)
            with timer.phase("waiting"):
                world.arrive("gradient all-reduce", cfg.run.collective_timeout_s)
            with timer.phase("allreduce"):
                all_reduce_mean_([p.grad for p in params], world, tag="grad_allreduce")
            with timer.phase("optimizer"):
                finite = optimizer_step(params, opt, f.max_grad_norm)
            if not finite:
                break
        skipped += 0 if finite else 1
        step += 1
        local = np.array([rollouts.rewards.sum().item(), (rollouts.rewards >= 1).sum().item(),
                          rollouts.rewards.numel(), adv.focal_weight.sum().item(),
                          float(adv.focal_weight.min()), float(adv.focal_weight.max()),
                          adv.zero_spread.sum().item(), adv.zero_spread.numel(),
                          sums["kl"], sums["clip_fraction"], sums["entropy"], sums["tokens"],
                          rollouts.completion_lengths.float().sum().item(), sums["loss"]])
        g = world.allgather(local, tag="metrics")
        tot = g.sum(axis=0)
        tokens = max(tot[11], 1.0)
        metrics = {"reward_mean": tot[0] / tot[2], "success_rate": tot[1] / tot[2],
                   "focal_weight_mean": tot[3] / tot[7], "focal_weight_min": g[:, 4].min(),
                   "focal_weight_max": g[:, 5].max(), "zero_spread_groups": tot[6],
                   "kl": tot[8] / tokens, "clip_fraction": tot[9] / tokens,
                   "entropy": tot[10] / tokens, "completion_length": tot[12] / tot[2],
                   "loss": tot[13] / world.size, "skipped_steps": skipped,
                   "wall_s": time.perf_counter() - t0}
        if cfg.eval.every and step % cfg.eval.every == 0 and step < f.steps:
            with timer.phase("eval"):
                res = held_out()
            store.write_row("heldout", step, flush=False, accuracy=res.accuracy,
                            wall_s=time.perf_counter() - t0)
        stop, preempted = should_stop(world, signals, cfg.run.max_time_s > 0 and
                                      time.perf_counter() - t0 >= cfg.run.max_time_s)
        # The row goes out before the checkpoint (see essa.trainer for why).
        store.log_step(step, metrics=metrics, timings=gather_timings(world, timer),
                       nbytes=world.take_bytes())
        if cfg.run.checkpoint_every and step % cfg.run.checkpoint_every == 0 or stop or \
                step == f.steps:
            with timer.phase("checkpoint"):
                if world.is_root:
                    save_checkpoint(ckpt_dir, step, {
                        "step": step, "params": [p.detach().cpu() for p in params],
                        "optimizer": opt.state_dict(), "elapsed_s": time.perf_counter() - t0,
                        "skipped": skipped, "run_file": store.snapshot()},
                        keep=f.keep_checkpoints)
        progress.update(1)
        progress.set_postfix(reward=f"{metrics['reward_mean']:.3f}", refresh=False)
        if stop:
            break
    progress.close()
    wall = time.perf_counter() - t0
    if preempted:
        return preempted_exit(world, store, step, wall)
    model.eval()
    final = held_out(sampled=True)
    log_eval(store, step, final)
    if world.is_root and not f.full_finetune:
        save_adapter(model, f"{job.out_dir}/adapter")
    store.set_attrs(steps_done=step, wall_seconds=wall)
    store.close("complete")
    return {"start": start_eval, "final": final, "steps": step, "wall_s": wall,
            "preempted": False}


@user_errors_exit
def main(argv=None):
    """``fgrpo [CONFIG.yaml] [key=value ...] [--resume]`` under mpirun/srun (or alone)."""
    job = start_job(FGRPOJobConfig, "fgrpo", "fgrpo", argv)
    finish(job, run(job), "start", "f-grpo")
