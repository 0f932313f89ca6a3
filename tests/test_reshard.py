"""Resume on another rank count under the real mpirun: a run cut back to its step-1 checkpoint
(what a kill after that checkpoint leaves) resumes on another number of ranks and ends as the
uninterrupted run did: FSDP2 F-GRPO (resharded through torch.distributed.checkpoint) within
1e-5 relative, DDP F-GRPO and SFT within 1e-5 relative (the gradient sums run in another
order), ESSA bitwise."""
import os
import shutil

import numpy as np
import pytest

from conftest import our_lines, run_mpi
from hpc.runtime.checkpoint import list_checkpoints, load_latest, step_of
from hpc.runtime.distckpt import prune_sharded, read_full
from hpc.runtime.runstore import RunFile

FGRPO = ("loss", "entropy", "reward_mean", "ratio_mean", "completion_length", "kl")


def fgrpo_args(out, *extra):
    return ["-m", "fgrpo", "model.path=toy", "task.n_train=64", "task.n_eval=12",
            "fgrpo.batch_prompts=12", "fgrpo.sampling.num_generations=4", "fgrpo.steps=2",
            "fgrpo.optim.num_iterations=2", "fgrpo.optim.micro_batch=8", "eval.every=0",
            "eval.n_samples=1", "run.progress=false", "run.checkpoint_every=1",
            "fgrpo.keep_checkpoints=2", f"run.out={out}", *extra]


def sft_args(out, *extra):
    return ["-m", "sft", "model.path=toy", "task.n_train=200", "task.n_eval=8",
            "sft.batch_size=12", "sft.steps=2", "eval.every=0", "eval.n_samples=1",
            "run.progress=false", "run.checkpoint_every=1", f"run.out={out}", *extra]


def essa_args(adapter, out):
    return ["-m", "essa", "model.path=toy", f"lora.adapter={adapter}", "task.n_train=200",
            "task.n_eval=8", "essa.population=6", "essa.minibatch=16", "essa.generations=2",
            "essa.sigma0=0.5", "eval.every=0", "eval.n_samples=2", "eval.batch_size=16",
            "run.progress=false", "run.checkpoint_every=1", f"run.out={out}"]


def cut_to_step(src, dst, step: int):
    """A copy of run folder ``src`` as a kill right after the checkpoint of ``step`` leaves
    it: later checkpoints removed (with their sharded folders, by the retention's own rule)."""
    shutil.copytree(src, dst)
    ckpt = str(dst / "checkpoints")
    for path in list_checkpoints(ckpt):
        if step_of(path) > step:
            os.remove(path)
            os.remove(path[:-len(".safetensors")] + ".sha256")
    prune_sharded(ckpt)
    return dst


def damage(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def run_ok(ranks, args):
    proc = run_mpi(ranks, args, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def resumed_on(ranks, src, dst, args_of):
    """Cut ``src`` back to step 1 into ``dst`` and resume it on ``ranks`` ranks."""
    cut_to_step(src, dst, 1)
    run_ok(ranks, args_of(dst) + ["--resume"])
    return dst


def relative(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def assert_metrics_close(a, b, names, rtol):
    assert a["step"].tolist() == b["step"].tolist() == [1, 2]
    for name in names:
        np.testing.assert_allclose(a[name], b[name], rtol=rtol, atol=1e-9, err_msg=name)


def trained_state(out):
    """The newest checkpoint's trained tensors and AdamW moments, whole: {name: tensor}."""
    state = load_latest(str(out / "checkpoints"))
    if state["sharded"] is not None:
        full = read_full(str(out / "checkpoints"), state["sharded"])
        tensors = dict(full["model"])
        for name, moments in full["optimizer"]["state"].items():
            tensors.update({f"{name}.{k}": v for k, v in moments.items() if v.dim() > 0})
        return tensors
    method = state["method"]
    tensors = {f"param{i}": p for i, p in enumerate(method["params"])}
    for i, moments in method["optimizer"]["state"].items():
        tensors.update({f"param{i}.{k}": v for k, v in moments.items() if v.dim() > 0})
    return tensors


def assert_state_close(a, b, rtol):
    assert set(a) == set(b) and a
    worst = max((relative(a[k], b[k]), k) for k in a)
    print("largest relative difference", worst)
    assert worst[0] < rtol, worst


@pytest.mark.mpi
@pytest.mark.toy
@pytest.mark.slow
def test_fsdp2_preempted_on_4_ranks_resumes_on_2_and_3(tmp_path):
    """On 2 ranks from a folder whose step-2 sharded state is damaged (it falls back to step
    1, with a warning), on 3 from one cut back to step 1."""
    whole = tmp_path / "whole"
    run_ok(4, fgrpo_args(whole, "fgrpo.parallel.strategy=fsdp2"))
    base = RunFile(str(whole / "fgrpo.h5"))
    assert (np.abs(base.group("metrics")["loss"]) > 1e-6).all()
    for ranks in (2, 3):
        out = tmp_path / f"on{ranks}"
        if ranks == 2:
            shutil.copytree(whole, out)
            damage(out / "checkpoints" / "sharded" / "step-00000002" / "__1_0.distcp")
            proc = run_ok(ranks, fgrpo_args(out, "fgrpo.parallel.strategy=fsdp2") + ["--resume"])
            lines = our_lines(proc.stderr)
            assert sum("its sharded state is unusable" in line and "checksum mismatch" in line
                       for line in lines) == 1, lines
            assert not any("Traceback" in line for line in lines), lines
        else:
            resumed_on(ranks, whole, out, lambda d: fgrpo_args(d, "fgrpo.parallel.strategy=fsdp2"))
        run = RunFile(str(out / "fgrpo.h5"))
        assert run.attrs["status"] == "complete"
        assert run.group("segments")["world_size"].tolist() == [4, ranks]
        assert run.group("segments")["step"].tolist() == [0, 1]
        timings = run.group("timings")["generate"]
        assert timings.shape == (2, 4) and np.isnan(timings[1, ranks:]).all()
        assert_metrics_close(run.group("metrics"), base.group("metrics"), FGRPO, 1e-5)
        assert_state_close(trained_state(out), trained_state(whole), 1e-5)
        assert sorted(os.listdir(out / "checkpoints" / "sharded")) == [
            "step-00000001", "step-00000002"]


@pytest.mark.mpi
@pytest.mark.toy
@pytest.mark.slow
def test_ddp_fgrpo_resumes_on_another_rank_count(tmp_path):
    """Weights within 5e-5 (measured 1e-5): the gradient sums run in another order, and in
    AdamW's first steps an entry whose moments nearly cancel turns their last-bit difference
    into a larger one."""
    whole = tmp_path / "whole"
    run_ok(1, fgrpo_args(whole))
    out = resumed_on(3, whole, tmp_path / "on3", fgrpo_args)
    run, base = (RunFile(str(d / "fgrpo.h5")) for d in (out, whole))
    assert run.group("segments")["world_size"].tolist() == [1, 3]
    assert_metrics_close(run.group("metrics"), base.group("metrics"), FGRPO, 1e-5)
    assert_state_close(trained_state(out), trained_state(whole), 5e-5)


@pytest.mark.mpi
@pytest.mark.toy
@pytest.mark.slow
def test_sft_resumes_on_another_rank_count(tmp_path):
    whole = tmp_path / "whole"
    run_ok(1, sft_args(whole))
    out = resumed_on(2, whole, tmp_path / "on2", sft_args)
    run, base = (RunFile(str(d / "sft.h5")) for d in (out, whole))
    assert run.group("segments")["world_size"].tolist() == [1, 2]
    assert_metrics_close(run.group("metrics"), base.group("metrics"), ("loss",), 1e-5)
    assert_state_close(trained_state(out), trained_state(whole), 1e-5)


@pytest.mark.mpi
@pytest.mark.toy
@pytest.mark.slow
def test_essa_resumes_on_another_rank_count_bitwise(toy_adapter, tmp_path):
    whole = tmp_path / "whole"
    run_ok(2, essa_args(toy_adapter, whole))
    out = resumed_on(3, whole, tmp_path / "on3", lambda d: essa_args(toy_adapter, d))
    run, base = (RunFile(str(d / "essa.h5")) for d in (out, whole))
    assert run.group("segments")["world_size"].tolist() == [2, 3]
    assert run.group("essa")["evaluated_by"][-1].max() == 2  # the second segment: 3 ranks
    assert base.group("essa")["fitness"].std() > 0
    for group, name in (("essa", "fitness"), ("final", "mean"), ("final", "best"),
                        ("metrics", "fitness_mean"), ("eval", "accuracy")):
        assert np.array_equal(run.group(group)[name], base.group(group)[name]), (group, name)
    assert (out / "adapter-mean" / "adapter_model.safetensors").read_bytes() == \
        (whole / "adapter-mean" / "adapter_model.safetensors").read_bytes()


def test_per_rank_timings_follow_the_rank_count_of_each_segment(tmp_path):
    """In one process: a run file whose segments have 2, 4 then 3 ranks; the per-rank timings
    widen (a dataset created fixed at 2 columns is rebuilt) and pad with NaN, and the report
    reads the last segment's steps on its ranks."""
    from hpc.analysis.report import step_timings
    from hpc.runtime.runstore import RunStore

    path = str(tmp_path / "run.h5")
    store = RunStore(path, True, {"method": "sft", "phases": '{"train": "train"}'})
    step = 0
    for ranks in (2, 4, 3):
        store.write_row("segments", step, world_size=ranks)
        for _ in range(2):
            step += 1
            store.log_step(step, metrics={"loss": 1.0 / step},
                           timings={"train": np.arange(ranks, dtype=float) + step})
    store.close()
    run = RunFile(path)
    train = run.group("timings")["train"]
    assert train.shape == (6, 4)
    assert np.isnan(train[:2, 2:]).all() and np.isnan(train[4:, 3]).all()
    assert train[3].tolist() == [4.0, 5.0, 6.0, 7.0] and train[5, :3].tolist() == [6.0, 7.0, 8.0]
    assert run.group("segments")["world_size"].tolist() == [2, 4, 3]
    last = step_timings(run)["train"]
    assert last.tolist() == [[5.0, 6.0, 7.0], [6.0, 7.0, 8.0]]
