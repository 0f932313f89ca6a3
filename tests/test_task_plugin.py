"""A new task is one file plus one line in hpc.data.registry.TASKS (docs/data.md): the toy task
``parity`` below, defined here and registered from outside the package, runs through a real
F-GRPO job on the toy model, and the run file shows its problems and reward were used."""
import random
from types import SimpleNamespace

import pytest
import yaml

from hpc.data.split import Split, Task

REGISTRY_LINE = "TASKS['parity'] = 'test_task_plugin:load_parity'"


def parity_reward(completion: str, gold: str) -> float:
    """1 where the problem's sum is even, whatever the completion: a job's accuracy is then the
    share of even sums among its problems, a number only this task gives."""
    return 1.0 if gold == "even" else 0.0


def load_parity(cfg) -> Task:
    """``a+b=`` problems (the toy model's prompts) whose gold is the parity of the sum; the
    eval split is drawn first, so it depends on ``task.n_eval`` and ``task.seed`` alone."""
    rng = random.Random(cfg.seed)

    def split(n: int) -> Split:
        pairs = [(rng.randint(10, 99), rng.randint(10, 99)) for _ in range(n)]
        return Split([f"{a}+{b}=" for a, b in pairs],
                     ["even" if (a + b) % 2 == 0 else "odd" for a, b in pairs],
                     [str(a + b) for a, b in pairs], [f"{a}+{b}" for a, b in pairs])

    evaluation = split(cfg.n_eval)
    return Task("parity", train=split(cfg.n_train), eval=evaluation, reward_fn=parity_reward)


def test_the_toy_task_is_unknown_until_registered(monkeypatch):
    from hpc.data.registry import TASKS, task_loader
    from hpc.runtime.errors import UserError

    with pytest.raises(UserError, match="'parity' is not a task"):
        task_loader("parity")
    monkeypatch.setitem(TASKS, "parity", "test_task_plugin:load_parity")
    assert task_loader("parity") is load_parity


@pytest.mark.subprocess
@pytest.mark.toy
def test_a_task_registered_from_outside_the_package_runs_an_fgrpo_job(tmp_path):
    from conftest import run_cli
    from hpc.runtime.runstore import RunFile

    out = tmp_path / "run"
    argv = ["model.path=toy", "task.name=parity", "task.n_train=8", "task.n_eval=12",
            "task.max_new_tokens=3", "fgrpo.steps=2", "fgrpo.batch_prompts=2",
            "fgrpo.sampling.num_generations=2", "eval.every=0", "eval.n_samples=2",
            "run.progress=false", f"run.out={out}"]
    code = ("import sys; sys.path.insert(0, 'tests'); "
            "from hpc.data.registry import TASKS; "
            f"{REGISTRY_LINE}; "
            "from fgrpo.__main__ import main; "
            f"sys.exit(main({argv!r}))")
    proc = run_cli(["-c", code], timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = RunFile(str(out / "fgrpo.h5"))
    assert yaml.safe_load(run.attrs["config"])["task"]["name"] == "parity"
    golds = load_parity(SimpleNamespace(n_train=0, n_eval=12, seed=0)).eval.answers
    even_share = golds.count("even") / len(golds)
    assert 0 < even_share < 1, golds  # else the accuracy would not tell the task apart
    # greedy accuracy at the start and the end: the toy task's reward on its own problems
    assert run.group("eval")["accuracy"].tolist() == [even_share, even_share]
    # each step's reward: the share of even sums among the step's 2 prompts
    assert set(run.group("metrics")["reward_mean"].tolist()) <= {0.0, 0.5, 1.0}
