"""ESSA under real mpirun: rank-count invariance, O(P) traffic, resume, bad input, learning,
and the exported adapter."""

import numpy as np
import pytest

from conftest import our_lines, run_cli, run_mpi
from hpc.runtime.runstore import RunFile

P = 6


def essa_args(adapter, out, *extra, model="toy"):
    return ["-m", "essa", f"model.path={model}", f"lora.adapter={adapter}",
            "task.n_train=200", "task.n_eval=32", f"essa.population={P}", "essa.minibatch=16",
            "essa.generations=3", "essa.sigma0=0.5", "eval.every=0", "eval.n_samples=2",
            "eval.batch_size=16", "run.progress=false", f"run.out={out}", *extra]


@pytest.mark.mpi
@pytest.mark.toy
@pytest.mark.slow
def test_rank_count_invariance(toy_adapter, tmp_path):
    runs = {}
    for n in (1, 2, 4):
        out = tmp_path / f"n{n}"
        proc = run_mpi(n, essa_args(toy_adapter, out))
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[n] = RunFile(str(out / "essa.h5"))
    fit1 = runs[1].group("essa")["fitness"]
    assert fit1.shape == (3, P)
    assert fit1.std() > 0, "fitness is constant: the comparison would prove nothing"
    for n in (2, 4):
        assert np.array_equal(runs[n].group("essa")["fitness"], fit1)
        assert np.array_equal(runs[n].group("final")["mean"], runs[1].group("final")["mean"])
        owners = runs[n].group("essa")["evaluated_by"][0]
        assert sorted(set(owners.tolist())) == list(range(n))


@pytest.mark.mpi
def test_bytes_per_generation_do_not_grow_with_the_model(tiny_models, tmp_path):
    per_gen = {}
    for name, (model_dir, adapter, n_params) in tiny_models.items():
        out = tmp_path / name
        proc = run_mpi(2, essa_args(adapter, out, "essa.generations=2", model=model_dir))
        assert proc.returncode == 0, proc.stderr[-3000:]
        run = RunFile(str(out / "essa.h5"))
        per_gen[name] = run.group("bytes")["fitness"].tolist()
    assert tiny_models["large"][2] >= 4 * tiny_models["small"][2]
    assert per_gen["small"] == per_gen["large"] == [8 * P, 8 * P]


@pytest.mark.mpi
@pytest.mark.toy
@pytest.mark.slow
def test_resume_equals_uninterrupted(toy_adapter, tmp_path):
    full = tmp_path / "full"
    assert run_mpi(2, essa_args(toy_adapter, full, "essa.generations=4")).returncode == 0
    part = tmp_path / "part"
    first = run_mpi(2, essa_args(toy_adapter, part, "essa.generations=2"))
    assert first.returncode == 0, first.stderr[-3000:]
    second = run_mpi(2, essa_args(toy_adapter, part, "essa.generations=4") + ["--resume"])
    assert second.returncode == 0, second.stderr[-3000:]
    a, b = RunFile(str(full / "essa.h5")), RunFile(str(part / "essa.h5"))
    assert b.group("essa")["step"].tolist() == [1, 2, 3, 4]
    assert np.array_equal(a.group("essa")["fitness"], b.group("essa")["fitness"])
    assert np.array_equal(a.group("final")["mean"][-1], b.group("final")["mean"][-1])


def _one_error_line(proc, *words):
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    lines = our_lines(proc.stderr)
    assert len(lines) == 1, lines
    assert lines[0].startswith("error") and "Traceback" not in proc.stderr
    for word in words:
        assert word in lines[0]


@pytest.mark.mpi
def test_population_smaller_than_ranks(tiny_models, tmp_path):
    model_dir, adapter, _ = tiny_models["small"]
    out = tmp_path / "run"
    proc = run_mpi(4, essa_args(adapter, out, "essa.population=2", model=model_dir))
    _one_error_line(proc, "essa.population=2", "4 ranks")
    assert not (out / "essa.h5").exists()


@pytest.mark.mpi
def test_adapter_missing_a_target_module(tiny_models, tmp_path):
    model_dir, adapter, _ = tiny_models["small"]
    out = tmp_path / "run"
    proc = run_mpi(2, essa_args(adapter, out, "lora.targets=q_proj,up_proj", model=model_dir))
    _one_error_line(proc, "up_proj")
    assert not (out / "essa.h5").exists()


@pytest.mark.mpi
def test_non_lora_adapter(tiny_models, tmp_path):
    from peft import IA3Config, get_peft_model

    from hpc.models.loading import load_model

    model_dir, _, _ = tiny_models["small"]
    model, _ = load_model(model_dir)
    ia3 = get_peft_model(model, IA3Config(target_modules=["k_proj", "v_proj", "down_proj"],
                                          feedforward_modules=["down_proj"],
                                          task_type="CAUSAL_LM"))
    ia3.save_pretrained(str(tmp_path / "ia3"))
    out = tmp_path / "run"
    proc = run_mpi(2, essa_args(str(tmp_path / "ia3"), out, model=model_dir))
    _one_error_line(proc, "LoRA")
    assert not (out / "essa.h5").exists()


@pytest.mark.toy
def test_missing_model_path_single_process(toy_adapter, tmp_path):
    proc = run_cli(essa_args(toy_adapter, tmp_path / "run", model=str(tmp_path / "nowhere")))
    _one_error_line(proc, "nowhere")


@pytest.mark.mpi
@pytest.mark.toy
@pytest.mark.slow
def test_learning_and_exported_adapter(toy_adapter, tmp_path):
    """ESSA climbs its objective (seed 0, 2 ranks) without losing held-out accuracy, and the
    exported mean adapter, loaded by plain transformers + peft, scores what the trainer
    reported."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hpc.engine.generate import generate
    from hpc.data.tasks import arith_task
    from hpc.toys.toy import toy_model_path

    out = tmp_path / "run"
    proc = run_mpi(2, essa_args(toy_adapter, out, "task.n_train=2000", "task.n_eval=256",
                                "essa.population=16", "essa.minibatch=256", "essa.sigma0=0.3",
                                "essa.generations=20"), timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = RunFile(str(out / "essa.h5"))
    acc = run.group("eval")["accuracy"]
    fitness = run.group("metrics")["fitness_mean"]  # (20,): the population's mean reward
    first, last = fitness[:10].mean(), fitness[10:].mean()
    print(f"population fitness {first:.3f} -> {last:.3f}; held-out accuracy: SFT start "
          f"{acc[0]:.3f} -> ESSA mean {acc[-1]:.3f}")
    # measured: fitness 0.515 -> 0.531, held-out 0.469 -> 0.469 (toy built on a Xeon, also
    # after 40 generations); held-out 0.582 -> 0.613 (toy built on a Zen 1). Whether 20
    # generations change the mean's greedy answers on 256 held-out problems depends on the CPU
    # the toy was built on: the held-out gain is the demo's (150 generations, docs/toy.md).
    assert last > first, fitness
    assert acc[-1] >= acc[0] - 4 / 256, acc

    base = AutoModelForCausalLM.from_pretrained(toy_model_path())
    tok = AutoTokenizer.from_pretrained(toy_model_path())
    model = PeftModel.from_pretrained(base, str(out / "adapter-mean")).eval()
    task = arith_task(200, 256, seed=0)
    completions = generate(model, tok, task.eval.prompts, 8, batch_size=64)
    score = np.mean(task.rewards(completions, task.eval.answers))
    assert score == acc[-1]
