"""Peak memory per rank: one ESSA generation (k = 1 and batched) vs one F-GRPO step.

    python benchmarks/memory.py [--ranks 2] [--ks 1 8] [--device cpu|cuda] [--population 96]
        [--minibatch 100] [--prompts 32] [--num-generations 8]

Every measurement is a fresh ``mpirun -n RANKS`` launch of this file, so each process's
high-water marks belong to one method. Each rank loads the benchmark model (toy model, fp32,
fresh rank-8 LoRA on q/k/v/o with random B), notes its resident set (VmHWM), then runs

* ESSA: scoring its share of a population of ``--population`` (``essa`` defaults: 96,
  minibatch 100 prompts, 8 new tokens, chunks of 64 prompts) with
  ``essa.population.score_members`` at k;
* F-GRPO: one step as ``fgrpo.trainer`` runs it with its defaults (``--prompts`` 32 prompts
  over all ranks, G = ``--num-generations`` 8 sampled completions, micro-batches of 64 rows):
  rollouts, advantages, forward and backward, gradient all-reduce, AdamW;

and reports peak resident memory (VmHWM, MiB) and, on CUDA, ``torch.cuda.max_memory_allocated``
since the model was loaded.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile

import numpy as np

from common import cpu_model, launch_mpi


def _vm_hwm_mib() -> float:
    """This process's peak resident set size (VmHWM), MiB."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _essa_generation(model, tok, task, world, k: int, population: int, minibatch: int) -> None:
    from essa.population import ScoringRequest, owners, score_members
    from hpc.models.adapter_space import SingularValueSpace
    from essa.trainer import PHASES
    from hpc.engine.engine_backend import EngineBackend
    from hpc.runtime.timing import PhaseTimer

    space = SingularValueSpace.from_peft(model)
    members = np.random.default_rng(0).normal(0.0, 0.1, (population, space.dim))
    mine = members[owners(population, world.size) == world.rank]
    prompts = task.train.prompts[:minibatch]
    score_members(model, tok, space, task,
                  ScoringRequest(mine, prompts, task.train.answers[:minibatch], 8, 64, k),
                  decoder=EngineBackend(), timer=PhaseTimer(PHASES))


def _fgrpo_step(model, tok, task, world, device, prompts: int, num_generations: int) -> None:
    import torch

    from fgrpo.advantages import group_advantages
    from fgrpo.config import FGRPOJobConfig
    from fgrpo.rollout import RolloutRequest, sample_rollouts
    from fgrpo.gradients import accumulate_gradients
    from fgrpo.trainer import PHASES
    from hpc.engine.config import EngineConfig
    from hpc.engine.engine_backend import EngineBackend
    from hpc.runtime.dist import all_reduce_mean_, init_process_group
    from hpc.runtime.timing import PhaseTimer
    from hpc.runtime.world import my_slice

    init_process_group(world, device)
    cfg = FGRPOJobConfig()
    cfg.fgrpo.batch_prompts, cfg.fgrpo.sampling.num_generations = prompts, num_generations
    f = cfg.fgrpo
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=f.optim.learning_rate, weight_decay=f.optim.weight_decay)
    mine = range(f.batch_prompts)[my_slice(f.batch_prompts, world)]
    request = RolloutRequest([task.train.prompts[i] for i in mine],
                             [task.train.answers[i] for i in mine], cfg.task.max_new_tokens,
                             cfg.model.decode_batch, world.rank)
    rollouts = sample_rollouts(model, tok, task, f, request,
                               decoder=EngineBackend(EngineConfig.from_model(cfg.model, "engine")),
                               timer=PhaseTimer(PHASES))
    adv = group_advantages(rollouts.rewards, f.advantage.scale_rewards, f.advantage.gamma)
    model.train()
    opt.zero_grad()
    accumulate_gradients(model, rollouts, adv.advantages.reshape(-1).to(device), cfg, world,
                         cfg.task.max_new_tokens)
    all_reduce_mean_([p.grad for p in params], world, tag="grad_allreduce")
    opt.step()


def worker(out_path: str, method: str, k: int, args) -> None:
    """Under mpirun: load, run ``method`` once, gather peaks; rank 0 writes JSON."""
    import torch

    from common import lora_model, model_path
    from hpc.data.tasks import arith_task
    from hpc.runtime.world import get_world, select_device

    world = get_world()
    device = select_device(world, args.device)
    with tempfile.TemporaryDirectory(prefix="memory-") as scratch:
        model, tok, _ = lora_model(model_path(scratch)[0], device)
    task = arith_task(max(args.minibatch, args.prompts, 64), 1)
    loaded = _vm_hwm_mib()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    if method == "essa":
        _essa_generation(model, tok, task, world, k, args.population, args.minibatch)
    else:
        _fgrpo_step(model, tok, task, world, device, args.prompts, args.num_generations)
    row = {"rank": world.rank, "loaded_mib": loaded, "peak_mib": _vm_hwm_mib(),
           "cuda_peak_mib": (torch.cuda.max_memory_allocated(device) / 2 ** 20
                             if device.type == "cuda" else None)}
    rows = world.comm.gather(row, root=0)
    if world.is_root:
        with open(out_path, "w") as fh:
            json.dump(rows, fh)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--population", type=int, default=96, help="ESSA members")
    parser.add_argument("--minibatch", type=int, default=100, help="ESSA prompts per member")
    parser.add_argument("--prompts", type=int, default=32, help="F-GRPO prompts per step")
    parser.add_argument("--num-generations", type=int, default=8, help="F-GRPO G")
    parser.add_argument("--worker", nargs=3, metavar=("OUT_JSON", "METHOD", "K"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker[0], args.worker[1], int(args.worker[2]), args)
        return
    with tempfile.TemporaryDirectory(prefix="memory-") as scratch:
        print_table(args, scratch)


def print_table(args, scratch: str) -> None:
    """One mpirun launch per method (JSON under ``scratch``); prints the table."""
    import torch

    print(f"machine: {cpu_model()}, {len(os.sched_getaffinity(0))} cores visible, "
          f"torch {torch.__version__}, device {args.device}; {args.ranks} ranks, 1 thread "
          f"each; MiB per rank (rank 0 / rank 1 / ...)")
    print(f"{'method':<42} {'RSS after load':>18} {'peak RSS':>18} {'peak - load':>14}"
          + (f" {'CUDA peak':>18}" if args.device == "cuda" else ""))
    runs = [("essa", k, f"ESSA generation, k={k} (P={args.population}, M={args.minibatch})")
            for k in args.ks] + [("fgrpo", 1, f"F-GRPO step ({args.prompts} prompts x "
                                             f"G={args.num_generations}, micro 64)")]
    for method, k, label in runs:
        out = os.path.join(scratch, f"{method}-{k}.json")
        launch_mpi(args.ranks, [os.path.abspath(__file__), "--worker", out, method, k,
                                "--device", args.device, "--population", args.population,
                                "--minibatch", args.minibatch, "--prompts", args.prompts,
                                "--num-generations", args.num_generations])
        with open(out) as fh:
            rows = json.load(fh)

        def col(key):
            return " / ".join(f"{r[key]:.0f}" for r in rows)

        grown = max(r["peak_mib"] - r["loaded_mib"] for r in rows)
        print(f"{label:<42} {col('loaded_mib'):>18} {col('peak_mib'):>18} {grown:>14.0f}"
              + (f" {col('cuda_peak_mib'):>18}" if args.device == "cuda" else ""))


if __name__ == "__main__":
    main()
