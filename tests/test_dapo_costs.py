"""Dynamic sampling's extra rollouts in the memory plan (hpc-plan) and the scaling model
(hpc-scaling): an expected filtered share, from a key or a pilot run file."""
import numpy as np
import pytest

from compare.measured import _rollout_rounds
from compare.model import Workload, fgrpo_step
from compare.network import LINKS, Network
from fgrpo.plan import expected_rounds, plan as fgrpo_plan
from hpc.engine.shape import ModelShape
from test_memory_plan import cluster_config, model_folder
from test_scaling import PAPER_W, paper_costs


@pytest.mark.parametrize("share, refills, rounds", [
    (0.0, 9, 1), (0.25, 9, 2), (0.5, 9, 2), (0.51, 9, 3), (0.9, 9, 10), (0.95, 9, 10),
    (0.95, 3, 4)])
def test_expected_rounds_are_whole_refill_rounds(share, refills, rounds):
    """Round r yields (1 - share) B informative groups: ceil(1 / (1 - share)) rounds fill B."""
    assert expected_rounds(share, refills) == rounds


def test_memory_plan_counts_the_kept_rollouts_and_says_the_extra_rollouts(tmp_path):
    cfg = cluster_config(model_folder(tmp_path, "7B"), "fgrpo.algorithm=dapo",
                         "fgrpo.sampling.filtered_share=0.6")
    shape = ModelShape.from_folder(cfg.model.path)
    plan = fgrpo_plan(shape, cfg, ranks=16)
    rollout = plan.phase("rollout")
    kept = dict(rollout.parts)["rollouts kept over 3 sampling rounds"]
    rows = (min(cfg.model.decode_batch, -(-cfg.fgrpo.batch_prompts // 16))
            * cfg.fgrpo.sampling.num_generations)
    assert kept == rows * (cfg.plan.max_prompt_tokens + cfg.task.max_new_tokens) * 20 * 2
    extra = 2 * cfg.fgrpo.batch_prompts * cfg.fgrpo.sampling.num_generations
    assert any(f"{extra} extra rollouts a step" in note for note in plan.notes)
    plain = fgrpo_plan(shape, cluster_config(cfg.model.path), ranks=16)
    assert not any("dynamic sampling" in note for note in plain.notes)
    assert rollout.peak == plain.phase("rollout").peak + kept


def test_scaling_model_decodes_every_round_and_trains_one_batch():
    cost, net = paper_costs(), Network(LINKS["infiniband-ndr"], LINKS["nvlink-h100"], 8)
    plain = fgrpo_step(64, PAPER_W, cost, net)
    w = Workload(**{**PAPER_W.__dict__, "fgrpo_rounds": 2.0})
    refilled = fgrpo_step(64, w, cost, net)
    assert refilled["generate"] == pytest.approx(2 * plain["generate"])
    assert refilled["forward_backward"] == plain["forward_backward"]
    assert refilled["allreduce"] == plain["allreduce"]


class Pilot:
    def __init__(self, extra):
        self.metrics = {"extra_rollouts": np.asarray(extra)}

    def group(self, name):
        return self.metrics


def test_pilot_run_gives_the_rollout_rounds():
    assert _rollout_rounds(Pilot([256, 0, 512, 256]), completions=256) == 2.0
    assert _rollout_rounds(type("Old", (), {"group": lambda self, n: {}})(), 256) == 1.0
