"""The decoding engine's memory budget (waves through fewer slots, one engine per phase's size,
the bytes formula against the tensors it allocates) and its CUDA-graph self-check (forced on
on CPU with a perturbed "captured" step), on the trained toy model (fp32, CPU)."""
import json
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from transformers import Qwen2Config, Qwen2ForCausalLM

from conftest import our_lines, run_cli, run_mpi
from hpc.models.adapter_space import SingularValueSpace
from hpc.models.engine import (GIB, MAX_LEN_STEP, DecodeShape, Request, bucket, engine_bytes,
                               engine_for, engine_memory, graph_check_failure,
                               reset_graph_check, slots_within)
from hpc.models.generation import (configure, eos_ids, generate_tokens, replaying_with,
                                   run_requests)
from hpc.models.loading import load_model
from hpc.models.sampling import Sampling
from hpc.runtime.config import ModelConfig
from hpc.runtime.errors import UserError
from hpc.runtime.runstore import RunFile
from hpc.toys.toy import toy_model_path
from mpi.engine_check import adapted_toy, mixed_prompts, toy_members
from mpi.engine_job import CheckedStep, PerturbedStep

MAX_NEW = 8


@pytest.fixture(scope="module", autouse=True)
def threads():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def default_settings():
    """Every test starts and ends with the default model section (budget, slots, graphs on)."""
    configure(ModelConfig())
    yield
    configure(ModelConfig())


@pytest.fixture(scope="module")
def toy():
    return load_model(toy_model_path())


@pytest.fixture(scope="module")
def prompts():
    return mixed_prompts(40)


def engine_of(model):
    return model.__dict__["_decode_engine"]


def budget_gib_for(model, slots: int, max_len: int, k: int = 0) -> float:
    """The model.engine_memory_gib that holds exactly ``slots`` rows of ``max_len`` tokens."""
    length = -(-max_len // MAX_LEN_STEP) * MAX_LEN_STEP
    shape = DecodeShape.from_config(model.config)
    return engine_bytes(shape, slots, length, k, 4) / GIB


@pytest.mark.toy
def test_bytes_formula_equals_the_engine_tensors():
    """KV cache, stacked members and fp32 logits of a built engine are the formula's bytes."""
    model, tok = adapted_toy()
    space = SingularValueSpace.from_peft(model)
    factors = space.factors_batch(toy_members(space, 3))
    requests = [Request(tok(p)["input_ids"], MAX_NEW, i % 3, i) for i, p in
                enumerate(mixed_prompts(12))]
    run_requests(model, requests, eos_ids(model, tok), None, 12, factors=factors)
    engine = engine_of(model)
    planned = engine.memory()
    assert engine.slots == 16 and engine.k == 3
    assert engine.cache.nbytes == planned["kv_cache"] == (
        2 * model.config.num_hidden_layers * 16 * model.config.num_key_value_heads
        * engine.cache.max_len * (model.config.hidden_size // model.config.num_attention_heads)
        * 4)
    stacked = sum(s.a_cat.nbytes + s.b_cat.nbytes for _, sites in engine.layers
                  for s in sites.values() if s.a_cat is not None)
    assert stacked == planned["members"] > 0
    assert engine.logits.nbytes == 16 * 4 * model.config.vocab_size
    assert planned["slot_buffers"] > engine.logits.nbytes and planned["step_peak"] > 0


class LiveBytes(TorchDispatchMode):
    """Peak bytes of the tensor storages that ops create within the block, each counted until
    it is freed (torch's MemTracker, without its per-module statistics, which refuse modules
    called more than once)."""

    def __init__(self):
        super().__init__()
        self.live, self.now, self.peak = {}, 0, 0

    def _gone(self, key):
        self.now -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key not in self.live and storage.nbytes():
                    self.live[key] = storage.nbytes()
                    self.now += storage.nbytes()
                    self.peak = max(self.peak, self.now)
                    weakref.finalize(storage, self._gone, key)
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bytes_formula_is_the_measured_peak_of_a_sampled_run(dtype):
    """A sampled engine run of a small Qwen2 with a large vocabulary (32 rows of 40-59 prompt
    tokens + 24 new): the formula's total is within 10% of the peak of live tensor bytes."""
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(
        hidden_size=128, intermediate_size=512, vocab_size=16000, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2)).to(dtype).eval()
    requests = [Request(list(range(1, 40 + i % 20)), 24, 0, i) for i in range(32)]
    tracker = LiveBytes()
    with tracker:
        engine = engine_for(model, 32, 59 + 24, 0)
        engine.run(requests, [], Sampling(1.0, 0.9, 1))
    planned = sum(engine_memory(engine.shape, 32, engine.cache.max_len, 0, dtype.itemsize,
                                prompt_tokens=59).values())
    assert 0.9 < planned / tracker.peak < 1.1


def test_slots_within_is_the_most_that_fit():
    shape = DecodeShape(layers=28, kv_heads=4, head_dim=128, hidden=3584, intermediate=18944,
                        vocab=152064)
    budget = 20 * GIB
    n = slots_within(budget, shape, 1024, 2, 2, 10_000_000, 4)
    assert engine_bytes(shape, n, 1024, 2, 2, 10_000_000, 4) <= budget
    assert engine_bytes(shape, n + 1, 1024, 2, 2, 10_000_000, 4) > budget
    parts = engine_memory(shape, n, 1024, 2, 2, 10_000_000, 4)
    assert parts["kv_cache"] == 2 * 28 * n * 4 * 1024 * 128 * 2
    assert parts["members"] == 2 * 10_000_000 * 4
    assert slots_within(budget, shape, 1024, most=8) == 8


@pytest.mark.parametrize("sampled", [False, True])
@pytest.mark.parametrize("limit", ["engine_memory_gib", "engine_slots"])
@pytest.mark.toy
def test_small_budget_decodes_in_waves_with_the_same_completions(toy, prompts, sampled, limit):
    """16 prompts x 4 samples asked for at once; a budget of 5 slots (or engine_slots=3) decodes
    them in waves through those slots, with the completions of the unlimited engine."""
    model, tok = toy
    kw = dict(do_sample=True, temperature=1.5, top_p=0.95, num_return_sequences=4,
              seed=3) if sampled else {}
    ref = generate_tokens(model, tok, prompts, MAX_NEW, batch_size=16, **kw)
    assert engine_of(model).slots == (64 if sampled else 16)
    max_len = max(len(tok(p)["input_ids"]) for p in prompts) + MAX_NEW
    value = budget_gib_for(model, 5, max_len) if limit == "engine_memory_gib" else 3
    configure(ModelConfig(**{limit: value}))
    assert generate_tokens(model, tok, prompts, MAX_NEW, batch_size=16, **kw) == ref
    assert engine_of(model).slots == (5 if limit == "engine_memory_gib" else 3)


@pytest.mark.toy
def test_an_engine_is_resized_to_each_phase(toy, prompts):
    """A phase of 64 rows builds 64 slots; the next phase of 8 rows gets an 8-slot engine (not
    the earlier 64), which its own smaller calls keep."""
    model, tok = toy
    eos = eos_ids(model, tok)
    requests = [Request(tok(p)["input_ids"], MAX_NEW) for p in prompts]
    run_requests(model, requests, eos, None, 64)
    assert engine_of(model).slots == 64
    run_requests(model, requests, eos, None, 8)
    small = engine_of(model)
    assert small.slots == 8 and small.cache.nbytes == small.memory()["kv_cache"]
    run_requests(model, requests[:3], eos, None, 8)  # a short last call of the phase
    assert engine_of(model) is small


@pytest.mark.toy
def test_budget_without_room_for_one_row_is_one_line(toy):
    model, tok = toy
    configure(ModelConfig(engine_memory_gib=1e-6))
    with pytest.raises(UserError, match="model.engine_memory_gib"):
        generate_tokens(model, tok, ["1+2="], MAX_NEW)


@pytest.mark.parametrize("replay", [CheckedStep, PerturbedStep])
@pytest.mark.toy
def test_self_check_on_first_capture(toy, prompts, replay):
    """An exact "captured" step passes the check and keeps replaying; a perturbed one is caught
    at its first shape: graphs go off (recorded) and decoding goes on eagerly, with the
    completions of the eager engine either way."""
    model, tok = toy
    ref = generate_tokens(model, tok, prompts, MAX_NEW, batch_size=8)
    with replaying_with(replay):
        out = generate_tokens(model, tok, prompts, MAX_NEW, batch_size=8)
    assert out == ref
    if replay is CheckedStep:
        assert graph_check_failure() == ""
        assert engine_of(model).graphs is not None and len(engine_of(model).graphs.replays) > 1
    else:
        assert graph_check_failure().startswith("decode shape (rows ")
        assert "logits differ by up to 1, more than the tolerance" in graph_check_failure()
        assert engine_of(model).graphs is None
        with replaying_with(CheckedStep):  # later engines of the process decode eagerly
            generate_tokens(model, tok, prompts[:2], MAX_NEW, batch_size=1)
        assert engine_of(model).graphs is None
        reset_graph_check()


ESSA_ARGS = ["model.path=toy", "task.n_train=200", "task.n_eval=32", "essa.population=4",
             "essa.minibatch=16", "essa.generations=2", "essa.sigma0=0.5", "eval.every=0",
             "eval.n_samples=8", "eval.batch_size=16", "run.progress=false"]


@pytest.mark.toy
def test_essa_engine_after_start_evaluation_holds_the_scoring_need(toy_adapter, tmp_path):
    """The start evaluation decodes 16 prompts x 8 samples (128 slots) and releases that engine
    at its end, as the first generation's scoring (16 prompts, one member per pass) needs
    fewer; the scoring then runs on a 16-slot engine, whose KV cache is the formula's."""
    prefix = tmp_path / "report"
    proc = run_cli(["tests/mpi/engine_job.py", str(prefix), "memory", *ESSA_ARGS,
                    f"lora.adapter={toy_adapter}", "essa.members_per_pass=1",
                    f"run.out={tmp_path / 'run'}"], timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "report.0.json").read_text())
    evaluation, scoring = report["end_of_start_eval"], report["after_generation"]
    assert evaluation["slots"] == 128 and evaluation["k"] == scoring["k"] == 1
    assert report["after_start_eval"] == {}  # released: no two engines at the hand-over
    assert scoring["slots"] == bucket(16, 1 << 30) == 16
    assert scoring["kv_bytes"] == scoring["memory"]["kv_cache"] < evaluation["kv_bytes"] / 4


@pytest.mark.mpi
@pytest.mark.toy
def test_essa_job_with_a_perturbed_captured_step(toy_adapter, tmp_path):
    """Two ranks, every engine self-checked, rank 1's "captured" step perturbed: rank 0 prints
    one line, both ranks turn graphs off, the run completes and its file says why."""
    prefix, out = tmp_path / "report", tmp_path / "run"
    proc = run_mpi(2, ["tests/mpi/engine_job.py", str(prefix), "perturb-1", *ESSA_ARGS,
                       f"lora.adapter={toy_adapter}", f"run.out={out}"], timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in our_lines(proc.stderr) if "self-check" in line]
    assert len(lines) == 1 and lines[0].startswith(
        "warning: the decoding engine's CUDA-graph self-check failed on rank 1: decode shape")
    assert "CUDA graphs are off for the rest of the run" in lines[0]
    for rank in (0, 1):
        report = json.loads((tmp_path / f"report.{rank}.json").read_text())
        assert report["failure"].startswith("rank 1: decode shape")
        assert report["end"]["replays"] is False
    run = RunFile(str(out / "essa.h5"))
    assert run.attrs["status"] == "complete"
    assert run.attrs["cuda_graphs_disabled"].startswith("rank 1: decode shape (rows ")


def _small_qwen():
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(
        hidden_size=64, intermediate_size=128, vocab_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2)).eval()


def test_replaced_engine_is_freed_before_the_next_is_built(monkeypatch):
    """engine_for: when the model's engine does not fit the call, its KV cache is gone before
    the next engine allocates its own (no two caches alive at once: the hand-over peak)."""
    from hpc.models.engine import KVCache

    model = _small_qwen()
    engine_for(model, 64, 128, 0)
    old = weakref.ref(engine_of(model))
    freed_first = []
    build = KVCache.__init__

    def watched(self, *args, **kwargs):
        engine = old()
        freed_first.append(engine is None or engine.cache is None)
        build(self, *args, **kwargs)

    monkeypatch.setattr(KVCache, "__init__", watched)
    engine_for(model, 8, 128, 0, most=8)  # fewer slots: replaced
    assert freed_first == [True] and engine_of(model).slots == 8


def test_end_phase_keeps_the_engine_only_for_a_next_phase_that_reuses_it():
    from hpc.models.engine import end_phase

    model = _small_qwen()
    engine_for(model, 512, 128, 0)
    assert not end_phase(model, 300, 0) and engine_of(model).slots == 512  # reused as it is
    assert end_phase(model, 64, 0) and "_decode_engine" not in model.__dict__  # fewer rows
    engine_for(model, 64, 128, 0)
    assert end_phase(model, 64, 2)  # other members: rebuilt anyway, so released now
    engine_for(model, 64, 128, 0)
    assert end_phase(model) and not end_phase(model)  # nothing decodes next (the export)
