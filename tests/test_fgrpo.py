"""F-GRPO end to end: DDP gradient under mpirun, learning on the toy task, resume, bad options."""
import json

import numpy as np
import peft
import pytest
import torch

from conftest import our_lines, run_mpi
from hpc.models.adapter_space import SingularValueSpace
from hpc.models.loading import load_model
from hpc.runtime.runstore import RunFile


LOSS_TYPES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
              "seq-mean-token-sum-norm"]


@pytest.fixture(scope="module")
def ddp_gradients(tmp_path_factory):
    """{ranks: {loss_type: LoRA gradients}} of tests/mpi/fgrpo_grad.py on 1 and 2 ranks (one
    run per rank count computes every loss type)."""
    grads = {}
    for n in (1, 2):
        out = tmp_path_factory.mktemp(f"grads-{n}")
        proc = run_mpi(n, ["tests/mpi/fgrpo_grad.py", str(out), *LOSS_TYPES], timeout=240)
        assert proc.returncode == 0, proc.stderr[-3000:]
        grads[n] = {loss: torch.load(out / f"{loss}.pt") for loss in LOSS_TYPES}
    return grads


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.mpi
@pytest.mark.xdist_group("ddp_gradients")  # one worker runs them once
def test_ddp_gradient_equals_single_process(ddp_gradients, loss_type):
    single, ddp = ddp_gradients[1][loss_type], ddp_gradients[2][loss_type]
    assert any(g.abs().sum() > 0 for g in single)
    for one, two in zip(single, ddp):
        torch.testing.assert_close(two, one, rtol=1e-5, atol=1e-7)


def fgrpo_args(adapter, out, *extra):
    return ["-m", "fgrpo", "model.path=toy", f"lora.adapter={adapter}", "task.n_train=1000",
            "task.n_eval=128", "fgrpo.batch_prompts=16", "fgrpo.sampling.num_generations=8",
            "eval.every=0", "eval.n_samples=2", "run.progress=false", f"run.out={out}", *extra]


@pytest.mark.mpi
@pytest.mark.toy
@pytest.mark.slow
def test_learning_on_the_toy_task(toy_adapter, tmp_path):
    out = tmp_path / "run"
    proc = run_mpi(2, fgrpo_args(toy_adapter, out, "fgrpo.steps=80", "fgrpo.batch_prompts=32",
                                 "fgrpo.optim.learning_rate=0.002", "task.n_eval=256",
                                 "eval.n_samples=4"),
                   timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = RunFile(str(out / "fgrpo.h5"))
    reward = run.group("metrics")["reward_mean"]
    first, last = reward[:10].mean(), reward[-10:].mean()
    acc, pass1 = run.group("eval")["accuracy"], run.group("eval")["pass_at_k"][:, 0]
    print(f"train reward {first:.3f} -> {last:.3f}; held-out greedy accuracy {acc[0]:.3f} -> "
          f"{acc[-1]:.3f}; held-out pass@1 {pass1[0]:.3f} -> {pass1[-1]:.3f}")
    # measured (seed 0, 2 ranks, toy-model-v2): reward 0.361 -> 0.408, greedy 0.535 -> 0.684,
    # pass@1 0.360 -> 0.452
    assert last >= first + 0.03, (first, last)
    assert acc[-1] >= acc[0] + 0.02, acc
    assert pass1[-1] >= pass1[0] + 0.05, pass1


@pytest.mark.mpi
@pytest.mark.toy
@pytest.mark.slow
def test_resume_equals_uninterrupted(toy_adapter, tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    assert run_mpi(2, fgrpo_args(toy_adapter, full, "fgrpo.steps=4")).returncode == 0
    assert run_mpi(2, fgrpo_args(toy_adapter, part, "fgrpo.steps=2")).returncode == 0
    proc = run_mpi(2, fgrpo_args(toy_adapter, part, "fgrpo.steps=4") + ["--resume"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    notes = [line for line in proc.stdout.splitlines() if line.startswith("note: --resume")]
    assert notes == ["note: --resume: fgrpo.steps=4 here, 2 in the run file; the run goes on "
                     "with 4 (give fgrpo.steps=2 to keep the run's value)"]  # rank 0's, once
    a, b = RunFile(str(full / "fgrpo.h5")), RunFile(str(part / "fgrpo.h5"))
    assert b.group("metrics")["step"].tolist() == [1, 2, 3, 4]
    for key in ("reward_mean", "loss", "kl", "clip_fraction", "entropy"):
        assert np.array_equal(a.group("metrics")[key], b.group("metrics")[key]), key
    from safetensors.torch import load_file
    wa = load_file(str(full / "adapter" / "adapter_model.safetensors"))
    wb = load_file(str(part / "adapter" / "adapter_model.safetensors"))
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.parametrize("override, words", [
    ("fgrpo.advantage.gamma=-0.5", ["fgrpo.advantage.gamma", "minimum"]),
    ("fgrpo.sampling.num_generations=1", ["fgrpo.sampling.num_generations", "minimum"]),
    ("fgrpo.loss.aggregation=seq-sum", ["fgrpo.loss.aggregation", "not one of"]),
    ("fgrpo.loss.clip.ratio_c=0.5", ["fgrpo.loss.clip.ratio_c", "or > 1"]),
])
@pytest.mark.mpi
@pytest.mark.toy
def test_bad_options_exit_2(tmp_path, override, words):
    out = tmp_path / "run"
    proc = run_mpi(2, fgrpo_args("unused", out, override))
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = our_lines(proc.stderr)
    assert len(lines) == 1 and lines[0].startswith("error"), lines
    assert all(w in lines[0] for w in words)
    assert not out.exists()


@pytest.mark.parametrize("extra", [["fgrpo.full_finetune=true", "fgrpo.loss.beta=0.1"],
                                   ["fgrpo.loss.beta=0.1", "fgrpo.optim.num_iterations=2",
                                    "fgrpo.advantage.scale_rewards=batch",
                                    "fgrpo.loss.aggregation=seq-mean-token-sum-norm",
                                    "fgrpo.loss.clip.ratio_c=3", "fgrpo.advantage.epsilon=1e-6",
                                    "fgrpo.reward.success_threshold=0.5"],
                                   ["fgrpo.algorithm=cispo", "fgrpo.loss.beta=0.1",
                                    "fgrpo.optim.num_iterations=2",
                                    "fgrpo.loss.aggregation=seq-mean-token-mean"],
                                   ["fgrpo.algorithm=dapo", "fgrpo.sampling.max_refills=1",
                                    "fgrpo.loss.overlong_filter=true", "fgrpo.loss.beta=0.1"]],
                         ids=["full-finetune-kl", "lora-kl-mu2-batch-std", "cispo-kl-mu2",
                              "dapo-overlong-filter"])
@pytest.mark.mpi
def test_variants_run_and_log(tiny_models, tmp_path, extra):
    """Full fine-tuning with a frozen reference copy, and LoRA with the adapter-disabled
    reference, several inner iterations and batch std scaling, both under mpirun -n 2."""
    model_dir, _, _ = tiny_models["small"]
    out = tmp_path / "run"
    proc = run_mpi(2, ["-m", "fgrpo", f"model.path={model_dir}", "task.n_train=64",
                       "task.n_eval=8", "fgrpo.steps=2", "fgrpo.batch_prompts=4",
                       "fgrpo.sampling.num_generations=4", "eval.every=0", "eval.n_samples=2",
                       "run.progress=false", f"run.out={out}", *extra])
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = RunFile(str(out / "fgrpo.h5")).group("metrics")
    assert m["step"].tolist() == [1, 2]
    assert np.all(np.isfinite(m["kl"])) and np.all(m["kl"] >= 0)
    assert RunFile(str(out / "fgrpo.h5")).group("bytes")["grad_allreduce"].min() > 0


@pytest.mark.mpi
@pytest.mark.toy
def test_token_budget_stops_the_run_and_counts_every_completion_token(toy_adapter, tmp_path):
    """run.max_generated_tokens ends the run at the first step whose running total reaches it;
    the loop's count (all ranks) equals the completion tokens the step trained on; training
    seconds exclude the held-out evaluations; the step the budget ends is evaluated too."""
    out = tmp_path / "run"
    proc = run_mpi(2, fgrpo_args(toy_adapter, out, "fgrpo.steps=50", "eval.every=3",
                                 "task.n_eval=16", "run.max_generated_tokens=2000"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = RunFile(str(out / "fgrpo.h5"))
    m, held = run.group("metrics"), run.group("heldout")
    tokens = m["generated_tokens"]
    rows = 16 * 8  # fgrpo.batch_prompts x fgrpo.sampling.num_generations, over both ranks
    assert np.array_equal(np.diff(tokens, prepend=0), m["completion_length"] * rows)
    assert tokens[-1] >= 2000 > tokens[-2] and len(tokens) < 50
    steps = m["step"]
    due = [s for s in steps if s % 3 == 0] + ([steps[-1]] if steps[-1] % 3 else [])
    assert held["step"].tolist() == due, (held["step"], steps)
    assert np.array_equal(held["generated_tokens"], tokens[np.asarray(due) - 1])
    assert np.all(held["train_s"] < held["wall_s"]) and np.all(np.diff(m["train_s"]) > 0)
    assert json.loads(run.attrs["metrics"])[-3:] == ["generated_tokens", "train_s", "wall_s"]


@pytest.mark.parametrize("overrides, words", [
    (["fgrpo.space=sv", "fgrpo.full_finetune=true"], ["fgrpo.space", "full_finetune"]),
    (["fgrpo.space=sv", "lora.adapter="], ["fgrpo.space", "lora.adapter"]),
    (["fgrpo.alpha=0.5"], ["fgrpo.alpha", "space=sv"]),
    (["fgrpo.space=sv", "fgrpo.alpha=0"], ["fgrpo.alpha"]),
    (["fgrpo.algorithm=cispo", "fgrpo.loss.clip.ratio_c=0.5"],
     ["fgrpo.loss.clip.ratio_c", "0.5", "> 1"]),
])
@pytest.mark.mpi
@pytest.mark.toy
def test_bad_space_combinations_exit_2(tmp_path, overrides, words):
    out = tmp_path / "run"
    proc = run_mpi(2, fgrpo_args("unused", out, *overrides))
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = our_lines(proc.stderr)
    assert len(lines) == 1 and lines[0].startswith("error"), lines
    assert all(w in lines[0] for w in words), lines[0]
    assert not out.exists()


@pytest.mark.mpi
@pytest.mark.slow
def test_singular_value_space_trains_resumes_and_exports(tiny_models, tmp_path):
    """fgrpo.space=sv under mpirun -n 2: only ESSA's offsets are trained (trainable count =
    the space's dim), a resumed run ends with the uninterrupted one's adapter bit for bit, and
    the export is a plain peft adapter whose change from the SFT adapter lies in the space.
    The random tiny model earns no reward, so the KL term (beta > 0) gives the gradient."""
    model_dir, adapter_dir, _ = tiny_models["small"]

    def args(out, steps):
        return ["-m", "fgrpo", f"model.path={model_dir}", f"lora.adapter={adapter_dir}",
                "task.n_train=64", "task.n_eval=8", f"fgrpo.steps={steps}",
                "fgrpo.batch_prompts=4", "fgrpo.sampling.num_generations=4", "fgrpo.space=sv",
                "fgrpo.alpha=0.5", "fgrpo.optim.learning_rate=0.05", "fgrpo.loss.beta=0.1",
                "eval.every=0", "eval.n_samples=2", "run.progress=false", f"run.out={out}"]
    full, part = tmp_path / "full", tmp_path / "part"
    for out, steps, extra in ((full, 4, []), (part, 2, []), (part, 4, ["--resume"])):
        proc = run_mpi(2, args(out, steps) + extra)
        assert proc.returncode == 0, proc.stderr[-3000:]
    sft = peft.PeftModel.from_pretrained(load_model(model_dir, "float32", "cpu")[0], adapter_dir)
    space = SingularValueSpace.from_peft(sft, alpha=0.5)
    assert RunFile(str(full / "fgrpo.h5")).attrs["trainable_parameters"] == space.dim
    trained = {}
    for out in (full, part):
        base = load_model(model_dir, "float32", "cpu")[0]
        loaded = peft.PeftModel.from_pretrained(base, str(out / "adapter"))
        trained[out] = {n: p.detach() for n, p in loaded.named_parameters() if "lora_" in n}
        x = space.to_vector_of(loaded)
        assert np.abs(x).max() > 0
        for name, (a, b) in space.factors(x).items():
            module = loaded.get_submodule(name)
            torch.testing.assert_close(module.lora_A["default"].weight, a, rtol=0, atol=1e-6)
            torch.testing.assert_close(module.lora_B["default"].weight, b, rtol=0, atol=1e-6)
    assert all(torch.equal(trained[full][n], trained[part][n]) for n in trained[full])


@pytest.mark.mpi
@pytest.mark.toy
@pytest.mark.slow
def test_dynamic_sampling_is_the_same_on_one_and_three_ranks(toy_adapter, tmp_path):
    """DAPO's refill under mpirun -n 3 equals -n 1 bitwise: steps, rewards, filtered counts,
    rounds, shortfalls and focal weights. The learning rate is 0, so the policy stays the
    SFT one: the float order of the gradient all-reduce (which differs with the rank count)
    cannot reach the next step's rollouts; what is compared is what the prompts, sampling keys
    and the cross-rank filtering decide. Temperature 0.1 leaves most groups uniform, so every
    step refills."""
    metrics = {}
    for n in (1, 3):
        out = tmp_path / f"n{n}"
        proc = run_mpi(n, fgrpo_args(toy_adapter, out, "fgrpo.steps=3", "fgrpo.batch_prompts=6",
                                     "fgrpo.sampling.num_generations=4", "fgrpo.algorithm=dapo",
                                     # gamma 1: weights 1 - k/4, exact in binary, so their
                                     # mean does not depend on the ranks' summation order
                                     "fgrpo.advantage.gamma=1.0",
                                     "fgrpo.sampling.max_refills=3",
                                     "fgrpo.sampling.temperature=0.1",
                                     "fgrpo.optim.learning_rate=0", "task.n_train=200",
                                     "task.n_eval=8"), timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        metrics[n] = RunFile(str(out / "fgrpo.h5")).group("metrics")
    one, three = metrics[1], metrics[3]
    assert one["step"].tolist() == three["step"].tolist() == [1, 2, 3]
    assert one["sampling_rounds"].min() >= 2  # every step refilled
    for key in ("reward_mean", "success_rate", "sampling_rounds", "filtered_groups",
                "filtered_share", "extra_rollouts", "shortfall_groups", "trained_groups",
                "focal_weight_mean", "focal_weight_min", "focal_weight_max",
                "completion_length", "generated_tokens"):
        assert np.array_equal(one[key], three[key]), (key, one[key], three[key])
    rounds = one["sampling_rounds"]
    assert np.array_equal(one["extra_rollouts"], (rounds - 1) * 6 * 4)
    assert np.all(one["trained_groups"] + one["shortfall_groups"] == 6)
