"""Decoding backends (hpc.engine.backend): one registry, no switch on a backend's name outside
it, ``model.engine=auto`` resolved from the model's config.json, and a new backend added by one
file and one registry line."""
import dataclasses
import json
import os
import re

import pytest

from conftest import REPO
from hpc.engine import backend as registry
from hpc.engine.backend import BACKENDS, make_backend, resolve_backend
from hpc.engine.generate import generate_tokens
from hpc.engine.hf_backend import HFBackend
from hpc.engine.config import ModelConfig
from hpc.job.config import JobConfig
from hpc.runtime.config import load_config
from hpc.runtime.errors import UserError
from hpc.toys.toy import architecture_config, tiny_model

PACKAGES = ("hpc", "essa", "fgrpo", "sft", "compare")
# a comparison or membership test on a backend's name, or on the old path attribute
SWITCH = re.compile(r"""(==|!=)\s*["'](engine|hf|vllm)["']|["'](engine|hf|vllm)["']\s*(==|!=)"""
                    r"""|in \(["'](engine|hf)["']|\.path\s*==|model\.engine\s*==|\.engine\s*==""")


def test_config_choices_are_the_registry_as_it_stands(monkeypatch):
    """model.engine takes auto and the registry's names, read when a value is checked: a
    backend registered after the section was declared is accepted, an unknown name refused."""
    choices = {f.name: f for f in dataclasses.fields(ModelConfig)}["engine"].metadata["choices"]
    assert list(choices) == ["auto", *BACKENDS]
    monkeypatch.setitem(BACKENDS, "recorder", "test_backends:Recorder")
    assert load_config(JobConfig, None, ["model.engine=recorder"]).model.engine == "recorder"
    with pytest.raises(UserError, match="'model.engine': 'nope' is not one of"):
        load_config(JobConfig, None, ["model.engine=nope"])


def test_no_switch_on_a_backend_name_outside_the_registry():
    found = []
    for package in PACKAGES:
        for folder, _, files in os.walk(os.path.join(REPO, package)):
            for name in files:
                path = os.path.join(folder, name)
                if not name.endswith(".py") or path.endswith(os.path.join("engine", "backend.py")):
                    continue
                with open(path) as fh:
                    found += [f"{os.path.relpath(path, REPO)}:{i}: {line.strip()}"
                              for i, line in enumerate(fh, 1) if SWITCH.search(line)]
    assert not found, "\n".join(found)


def _folder(path, **config) -> str:
    path.mkdir(parents=True, exist_ok=True)
    with open(path / "config.json", "w") as fh:
        json.dump(config, fh)
    return str(path)


@pytest.mark.parametrize("arch", ["qwen2", "llama", "mistral", "qwen3"])
def test_auto_takes_the_engine_for_the_architectures_it_runs(tmp_path, arch):
    config = architecture_config(arch, vocab_size=64).to_dict()
    assert resolve_backend("auto", _folder(tmp_path, **config), 1024) == "engine"


def test_auto_falls_back_and_a_named_backend_that_refuses_is_one_line(tmp_path):
    gemma = _folder(tmp_path, model_type="gemma2")
    assert resolve_backend("auto", gemma, 1024) == "hf"
    assert resolve_backend("hf", gemma, 1024) == "hf"
    with pytest.raises(UserError) as err:
        resolve_backend("engine", gemma, 1024)
    line = str(err.value)
    assert line.startswith("model.engine=engine: ") and "gemma2" in line and "\n" not in line
    # no config.json yet (a built-in model built at its first load): every built-in runs there
    assert resolve_backend("auto", str(tmp_path / "absent"), 1024) == "engine"


def test_a_mistral_whose_rows_outgrow_its_window_goes_to_hf(tmp_path):
    mistral = _folder(tmp_path, **architecture_config("mistral", vocab_size=64).to_dict())
    window = json.load(open(os.path.join(mistral, "config.json")))["sliding_window"]
    assert resolve_backend("auto", mistral, window) == "engine"
    assert resolve_backend("auto", mistral, window + 1) == "hf"


def test_vllm_is_named_in_one_line_when_absent_or_when_it_cannot_run_the_job(tmp_path,
                                                                            monkeypatch):
    from hpc.engine.vllm_backend import VLLMBackend

    qwen = _folder(tmp_path / "qwen", **architecture_config("qwen2", vocab_size=64).to_dict())
    monkeypatch.setattr(VLLMBackend, "installed", classmethod(lambda cls: False))
    with pytest.raises(UserError, match=r"^model.engine=vllm: its package \(vllm\) is not "):
        resolve_backend("vllm", qwen, 64)
    assert resolve_backend("auto", _folder(tmp_path / "g", model_type="gemma2"), 64) == "hf"
    monkeypatch.setattr(VLLMBackend, "installed", classmethod(lambda cls: True))
    assert resolve_backend("vllm", qwen, 64) == "vllm"  # head_dim 32 runs on vLLM's CPU kernels
    with pytest.raises(UserError, match="does not decode model.quantize=int8"):
        resolve_backend("vllm", qwen, 64, quantize="int8")
    small = _folder(tmp_path / "small", **architecture_config("qwen2", 64, hidden=32).to_dict())
    with pytest.raises(UserError, match="CPU attention runs head_dim 32, .* not 8"):
        resolve_backend("vllm", small, 64)
    gemma = _folder(tmp_path / "gemma", model_type="gemma2", hidden_size=256,
                    num_attention_heads=4)
    assert resolve_backend("auto", gemma, 64) == "vllm"  # engine refuses, vLLM is next


class Recorder(HFBackend):
    """A backend of this file: HF generate, recording every call's rows."""

    name = "recorder"
    calls: list = []

    def decode(self, model, requests, eos, sampling, rows, members=None):
        Recorder.calls.append((len(requests), rows, members is not None))
        return super().decode(model, requests, eos, sampling, rows, members)


def test_a_new_backend_is_one_file_and_one_registry_line(monkeypatch):
    """Registered by one line, it is resolved, built and decodes a call, and auto prefers it
    by its place in the registry."""
    monkeypatch.setitem(BACKENDS, "recorder", "test_backends:Recorder")
    monkeypatch.setattr(registry, "BACKENDS", {"recorder": BACKENDS["recorder"], **BACKENDS})
    model, tok = tiny_model()
    prompts = ["12+34=", "5+6="]
    want = generate_tokens(model, tok, prompts, 6, backend="hf")
    assert generate_tokens(model, tok, prompts, 6, backend="recorder", batch_size=1) == want
    assert Recorder.calls == [(2, 1, False)]
    assert isinstance(make_backend("recorder"), Recorder)
    assert resolve_backend("auto", "absent", 64) == "recorder"
    assert make_backend("recorder").version().startswith("transformers ")


def test_the_plan_charges_vllm_its_whole_budget_and_its_own_weights(tmp_path):
    """Qwen2.5-7B at the cluster config on 16 ranks: with model.engine=vllm the ESSA scoring
    phase holds vLLM's KV pool (the whole engine budget) and a second copy of the base weights
    where the engine holds what its rows need."""
    from essa.plan import plan as essa_plan
    from hpc.engine.shape import QWEN25, ModelShape
    from hpc.job.config import plan_job_class
    from hpc.runtime.config import load_config

    folder = _folder(tmp_path / "7b", **QWEN25["7B"], model_type="qwen2",
                     architectures=["Qwen2ForCausalLM"])
    plans = {}
    for engine in ("engine", "vllm"):
        cfg = load_config(plan_job_class(), os.path.join(REPO, "configs/cluster/math.yaml"),
                          [f"model.path={folder}", f"model.engine={engine}"])
        plans[engine] = essa_plan(ModelShape.from_folder(folder), cfg, ranks=16)
    weights = 7_615_616_512 * 2  # bf16
    parts = dict(plans["vllm"].phase("ESSA scoring").parts)
    assert parts["vllm: its own copy of the base weights"] == weights
    pool = next(b for label, b in parts.items() if label.endswith("the whole engine budget"))
    assert pool == 32 * 2**30  # the 7B's engine budget on 80 GiB (tests/test_memory_plan.py)
    engine = plans["engine"].phase("ESSA scoring").peak
    assert plans["vllm"].phase("ESSA scoring").peak > engine + weights

