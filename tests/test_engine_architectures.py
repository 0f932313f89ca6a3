"""The package's decoding engine on the Llama, Mistral and Qwen3 architectures besides Qwen2:
token for token against Hugging Face ``generate`` (greedy, keyed sampling, a peft adapter and
ESSA members per row) on a random model of each architecture (:func:`hpc.toys.toy.tiny_model`:
Llama 3.x untied with ``llama3`` RoPE scaling, Llama with q/k/v/o and MLP biases, Mistral with
its sliding window wider than any row, Qwen3 with q/k norms), its shape's parameter count, and
the one-line refusals of what it does not run."""
import numpy as np
import pytest
import torch

import hpc.engine.runner as runner
from hpc.engine.generate import member_completions
from hpc.engine.architectures import engine_refusal
from hpc.engine.engine_backend import EngineBackend
from hpc.engine.generate import eos_ids, generate_tokens
from hpc.engine.scheduler import Request
from hpc.engine.shape import ModelShape
from hpc.models.adapter_space import SingularValueSpace
from hpc.models.loading import attach_lora, randomize_lora_b
from hpc.runtime.errors import UserError
from mpi.engine_check import random_model_of

ARCHS = ["qwen2", "llama", "mistral", "qwen3"]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MAX_NEW = 12
PROMPTS = [f"{a}+{b}=" for a in (3, 41, 507, 8) for b in (9, 62, 130, 7)]  # 4 to 8 tokens


@pytest.fixture(scope="module", autouse=True)
def threads():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def built(case: str):
    """(case, model, tokenizer): an architecture of ARCHS, or ``llama-biases`` (Llama with
    q/k/v/o and MLP biases)."""
    if case == "llama-biases":
        return case, *random_model_of("llama", attention_bias=True, mlp_bias=True)
    return case, *random_model_of(case)


@pytest.fixture(scope="module", params=ARCHS + ["llama-biases"])
def arch_model(request):
    return built(request.param)


def test_greedy_tokens_equal_hf_generate(arch_model):
    arch, model, tok = arch_model
    ref = generate_tokens(model, tok, PROMPTS, MAX_NEW, backend="hf", batch_size=5)
    assert len({tuple(r) for r in ref}) >= 4, ref  # completions depend on the prompt
    assert generate_tokens(model, tok, PROMPTS, MAX_NEW, backend="engine", batch_size=6) == ref


def test_sampled_tokens_equal_hf_generate(arch_model):
    arch, model, tok = arch_model
    kw = dict(do_sample=True, temperature=1.2, top_p=0.95, num_return_sequences=3, seed=5)
    ref = generate_tokens(model, tok, PROMPTS, MAX_NEW, backend="hf", batch_size=8, **kw)
    assert len({tuple(r) for r in ref}) > len(PROMPTS)
    assert generate_tokens(model, tok, PROMPTS, MAX_NEW, backend="engine", batch_size=7,
                           **kw) == ref


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_adapter_and_members_per_row_equal_hf(arch):
    """A peft LoRA on all seven linears as the engine's one member, and 3 ESSA members of its
    singular-value space interleaved in one batch, each equal to HF's completions."""
    model, tok = random_model_of(arch)
    peft = attach_lora(model, 4, 8.0, TARGETS)
    randomize_lora_b(peft, 0.3, torch.Generator().manual_seed(3))
    peft.eval()
    ref = generate_tokens(peft, tok, PROMPTS, MAX_NEW, backend="hf", batch_size=5)
    with peft.disable_adapter():
        assert generate_tokens(peft, tok, PROMPTS, MAX_NEW, backend="hf") != ref  # it acts
    assert generate_tokens(peft, tok, PROMPTS, MAX_NEW, backend="engine", batch_size=6) == ref

    space = SingularValueSpace.from_peft(peft)
    k = 3
    members = np.random.default_rng(k).normal(0.0, 0.5, (k, space.dim)) * space.singular_values()
    factors = space.factors_batch(members)
    want = member_completions(peft, tok, factors, PROMPTS, MAX_NEW, 8, backend="hf")
    assert len({tuple(t) for t in want}) == k
    requests = [Request(tok(p)["input_ids"], MAX_NEW, m, i) for i, p in enumerate(PROMPTS)
                for m in range(k)]
    out = tok.batch_decode(EngineBackend().decode(peft, requests, eos_ids(peft, tok), None, 10,
                                                  members=factors), skip_special_tokens=True)
    assert [[out[i * k + m] for i in range(len(PROMPTS))] for m in range(k)] == want


def test_qwen3_without_its_qk_norms_differs(monkeypatch):
    """The Qwen3 comparison above would catch an engine that skipped the q/k norms."""
    model, tok = random_model_of("qwen3")
    ref = generate_tokens(model, tok, PROMPTS, MAX_NEW, backend="hf", batch_size=8)
    original = runner.DecodeEngine.__init__

    def without_norms(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.qk_norm = False

    monkeypatch.setattr(runner.DecodeEngine, "__init__", without_norms)
    assert generate_tokens(model, tok, PROMPTS, MAX_NEW, backend="engine", batch_size=8) != ref


def test_shape_counts_the_parameters(arch_model):
    _, model, _ = arch_model
    assert ModelShape.from_config(model.config).parameters() == sum(
        p.numel() for p in model.parameters())


REFUSED = {
    "gemma2": ({"model_type": "gemma2"}, "gemma2-architecture models"),
    "dynamic RoPE": ({"model_type": "llama", "rope_parameters": {"rope_type": "dynamic",
                                                                  "factor": 2.0}},
                     "RoPE of type dynamic"),
    "longrope (old key)": ({"model_type": "llama", "rope_scaling": {"type": "longrope"}},
                           "RoPE of type longrope"),
    "Qwen2 sliding window": ({"model_type": "qwen2", "use_sliding_window": True,
                              "sliding_window": 4096}, "sliding-window attention"),
    "Mistral window below the rows": ({"model_type": "mistral", "sliding_window": 16},
                                      "sliding-window attention (window 16, rows of up to 64"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_what_the_engine_refuses_is_one_line_naming_the_backend_that_runs_it(case):
    config, what = REFUSED[case]
    line = engine_refusal(config, 64)
    assert what in line and line.endswith("use model.engine=hf") and "\n" not in line


def test_runs_what_it_should():
    for config in ({"model_type": "qwen2", "use_sliding_window": False, "sliding_window": 32},
                   {"model_type": "mistral", "sliding_window": 4096},
                   {"model_type": "mistral", "sliding_window": None},
                   {"model_type": "llama", "rope_parameters": {"rope_type": "yarn"}},
                   {"model_type": "qwen3", "layer_types": ["full_attention"] * 2}):
        assert engine_refusal(config, 64) == "", config


def test_a_refused_model_is_a_user_error_at_the_engine():
    model, tok = random_model_of("mistral")
    model.config.sliding_window = 8
    with pytest.raises(UserError, match="sliding-window attention.*use model.engine=hf"):
        generate_tokens(model, tok, PROMPTS, MAX_NEW, backend="engine")



@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_sft_essa_and_fgrpo_jobs_decode_on_the_engine_through_auto(tmp_path, arch):
    """A Llama and a Qwen3 model run SFT, then ESSA and F-GRPO from its adapter, on 2 ranks
    with ``model.engine=auto``: each run file names the package's engine, and the adapters the
    jobs exported decode to HF ``generate``'s greedy tokens on it."""
    from peft import PeftModel

    from conftest import run_mpi
    from hpc.runtime.runstore import RunFile

    _, model, tok = built(arch)
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    runs = tmp_path / "runs"
    common = [f"model.path={folder}", "model.engine=auto", "task.n_train=64", "task.n_eval=8",
              "eval.n_samples=2", "eval.every=0", "run.progress=false"]
    for method, extra in (("sft", ["sft.steps=2", "sft.batch_size=8"]),
                          ("essa", ["essa.population=4", "essa.minibatch=8",
                                    "essa.generations=1", f"lora.adapter={runs / 'sft' / 'adapter'}"]),
                          ("fgrpo", ["fgrpo.steps=1", "fgrpo.batch_prompts=4",
                                     "fgrpo.sampling.num_generations=2",
                                     f"lora.adapter={runs / 'sft' / 'adapter'}"])):
        proc = run_mpi(2, ["-m", method, *common, *extra, f"run.out={runs / method}"],
                       timeout=300)
        assert proc.returncode == 0, (method, proc.stderr[-3000:])
        attrs = RunFile(str(runs / method / f"{method}.h5")).attrs
        assert attrs["decode_backend"] == "engine", method
    for method in ("sft", "fgrpo"):
        peft = PeftModel.from_pretrained(type(model).from_pretrained(folder),
                                         runs / method / "adapter").eval()
        want = generate_tokens(peft, tok, PROMPTS, MAX_NEW, backend="hf", batch_size=16)
        assert len({tuple(t) for t in want}) > 8, method  # completions differ between prompts
        assert generate_tokens(peft, tok, PROMPTS, MAX_NEW, backend="engine") == want, method
