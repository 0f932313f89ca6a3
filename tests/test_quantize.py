"""model.quantize: torchao INT8 weight-only base linears (hpc/models/quantize.py): accuracy
against the unquantised model, the job's model decoding from int8 weights, the training jobs'
quantised generation copy, ESSA end to end (the run file's record, an INT8 run against a
`none` one, rank-count invariance and resume under mpirun), and the one-line errors.

A test that needs torchao (the extra 'quant', which `make venv` installs) takes the fixture
``torchao``: skipped without it, a failure under HPC_TEST_STRICT=1 (CI)."""
import copy
import re
import sys

import numpy as np
import pytest
import torch
import yaml

from conftest import run_cli, run_mpi
from test_essa import _one_error_line, essa_args
from test_fgrpo import fgrpo_args
from hpc.data.tasks import arith_task
from hpc.engine.generate import generate_tokens
from hpc.models.loading import attach_lora, load_adapter, load_model, randomize_lora_b
from hpc.models.quantize import (attach_generation_copy, base_linears, check_quantize,
                                 generation_weights, quantize_base, quantized_linears)
from hpc.runtime.config import load_config
from hpc.runtime.errors import UserError
from hpc.runtime.runstore import RunFile
from hpc.toys.toy import toy_model_path


def _quantised(linear) -> bool:
    return type(linear.weight).__name__ == "Int8Tensor"


# a decoder layer's seven linears (inside a peft LoRA wrapper: its base_layer), named here
# apart from hpc.models.quantize.base_linears, which the tests check
DECODER_LINEAR = re.compile(r"\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)"
                            r"(\.base_layer)?$")


def _decoder_linears(model) -> dict:
    return {name: m for name, m in model.named_modules()
            if type(m) is torch.nn.Linear and DECODER_LINEAR.search(name)}


@pytest.mark.toy
@pytest.mark.usefixtures("torchao")
def test_int8_greedy_completions_of_the_toy_stay_close():
    """Measured on 256 held-out arith problems (benchmarks/quantization.py, 2026-12-01): 99.6%
    of the greedy completions identical, accuracy equal. Asserted on 128: >= 95% identical and
    accuracy within 3 points."""
    model, tok = load_model(toy_model_path())
    quantised = quantize_base(copy.deepcopy(model), "int8")
    linears = base_linears(quantised)
    assert len(linears) == 7 * model.config.num_hidden_layers
    assert all(_quantised(m) for m in linears.values())
    assert not _quantised(quantised.lm_head) and not any(map(_quantised,
                                                             base_linears(model).values()))
    task = arith_task(0, 128, seed=3)
    ids = torch.tensor([tok("12+34=")["input_ids"]])
    with torch.inference_mode():
        diff = (model(ids).logits - quantised(ids).logits).abs().max()
    assert 0 < diff < 0.5, "INT8 must change the logits a little, not a lot"
    out = {}
    for name, m in (("fp32", model), ("int8", quantised)):
        completions = generate_tokens(m, tok, task.eval.prompts, 8)
        texts = tok.batch_decode(completions, skip_special_tokens=True)
        out[name] = completions, np.mean(task.rewards(texts, task.eval.answers))
    identical = np.mean([a == b for a, b in zip(out["fp32"][0], out["int8"][0])])
    assert identical >= 0.95, identical
    assert abs(out["fp32"][1] - out["int8"][1]) <= 0.03, (out["fp32"][1], out["int8"][1])


@pytest.mark.toy
@pytest.mark.usefixtures("torchao")
def test_the_jobs_int8_model_decodes_from_int8_linears(toy_adapter):
    """Loaded as ESSA and hpc-eval load it (streamed, the SFT adapter wrapped around the base,
    model.quantize=int8): every one of the 7 linears of each decoder layer is called while the
    decoding engine completes 32 prompts, and at every call its weight is torchao's Int8Tensor
    whose values are int8; under model.quantize=none the same calls see float32 weights. The
    logits differ from the unquantised model's, by less than 0.5 (measured: 0.016 on 12+34=);
    quantized_linears (the run file's count) is 7 per layer and 0."""
    import torchao.quantization as tq

    models, calls = {}, {}
    for mode in ("none", "int8"):
        model, tok = load_model("toy", "float32", "cpu", load="streamed", quantize=mode,
                                wrap=lambda base: load_adapter(base, toy_adapter))
        linears = _decoder_linears(model)
        assert len(linears) == 7 * model.config.num_hidden_layers
        seen = calls[mode] = {name: [] for name in linears}
        for name, linear in linears.items():
            linear.register_forward_pre_hook(
                lambda m, args, name=name: seen[name].append(
                    (type(m.weight), getattr(m.weight, "qdata", m.weight).dtype)))
        generate_tokens(model, tok, arith_task(0, 32, seed=4).eval.prompts, 8)
        assert all(seen.values()), [n for n, c in seen.items() if not c]  # each one decoded
        models[mode] = model
    assert all(kind is tq.Int8Tensor and dtype == torch.int8
               for c in calls["int8"].values() for kind, dtype in c), calls["int8"]
    assert all(kind is torch.nn.Parameter and dtype == torch.float32
               for c in calls["none"].values() for kind, dtype in c)
    assert quantized_linears(models["int8"]) == len(calls["int8"])
    assert quantized_linears(models["none"]) == 0
    ids = torch.tensor([tok("12+34=")["input_ids"]])
    with torch.inference_mode():
        diff = (models["none"](ids).logits - models["int8"](ids).logits).abs().max()
    assert 0 < diff < 0.5, diff


@pytest.mark.toy
@pytest.mark.usefixtures("torchao")
def test_generation_copy_leaves_the_training_weights_alone():
    """F-GRPO/SFT: the training forward runs on the unquantised weights, generation on the
    quantised copy, which decodes as the in-place quantised model (quantize_base, its linears
    int8) does; LoRA stays on top."""
    model, tok = load_model(toy_model_path())
    peft = attach_lora(model, 4, 8.0, ["q_proj", "v_proj"])
    randomize_lora_b(peft, 0.05, torch.Generator().manual_seed(0))
    reference = quantize_base(copy.deepcopy(peft), "int8")
    assert all(map(_quantised, base_linears(reference).values()))  # else the last line is moot
    ids = torch.tensor([tok("7+5=")["input_ids"]])
    with torch.no_grad():
        before = peft(ids).logits
    modules = dict(peft.named_modules())
    n_params = len(list(peft.parameters()))
    attach_generation_copy(peft, "int8")
    assert len(list(peft.parameters())) == n_params  # the copy is not a parameter
    assert not any(map(_quantised, base_linears(peft).values()))
    with torch.no_grad():
        assert torch.equal(peft(ids).logits, before)
    with generation_weights(peft):
        assert all(map(_quantised, base_linears(peft).values()))
        assert peft.get_submodule("base_model.model.model.layers.0.self_attn.q_proj").lora_A
    assert all(modules[n] is m for n, m in peft.named_modules())  # all swapped back
    prompts = arith_task(0, 32, seed=5).eval.prompts
    assert generate_tokens(peft, tok, prompts, 8) == generate_tokens(reference, tok, prompts, 8)


@pytest.mark.mpi
@pytest.mark.toy
@pytest.mark.slow
@pytest.mark.usefixtures("torchao")
def test_essa_int8_under_mpirun_rank_invariant_and_resumable(toy_adapter, tmp_path):
    """ESSA with model.quantize=int8: bitwise the same fitness and mean on 1 and 3 ranks, and
    a run stopped after 2 generations on 2 ranks and resumed to 4 equals them."""
    int8 = ("model.quantize=int8", "essa.generations=4")
    runs = {}
    for n in (1, 3):
        proc = run_mpi(n, essa_args(toy_adapter, tmp_path / f"n{n}", *int8))
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[n] = RunFile(str(tmp_path / f"n{n}" / "essa.h5"))
    part = tmp_path / "part"
    first = run_mpi(2, essa_args(toy_adapter, part, "model.quantize=int8",
                                 "essa.generations=2"))
    assert first.returncode == 0, first.stderr[-3000:]
    second = run_mpi(2, essa_args(toy_adapter, part, *int8) + ["--resume"])
    assert second.returncode == 0, second.stderr[-3000:]
    runs["resumed"] = RunFile(str(part / "essa.h5"))
    fit = runs[1].group("essa")["fitness"]
    assert fit.shape == (4, 6) and fit.std() > 0
    for run in runs.values():  # the 4 layers' 28 linears quantised on every job
        assert run.attrs["quantized_linears"] == 28
    assert runs["resumed"].group("essa")["step"].tolist() == [1, 2, 3, 4]
    for key in (3, "resumed"):
        assert np.array_equal(runs[key].group("essa")["fitness"], fit), key
        assert np.array_equal(runs[key].group("final")["mean"][-1],
                              runs[1].group("final")["mean"][-1]), key


@pytest.mark.subprocess
@pytest.mark.toy
@pytest.mark.usefixtures("torchao")
def test_essa_int8_run_differs_from_none_and_stays_close(toy_adapter, tmp_path):
    """The same ESSA job (one process, seed 0, 4 generations of 6 members on 128 problems)
    with model.quantize=none and int8: the run files record the mode asked (config) and what
    the load did (quantized_linears: 0, and the toy's 4 x 7 linears); the fitness differs
    (INT8 flips the greedy reward of about 0.4% of the completions, 8 of 2,000 measured on the
    SFT adapter: about 12 flips expected among the 3,072 completions scored) and stays close:
    the first generation scores the same 6 members on the same problems, each within 6/128,
    and the runs' mean fitness within 0.05 (measured: 19 of 24 values differ, the first
    generation's by at most 1/128, mean 0.544 against 0.554)."""
    runs = {}
    for mode in ("none", "int8"):
        out = tmp_path / mode
        proc = run_cli(essa_args(toy_adapter, out, f"model.quantize={mode}", "essa.minibatch=128",
                                 "essa.generations=4", "eval.batch_size=64"))
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[mode] = run = RunFile(str(out / "essa.h5"))
        assert yaml.safe_load(run.attrs["config"])["model"]["quantize"] == mode
    assert runs["none"].attrs["quantized_linears"] == 0
    assert runs["int8"].attrs["quantized_linears"] == 28
    none, int8 = (runs[m].group("essa")["fitness"] for m in ("none", "int8"))
    print(f"fitness none {none.mean():.4f}, int8 {int8.mean():.4f}; members differing: "
          f"{int((none != int8).sum())} of {none.size}, first generation by at most "
          f"{np.abs(none[0] - int8[0]).max():.4f}")
    assert none.shape == int8.shape == (4, 6)
    assert not np.array_equal(none, int8), "INT8 decoded exactly as float32: not quantised"
    assert np.abs(none[0] - int8[0]).max() <= 6 / 128
    assert abs(none.mean() - int8.mean()) <= 0.05


@pytest.mark.toy
@pytest.mark.usefixtures("torchao")
def test_fgrpo_int8_runs(toy_adapter, tmp_path):
    """F-GRPO with model.quantize=int8: rollouts and evaluation from the quantised copy, the
    LoRA trained on the unquantised model; the run file counts the copy's 28 int8 linears (the
    toy's 4 layers x 7); the run ends and its adapter is saved."""
    out = tmp_path / "run"
    proc = run_cli(fgrpo_args(toy_adapter, out, "fgrpo.steps=2", "fgrpo.batch_prompts=4",
                              "task.n_eval=16", "model.quantize=int8"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = RunFile(str(out / "fgrpo.h5"))
    assert run.group("metrics")["step"].tolist() == [1, 2]
    assert run.attrs["quantized_linears"] == 28
    assert (out / "adapter" / "adapter_config.json").exists()


@pytest.mark.mpi
@pytest.mark.usefixtures("torchao")
def test_int4_on_cpu_is_one_line_exit_2(tiny_models, tmp_path):
    model_dir, adapter, _ = tiny_models["small"]
    proc = run_mpi(2, essa_args(adapter, tmp_path / "run", "model.quantize=int4",
                                model=model_dir))
    _one_error_line(proc, "model.quantize=int4", "device cpu")
    assert not (tmp_path / "run" / "essa.h5").exists()


@pytest.mark.usefixtures("torchao")
def test_int4_needs_bfloat16():
    with pytest.raises(UserError, match="model.dtype=bfloat16"):
        check_quantize("int4", "float32", torch.device("cuda"))


def test_missing_torchao_names_the_extra(monkeypatch):
    for name in [m for m in sys.modules if m == "torchao" or m.startswith("torchao.")]:
        monkeypatch.setitem(sys.modules, name, None)  # import torchao... raises ImportError
    monkeypatch.setitem(sys.modules, "torchao", None)
    with pytest.raises(UserError, match=r"essa-hpc\[quant\]"):
        check_quantize("int8", "float32", torch.device("cpu"))
    check_quantize("none", "float32", torch.device("cpu"))  # needs nothing


def test_fgrpo_full_finetune_cannot_quantise():
    from fgrpo.config import FGRPOJobConfig

    with pytest.raises(UserError, match="model.quantize"):
        load_config(FGRPOJobConfig, None, ["model.quantize=int8", "fgrpo.full_finetune=true"])
