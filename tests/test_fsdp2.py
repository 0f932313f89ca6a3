"""fgrpo.parallel.strategy=fsdp2 against ddp under the real mpirun (gloo, fp32 toy), fp32 master
weights under bf16 compute, the full fine-tune's export, sharded (DCP) checkpoints (resume on
another rank count: tests/test_reshard.py)."""
import os
import shutil

import numpy as np
import pytest
import torch

from conftest import our_lines, run_mpi
from hpc.toys.toy import tiny_model
from hpc.models.parallelize import TrainedWeights
from hpc.runtime.checkpoint import list_checkpoints, load_latest
from hpc.runtime.distckpt import read_full
from hpc.runtime.runstore import RunFile
from hpc.runtime.world import World

STEPS = 2


def fgrpo_args(out, *extra):
    return ["-m", "fgrpo", "model.path=toy", "task.n_train=64", "task.n_eval=12",
            "fgrpo.batch_prompts=6", "fgrpo.sampling.num_generations=4", f"fgrpo.steps={STEPS}",
            "fgrpo.optim.num_iterations=2",
            "fgrpo.optim.micro_batch=8", "eval.every=0", "eval.n_samples=1", "run.progress=false",
            "run.checkpoint_every=1", f"fgrpo.keep_checkpoints={STEPS}", f"run.out={out}",
            *extra]


def checkpoint_at(directory, step, tmp_path):
    """The checkpoint of ``step`` in ``directory`` (through the public loader)."""
    one = tmp_path / f"one-{abs(hash(str(directory)))}-{step}"
    one.mkdir(exist_ok=True)
    for path in list_checkpoints(str(directory)):
        if path.endswith(f"step-{step:08d}.safetensors"):
            shutil.copy(path, one)
            shutil.copy(path[:-len(".safetensors")] + ".sha256", one)
    return load_latest(str(one))


def masters_at(out, step, ranks, tmp_path):
    """The trained fp32 tensors after ``step``: DDP's from the checkpoint, FSDP2's whole from
    its sharded (DCP) folder, in the optimizer's parameter order."""
    state = checkpoint_at(out / "checkpoints", step, tmp_path)
    if state["sharded"] is None:
        return state["method"]["params"]
    assert state["sharded"]["ranks"] == ranks
    full = read_full(str(out / "checkpoints"), state["sharded"])
    order = full["optimizer"]["param_groups"][0]["params"]
    return [full["model"][name] for name in order]


def relative(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.fixture(scope="module")
def compared_run(tmp_path_factory):
    """``compared_run(ranks, mode, parallelism)``: the folder of that run of
    test_fsdp2_equals_ddp_step_by_step, run the first time it is asked for (read-only to the
    tests): test_resume_with_another_parallelism_is_refused resumes a copy of the 2-rank LoRA
    FSDP2 one instead of a run of its own."""
    root = tmp_path_factory.mktemp("compared")
    made = {}

    def run(ranks, mode, parallelism):
        if (ranks, mode, parallelism) not in made:
            out = root / f"{mode}-{ranks}-{parallelism}"
            extra = (["fgrpo.full_finetune=true", "fgrpo.optim.learning_rate=1e-4"]
                     if mode == "full" else [])
            offload = "state" if parallelism == "fsdp2" else "optimizer"  # changes nothing
            proc = run_mpi(ranks, fgrpo_args(out, f"fgrpo.parallel.strategy={parallelism}",
                                             f"fgrpo.parallel.offload={offload}", *extra),
                           timeout=300)
            assert proc.returncode == 0, proc.stderr[-3000:]
            made[(ranks, mode, parallelism)] = out
        return made[(ranks, mode, parallelism)]

    return run


@pytest.mark.parametrize("mode, ranks", [
    pytest.param("lora", 2, marks=pytest.mark.xdist_group("fsdp2_lora_2")),  # see compared_run
    ("full", 2), ("lora", 3), ("full", 3)], ids=["lora-2", "full-2", "lora-3", "full-3"])
@pytest.mark.mpi
@pytest.mark.toy
@pytest.mark.slow
def test_fsdp2_equals_ddp_step_by_step(compared_run, tmp_path, ranks, mode):
    outs = {p: compared_run(ranks, mode, p) for p in ("ddp", "fsdp2")}
    ddp, fsdp = (RunFile(str(outs[p] / "fgrpo.h5")).group("metrics") for p in ("ddp", "fsdp2"))
    assert ddp["step"].tolist() == list(range(1, STEPS + 1))
    assert (np.abs(ddp["loss"]) > 1e-6).all()  # a second pass over the rollouts: ratio != 1
    # the loss is a mean of terms of order 1 that nearly cancel (-0.0026 at step 2): another
    # summation order moves it by float32 rounding of those terms (2.7e-8 measured), so its
    # absolute tolerance is one float32 ulp of 1 (1.2e-7), not a share of the small result
    for key in ("loss", "entropy", "reward_mean", "ratio_mean", "completion_length"):
        np.testing.assert_allclose(fsdp[key], ddp[key], rtol=1e-5,
                                   atol=1.2e-7 if key == "loss" else 1e-9, err_msg=key)
    previous = None
    for step in range(1, STEPS + 1):
        a = masters_at(outs["ddp"], step, ranks, tmp_path)
        b = masters_at(outs["fsdp2"], step, ranks, tmp_path)
        assert len(a) == len(b) and all(x.shape == y.shape for x, y in zip(a, b))
        # 5e-5: measured 1.5e-5 (LoRA, 2 ranks), 2.4e-5 (LoRA, 3), 1.3e-6 (full, 2), all in
        # one LoRA B factor of the last layer, whose gradient is a sum of nearly cancelling
        # terms: summed in another order its last bits differ, and AdamW scales every entry's
        # step to about lr whatever the gradient's size
        assert max(relative(y, x) for x, y in zip(a, b)) < 5e-5, step
        if previous is not None:  # the weights moved between the compared steps
            assert any(not torch.equal(x, p) for x, p in zip(a, previous))
        previous = a


@pytest.mark.mpi
@pytest.mark.toy
def test_full_finetune_export_loads_in_transformers_and_reproduces_accuracy(tmp_path):
    """An FSDP2 full fine-tune's export is a save_pretrained folder: plain transformers loads
    it, and hpc-eval on it logs the run's final accuracy."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    proc = run_mpi(2, fgrpo_args(out, "fgrpo.parallel.strategy=fsdp2", "fgrpo.full_finetune=true",
                                 "fgrpo.optim.learning_rate=1e-3"), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    folder = out / "model"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(folder))
    model = AutoModelForCausalLM.from_pretrained(str(folder))
    assert type(model).__name__ == "Qwen2ForCausalLM"
    logged = RunFile(str(out / "fgrpo.h5")).group("eval")
    proc = run_mpi(2, ["-m", "hpc.evaluate", f"model.path={folder}", "task.n_train=64",
                       "task.n_eval=12", "eval.n_samples=1", "run.progress=false",
                       f"run.out={tmp_path / 'eval'}"], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    evaluated = RunFile(str(tmp_path / "eval" / "eval.h5")).group("eval")
    assert evaluated["accuracy"][-1] == logged["accuracy"][-1]


def assert_one_line(stderr, words):
    """The job said why in one line (once, from rank 0), with no traceback."""
    lines = our_lines(stderr)
    assert sum(words in line for line in lines) == 1, lines
    assert not any("Traceback" in line for line in lines), lines


@pytest.mark.mpi
@pytest.mark.toy
@pytest.mark.xdist_group("fsdp2_lora_2")  # the worker that ran the FSDP2 run it resumes
def test_resume_with_another_parallelism_is_refused(compared_run, tmp_path):
    """A copy of the comparison's 2-rank LoRA FSDP2 run, resumed under DDP for one more step."""
    out = tmp_path / "run"
    shutil.copytree(compared_run(2, "lora", "fsdp2"), out)
    proc = run_mpi(2, fgrpo_args(out, "fgrpo.parallel.strategy=ddp", f"fgrpo.steps={STEPS + 1}")
                   + ["--resume"])
    assert proc.returncode == 2
    assert_one_line(proc.stderr, "resume with the parallelism that wrote it")


@pytest.mark.mpi
@pytest.mark.toy
def test_uneven_prompts_over_ranks_exit_2(tmp_path):
    proc = run_mpi(2, fgrpo_args(tmp_path / "run", "fgrpo.parallel.strategy=fsdp2",
                                 "fgrpo.batch_prompts=5"))
    assert proc.returncode == 2
    assert_one_line(proc.stderr, "'fgrpo.batch_prompts'")


def _bf16_full_finetune(masters: bool, steps: int = 120, lr: float = 1e-6):
    """A bf16 full fine-tune of a tiny model at ``lr`` on one fixed batch, with fp32 masters
    (:class:`TrainedWeights`) or, as before, AdamW directly on the bf16 weights. Returns
    (per step: bf16 weights changed, per step: fraction of fp32 masters that moved, mean
    |total change| of the bf16 weights / (steps * lr))."""
    model, _ = tiny_model(hidden=32, layers=2, seed=0)
    model = model.to(torch.bfloat16).train()
    params = [p for p in model.parameters() if p.requires_grad]
    start = [p.detach().float().clone() for p in params]
    n = sum(p.numel() for p in params)
    one_rank = World(comm=None, rank=0, size=1, local_rank=0, local_size=1, hostname="here")
    weights = TrainedWeights(params, lr, 0.0) if masters else None
    opt = None if masters else torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    ids = torch.randint(3, 40, (4, 12), generator=torch.Generator().manual_seed(0))
    changed, master_moved = [], []
    for _ in range(steps):
        before = [p.detach().clone() for p in params]
        master_before = [m.detach().clone() for m in weights.masters] if masters else []
        weights.zero_grad() if masters else opt.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        if masters:
            weights.reduce_gradients(one_rank)
            assert weights.step(max_grad_norm=0.0)
        else:
            opt.step()
        changed.append(sum(int((p != b).sum()) for p, b in zip(params, before)))
        master_moved.append(sum(int((m != b).sum()) for m, b in
                                zip(weights.masters, master_before)) / n if masters else 0.0)
    total = sum(float((p.detach().float() - s).abs().sum()) for p, s in zip(params, start))
    return changed, master_moved, total / n / (steps * lr)


@pytest.mark.slow
def test_bf16_full_finetune_at_lr_1e6_moves_its_weights():
    """At lr 1e-6 an AdamW step (about lr per weight) is far below half a bf16 ulp at the
    weights' scale (~6e-5 at 0.02). With fp32 masters every master moves every step, the bf16
    weights change every step, and over 120 steps they travel about what AdamW asked (their
    mean |change| near 120 * lr). The old path (AdamW on the bf16 weights) fails the same
    check: only the few near-zero weights ever move."""
    changed, master_moved, travelled = _bf16_full_finetune(masters=True)
    assert all(c > 0 for c in changed)
    assert all(f > 0.9 for f in master_moved)
    assert travelled > 0.5
    _, _, old_travelled = _bf16_full_finetune(masters=False)
    assert old_travelled < 0.1


@pytest.mark.mpi
@pytest.mark.toy
def test_bf16_lora_with_reference_kl_runs(tmp_path):
    """bf16 compute over fp32 shards, LoRA, a KL term (whose reference pass freezes the LoRA
    factors for a moment through peft's disable_adapter): the gradients come back in fp32."""
    out = tmp_path / "run"
    proc = run_mpi(2, fgrpo_args(out, "fgrpo.parallel.strategy=fsdp2", "model.dtype=bfloat16",
                                 "fgrpo.loss.beta=0.1", "fgrpo.steps=2",
                                 "fgrpo.optim.num_iterations=1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = RunFile(str(out / "fgrpo.h5")).group("metrics")
    assert metrics["step"].tolist() == [1, 2] and metrics["kl"][-1] > 0


@pytest.mark.mpi
def test_offload_moves_the_state_while_decoding_and_changes_nothing(tmp_path):
    """fgrpo.parallel.offload (hpc.models.offload): while the model decodes, optimizer moves the
    AdamW moments and DDP's fp32 master copies off the device and state also FSDP2's shards (their
    storages hold 0 bytes), no gradient exists, and the logits, decoded tokens, masters and
    moments after two steps equal those of a run that moves nothing, bit for bit (2 ranks)."""
    out = tmp_path / "offload.pt"
    proc = run_mpi(2, ["tests/mpi/offload_check.py", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = torch.load(out, weights_only=False)
    for case in ("fsdp2-full", "fsdp2-lora", "ddp-full-bf16"):
        kept = results[(case, "none")]
        for held in kept["held"]:
            assert held["moments"] > 0 and held["gradients"] == 0
            assert (held["shards"] or 0) > 0 or case.startswith("ddp")
        for mode in ("optimizer", "state"):
            moved = results[(case, mode)]
            for held in moved["held"]:
                assert held["moments"] == 0 and held["master copies"] == 0, (case, mode)
                if case.startswith("fsdp2"):
                    assert (held["shards"] == 0) == (mode == "state"), (case, mode)
            assert moved["tokens"] == kept["tokens"], (case, mode)
            assert all(torch.equal(a, b) for a, b in zip(moved["logits"], kept["logits"]))
            for key in ("masters", "moments"):
                assert all(torch.equal(a, b) for a, b in zip(moved[key], kept[key])), key
            assert moved["before"] == kept["before"]  # every storage came back whole
    assert results[("ddp-full-bf16", "none")]["held"][0]["master copies"] > 0


@pytest.mark.mpi
@pytest.mark.toy
def test_fsdp2_runs_dapo_and_mini_batches_with_uneven_rows_as_ddp(tmp_path):
    """F-DAPO under FSDP2 (the paper's full fine-tuning of DAPO): dynamic sampling keeps a
    different number of groups on each of 3 ranks, and 3 mini-batch updates of 2 prompts leave
    every rank without rows in one of them; the idle forwards keep FSDP2's collectives in step,
    and the run follows DDP's within test_fsdp2_equals_ddp_step_by_step's tolerances."""
    extra = ["fgrpo.algorithm=dapo", "fgrpo.sampling.max_refills=2",
             "fgrpo.optim.mini_batch_prompts=2", "fgrpo.optim.num_iterations=1"]
    outs = {}
    for parallelism in ("ddp", "fsdp2"):
        outs[parallelism] = out = tmp_path / parallelism
        proc = run_mpi(3, fgrpo_args(out, f"fgrpo.parallel.strategy={parallelism}", *extra),
                       timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
    ddp, fsdp = (RunFile(str(outs[p] / "fgrpo.h5")).group("metrics") for p in ("ddp", "fsdp2"))
    assert ddp["updates"].tolist() == fsdp["updates"].tolist() == [3] * STEPS
    for key in ("reward_mean", "trained_groups", "sampling_rounds", "ratio_mean", "entropy"):
        np.testing.assert_allclose(fsdp[key], ddp[key], rtol=1e-5, atol=1e-9, err_msg=key)
    for step in range(1, STEPS + 1):
        a = masters_at(outs["ddp"], step, 3, tmp_path)
        b = masters_at(outs["fsdp2"], step, 3, tmp_path)
        assert max(relative(y, x) for x, y in zip(a, b)) < 5e-5, step
