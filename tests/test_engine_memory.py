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
from hpc.engine.config import EngineConfig
from hpc.engine.engine_backend import EngineBackend
from hpc.engine.generate import eos_ids, generate_tokens
from hpc.engine.memory import (GIB, bucket, engine_bytes, engine_memory, rounded_length,
                               slots_within)
from hpc.engine.scheduler import Request
from hpc.engine.shape import ModelShape
from hpc.models.loading import load_model
from hpc.models.sampling import Sampling
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


@pytest.fixture
def decoder():
    """A fresh decoder of the default model section (budget, slots, graphs on)."""
    return EngineBackend()


@pytest.fixture(scope="module")
def toy():
    return load_model(toy_model_path())


@pytest.fixture(scope="module")
def prompts():
    return mixed_prompts(40)



def budget_gib_for(model, slots: int, max_len: int, k: int = 0) -> float:
    """The model.engine_memory_gib that holds exactly ``slots`` rows of ``max_len`` tokens."""
    length = rounded_length(max_len)
    shape = ModelShape.from_config(model.config)
    return engine_bytes(shape, slots, length, k, 4) / GIB


@pytest.mark.toy
def test_bytes_formula_equals_the_engine_tensors(decoder):
    """KV cache, stacked members and fp32 logits of a built engine are the formula's bytes."""
    model, tok = adapted_toy()
    space = SingularValueSpace.from_peft(model)
    factors = space.factors_batch(toy_members(space, 3))
    requests = [Request(tok(p)["input_ids"], MAX_NEW, i % 3, i) for i, p in
                enumerate(mixed_prompts(12))]
    decoder.decode(model, requests, eos_ids(model, tok), None, 12, members=factors)
    engine = decoder.engine
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
def test_bytes_formula_is_the_measured_peak_of_a_sampled_run(dtype, decoder):
    """A sampled engine run of a small Qwen2 with a large vocabulary (32 rows of 40-59 prompt
    tokens + 24 new): the formula's total is within 10% of the peak of live tensor bytes."""
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(
        hidden_size=128, intermediate_size=512, vocab_size=16000, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2)).to(dtype).eval()
    requests = [Request(list(range(1, 40 + i % 20)), 24, 0, i) for i in range(32)]
    tracker = LiveBytes()
    with tracker:
        engine = decoder.engine_for(model, 32, 59 + 24, 0)
        engine.run(requests, [], Sampling(1.0, 0.9, 1))
    planned = sum(engine_memory(engine.shape, 32, engine.cache.max_len, 0, dtype.itemsize,
                                prompt_tokens=59).values())
    assert 0.9 < planned / tracker.peak < 1.1


def test_slots_within_is_the_most_that_fit():
    shape = ModelShape.qwen25("7B")
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
def test_small_budget_decodes_in_waves_with_the_same_completions(toy, prompts, sampled, limit,
                                                                  decoder):
    """16 prompts x 4 samples asked for at once; a budget of 5 slots (or engine_slots=3) decodes
    them in waves through those slots, with the completions of the unlimited engine."""
    model, tok = toy
    kw = dict(do_sample=True, temperature=1.5, top_p=0.95, num_return_sequences=4,
              seed=3) if sampled else {}
    ref = generate_tokens(model, tok, prompts, MAX_NEW, batch_size=16, decoder=decoder, **kw)
    assert decoder.engine.slots == (64 if sampled else 16)
    max_len = max(len(tok(p)["input_ids"]) for p in prompts) + MAX_NEW
    limited = EngineBackend(EngineConfig(memory_gib=budget_gib_for(model, 5, max_len))
                      if limit == "engine_memory_gib" else EngineConfig(slots=3))
    assert generate_tokens(model, tok, prompts, MAX_NEW, batch_size=16, decoder=limited,
                           **kw) == ref
    assert limited.engine.slots == (5 if limit == "engine_memory_gib" else 3)


@pytest.mark.toy
def test_an_engine_is_resized_to_each_phase(toy, prompts, decoder):
    """A phase of 64 rows builds 64 slots; the next phase of 8 rows gets an 8-slot engine (not
    the earlier 64), which its own smaller calls keep."""
    model, tok = toy
    eos = eos_ids(model, tok)
    requests = [Request(tok(p)["input_ids"], MAX_NEW) for p in prompts]
    decoder.decode(model, requests, eos, None, 64)
    assert decoder.engine.slots == 64
    decoder.decode(model, requests, eos, None, 8)
    small = decoder.engine
    assert small.slots == 8 and small.cache.nbytes == small.memory()["kv_cache"]
    decoder.decode(model, requests[:3], eos, None, 8)  # a short last call of the phase
    assert decoder.engine is small


@pytest.mark.toy
def test_budget_without_room_for_one_row_is_one_line(toy):
    model, tok = toy
    with pytest.raises(UserError, match="model.engine_memory_gib"):
        generate_tokens(model, tok, ["1+2="], MAX_NEW,
                        decoder=EngineBackend(EngineConfig(memory_gib=1e-6)))


@pytest.mark.parametrize("replay", [CheckedStep, PerturbedStep])
@pytest.mark.toy
def test_self_check_on_first_capture(toy, prompts, replay):
    """An exact "captured" step passes the check and keeps replaying; a perturbed one is caught
    at its first shape: graphs go off (recorded on the decoder) and decoding goes on eagerly,
    with the completions of the eager engine either way; another decoder is not touched."""
    model, tok = toy
    ref = generate_tokens(model, tok, prompts, MAX_NEW, batch_size=8)
    decoder = EngineBackend(EngineConfig(replay=replay))
    out = generate_tokens(model, tok, prompts, MAX_NEW, batch_size=8, decoder=decoder)
    assert out == ref
    if replay is CheckedStep:
        assert decoder.graph_failure == ""
        assert decoder.engine.graphs is not None and len(decoder.engine.graphs.replays) > 1
    else:
        assert decoder.graph_failure.startswith("decode shape (rows ")
        assert "logits differ by up to 1, more than the tolerance" in decoder.graph_failure
        assert decoder.engine.graphs is None
        # the decoder's later engines decode eagerly: one of another shape replays nothing
        generate_tokens(model, tok, prompts[:2], MAX_NEW, batch_size=1, decoder=decoder)
        assert decoder.engine.graphs is None and decoder.engine.slots == 1
        other = EngineBackend(EngineConfig(replay=CheckedStep))
        generate_tokens(model, tok, prompts[:2], MAX_NEW, batch_size=1, decoder=other)
        assert other.graph_failure == "" and other.engine.graphs is not None


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


def test_replaced_engine_is_freed_before_the_next_is_built(monkeypatch, decoder):
    """engine_for: when the decoder's engine does not fit the call, its KV cache is gone
    before the next engine allocates its own (no two caches alive at once: the hand-over
    peak)."""
    from hpc.engine.kv_cache import KVCache

    model = _small_qwen()
    decoder.engine_for(model, 64, 128, 0)
    old = weakref.ref(decoder.engine)
    freed_first = []
    build = KVCache.__init__

    def watched(self, *args, **kwargs):
        engine = old()
        freed_first.append(engine is None or engine.cache is None)
        build(self, *args, **kwargs)

    monkeypatch.setattr(KVCache, "__init__", watched)
    decoder.engine_for(model, 8, 128, 0, most=8)  # fewer slots: replaced
    assert freed_first == [True] and decoder.engine.slots == 8
    old = weakref.ref(decoder.engine)
    decoder.engine_for(_small_qwen(), 8, 128, 0, most=8)  # another model: replaced
    assert freed_first == [True, True]


def test_end_phase_keeps_the_engine_only_for_a_next_phase_that_reuses_it(decoder):
    model = _small_qwen()
    decoder.engine_for(model, 512, 128, 0)
    assert not decoder.end_phase(300, 0) and decoder.engine.slots == 512  # reused as it is
    assert decoder.end_phase(64, 0) and decoder.engine is None  # fewer rows
    decoder.engine_for(model, 64, 128, 0)
    assert decoder.end_phase(64, 2)  # other members: rebuilt anyway, so released now
    decoder.engine_for(model, 64, 128, 0)
    assert decoder.end_phase() and not decoder.end_phase()  # nothing decodes next (the export)
