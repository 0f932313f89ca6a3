"""Run under mpirun -n N: F-GRPO gradient of fixed synthetic rollouts, split over N ranks.

Every rank builds the same tiny LoRA model and the same 4 groups x G=4 rollouts (seeded),
keeps its contiguous share of the groups, runs the trainer's accumulate_gradients (micro-batch
of 3 sequences, so accumulation is exercised too) and the gradient all-reduce, once for each
loss_type of argv[2:] (one model load for all). Rank 0 saves the LoRA gradients of each to
``argv[1]/LOSS_TYPE.pt`` (torch.save).
"""
import os
import sys

import torch

from fgrpo.advantages import group_advantages
from fgrpo.config import FGRPOJobConfig
from fgrpo.rollout import Rollouts
from fgrpo.gradients import accumulate_gradients
from hpc.runtime.config import load_config
from hpc.runtime.dist import all_reduce_mean_, init_process_group
from hpc.models.loading import attach_lora, randomize_lora_b
from hpc.toys.toy import tiny_model
from hpc.runtime.world import get_world, split_evenly

world = get_world()
init_process_group(world, torch.device("cpu"))
model, _ = tiny_model(seed=0)
model = attach_lora(model, 4, 8.0, ["q_proj", "v_proj"], seed=0)
gen = torch.Generator().manual_seed(0)
randomize_lora_b(model, 0.1, gen)  # gen goes on to draw the batch below
groups, G, T = 4, 4, 9
ids = torch.randint(3, 40, (groups * G, T), generator=gen)
lengths = torch.randint(3, T + 1, (groups * G,), generator=gen)
attn = (torch.arange(T)[None, :] < lengths[:, None]).long()
cmask = ((torch.arange(T)[None, :] >= 2) & (attn == 1)).float()
rewards = torch.randint(0, 2, (groups, G), generator=gen).float()

counts = split_evenly(groups, world.size)
g0 = sum(counts[: world.rank])
rows = slice(g0 * G, (g0 + counts[world.rank]) * G)
my_rewards = rewards[g0:g0 + counts[world.rank]]
mine = Rollouts(ids[rows], attn[rows], cmask[rows], my_rewards, torch.zeros_like(my_rewards),
                lengths[rows], torch.zeros(rows.stop - rows.start, dtype=torch.bool))
adv = group_advantages(mine.rewards, "group", 1.0).advantages.reshape(-1)
params = [p for p in model.parameters() if p.requires_grad]
for loss_type in sys.argv[2:]:
    cfg = load_config(FGRPOJobConfig, None, [f"fgrpo.loss.aggregation={loss_type}",
                                             "fgrpo.optim.micro_batch=3",
                                             "fgrpo.advantage.gamma=1.0"])
    for p in params:
        p.grad = None
    accumulate_gradients(model, mine, adv, cfg, world, max_new_tokens=T)
    all_reduce_mean_([p.grad for p in params], world)
    if world.is_root:
        torch.save([p.grad.clone() for p in params], os.path.join(sys.argv[1], f"{loss_type}.pt"))
