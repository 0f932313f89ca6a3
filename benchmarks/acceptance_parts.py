"""The decoding and memory parts of ``gpu_acceptance.py``, and what every part shares.

Each part is a function ``part(setup, budget) -> dict`` that returns its ``verdict`` (``ok``,
``FAILED`` or ``skipped``), a ``reason`` (why it failed or was skipped), a one-line
``summary`` of its key figures and the figures themselves, one entry per step. A step starts
only while the part's budget holds twice its slowest step so far (:class:`PartBudget`); a step
that raises is recorded with its error (:func:`guarded`) and fails the part, whose other steps
still run; a part whose dependency is missing raises :class:`Skipped`.

* :func:`engine_vs_hf`: greedy tokens and tokens/s of the engine against HF ``generate``;
* :func:`cuda_graphs`: the engine with CUDA graphs against the same engine without;
* :func:`quantized_decode`: INT8 and INT4 weight-only decoding against the model dtype;
* :func:`memory_plan`: the plan's peak against the allocator's for an ESSA scoring step and an
  F-GRPO step.

Shapes (:meth:`Setup.for_device`): the trained toy (fp32; also bf16 in the engine part, and
bf16 for the quantised part on CUDA) and a random-weight model of Qwen2.5-1.5B's shape on CUDA,
of ``gpu_check.py``'s ``tiny`` shape on CPU. Random weights make nearly every greedy token a
near-tie, so on them token agreement is a figure, not a check; exactness is checked on the
trained toy in fp32 only (its closest greedy choice over 64 prompts is 0.011 apart in logits of
up to 11: a bf16 rounding can flip it, an fp32 one cannot).
"""
from __future__ import annotations

import copy
import gc
import json
import os
import tempfile
import time
import traceback
from dataclasses import dataclass, field

import torch

from common import REPO
from gpu_check import SHAPES, Budget, build, greedy
from engine_speed import stored_bytes

from hpc.engine.backend import make_backend  # common.py: repo on sys.path
from hpc.engine.config import EngineConfig
from hpc.engine.engine_backend import EngineBackend
from hpc.engine.generate import generate_tokens
from hpc.engine.graphs import GraphedDecode
from hpc.engine.scheduler import Request
from hpc.models.loading import load_model

TOY_NEW = 8  # new tokens per toy prompt: its answers are at most 4 tokens and eos
SEED = 0
INT8_AGREEMENT = 0.9  # least share of the toy's tokens INT8 decodes as the model dtype does
#   (up to each row's first difference; on CPU in fp32: 100%, and 99.6% of 256 held-out rows)
INT4_AGREEMENT = 0.5  # the same for INT4: a broken kernel differs at almost every first token
PLAN_MARGIN = 0.15  # the plan may exceed the measured peak by this share, never fall below it
CLUSTER_CONFIG = os.path.join(REPO, "configs", "cluster", "math.yaml")
CPU_PLAN_KEYS = ["plan.max_prompt_tokens=32", "task.max_new_tokens=64", "eval.batch_size=8",
                 "eval.n_samples=4", "essa.population=8", "essa.minibatch=8",
                 "fgrpo.batch_prompts=4", "fgrpo.sampling.num_generations=4",
                 "fgrpo.optim.micro_batch=4"]


class Skipped(Exception):
    """A part cannot run here (a missing dependency or device); the message says why."""


def describe(err: Exception) -> str:
    """``Type: first line of the message`` (at most 500 characters)."""
    first = (str(err).strip().splitlines() or [""])[0]
    return f"{type(err).__name__}: {first}"[:500]


def guarded(fn) -> dict:
    """``fn()``, or ``{"error": ..., "traceback": ...}`` when it raises: what broke is a
    finding, and the run goes on (after an out-of-memory error, with the cache emptied)."""
    try:
        return fn()
    except Exception as err:  # noqa: BLE001 - see the docstring
        if isinstance(err, torch.OutOfMemoryError):
            torch.cuda.empty_cache()
        return {"error": describe(err), "traceback": traceback.format_exc()[-4000:]}


def ran(step: dict) -> bool:
    """Whether a step (or a mode of one) ran to its figures: neither skipped nor broken."""
    return "skipped" not in step and "error" not in step


class PartBudget(Budget):
    """A part's wall-clock budget; :meth:`run` starts a step only while the time left holds
    twice the slowest step so far."""

    def __init__(self, seconds: float):
        super().__init__(seconds)
        self.slowest = 0.0

    def run(self, out: dict, name: str, step) -> None:
        """``out[name] = guarded(step)``, or a ``skipped`` entry when the budget cannot hold
        it."""
        if not self.fits(2 * self.slowest):
            out[name] = {"skipped": f"time budget spent ({max(self.left(), 0):.0f} s left)"}
            return
        start = time.perf_counter()
        out[name] = guarded(step)
        self.slowest = max(self.slowest, time.perf_counter() - start)


@dataclass
class Setup:
    """What the parts run on: ``device``; the trained toy's folder; the random-weight shape
    (a key of ``gpu_check.SHAPES``), decoded ``rows`` at a time with ``lengths`` (prompt, new
    tokens); ``toy_prompts`` per toy call. Built models are kept in ``cache`` for later parts."""

    device: torch.device
    toy_path: str
    shape: str
    rows: int
    lengths: tuple
    toy_prompts: int
    cache: dict = field(default_factory=dict)

    @classmethod
    def for_device(cls, device: torch.device, toy_path: str) -> "Setup":
        if device.type == "cuda":
            return cls(device, toy_path, "qwen2.5-1.5b", 32, (64, 64), 64)
        return cls(device, toy_path, "tiny", 4, (16, 16), 32)

    @property
    def dtype(self) -> str:
        """The random shape's dtype and the quantised part's reference: bf16 on CUDA."""
        return "bfloat16" if self.device.type == "cuda" else "float32"

    def toy(self):
        """(model, tokenizer): the trained toy in fp32 on the device (kept)."""
        if "toy" not in self.cache:
            self.cache["toy"] = load_model(self.toy_path, "float32", self.device)
        return self.cache["toy"]

    def random_model(self):
        """(peft model with a random rank-8 q/k/v/o LoRA, its prompts (rows, prompt tokens)):
        ``gpu_check.build`` of the shape (kept)."""
        if "random" not in self.cache:
            model, _ = build(SHAPES[self.shape], self.device, getattr(torch, self.dtype))
            gen = torch.Generator().manual_seed(SEED)
            ids = torch.randint(2, model.config.vocab_size, (self.rows, self.lengths[0]),
                                generator=gen).to(self.device)
            self.cache["random"] = model, ids
        return self.cache["random"]

    def release(self) -> None:
        """Drop the kept models and give their memory back to the device."""
        self.cache.clear()
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def toy_prompts(n: int) -> list:
    """``n`` two-digit additions, the toy's task (every prompt 6 tokens: no padding)."""
    gen = torch.Generator().manual_seed(SEED)
    a, b = torch.randint(10, 100, (2, n), generator=gen).tolist()
    return [f"{x}+{y}=" for x, y in zip(a, b)]


def warm_then_time(fn, device: torch.device) -> tuple:
    """(result, seconds) of ``fn()``'s second call, the first one a warm-up (CUDA graphs are
    captured, kernels chosen), the device synchronised around the timed call."""
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, time.perf_counter() - start


def agreement(tokens: list, reference: list) -> dict:
    """Token lists against the reference's, row by row: the share of rows identical and of
    the reference's tokens before each row's first difference."""
    prefix = 0
    for row, ref in zip(tokens, reference):
        same = [a == b for a, b in zip(row, ref)] + [False]
        prefix += min(same.index(False), len(ref))
    return {"rows_identical": sum(a == b for a, b in zip(tokens, reference)) / len(reference),
            "tokens_before_first_difference": prefix / sum(len(r) for r in reference)}


def graph_state(decoder: EngineBackend) -> dict:
    """Whether ``decoder``'s engine replays CUDA graphs, how many decode shapes passed their
    self-check, and the failure of the one that did not ('' if none)."""
    graphs = decoder.engine.graphs if decoder.engine is not None else None
    return {"replayed": graphs is not None,
            "shapes_checked": len(graphs.replays) if graphs is not None else 0,
            "self_check_failure": decoder.graph_failure}


def engine_tokens(decoder: EngineBackend, model, ids: torch.Tensor, new: int) -> list:
    """Exactly ``new`` greedy tokens per row of ``ids`` (rows, prompt) from the engine."""
    requests = [Request(p, new) for p in ids.tolist()]
    return decoder.decode(model, requests, [], None, len(requests))


def tokens_per_s(rows: list, seconds: float) -> float:
    return sum(len(r) for r in rows) / seconds


def finish(out: dict, steps: tuple, failures: list, summary: str) -> dict:
    """The part's result: FAILED with its ``failures`` and the errors of its ``steps`` (names
    in ``out``; a step's modes, one level down, too), skipped when none of them ran, else
    ok."""
    errors = [f"{name}: {out[name]['error']}" for name in steps if "error" in out[name]]
    errors += [f"{name} {mode}: {r['error']}" for name in steps for mode, r in out[name].items()
               if isinstance(r, dict) and "error" in r]
    failures = errors + failures
    if failures:
        return dict(out, verdict="FAILED", reason="; ".join(failures), summary=summary)
    if all("skipped" in out[name] for name in steps):
        return dict(out, verdict="skipped", reason=out[steps[0]]["skipped"], summary=summary)
    return dict(out, verdict="ok", reason="", summary=summary)


def _figures(out: dict, name: str, text) -> str:
    """``name: text(step)`` for a step that ran, else ``name: skipped`` or ``error``."""
    step = out[name]
    return f"{name}: {text(step) if ran(step) else 'skipped' if 'skipped' in step else 'error'}"


# --- part 1: the engine against HF generate

def _toy_engine_vs_hf(s: Setup, dtype: str) -> dict:
    """The toy in ``dtype`` (float32: the one :meth:`Setup.toy` keeps) through both paths."""
    model, tok = s.toy() if dtype == "float32" else load_model(s.toy_path, dtype, s.device)
    prompts = toy_prompts(s.toy_prompts)
    decoder = EngineBackend()  # as a job has it: CUDA graphs on CUDA
    reference = make_backend("hf")

    def run(backend):
        return generate_tokens(model, tok, prompts, TOY_NEW, batch_size=len(prompts),
                               decoder=backend)

    hf, hf_s = warm_then_time(lambda: run(reference), s.device)
    eng, eng_s = warm_then_time(lambda: run(decoder), s.device)
    out = {"dtype": dtype, "prompts": len(prompts), "identical": eng == hf,
           **agreement(eng, hf), "hf_tokens_per_s": tokens_per_s(hf, hf_s),
           "engine_tokens_per_s": tokens_per_s(eng, eng_s), "engine_vs_hf": hf_s / eng_s,
           "cuda_graphs": graph_state(decoder)}
    decoder.release()
    return out


def _random_engine_vs_hf(s: Setup) -> dict:
    model, ids = s.random_model()
    new = s.lengths[1]
    decoder = EngineBackend()
    hf, hf_s = warm_then_time(lambda: greedy(model, ids, new).tolist(), s.device)
    eng, eng_s = warm_then_time(lambda: engine_tokens(decoder, model, ids, new), s.device)
    out = {"rows": len(ids), "prompt_tokens": s.lengths[0], "new_tokens": new,
           **agreement(eng, hf), "hf_tokens_per_s": tokens_per_s(hf, hf_s),
           "engine_tokens_per_s": tokens_per_s(eng, eng_s), "engine_vs_hf": hf_s / eng_s,
           "cuda_graphs": graph_state(decoder)}
    decoder.release()
    return out


def engine_vs_hf(s: Setup, budget: PartBudget) -> dict:
    """Greedy tokens of the engine (:class:`hpc.engine.engine_backend.EngineBackend`, as a job builds it)
    and HF ``generate``: identical on the trained toy in fp32 (the check); in bf16 (``toy_bf16``,
    where a bf16 rounding may flip the toy's closest greedy choices) and on the random shape
    the share of tokens that agree and tokens/s of each, as figures."""
    out = {}
    budget.run(out, "toy", lambda: _toy_engine_vs_hf(s, "float32"))
    budget.run(out, "toy_bf16", lambda: _toy_engine_vs_hf(s, "bfloat16"))
    budget.run(out, s.shape, lambda: _random_engine_vs_hf(s))
    toy = out["toy"]
    failures = ([f"toy: engine and HF greedy tokens differ in "
                 f"{1 - toy['rows_identical']:.0%} of rows"]
                if ran(toy) and not toy["identical"] else [])

    def text(r):
        return (f"{r['rows_identical']:.0%} rows identical, engine "
                f"{r['engine_tokens_per_s']:.0f} tok/s vs HF {r['hf_tokens_per_s']:.0f}")

    names = ("toy", "toy_bf16", s.shape)
    return finish(out, names, failures, "; ".join(_figures(out, n, text) for n in names))


# --- part 2: CUDA graphs on against off

def _graphs_on_off(s: Setup, replay, decode) -> dict:
    """``decode(decoder)`` (token lists) with CUDA graphs (``replay``; GraphedDecode: through
    ``cuda_graphs=True``, as a job's config asks for them) and without."""
    on = EngineBackend(EngineConfig(cuda_graphs=True,
                              replay=None if replay is GraphedDecode else replay))
    off = EngineBackend(EngineConfig(cuda_graphs=False))
    eager, eager_s = warm_then_time(lambda: decode(off), s.device)
    graphed, graphed_s = warm_then_time(lambda: decode(on), s.device)
    out = {"identical": graphed == eager, **agreement(graphed, eager),
           "eager_tokens_per_s": tokens_per_s(eager, eager_s),
           "graphs_tokens_per_s": tokens_per_s(graphed, graphed_s),
           "speedup": eager_s / graphed_s, **graph_state(on)}
    on.release()
    off.release()
    return out


def cuda_graphs(s: Setup, budget: PartBudget, replay=GraphedDecode) -> dict:
    """The engine with its decode steps replayed from CUDA graphs (``replay``: a
    :class:`hpc.engine.graphs.GraphedDecode`; a test passes a stand-in that runs on CPU) and
    without: the self-check of every captured shape passes and some shape is replayed (on both
    models), and the toy's greedy tokens are identical; tokens/s of each."""
    if replay is GraphedDecode and s.device.type != "cuda":
        raise Skipped("CUDA graphs need a CUDA device")
    out = {}

    def toy(decoder):
        model, tok = s.toy()
        prompts = toy_prompts(s.toy_prompts)
        return generate_tokens(model, tok, prompts, TOY_NEW, batch_size=len(prompts),
                               decoder=decoder)

    def random(decoder):
        model, ids = s.random_model()
        return engine_tokens(decoder, model, ids, s.lengths[1])

    budget.run(out, "toy", lambda: _graphs_on_off(s, replay, toy))
    budget.run(out, s.shape, lambda: _graphs_on_off(s, replay, random))
    failures = []
    for name in ("toy", s.shape):
        r = out[name]
        if not ran(r):
            continue
        if r["self_check_failure"]:
            failures.append(f"{name}: self-check failed: {r['self_check_failure']}")
        elif not r["replayed"] or not r["shapes_checked"]:
            failures.append(f"{name}: no decode step was replayed from a graph")
        if name == "toy" and not r["identical"]:
            failures.append(f"toy: tokens with graphs differ in {1 - r['rows_identical']:.0%} "
                            f"of rows")

    def text(r):
        return (f"self-check {'passed' if not r['self_check_failure'] else 'FAILED'} "
                f"({r['shapes_checked']} shapes), {r['rows_identical']:.0%} rows identical, "
                f"{r['speedup']:.2f}x eager")

    names = ("toy", s.shape)
    return finish(out, names, failures, "; ".join(_figures(out, n, text) for n in names))


# --- part 3: INT8 and INT4 weight-only decoding

def _quantized_toy(s: Setup, modes: list) -> dict:
    """The toy's greedy tokens at each of ``modes`` against the model dtype's: agreement."""
    from hpc.models.quantize import quantize_base

    prompts = toy_prompts(s.toy_prompts)

    def decode(mode, reference=None) -> tuple:
        model, tok = load_model(s.toy_path, s.dtype, s.device)
        quantize_base(model, mode)
        decoder = EngineBackend()  # as a job has it: CUDA graphs on CUDA
        tokens = generate_tokens(model, tok, prompts, TOY_NEW, batch_size=len(prompts),
                                 decoder=decoder)
        figures = {**agreement(tokens, reference or tokens), "cuda_graphs": graph_state(decoder)}
        decoder.release()
        return figures, tokens

    _, reference = decode("none")
    return {"dtype": s.dtype, "prompts": len(prompts),
            **{mode: guarded(lambda: decode(mode, reference)[0]) for mode in modes}}


def _quantized_random(s: Setup, modes: list) -> dict:
    """The random shape's engine tokens/s, weight bytes and agreement at each of ``modes``
    against the model dtype (each mode on its own copy of the model)."""
    from hpc.models.quantize import quantize_base

    model, ids = s.random_model()

    def decode(mode, reference=None) -> tuple:
        quantized = quantize_base(copy.deepcopy(model), mode) if mode != "none" else model
        decoder = EngineBackend()
        tokens, seconds = warm_then_time(
            lambda: engine_tokens(decoder, quantized, ids, s.lengths[1]), s.device)
        figures = {"tokens_per_s": tokens_per_s(tokens, seconds),
                   "weight_bytes": sum(stored_bytes(p) for n, p in
                                       quantized.named_parameters() if "lora_" not in n),
                   **agreement(tokens, reference or tokens), "cuda_graphs": graph_state(decoder)}
        decoder.release()
        del quantized
        gc.collect()
        if s.device.type == "cuda":
            torch.cuda.empty_cache()
        return figures, tokens

    figures, reference = decode("none")
    return {s.dtype: figures,
            **{mode: guarded(lambda: decode(mode, reference)[0]) for mode in modes}}


def quantized_decode(s: Setup, budget: PartBudget) -> dict:
    """torchao weight-only INT8 and INT4 (:func:`hpc.models.quantize.quantize_base`) against
    the model dtype (bf16 on CUDA), each decoded as a job decodes (CUDA graphs on CUDA): the
    share of the toy's tokens that agree (at least INT8_AGREEMENT, INT4_AGREEMENT), the CUDA
    graphs' self-check passing; tokens/s and weight bytes on the random shape."""
    from hpc.models.quantize import check_quantize
    from hpc.runtime.errors import UserError

    modes, skipped = [], {}
    for mode in ("int8", "int4"):
        try:
            check_quantize(mode, s.dtype, s.device)
            modes.append(mode)
        except UserError as err:
            skipped[mode] = str(err)
    if not modes:
        raise Skipped("; ".join(skipped.values()))
    out = {"not_run": skipped}
    budget.run(out, "toy", lambda: _quantized_toy(s, modes))
    budget.run(out, s.shape, lambda: _quantized_random(s, modes))
    failures = []
    toy, big = out["toy"], out[s.shape]
    for mode, least in (("int8", INT8_AGREEMENT), ("int4", INT4_AGREEMENT)):
        share = toy.get(mode, {}).get("tokens_before_first_difference")
        if share is not None and share < least:
            failures.append(f"toy: {mode} agrees with {s.dtype} on {share:.0%} of the tokens "
                            f"(least {least:.0%})")
    for name, step in (("toy", toy), (s.shape, big)):
        for mode, r in step.items():
            ok = isinstance(r, dict) and ran(r)
            failure = r.get("cuda_graphs", {}).get("self_check_failure") if ok else ""
            if failure:
                failures.append(f"{name} {mode}: CUDA-graph self-check failed: {failure}")

    def figures(mode):
        text = f"{mode}: toy " + (f"{toy[mode]['tokens_before_first_difference']:.0%} tokens "
                                  f"agree ({toy[mode]['rows_identical']:.0%} rows identical)"
                                  if mode in toy and ran(toy[mode]) else "not measured")
        if mode in big and ran(big[mode]):
            text += (f", {big[mode]['tokens_per_s'] / big[s.dtype]['tokens_per_s']:.2f}x "
                     f"{s.dtype} tok/s")
        return text

    parts = [figures(mode) for mode in modes]
    parts += [f"{mode}: not run ({why.split(': ', 1)[-1].split(' (')[0]})"
              for mode, why in skipped.items()]
    return finish(out, ("toy", s.shape), failures, "; ".join(parts))


# --- part 4: the memory plan against the allocator

def _plan_config(s: Setup, folder: str):
    """The job config the plan and the measurement read: the cluster config with the random
    shape's ``config.json`` in ``folder`` as ``model.path`` (on CPU, smaller batches)."""
    from hpc.job.config import plan_job_class
    from hpc.runtime.config import load_config

    with open(os.path.join(folder, "config.json"), "w") as fh:
        json.dump(dict(SHAPES[s.shape], model_type="qwen2",
                       architectures=["Qwen2ForCausalLM"]), fh)
    keys = [f"model.path={folder}"] + (CPU_PLAN_KEYS if s.device.type == "cpu" else [])
    return load_config(plan_job_class(), CLUSTER_CONFIG, keys)


def _resident_bytes(device: torch.device) -> int:
    """What the allocator holds now, after a collection (0 on CPU: the tracker counts only
    what the case allocates); on CUDA the peak statistics start again here, so no earlier
    part's (or case's) peak is read as this case's."""
    gc.collect()
    if device.type != "cuda":
        return 0
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def _plan_against_measured(case: str, cfg, device: torch.device) -> dict:
    """One case of :func:`memory_tracker.measure_phases` beside the plan; on CUDA the bytes
    resident before it (should be none) are taken off its peaks."""
    from memory_tracker import measure_phases, planned_for, planned_phases

    resident = _resident_bytes(device)
    measured = {p: b - resident for p, b in
                measure_phases(case, cfg, 1, None, device.type).items()}
    planned = planned_phases(case, cfg, 1)
    phases = {p: {"measured_bytes": int(b), "planned_bytes": int(planned_for(p, planned))}
              for p, b in measured.items()}
    peak = max(measured.values())
    plan = max(r["planned_bytes"] for r in phases.values())
    return {"resident_bytes": resident, "phases": phases, "measured_peak_bytes": int(peak),
            "planned_peak_bytes": plan, "plan_over_measured": plan / peak}


def memory_plan(s: Setup, budget: PartBudget) -> dict:
    """The plan's peak (:func:`memory_tracker.planned_phases`) against the measured one
    (:func:`memory_tracker.measure_phases`: on CUDA ``torch.cuda.max_memory_allocated``, on
    CPU torch's tracker) of an ESSA scoring pass and an F-GRPO step on one rank, the cluster
    config on the random shape: measured <= plan <= (1 + PLAN_MARGIN) x measured."""
    s.release()  # nothing else is resident while the allocator's peak is read
    out = {}
    with tempfile.TemporaryDirectory(prefix="plan-shape-") as folder:
        cfg = _plan_config(s, folder)
        for case in ("essa", "fgrpo"):
            budget.run(out, case, lambda: _plan_against_measured(case, cfg, s.device))
    failures = []
    for case in ("essa", "fgrpo"):
        r = out[case]
        if ran(r) and not 1.0 <= r["plan_over_measured"] <= 1.0 + PLAN_MARGIN:
            failures.append(f"{case}: plan {r['planned_peak_bytes'] / 2 ** 20:.1f} MiB, "
                            f"measured {r['measured_peak_bytes'] / 2 ** 20:.1f} MiB "
                            f"(allowed: measured to +{PLAN_MARGIN:.0%})")

    def text(r):
        return (f"plan {r['planned_peak_bytes'] / 2 ** 20:.1f} MiB vs measured "
                f"{r['measured_peak_bytes'] / 2 ** 20:.1f} ({r['plan_over_measured'] - 1:+.1%})")

    names = ("essa", "fgrpo")
    return finish(out, names, failures, "; ".join(_figures(out, c, text) for c in names))


# --- part 7: every installed decoding backend on the same work

def backends(s: Setup, budget: PartBudget) -> dict:
    """``benchmarks/backends.py`` on the device: ESSA scoring (16 members x 256 prompts),
    F-GRPO rollouts (32 x 8 at temperature 1) and evaluation (256 greedy) on every decoding
    backend installed here, on the trained toy with a rank-8 LoRA: tokens/s, each backend's
    ratio to the package's engine and its completions equal to the engine's, as figures (the
    first GPU run says which backend is faster there)."""
    import backends as bench  # this folder: benchmarks/

    out = {}
    size = [] if s.device.type == "cuda" else ["--members", "2", "--prompts", "16",
                                              "--rollouts", "4"]
    budget.run(out, "toy", lambda: bench.main(["--repeats", "2", "--model", s.toy_path] + size))

    def text(r):
        engine = r["backends"]["engine"]
        return ", ".join(f"{name} {work} {rows[work]['tokens_per_s'] / engine[work]['tokens_per_s']:.2f}x"
                         for name, rows in r["backends"].items() if name != "engine"
                         for work in rows)

    return finish(out, ("toy",), [], _figures(out, "toy", text))
