"""The warm start's own data (``task.sft_split``) and SFT by epochs (``sft.epochs``): the split
is disjoint, deterministic from task.seed and the same for every method; SFT by epochs runs
ceil(problems / batch) steps an epoch and sees each problem once an epoch; bad values end in
one error line."""
import h5py
import numpy as np
import pytest

from conftest import our_lines, run_cli, run_mpi
from hpc.data.tasks import load_task, sft_split_indices
from hpc.data.config import TaskConfig
from hpc.runtime.config import load_config
from hpc.runtime.errors import UserError
from sft.config import SFTJobConfig
from sft.trainer import epoch_batch


def test_the_split_is_disjoint_complete_and_deterministic():
    sft, rest = sft_split_indices(7473, 1495, seed=0)
    assert len(sft) == 1495 and len(rest) == 5978  # the ESSA paper's GSM8K split
    assert not set(sft) & set(rest) and sorted(sft + rest) == list(range(7473))
    assert (sft, rest) == sft_split_indices(7473, 1495, seed=0)
    assert sft != sft_split_indices(7473, 1495, seed=1)[0]
    assert len(sft_split_indices(7473, 0.2, seed=0)[0]) == 1495  # a fraction, rounded
    assert sft_split_indices(10, 0, seed=0) == (list(range(10)), list(range(10)))


def test_sft_trains_on_the_held_apart_part_and_the_others_on_the_rest():
    cfg = TaskConfig(n_train=100, n_eval=8, sft_split=0.25, seed=3)
    sft, rest, again = load_task(cfg, part="held"), load_task(cfg), load_task(cfg, part="rest")
    assert len(sft.train) == 25 and len(rest.train) == 75
    assert not set(sft.train.prompts) & set(rest.train.prompts)
    assert rest.train.prompts == again.train.prompts
    whole = load_task(TaskConfig(n_train=100, n_eval=8, seed=3))
    assert set(sft.train.prompts) | set(rest.train.prompts) == set(whole.train.prompts)
    assert sft.eval.prompts == rest.eval.prompts == whole.eval.prompts  # eval is not split


@pytest.mark.parametrize("value, words", [(1.5, ["1.5", "whole count"]),
                                          (100, ["100", "of the 100"]),
                                          (0.001, ["holds apart 0"])])
def test_a_bad_split_is_one_user_error(value, words):
    with pytest.raises(UserError) as caught:
        load_task(TaskConfig(n_train=100, n_eval=8, sft_split=value))
    assert "\n" not in str(caught.value) and "task.sft_split" in str(caught.value)
    for word in words:
        assert word in str(caught.value)


def test_an_epoch_sees_each_problem_once_and_the_last_batch_is_filled_up():
    n, batch = 21, 8
    steps = -(-n // batch)
    epoch = np.concatenate([epoch_batch(n, batch, i, steps, seed=5) for i in range(steps)])
    assert len(epoch) == steps * batch and set(epoch[:n]) == set(range(n))
    assert list(epoch[n:]) == list(epoch[:steps * batch - n])
    nxt = np.concatenate([epoch_batch(n, batch, i, steps, 5) for i in range(steps, 2 * steps)])
    assert set(nxt[:n]) == set(range(n)) and list(nxt) != list(epoch)  # a new order an epoch
    assert list(epoch_batch(n, batch, 1, steps, 5)) == list(epoch_batch(n, batch, 1, steps, 5))


def test_the_keys_are_read_and_a_negative_epoch_count_is_refused():
    cfg = load_config(SFTJobConfig, None, ["sft.epochs=3", "task.sft_split=0.2"])
    assert cfg.sft.epochs == 3 and cfg.task.sft_split == 0.2
    for bad in ("sft.epochs=-1", "task.sft_split=-0.5"):
        with pytest.raises(UserError) as caught:
            load_config(SFTJobConfig, None, [bad])
        assert "\n" not in str(caught.value) and bad.split("=")[0] in str(caught.value)


@pytest.mark.mpi
@pytest.mark.toy
def test_sft_by_epochs_on_its_split_runs_the_epochs_steps(tmp_path):
    out = tmp_path / "run"
    proc = run_mpi(1, ["-m", "sft", "model.path=toy", "task.n_train=120", "task.n_eval=8",
                       "task.sft_split=20", "sft.batch_size=8", "sft.epochs=2", "sft.steps=50",
                       "eval.every=0", "eval.n_samples=1", "run.progress=false",
                       f"run.out={out}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    with h5py.File(out / "sft.h5", "r") as f:
        assert len(f["metrics/loss"]) == 2 * 3  # 2 epochs of ceil(20 / 8) steps


@pytest.mark.toy
def test_a_split_too_large_for_the_training_set_is_one_error_line(tmp_path):
    proc = run_cli(["-m", "sft", "model.path=toy", "task.n_train=50", "task.n_eval=8",
                    "task.sft_split=50", f"run.out={tmp_path / 'run'}"])
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in our_lines(proc.stderr) if line.startswith("error")]
    assert len(errors) == 1 and "task.sft_split" in errors[0], our_lines(proc.stderr)
    assert "Traceback" not in proc.stderr
