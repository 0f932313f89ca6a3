"""DAPO's parts: the overlong penalty at its buffer's edges, overlong filtering, and dynamic
sampling's refill (every group uniform: refilled; no informative group left: the step keeps
what it has and logs the shortfall). Rank invariance and preemption: tests/test_fgrpo.py and
tests/test_faults.py."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import fgrpo.sampling as sampling
from fgrpo.advantages import group_advantages
from fgrpo.config import FGRPOJobConfig
from fgrpo.loss import step_counts
from fgrpo.rollout import Rollouts, cat_rollouts, overlong_penalty
from hpc.runtime.config import load_config


@pytest.mark.parametrize("length, want", [
    (0, 0.0), (15, 0.0), (16, 0.0),   # up to L - B = 16 tokens: no penalty
    (17, -0.25), (18, -0.5), (19, -0.75), (20, -1.0),  # -(|y| - 16) / 4 up to -1 at L = 20
])
def test_overlong_penalty_at_the_buffer_edges(length, want):
    """L = 20, B = 4, factor 1: verl's min(-(|y| - (L - B)) / B * factor, 0)."""
    got = overlong_penalty(torch.tensor([length]), max_len=20, buffer=4, factor=1.0)
    assert got.dtype == torch.float32 and float(got) == want


def test_overlong_penalty_factor_and_off():
    lengths = torch.tensor([[10, 19], [20, 3]])
    assert torch.equal(overlong_penalty(lengths, 20, 4, 0.5),
                       torch.tensor([[0.0, -0.375], [-0.5, 0.0]]))
    assert torch.equal(overlong_penalty(lengths, 20, 0, 1.0), torch.zeros(2, 2))
    # buffer = the whole limit: -|y| / L
    assert float(overlong_penalty(torch.tensor(5), 20, 20, 1.0)) == -0.25


def test_shaped_rewards_give_advantages_and_task_rewards_success():
    """A correct but overlong completion keeps its success (p) and loses advantage."""
    rewards = torch.tensor([[1.0, 1.0, 0.0, 1.0]])
    penalty = torch.tensor([[0.0, -0.5, 0.0, 0.0]])
    adv = group_advantages(rewards + penalty, "none", 1.0, task_rewards=rewards)
    assert float(adv.success_rate[0]) == 0.75 and float(adv.focal_weight[0]) == 0.25
    mean = (1 + 0.5 + 0 + 1) / 4
    torch.testing.assert_close(adv.advantages, 0.25 * (rewards + penalty - mean))


def rollouts(rewards, width=3, truncated=None):
    """Rollouts of (n, G) ``rewards`` with ``width``-token rows (2 completion tokens)."""
    n, G = len(rewards), len(rewards[0])
    cm = torch.zeros(n * G, width)
    cm[:, 1:] = 1.0
    return Rollouts(torch.arange(n * G * width).reshape(n * G, width),
                    torch.ones(n * G, width, dtype=torch.long), cm,
                    torch.tensor(rewards, dtype=torch.float32), torch.zeros(n, G),
                    torch.full((n * G,), 2), torch.tensor(truncated or [False] * (n * G)))


def test_groups_and_cat_keep_rows_in_order_and_pad():
    a = rollouts([[1.0, 0.0], [1.0, 1.0], [0.0, 1.0]])
    kept = a.groups(torch.tensor([True, False, True]))
    assert kept.rewards.tolist() == [[1.0, 0.0], [0.0, 1.0]]
    assert torch.equal(kept.input_ids, a.input_ids[[0, 1, 4, 5]])
    both = cat_rollouts([kept, rollouts([[0.0, 1.0]], width=5)], pad_id=-1)
    assert both.input_ids.shape == (6, 5) and both.input_ids[0, 3:].tolist() == [-1, -1]
    assert both.attention_mask[0, 3:].sum() == 0 and both.rewards.shape == (3, 2)


def test_filtered_rows_are_no_sequences_of_the_seq_means():
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    assert step_counts(mask).tolist() == [3.0, 2.0]


# ---------------------------------------------------------------- dynamic sampling

class OneRank:
    rank, size = 0, 1

    def allgatherv(self, send, counts, tag):
        assert tag == "sampling" and len(send) == counts[0]
        return send


class Split:
    def __init__(self, n):
        self.prompts, self.answers = [str(j) for j in range(n)], [""] * n

    def __len__(self):
        return len(self.prompts)


def fake_step(monkeypatch, informative: set, *overrides, n_train=40, G=4):
    """sample_step on a task of ``n_train`` prompts whose groups are informative (rewards 1,
    0, 0, 0) for the prompt indices in ``informative`` and uniform (all 0) otherwise; DAPO's
    preset with 4 prompts a step and 3 refills unless ``overrides`` say otherwise."""
    def fake_rollouts(model, tok, task, f, request, *, decoder, timer):
        return rollouts([[1.0] + [0.0] * (G - 1) if int(p) in informative else [0.0] * G
                         for p in request.prompts])
    monkeypatch.setattr(sampling, "sample_rollouts", fake_rollouts)
    cfg = load_config(FGRPOJobConfig, None, [
        "fgrpo.algorithm=dapo", "fgrpo.batch_prompts=4", "fgrpo.sampling.max_refills=3",
        f"fgrpo.sampling.num_generations={G}", *overrides])
    task, tok = SimpleNamespace(train=Split(n_train)), SimpleNamespace(pad_token_id=0)
    return lambda step: sampling.sample_step(None, tok, task, cfg, OneRank(), step, None, None)


def test_a_batch_of_uniform_groups_refills(monkeypatch):
    first = set(sampling.round_prompts(0, 1, 0, 40, 4).tolist())
    informative = set(range(40)) - first  # round 0 all uniform, most others informative
    out = fake_step(monkeypatch, informative)(1)
    s = out.stats
    assert s["sampling_rounds"] >= 2 and s["shortfall_groups"] == 0
    assert out.train.rewards.shape == (4, 4)
    assert torch.all(out.train.rewards.amax(1) > out.train.rewards.amin(1))
    assert s["extra_rollouts"] == (s["sampling_rounds"] - 1) * 4 * 4
    drawn = [sampling.round_prompts(0, 1, r, 40, 4) for r in range(s["sampling_rounds"])]
    assert s["filtered_groups"] == sum(int(j) not in informative for d in drawn for j in d)
    assert s["filtered_share"] == s["filtered_groups"] / (4 * s["sampling_rounds"])
    assert out.first.rewards.sum() == 0  # the step's reward metrics: its round 0


def test_no_informative_group_left_trains_on_what_it_has_and_logs_the_shortfall(monkeypatch):
    drawn = [sampling.round_prompts(0, 2, r, 40, 4) for r in range(4)]
    only = int(drawn[2][1])  # one informative prompt, first drawn in round 2
    out = fake_step(monkeypatch, {only})(2)
    hits = sum(int(j) == only for d in drawn for j in d)
    assert out.stats == {"sampling_rounds": 4, "filtered_groups": 16 - hits,
                         "filtered_share": (16 - hits) / 16, "extra_rollouts": 3 * 4 * 4,
                         "shortfall_groups": 4 - hits}
    assert out.train.rewards.shape == (hits, 4)
    none = fake_step(monkeypatch, set(), "fgrpo.sampling.max_refills=1")(3)
    assert none.stats["shortfall_groups"] == 4 and none.train.rewards.shape == (0, 4)
    assert none.train.input_ids.shape[0] == 0


def test_without_dynamic_sampling_every_group_is_kept(monkeypatch):
    out = fake_step(monkeypatch, set(), "fgrpo.algorithm=grpo")(1)
    assert out.train.rewards.shape == (4, 4) and out.stats["sampling_rounds"] == 1
    assert out.stats["filtered_groups"] == 0 and out.stats["extra_rollouts"] == 0


def test_keep_informative_takes_the_first_needed():
    uniform = np.array([1, 0, 0, 1, 0], dtype=np.uint8)
    assert keep(uniform, 2) == [False, True, True, False, False]
    assert keep(uniform, 0) == [False] * 5


def keep(uniform, need):
    return sampling.keep_informative(uniform, need).tolist()


class Tokenizer:
    pad_token_id = 0

    def __call__(self, text, **kwargs):
        return {"input_ids": [3, 4]}

    def batch_decode(self, ids, **kwargs):
        return ["a"] * len(ids)


class Timer:
    def phase(self, name):
        import contextlib
        return contextlib.nullcontext()


def test_truncated_completions_are_shaped_and_filtered(monkeypatch):
    """Length limit 4, buffer 2: a completion ended by eos at 2 tokens is untouched; one cut
    at 4 tokens (no eos) gets penalty -1 and, with overlong filtering, no loss tokens."""
    import fgrpo.rollout as rollout
    monkeypatch.setattr(rollout, "generate_tokens", lambda *a, **k: [[7, 2], [7, 7, 7, 7]])
    monkeypatch.setattr(rollout, "eos_ids", lambda model, tok: [2])
    tok = Tokenizer()
    model = torch.nn.Linear(1, 1)
    task = SimpleNamespace(rewards=lambda texts, answers: [1.0, 1.0])
    for filtered in (False, True):
        f = load_config(FGRPOJobConfig, None, [
            "fgrpo.sampling.num_generations=2", "fgrpo.reward.overlong_buffer=2",
            "task.max_new_tokens=4",
            f"fgrpo.loss.overlong_filter={str(filtered).lower()}"]).fgrpo
        out = rollout.sample_rollouts(model, tok, task, f,
                                      rollout.RolloutRequest(["q"], ["a"], 4, 8, 0),
                                      decoder=None, timer=Timer())
        assert out.truncated.tolist() == [False, True]
        assert out.penalty.tolist() == [[0.0, -1.0]] and out.rewards.tolist() == [[1.0, 1.0]]
        assert out.completion_mask[0].tolist() == [0, 0, 1, 1, 0, 0]
        assert out.completion_mask[1].tolist() == ([0] * 6 if filtered else [0, 0, 1, 1, 1, 1])
