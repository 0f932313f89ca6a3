"""PPO mini-batches and the learning-rate warm-up of :func:`fgrpo.step.train_on_rollouts`: one
update a pass is the single-update step of earlier versions bit for bit; four updates make the
later ones off-policy (ratio != 1, the clip acting); a 2-rank DDP job with four updates a step
ends where the 1-rank job does."""
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from conftest import run_mpi
from fgrpo.advantages import group_advantages
from fgrpo.config import FGRPOJobConfig
from fgrpo.gradients import accumulate_gradients
from fgrpo.rollout import Rollouts
from fgrpo.rollout import StepRollouts
from fgrpo.step import OneProcess as OneRank, learning_rate, mini_batches, train_on_rollouts
from hpc.models.loading import attach_lora, randomize_lora_b
from hpc.models.parallelize import TrainedWeights
from hpc.runtime.config import load_config
from hpc.runtime.runstore import RunFile
from hpc.toys.toy import tiny_model
from test_fgrpo import fgrpo_args

GROUPS, G, T = 8, 4, 10


def setup(seed=0):
    """(model, weights' params, StepRollouts) of a tiny LoRA model and 8 groups x G=4 rollouts
    with rewards of every success rate."""
    model, _ = tiny_model(seed=0)
    model = attach_lora(model, 4, 8.0, ["q_proj", "v_proj"], seed=0)
    gen = torch.Generator().manual_seed(seed)
    randomize_lora_b(model, 0.1, gen)
    ids = torch.randint(3, 40, (GROUPS * G, T), generator=gen)
    lengths = torch.randint(4, T + 1, (GROUPS * G,), generator=gen)
    attn = (torch.arange(T)[None, :] < lengths[:, None]).long()
    cmask = ((torch.arange(T)[None, :] >= 2) & (attn == 1)).float()
    rewards = torch.randint(0, 2, (GROUPS, G), generator=gen).float()
    rollouts = Rollouts(ids, attn, cmask, rewards, torch.zeros_like(rewards), lengths,
                        torch.zeros(GROUPS * G, dtype=torch.bool))
    return model, StepRollouts(rollouts, rollouts, {})


def config(*extra):
    return load_config(FGRPOJobConfig, None, [f"fgrpo.batch_prompts={GROUPS}",
                                              f"fgrpo.sampling.num_generations={G}",
                                              f"task.max_new_tokens={T}",
                                              "fgrpo.optim.micro_batch=5",
                                              "fgrpo.optim.learning_rate=0.05", *extra])


def lora(model):
    return [p.detach().clone() for p in model.parameters() if p.requires_grad]


def earlier_step(model, weights, batch, cfg, world, seed):
    """The F-GRPO update as earlier versions ran it (fgrpo/trainer.py before mini-batches):
    mu passes, each one update of the whole batch."""
    f, rollouts = cfg.fgrpo, batch.train
    adv = group_advantages(rollouts.shaped_rewards, f.advantage.scale_rewards,
                           f.advantage.gamma, eps=f.advantage.epsilon,
                           success_threshold=f.reward.success_threshold,
                           task_rewards=rollouts.rewards)
    from fgrpo.step import frozen_logprobs
    old = (frozen_logprobs(model, rollouts, f.optim.micro_batch, cfg.model.logprob_chunk)
           if f.optim.num_iterations > 1 else None)
    model.train()
    torch.manual_seed(seed)
    row_adv = adv.advantages.reshape(-1)
    for _ in range(f.optim.num_iterations):
        weights.zero_grad()
        accumulate_gradients(model, rollouts, row_adv, cfg, world, cfg.task.max_new_tokens, old)
        weights.ensure_gradients()
        weights.reduce_gradients(world)
        assert weights.step(f.optim.max_grad_norm)
    weights.free_gradients()


@pytest.mark.parametrize("mu", [1, 2])
@pytest.mark.parametrize("mini", [0, GROUPS])
def test_one_update_a_pass_is_the_earlier_step_bitwise(mini, mu):
    world, results = OneRank(), []
    for new in (True, False):
        model, batch = setup()
        cfg = config(f"fgrpo.optim.mini_batch_prompts={mini}", f"fgrpo.optim.num_iterations={mu}")
        weights = TrainedWeights([p for p in model.parameters() if p.requires_grad],
                                 cfg.fgrpo.optim.learning_rate, cfg.fgrpo.optim.weight_decay)
        for step in range(2):
            model.eval()
            if new:
                update = train_on_rollouts(model, weights, batch, cfg, world, step, seed=step)
                assert update.updates == mu and update.finite
            else:
                earlier_step(model, weights, batch, cfg, world, seed=step)
        results.append(lora(model))
    assert all(torch.equal(a, b) for a, b in zip(*results))
    assert any(not torch.equal(a, b) for a, b in zip(results[0], lora(setup()[0])))


def test_four_updates_make_the_later_ones_off_policy_and_the_clip_act():
    model, batch = setup()
    cfg = config("fgrpo.optim.mini_batch_prompts=2", "fgrpo.optim.learning_rate=0.5")
    weights = TrainedWeights([p for p in model.parameters() if p.requires_grad],
                             cfg.fgrpo.optim.learning_rate, 0.0)
    model.eval()
    update = train_on_rollouts(model, weights, batch, cfg, OneRank(), 0, seed=0)
    assert update.updates == 4 and len(update.per_update) == 4
    ratios = [u["ratio_mean"] for u in update.per_update]
    assert abs(ratios[0] - 1.0) < 1e-5  # on-policy: the sampling policy's own weights
    assert all(abs(r - 1.0) > 1e-4 for r in ratios[1:]), ratios
    assert update.per_update[0]["clip_fraction"] == 0.0
    assert sum(u["clip_fraction"] for u in update.per_update[1:]) > 0
    assert update.sums["clip_fraction"] > 0  # the clipped tokens the step's metrics count
    # each update trained its own two groups: groups i and i + 4 (i mod 4)
    masks = mini_batches(None, GROUPS, 4)
    assert [m.nonzero().flatten().tolist() for m in masks] == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_mini_batches_follow_the_groups_place_in_the_step_not_the_rank():
    order = torch.tensor([4, 5, 6, 7])  # rank 1 of 2 holds groups 4..7 of the step
    assert [m.tolist() for m in mini_batches(order, 4, 2)] == \
        [[True, False, True, False], [False, True, False, True]]
    assert mini_batches(order, 4, 1) == [None]


def test_warm_up_is_linear_from_zero():
    optim = config("fgrpo.optim.warmup_steps=4", "fgrpo.optim.learning_rate=1e-6").fgrpo.optim
    assert [learning_rate(optim, i) for i in range(6)] == \
        [0.0, 0.25e-6, 0.5e-6, 0.75e-6, 1e-6, 1e-6]
    assert learning_rate(config().fgrpo.optim, 0) == 0.05
    model, batch = setup()  # step 0 of a warm-up trains at 0: the weights stay
    cfg = config("fgrpo.optim.warmup_steps=4")
    weights = TrainedWeights([p for p in model.parameters() if p.requires_grad], 0.05, 0.0)
    before = lora(model)
    train_on_rollouts(model, weights, batch, cfg, OneRank(), 0, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(before, lora(model)))
    assert weights.opt.param_groups[0]["lr"] == 0.0


@pytest.mark.parametrize("overrides, words", [
    (["fgrpo.batch_prompts=16", "fgrpo.optim.mini_batch_prompts=5"],
     ["fgrpo.optim.mini_batch_prompts", "5", "16"]),
    (["fgrpo.batch_prompts=16", "fgrpo.optim.mini_batch_prompts=32"],
     ["fgrpo.optim.mini_batch_prompts", "32"]),
])
def test_mini_batches_that_do_not_divide_the_batch_are_one_line(overrides, words):
    from hpc.runtime.errors import UserError
    with pytest.raises(UserError) as err:
        load_config(FGRPOJobConfig, None, overrides)
    assert "\n" not in str(err.value) and all(w in str(err.value) for w in words)


@pytest.mark.mpi
@pytest.mark.toy
def test_two_rank_job_with_four_updates_a_step_equals_one_rank(toy_adapter, tmp_path):
    """One step of 16 prompts in 4 updates of 4, 2 PPO epochs: the rollouts are the SFT
    policy's on any rank count (keyed sampling), so the 2-rank job's exported adapter must equal
    the 1-rank job's within the DDP gradient tests' tolerance (rtol 1e-5, atol 1e-7,
    tests/test_fgrpo.py::test_ddp_gradient_equals_single_process) and its metrics agree."""
    runs = {}
    for n in (1, 2):
        out = tmp_path / f"n{n}"
        proc = run_mpi(n, fgrpo_args(toy_adapter, out, "fgrpo.steps=1",
                                     "fgrpo.optim.mini_batch_prompts=4",
                                     "fgrpo.optim.num_iterations=2", "task.n_eval=8",
                                     "fgrpo.optim.learning_rate=0.002"), timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[n] = (load_file(str(out / "adapter" / "adapter_model.safetensors")),
                   RunFile(str(out / "fgrpo.h5")).group("metrics"))
    (one, m1), (two, m2) = runs[1], runs[2]
    assert m1["updates"].tolist() == m2["updates"].tolist() == [8]
    assert m1["ratio_mean"][0] != 1.0  # the last epoch's updates were off-policy
    start = load_file(f"{toy_adapter}/adapter_model.safetensors")
    assert any(not torch.equal(one[k], start[k]) for k in one)
    for key in one:
        torch.testing.assert_close(two[key], one[key], rtol=1e-5, atol=1e-7)
    for key in ("reward_mean", "success_rate", "focal_weight_mean", "clipped_tokens"):
        assert m1[key][0] == pytest.approx(m2[key][0], rel=1e-6), key
