"""A new ES optimizer and a new F-GRPO surrogate are a class and one registering line each: the
toys below, registered in the job's own process before its main runs, drive a real job on the
built-in toy model (no package edit, no reinstall); docs/architecture.md walks through both."""
import os

import numpy as np
import pytest
import yaml

from conftest import REPO, run_cli
from hpc.runtime.runstore import RunFile

GENERATIONS, STEPS = 2, 2
CONSTANT_LOSS = 7.0

# python -c: register one toy of this file, then run the method's main on the arguments
REGISTER_AND_RUN = ("import sys; sys.path.insert(0, {tests!r}); import test_plugins; "
                    "from {registry} import {table}; "
                    "{table}[{name!r}] = test_plugins.{toy}; "
                    "from {method}.__main__ import main; sys.exit(main())")


class CountingES:
    """A toy ES optimizer: all members are the mean, and the mean is the number of ask() calls
    so far in every coordinate, so the exported mean counts the generations asked."""

    def __init__(self, dim, popsize, sigma0, seed, lr, stds):
        self.dim, self.popsize, self.asked = dim, popsize, 0

    @property
    def mean(self) -> np.ndarray:
        return np.full(self.dim, float(self.asked))

    def ask(self) -> np.ndarray:
        self.asked += 1
        return np.tile(self.mean, (self.popsize, 1))

    def tell(self, solutions, fitness) -> None:
        pass

    def state_dict(self) -> dict:
        return {"asked": self.asked}

    def load_state_dict(self, state: dict) -> None:
        self.asked = state["asked"]


class ConstantLoss:
    """A toy surrogate without parameters (so no section of its own): every token's loss is
    CONSTANT_LOSS, whatever the ratio and advantage; the run's loss metric shows it."""

    def __call__(self, logp, ratio, adv):
        import torch

        none = torch.zeros_like(ratio, dtype=torch.bool)
        return logp * 0.0 + CONSTANT_LOSS, none, none


def run_with(registry: str, table: str, name: str, toy: str, method: str, args: list):
    """Run ``python -m method args`` (one process) with ``toy`` registered as ``name``."""
    code = REGISTER_AND_RUN.format(tests=os.path.join(REPO, "tests"), registry=registry,
                                   table=table, name=name, toy=toy, method=method)
    proc = run_cli(["-c", code, *args], timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]


def random_adapter(folder) -> str:
    """A LoRA adapter on the toy model with non-zero B factors (ESSA needs singular values)."""
    import torch

    from hpc.models.loading import attach_lora, load_model, randomize_lora_b, save_adapter

    model, _ = load_model("toy")
    peft_model = attach_lora(model, 2, 4.0, ["q_proj", "k_proj", "v_proj", "o_proj"])
    randomize_lora_b(peft_model, 0.1, torch.Generator().manual_seed(1))
    save_adapter(peft_model, str(folder))
    return str(folder)


def common_args(out) -> list:
    return ["model.path=toy", "task.n_train=16", "task.n_eval=4", "eval.every=0",
            "eval.n_samples=1", "eval.batch_size=4", "run.progress=false", f"run.out={out}"]


@pytest.mark.subprocess
@pytest.mark.toy
def test_a_registered_es_optimizer_runs_an_essa_job(tmp_path):
    out = tmp_path / "run"
    run_with("essa.optimizers", "OPTIMIZERS", "counting", "CountingES", "essa",
             [*common_args(out), f"lora.adapter={random_adapter(tmp_path / 'adapter')}",
              "essa.optimizer=counting", "essa.population=2", "essa.minibatch=2",
              f"essa.generations={GENERATIONS}"])
    run = RunFile(str(out / "essa.h5"))
    assert yaml.safe_load(run.attrs["config"])["essa"]["optimizer"] == "counting"
    assert run.group("essa")["fitness"].shape == (GENERATIONS, 2)
    assert np.array_equal(run.group("final")["mean"][-1],
                          np.full(run.attrs["search_dim"], float(GENERATIONS)))


@pytest.mark.subprocess
@pytest.mark.toy
def test_a_registered_surrogate_is_the_loss_of_an_fgrpo_job(tmp_path):
    out = tmp_path / "run"
    run_with("fgrpo.surrogates", "SURROGATES", "constant", "ConstantLoss", "fgrpo",
             [*common_args(out), "fgrpo.loss.surrogate=constant", f"fgrpo.steps={STEPS}",
              "fgrpo.batch_prompts=2", "fgrpo.sampling.num_generations=2",
              "task.max_new_tokens=4"])
    run = RunFile(str(out / "fgrpo.h5"))
    assert yaml.safe_load(run.attrs["config"])["fgrpo"]["loss"]["surrogate"] == "constant"
    assert run.group("metrics")["loss"].tolist() == [CONSTANT_LOSS] * STEPS
