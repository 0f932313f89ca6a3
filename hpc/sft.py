"""LoRA SFT stage: supervised fine-tuning of a fresh LoRA on task solutions (ESSA starts here).

Data parallel over torch.distributed when there are several ranks: every rank draws the same
global batch of indices from the shared seed, keeps its contiguous share, and LoRA gradients are
averaged with one flat all-reduce per step. Writes ``<run.out>/adapter`` (peft format) and
``<run.out>/sft.h5``. Command: ``hpc-sft [CONFIG.yaml] [key=value ...]``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from hpc.data.prompts import completion_batch
from hpc.runtime.config import JobConfig, param
from hpc.runtime.errors import UserError, user_errors_exit
from hpc.runtime.world import my_slice

PHASES = ["forward_backward", "allreduce", "optimizer"]


@dataclass
class SFTConfig:
    steps: int = param(40, "optimizer steps", min=1)
    batch_size: int = param(32, "global batch (prompts per step, split over ranks)", min=1)
    lr: float = param(3e-3, "AdamW learning rate", min=0.0)
    weight_decay: float = param(0.0, "AdamW weight decay", min=0.0)
    grad_clip: float = param(1.0, "max gradient norm (0 = off)", min=0.0)


@dataclass
class SFTJobConfig(JobConfig):
    sft: SFTConfig = field(default_factory=SFTConfig)

    def validate_world(self, world):
        if self.sft.batch_size < world.size:
            raise UserError(f"sft.batch_size={self.sft.batch_size} is smaller than the "
                            f"{world.size} ranks")


def train_sft(model, tokenizer, task, cfg: SFTJobConfig, world, store, timer, progress=None):
    """Run ``cfg.sft.steps`` steps of completion-only cross-entropy on ``task.train``."""
    from hpc.runtime.dist import all_reduce_mean_
    from hpc.runtime.timing import gather_timings

    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.sft.lr, weight_decay=cfg.sft.weight_decay)
    rng = np.random.default_rng(cfg.run.seed)
    device = next(model.parameters()).device
    model.train()
    for step in range(cfg.sft.steps):
        wall = time.perf_counter()
        batch = rng.choice(len(task.train), size=cfg.sft.batch_size, replace=False)
        mine = batch[my_slice(len(batch), world)]
        with timer.phase("forward_backward"):
            ids, mask, labels = completion_batch(
                tokenizer, [task.train.prompts[i] for i in mine],
                [task.train.solutions[i] for i in mine], device, chat=task.chat)
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            opt.zero_grad(set_to_none=False)
            loss.backward()
        with timer.phase("allreduce"):
            all_reduce_mean_([p.grad for p in params], world, tag="grad_allreduce")
        with timer.phase("optimizer"):
            if cfg.sft.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(params, cfg.sft.grad_clip)
            opt.step()
        losses = world.allgather(np.array([loss.item()]), tag="metrics")
        store.log_step(step, metrics={"loss": float(losses.mean()),
                                      "wall_s": time.perf_counter() - wall},
                       timings=gather_timings(world, timer), nbytes=world.take_bytes())
        if progress is not None:
            progress.update(1)
            progress.set_postfix(loss=f"{losses.mean():.3f}", refresh=False)
    model.eval()


@user_errors_exit
def main(argv=None):
    from hpc.runtime.dist import init_process_group
    from hpc.evaluate import evaluate, format_table, log_eval
    from hpc.runtime.job import on_all_ranks, progress_bar, start_job
    from hpc.models.loading import attach_lora, load_model, save_adapter
    from hpc.runtime.runstore import RunStore, environment_attrs
    from hpc.data.tasks import load_task
    from hpc.runtime.timing import PhaseTimer

    job = start_job(SFTJobConfig, "sft", "hpc-sft", argv)
    cfg, world = job.cfg, job.world
    task = on_all_ranks(world, lambda: load_task(cfg.task, cfg.model.path))
    if len(task.train) < cfg.sft.batch_size:
        raise UserError(f"the training set has {len(task.train)} problems, fewer than "
                        f"sft.batch_size={cfg.sft.batch_size}")
    torch.manual_seed(cfg.run.seed)
    model, tok = on_all_ranks(world, lambda: load_model(cfg.model.path, cfg.model.dtype,
                                                        job.device))
    model = on_all_ranks(world, lambda: attach_lora(model, cfg.lora.rank, cfg.lora.alpha,
                                                    cfg.lora.targets, cfg.lora.dropout,
                                                    seed=cfg.run.seed))
    init_process_group(world, job.device)
    attrs = environment_attrs(world, job.device)
    store = RunStore(f"{job.out_dir}/sft.h5", world.is_root,
                     dict(attrs, method="sft", config=job.config_text))
    sync = torch.cuda.synchronize if job.device.type == "cuda" else None
    timer = PhaseTimer(PHASES, sync=sync)
    before = evaluate(model, tok, task, task.eval, cfg.eval, cfg.task.max_new_tokens, world,
                      seed=cfg.run.seed)
    log_eval(store, -1, before)
    progress = progress_bar(job, cfg.sft.steps, "sft")
    start = time.perf_counter()
    train_sft(model, tok, task, cfg, world, store, timer, progress)
    progress.close()
    train_s = time.perf_counter() - start
    after = evaluate(model, tok, task, task.eval, cfg.eval, cfg.task.max_new_tokens, world,
                     seed=cfg.run.seed)
    log_eval(store, cfg.sft.steps, after)
    if world.is_root:
        save_adapter(model, f"{job.out_dir}/adapter")
    store.set_attrs(train_seconds=train_s)
    store.close()
    if world.is_root:
        print(format_table([("base", before, {}),
                            ("sft", after, {"train s": f"{train_s:.0f}"})]))
        print(f"adapter: {job.out_dir}/adapter")


if __name__ == "__main__":
    main()
