"""GPU check: batched ESSA members against plain batched generation, one F-GRPO step by phase,
and the decoding engine against HF eager generate.

    python benchmarks/gpu_check.py OUTDIR [--model qwen2.5-1.5b|qwen2.5-7b|tiny ...]
        [--minutes 6] [--device cuda|cpu] [--ks 1 2 4 8 16] [--prompts 32]
        [--engine | --engine-only] [--rows 32 256 1024] [--engine-ks 1 2 4 8 16]
    python benchmarks/gpu_check.py OUTDIR --device cpu --tiny     # smoke run of the engine part
    python benchmarks/gpu_check.py OUTDIR --model qwen2.5-1.5b qwen2.5-7b --int8-only

INT8 part (``--int8``: after the rest; ``--int8-only``: alone): the engine's tokens/s (k = 1
at every ``--rows``, fixed lengths; then ``--engine-ks`` members per row at the middle row
count, spread lengths), and the members per pass that fit (:func:`members_on_device`), first
with the weights in the model dtype, then after :func:`hpc.models.quantize.quantize_base`
(``model.quantize=int8``: torchao INT8 weight-only decoder linears) on the same rows. The
``int8`` rows' bound counts the bytes the quantised weights hold (values and scales).

Engine part (``--engine``: after the rest; ``--engine-only``: alone): for each shape, useful
tokens/s of the engine and of HF eager ``generate`` on the same rows, each against the bound
max(weight bytes / bandwidth, FLOPs / peak) (:mod:`engine_speed`): at every ``--rows`` with
fixed lengths and with the GSM8K / MATH-500 spread (k = 1, the peft adapter), then k members
per row at the middle row count (spread lengths). The GPU command of the README:

    python benchmarks/gpu_check.py results --model qwen2.5-1.5b qwen2.5-7b --engine-only \
        --minutes 7

Builds a Qwen2 of a real shape with random weights (bf16 on CUDA, fp32 on CPU; no hub access),
a rank-8 LoRA on q/k/v/o with random B, and the ESSA search space over it. Prompts are random
tokens, the generation length is fixed (min_new_tokens = max_new_tokens, greedy). For each k it
times the generation of k members x P prompts (k*P rows):

* ``lora_fused`` and ``lora_exact``: :class:`hpc.models.member_lora.MemberLora`, fused (the CUDA
  default) and with peft's arithmetic, member-major rows;
* ``base``: the same rows through the model with every adapted layer swapped back to its base
  Linear: pure batched generation without LoRA;
* at k = 1 also ``peft``: one member through peft's own LoRA forward (ESSA one at a time);

The variants' timed calls are interleaved (best of two each, after a warm-up call), and the
report gives tokens/s, members/s, the ratio to pure generation (target >= 0.8), the speedup
over peft one at a time, the time to rebuild the k members' factors, the peak memory and the
host ops per decoding step of each variant (:func:`host_ops_per_step`). Then
one F-GRPO step (32 prompts x G = 8 sampled completions, micro-batches of 64 rows, AdamW on the
LoRA, the grpo preset otherwise; rewards are a hash of the tokens) timed by phase: generation,
reward, then the trainer's own update :func:`fgrpo.step.train_on_rollouts`: forward_backward,
optimizer (one rank: no all-reduce). A
measurement that would overrun the --minutes budget is skipped; OUTDIR/gpu_check.json is
rewritten after every measurement, so a killed run still leaves its figures.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from common import REPO, TARGETS, machine
from engine_speed import compare, row_lengths, solution_lengths, stored_bytes
from hpc.engine.engine_backend import EngineBackend
from hpc.engine.scheduler import Request
from hpc.models.sampling import Sampling

from hpc.engine.hf_backend import members_on_device  # common.py: repo on sys.path
from hpc.models.member_lora import MemberLora
from hpc.models.adapter_space import SingularValueSpace
from hpc.models.loading import attach_lora
from hpc.engine.shape import QWEN25
from hpc.models.quantize import quantize_base

# Qwen2.5 shapes (config.json of the released models) and a tiny one for CPU runs.
SHAPES = {**{f"qwen2.5-{size.lower()}": QWEN25[size] for size in ("1.5B", "7B")},
          "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, intermediate_size=128, vocab_size=512,
                       tie_word_embeddings=True)}
LENGTHS = {"tiny": (16, 16)}  # (prompt tokens, new tokens); real shapes: 64, 64
LORA_RANK, LORA_ALPHA, SEED = 8, 16.0, 0
VARIANTS = ("lora_fused", "lora_exact", "base")
REPEATS = 2  # timed calls per variant and k (best kept), after one warm-up call
# The F-GRPO step's keys (fgrpo defaults otherwise); the rollouts are random prompts.
FGRPO_KEYS = ["fgrpo.batch_prompts=32", "fgrpo.sampling.num_generations=8",
              "fgrpo.optim.micro_batch=64", "fgrpo.optim.learning_rate=2e-3"]


class Budget:
    """Wall-clock budget: ``fits(seconds)`` is False once a step of that length would overrun."""

    def __init__(self, seconds: float):
        self.deadline = time.perf_counter() + seconds

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def fits(self, seconds: float) -> bool:
        return seconds < self.left()


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build(shape: dict, device, dtype):
    """(peft model with a random-B rank-8 q/k/v/o LoRA, its SingularValueSpace), eval mode.
    ``shape``: Qwen2Config fields, as in SHAPES."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**shape, max_position_embeddings=32768, pad_token_id=0,
                         bos_token_id=None, eos_token_id=None)
    default = torch.get_default_dtype()
    torch.manual_seed(SEED)
    try:
        torch.set_default_dtype(dtype)
        with torch.device(device):
            model = Qwen2ForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    peft_model = attach_lora(model.eval(), LORA_RANK, LORA_ALPHA, TARGETS, seed=SEED)
    with torch.no_grad():
        for pname, p in peft_model.named_parameters():
            if "lora_B" in pname:
                p.normal_(0.0, 0.02)
    return peft_model.eval(), SingularValueSpace.from_peft(peft_model)


class BaseOnly:
    """Context manager: every adapted layer swapped back to its base Linear (no LoRA code)."""

    def __init__(self, peft_model, modules: list):
        self.model, self.modules = peft_model, modules

    def _holders(self):
        for name in self.modules:
            parent, _, child = name.rpartition(".")
            yield self.model.get_submodule(parent), child

    def __enter__(self):
        self.saved = [getattr(holder, child) for holder, child in self._holders()]
        for (holder, child), lora in zip(self._holders(), self.saved):
            setattr(holder, child, lora.base_layer)

    def __exit__(self, *exc):
        for (holder, child), lora in zip(self._holders(), self.saved):
            setattr(holder, child, lora)


def greedy(model, ids, new_tokens: int) -> torch.Tensor:
    """Exactly ``new_tokens`` greedy tokens per row of ``ids`` (rows, prompt): (rows, new)."""
    from transformers import GenerationConfig

    cfg = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                           do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             generation_config=cfg)
    if out.shape[1] != ids.shape[1] + new_tokens:
        raise RuntimeError(f"generated {out.shape[1] - ids.shape[1]} tokens, not {new_tokens}")
    return out[:, ids.shape[1]:]


def seconds_of_greedy(model, ids, new_tokens: int, device) -> float:
    """Seconds of one :func:`greedy` call, the device synchronised before and after."""
    _sync(device)
    start = time.perf_counter()
    greedy(model, ids, new_tokens)
    _sync(device)
    return time.perf_counter() - start


def variant_context(name: str, model, space, factors):
    """The context manager that puts ``model`` in variant ``name`` (``base``, ``lora_fused``
    or ``lora_exact``)."""
    if name == "base":
        return BaseOnly(model, space.modules)
    return MemberLora(model, factors, fused=name == "lora_fused")


class _OpCounter(TorchDispatchMode):
    """Counts every aten op the host issues while active (views and in-place ops included)."""

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def host_ops_per_step(model, ids) -> int:
    """Aten ops issued per greedy decoding step on ``ids`` (rows, prompt): the ops of 3 new
    tokens minus those of 2. At small batch a GPU waits on the host, so this count sets the
    speed of a decoding step; it does not depend on the layer widths."""
    counts = []
    for new_tokens in (2, 3):
        with _OpCounter() as counter:
            greedy(model, ids, new_tokens)
        counts.append(counter.ops)
    return counts[1] - counts[0]


def agreement(model, space, members, prompts, new_tokens: int) -> dict:
    """Greedy tokens of members batched (fused and exact) vs one at a time through peft: the
    share of rows that agree on every token and of tokens before a row's first difference."""
    single = []
    for x in members:
        space.apply(model, x)
        single.append(greedy(model, prompts, new_tokens))
    single = torch.cat(single)
    out = {}
    for variant, fused in (("lora_fused", True), ("lora_exact", False)):
        with MemberLora(model, space.factors_batch(members), fused=fused):
            batched = greedy(model, prompts.repeat(len(members), 1), new_tokens)
        same = (batched == single).int().cumprod(dim=1)  # 1 until a row's first difference
        out[variant] = {"rows_identical": float(same[:, -1].float().mean()),
                        "tokens_before_first_difference": float(same.float().mean())}
    return out


def _peak_mib(device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2 ** 20 if device.type == "cuda" else None


def measure_k(model, space, device, members, prompts, k: int, new_tokens: int) -> dict:
    """Timings of k members x P prompts: rebuild, each variant, peak memory (a row)."""
    n_prompts = prompts.shape[0]
    ids = prompts.repeat(k, 1)  # member-major: member m holds rows m*P .. m*P+P-1
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    _sync(device)
    start = time.perf_counter()
    factors = space.factors_batch(members[:k])
    _sync(device)
    row = {"k": k, "rows": k * n_prompts, "rebuild_s": time.perf_counter() - start}
    seconds, ops = dict.fromkeys(VARIANTS, float("inf")), {}
    for variant in VARIANTS:  # warm-up call, then the host ops of one step
        with variant_context(variant, model, space, factors):
            greedy(model, ids, new_tokens)
            ops[variant] = host_ops_per_step(model, ids)
    row["host_ops_per_step"] = ops
    for _ in range(REPEATS):  # interleaved, so drift in clocks or load hits every variant
        for variant in VARIANTS:
            with variant_context(variant, model, space, factors):
                seconds[variant] = min(seconds[variant],
                                       seconds_of_greedy(model, ids, new_tokens, device))
    if k == 1:
        space.apply(model, members[0])
        greedy(model, ids, new_tokens)
        seconds["peft"] = min(seconds_of_greedy(model, ids, new_tokens, device)
                              for _ in range(REPEATS))
    if k == 2:
        row["agreement_with_one_at_a_time"] = agreement(model, space, members[:2], prompts,
                                                        new_tokens)
    row["peak_mib"] = _peak_mib(device)
    for variant, s in seconds.items():
        row[variant] = {"s": s, "tokens_per_s": k * n_prompts * new_tokens / s,
                        "members_per_s": k / s}
    for variant in ("lora_fused", "lora_exact"):
        row[f"{variant}_vs_base"] = seconds["base"] / seconds[variant]
    return row


def members_section(model, space, device, ks, n_prompts, lengths, budget, save) -> list:
    """One :func:`measure_k` row per k while the budget lasts; ``save()`` after each."""
    prompt_len, new_tokens = lengths
    gen = torch.Generator().manual_seed(SEED)
    prompts = torch.randint(1, model.config.vocab_size, (n_prompts, prompt_len),
                            generator=gen).to(device)
    members = np.random.default_rng(SEED).normal(0.0, 0.1, (max(ks), space.dim))
    rows, slowest = [], None
    for k in ks:
        # 4 variants x (warm-up + 2 timed calls), each up to 2.5x the last k's slowest call
        if slowest is not None and not budget.fits(12 * 2.5 * slowest):
            rows.append({"k": k, "skipped": f"time budget ({budget.left():.0f} s left)"})
            continue
        try:
            row = measure_k(model, space, device, members, prompts, k, new_tokens)
        except torch.OutOfMemoryError:
            rows.append({"k": k, "skipped": "out of memory"})
            torch.cuda.empty_cache()
            break
        rows.append(row)
        slowest = max(v["s"] for v in row.values() if isinstance(v, dict) and "s" in v)
        save()
        print(f"  k={k}: {row['lora_fused']['members_per_s']:.2f} members/s fused, "
              f"{row['lora_fused_vs_base']:.2f} of pure generation ({budget.left():.0f} s "
              f"left)", flush=True)
    one = next((r for r in rows if "peft" in r), None)
    for r in rows:
        if one is not None and "base" in r:
            for variant in ("lora_fused", "lora_exact"):
                r[f"{variant}_vs_peft_one_at_a_time"] = (r[variant]["members_per_s"]
                                                         / one["peft"]["members_per_s"])
    return rows


def fgrpo_step(model, device, lengths, decoder: EngineBackend | None = None) -> dict:
    """Seconds per phase of one F-GRPO step on one rank (see the module docstring); with a
    ``decoder`` the rollouts are sampled by its engine instead of HF generate. The update is
    the trainer's own :func:`fgrpo.step.train_on_rollouts` under the ``fgrpo`` section of
    :data:`FGRPO_KEYS` (the package's defaults otherwise: the grpo preset)."""
    from transformers import GenerationConfig

    from fgrpo.config import FGRPOJobConfig
    from fgrpo.rollout import Rollouts
    from fgrpo.rollout import StepRollouts
    from fgrpo.step import train_on_rollouts
    from hpc.models.parallelize import TrainedWeights
    from hpc.runtime.config import load_config
    from hpc.runtime.timing import PhaseTimer

    prompt_len, new_tokens = lengths
    cfg = load_config(FGRPOJobConfig, None, FGRPO_KEYS + [f"task.max_new_tokens={new_tokens}"])
    f = cfg.fgrpo
    n, G = f.batch_prompts, f.sampling.num_generations
    gen = torch.Generator().manual_seed(SEED + 1)
    prompts = torch.randint(1, model.config.vocab_size, (n, prompt_len), generator=gen)
    weights = TrainedWeights([p for p in model.parameters() if p.requires_grad],
                             f.optim.learning_rate, f.optim.weight_decay)
    gen_cfg = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                               do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                               num_return_sequences=G, pad_token_id=0, eos_token_id=None)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    timer = PhaseTimer(["generation", "reward", "forward_backward", "waiting", "allreduce",
                        "optimizer"], sync=lambda: _sync(device))

    def rollout():
        model.eval()
        if decoder is not None:
            requests = [Request(p, new_tokens, 0, i, j) for i, p in enumerate(prompts.tolist())
                        for j in range(G)]
            new = decoder.decode(model, requests, [], Sampling(1.0, 1.0, SEED), n * G)
            return torch.cat([prompts.repeat_interleave(G, 0), torch.tensor(new)],
                             dim=1).to(device)
        with torch.inference_mode():
            out = model.generate(input_ids=prompts.to(device),
                                 attention_mask=torch.ones_like(prompts, device=device),
                                 generation_config=gen_cfg)
        return out.clone()  # (n*G, prompt + new), prompt-major; usable by autograd

    with timer.phase("generation"):
        ids = rollout()
    with timer.phase("reward"):
        rewards = torch.tensor([float(hash(tuple(r)) % 2) for r in ids[:, prompt_len:].tolist()]
                               ).reshape(n, G)
    cmask = torch.zeros(ids.shape, device=device)
    cmask[:, prompt_len:] = 1.0
    rollouts = Rollouts(ids, torch.ones_like(ids), cmask, rewards, torch.zeros_like(rewards),
                        torch.full((n * G,), new_tokens), torch.ones(n * G, dtype=torch.bool))
    model.eval()
    train_on_rollouts(model, weights, StepRollouts(rollouts, rollouts, {}), cfg, step=0,
                      seed=SEED, timer=timer)  # one process: no MPI on the GPU machine
    model.eval()
    phases = timer.seconds
    total = sum(phases.values())
    return {"rows": n * G, "fgrpo_keys": FGRPO_KEYS, "phases_s": phases, "total_s": total,
            "shares": {p: s / total for p, s in phases.items()}, "peak_mib": _peak_mib(device)}


def engine_rows(decoder, model, space, device, args, lengths, plan, seed, budget, save,
                with_hf: bool, label: str, out: list | None = None) -> list:
    """Rows of :func:`engine_speed.compare` for each (rows, k, lengths kind) of ``plan``, with
    HF eager beside the engine when ``with_hf``, while the budget lasts (what it skips or what
    runs out of memory is a row that says so), appended to ``out`` (saved as they come);
    prompts drawn from ``seed``."""
    pool = solution_lengths(args.data)
    hw = {"bandwidth": args.bandwidth, "peak_flops": args.peak_tflops * 1e12}
    prompt_len, fixed = lengths[0], args.fixed_tokens or lengths[1]
    gen = torch.Generator().manual_seed(seed)
    out, slowest = ([] if out is None else out), None
    for rows, k, kind in plan:
        if slowest is not None and not budget.fits(3 * slowest):
            out.append({"rows": rows, "k": k, "lengths": kind,
                        "skipped": f"time budget ({budget.left():.0f} s left)"})
            continue
        prompts = torch.randint(2, model.config.vocab_size, (rows, prompt_len),
                                generator=gen).to(device)
        row_len = row_lengths(kind, rows, fixed if kind == "fixed" else args.cap, pool)
        start = time.perf_counter()
        try:
            row = compare(decoder, model, space, device, rows, k, kind, row_len, prompts,
                          with_hf, hw)
        except torch.OutOfMemoryError:
            out.append({"rows": rows, "k": k, "lengths": kind, "skipped": "out of memory"})
            decoder.release()
            torch.cuda.empty_cache()
            continue
        slowest = max(slowest or 0.0, time.perf_counter() - start)
        out.append(row)
        save()
        versus = (f", {row['engine_vs_hf']:.2f}x HF eager, {row['engine']['of_bound']:.2f} of "
                  f"the bound" if with_hf else "")
        print(f"  {label}engine rows={rows} k={k} {kind}: {row['engine']['tokens_per_s']:.0f} "
              f"tok/s{versus} ({budget.left():.0f} s left)", flush=True)
    decoder.release()  # free its cache for the next shape
    return out


def engine_section(decoder, model, space, device, args, lengths, budget, save) -> list:
    """Engine vs HF eager rows (:func:`engine_rows`) while the budget lasts."""
    middle = args.rows[len(args.rows) // 2]
    plan = [(rows, 1, kind) for rows in args.rows for kind in ("fixed", "spread")]
    plan += [(middle, k, "spread") for k in args.engine_ks if k > 1]
    return engine_rows(decoder, model, space, device, args, lengths, plan, SEED + 2, budget,
                       save, True, "")


def check_model(name: str, device, ks, n_prompts, budget, save, args=None) -> dict:
    """Every measurement for one model shape, into a dict registered with ``save(result)``
    at once and saved again as figures come in."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    lengths = LENGTHS.get(name, (64, 64))
    result = {"model": name, "shape": SHAPES[name], "dtype": str(dtype),
              "prompt_tokens": lengths[0], "new_tokens": lengths[1],
              "prompts_per_member": n_prompts, "lora": f"r={LORA_RANK} on {TARGETS}"}
    save(result)
    start = time.perf_counter()
    model, space = build(SHAPES[name], device, dtype)
    decoder = EngineBackend()
    _sync(device)
    result["build_s"] = time.perf_counter() - start
    result["parameters"] = sum(p.numel() for p in model.parameters())
    result["search_dim"] = space.dim
    result["members_that_fit"] = (members_on_device(model, 96, n_prompts, sum(lengths))
                                  if device.type == "cuda" else None)  # of 96, the hf backend's cap
    save(result)
    print(f"{name}: built in {result['build_s']:.0f} s", flush=True)
    if args is not None and args.int8_only:
        result["int8"] = int8_section(decoder, model, space, device, args, lengths, n_prompts,
                                      budget, lambda: save(result))
        return result
    if args is not None and args.engine_only:
        result["engine"] = engine_section(decoder, model, space, device, args, lengths,
                                          budget, lambda: save(result))
        result["fgrpo_step"] = engine_fgrpo_steps(decoder, model, device, lengths, budget)
        save(result)
        return result
    try:
        first = fgrpo_step(model, device, lengths)  # the first step also warms the device up
    except ImportError as err:  # the fgrpo modules are missing a dependency on this machine
        result["fgrpo_step"] = {"skipped": f"fgrpo modules not importable: {err}"}
    except torch.OutOfMemoryError:
        result["fgrpo_step"] = {"skipped": "out of memory"}
        torch.cuda.empty_cache()
    else:
        result["fgrpo_step"] = (dict(fgrpo_step(model, device, lengths), first_step=first)
                                if budget.fits(2 * first["total_s"] + 60) else
                                dict(first, note="first step only (time budget)"))
    save(result)
    result["members"] = members_section(model, space, device, ks, n_prompts, lengths, budget,
                                        lambda: save(result))
    if args is not None and args.engine:
        result["engine"] = engine_section(decoder, model, space, device, args, lengths,
                                          budget, lambda: save(result))
        result["fgrpo_step_engine"] = engine_fgrpo_steps(decoder, model, device, lengths,
                                                         budget)["engine"]
    if args is not None and args.int8:  # last: it quantises the model in place
        result["int8"] = int8_section(decoder, model, space, device, args, lengths, n_prompts,
                                      budget, lambda: save(result))
    return result


def int8_section(decoder, model, space, device, args, lengths, n_prompts, budget,
                 save) -> dict:
    """The INT8 part (module docstring): {"model dtype": {...}, "int8": {...}}, each with
    ``members_that_fit`` (CUDA) and ``engine`` rows of :func:`engine_speed.compare` (no HF).
    Quantises ``model`` in place."""
    middle = args.rows[len(args.rows) // 2]
    plan = [(rows, 1, "fixed") for rows in args.rows]
    plan += [(middle, k, "spread") for k in args.engine_ks if k > 1]
    out = {}
    for weights in ("model dtype", "int8"):
        if weights == "int8":
            decoder.release()
            quantize_base(model, "int8")
            if device.type == "cuda":
                torch.cuda.empty_cache()
        part = out[weights] = {
            "weight_bytes": sum(stored_bytes(p) for n, p in model.named_parameters()
                                if "lora_" not in n),
            "members_that_fit": (members_on_device(model, 96, n_prompts, sum(lengths))
                                 if device.type == "cuda" else None),  # of 96, the hf backend's cap
            "free_gib": (torch.cuda.mem_get_info(device)[0] / 2 ** 30
                         if device.type == "cuda" else None),
            "engine": []}
        save()
        engine_rows(decoder, model, space, device, args, lengths, plan, SEED + 3, budget, save,
                    False, f"{weights}: ", out=part["engine"])  # the same prompts for both weights
    return out


def int8_summary(result: dict) -> str:
    part = result.get("int8", {})
    lines = [f"{result['model']}: engine tokens/s, weights in {result['dtype']} vs INT8 "
             f"weight-only (model.quantize=int8)"]
    for weights, p in part.items():
        free = "" if p["free_gib"] is None else f", {p['free_gib']:.1f} GiB free"
        lines.append(f"  {weights}: weights {p['weight_bytes'] / 2 ** 30:.2f} GiB{free}, members "
                     f"per pass that fit (of 96): {p['members_that_fit']}")
    lines.append(f"{'rows':>5} {'k':>3} {'lengths':>7} {'dtype tok/s':>11} {'int8 tok/s':>11} "
                 f"{'int8/dtype':>10}")
    rows = zip(part.get("model dtype", {}).get("engine", []),
               part.get("int8", {}).get("engine", []))
    for a, b in rows:
        if "skipped" in a or "skipped" in b:
            lines.append(f"{a['rows']:>5} {a['k']:>3} {a['lengths']:>7} skipped: "
                         f"{a.get('skipped') or b.get('skipped')}")
            continue
        ta, tb = a["engine"]["tokens_per_s"], b["engine"]["tokens_per_s"]
        lines.append(f"{a['rows']:>5} {a['k']:>3} {a['lengths']:>7} {ta:>11.0f} {tb:>11.0f} "
                     f"{tb / ta:>10.2f}")
    return "\n".join(lines)


def engine_fgrpo_steps(decoder, model, device, lengths, budget) -> dict:
    """One F-GRPO step with HF generate rollouts and one with engine rollouts (each after a
    warm-up step), as far as the budget allows: {"hf": ..., "engine": ...}."""
    out = {}
    for name, engine in (("hf", None), ("engine", decoder)):
        if not budget.fits(60.0):
            out[name] = {"skipped": f"time budget ({budget.left():.0f} s left)"}
            continue
        try:
            fgrpo_step(model, device, lengths, engine)
            out[name] = fgrpo_step(model, device, lengths, engine)
        except torch.OutOfMemoryError:
            out[name] = {"skipped": "out of memory"}
            torch.cuda.empty_cache()
    decoder.release()
    return out


def engine_summary(result: dict) -> str:
    lines = [f"{result['model']}: engine vs HF eager generate (useful tokens/s)",
             f"{'rows':>5} {'k':>3} {'lengths':>7} {'mean len':>8} {'engine':>9} {'HF':>9} "
             f"{'x HF':>6} {'bound':>9} {'eng/bound':>9} {'HF/bound':>9}"]
    for r in result.get("engine", []):
        if "skipped" in r:
            lines.append(f"{r['rows']:>5} {r['k']:>3} {r['lengths']:>7} skipped: {r['skipped']}")
            continue
        lines.append(f"{r['rows']:>5} {r['k']:>3} {r['lengths']:>7} {r['mean_length']:>8.0f} "
                     f"{r['engine']['tokens_per_s']:>9.0f} {r['hf_eager']['tokens_per_s']:>9.0f}"
                     f" {r['engine_vs_hf']:>6.2f} {r['bound']['tokens_per_s']:>9.0f} "
                     f"{r['engine']['of_bound']:>9.3f} {r['hf_eager']['of_bound']:>9.3f}")
    steps = result.get("fgrpo_step", {})
    for name in ("hf", "engine"):
        step = steps.get(name) if isinstance(steps, dict) else None
        if step and "phases_s" in step:
            lines.append(f"F-GRPO step, {name} rollouts: {step['total_s']:.2f} s, generation "
                         f"{step['shares']['generation']:.0%}")
    return "\n".join(lines)


def summary(result: dict) -> str:
    lines = [f"{result['model']} ({result['parameters'] / 1e6:.1f}M parameters, "
             f"{result['dtype']}, {result['prompt_tokens']}+{result['new_tokens']} tokens, "
             f"{result['prompts_per_member']} prompts per member; built in "
             f"{result['build_s']:.0f} s; members that fit: {result['members_that_fit']})",
             f"{'k':>3} {'rows':>5} {'fused m/s':>10} {'exact m/s':>10} {'base tok/s':>11} "
             f"{'fused/base':>11} {'exact/base':>11} {'x peft 1-by-1':>14} {'rebuild ms':>11} "
             f"{'host ops/step base, fused, exact':>33}"]
    for r in result.get("members", []):
        if "base" not in r:
            lines.append(f"{r['k']:>3} skipped: {r['skipped']}")
            continue
        ops = r["host_ops_per_step"]
        lines.append(
            f"{r['k']:>3} {r['rows']:>5} {r['lora_fused']['members_per_s']:>10.2f} "
            f"{r['lora_exact']['members_per_s']:>10.2f} {r['base']['tokens_per_s']:>11.0f} "
            f"{r['lora_fused_vs_base']:>11.2f} {r['lora_exact_vs_base']:>11.2f} "
            f"{r.get('lora_fused_vs_peft_one_at_a_time', float('nan')):>14.2f} "
            f"{r['rebuild_s'] * 1e3:>11.1f} {ops['base']:>17} {ops['lora_fused']:>7} "
            f"{ops['lora_exact']:>7}")
    step = result["fgrpo_step"]
    lines.append(f"F-GRPO step skipped: {step['skipped']}" if "skipped" in step else
                 f"F-GRPO step ({step['rows']} rows): {step['total_s']:.2f} s = " + ", ".join(
                     f"{p} {s:.2f} s ({step['shares'][p]:.0%})"
                     for p, s in step["phases_s"].items()))
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("outdir")
    parser.add_argument("--model", nargs="+", default=["qwen2.5-1.5b"], choices=list(SHAPES))
    parser.add_argument("--minutes", type=float, default=6.0, help="budget for all models")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--prompts", type=int, default=32, help="prompts per member (P)")
    parser.add_argument("--engine", action="store_true", help="also the engine part")
    parser.add_argument("--engine-only", action="store_true", help="only the engine part")
    parser.add_argument("--int8", action="store_true", help="also the INT8 part (last)")
    parser.add_argument("--int8-only", action="store_true", help="only the INT8 part")
    parser.add_argument("--tiny", action="store_true",
                        help="smoke run: tiny shape, engine part only, 4 and 8 rows, k 1 and 2")
    parser.add_argument("--rows", type=int, nargs="+", default=[32, 256, 1024])
    parser.add_argument("--engine-ks", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--cap", type=int, default=512,
                        help="spread lengths are clipped to this many tokens")
    parser.add_argument("--fixed-tokens", type=int, default=0,
                        help="fixed length in tokens (0: the shape's usual 64)")
    parser.add_argument("--data", default=os.path.join(os.path.dirname(REPO), "shared",
                                                         "data"),
                        help="folder with gsm8k/test.jsonl and math500/test.jsonl")
    parser.add_argument("--bandwidth", type=float, default=4.8e12,
                        help="memory bandwidth of the bound, bytes/s (H200: 4.8e12)")
    parser.add_argument("--peak-tflops", type=float, default=989.0,
                        help="dense bf16 peak of the bound, TFLOP/s (H200: 989)")
    args = parser.parse_args(argv)
    if args.tiny:
        args.model, args.engine_only, args.rows, args.engine_ks = ["tiny"], True, [4, 8], [1, 2]
        args.cap = 16
    budget = Budget(60 * args.minutes)
    device = torch.device(args.device)
    os.makedirs(args.outdir, exist_ok=True)
    path = os.path.join(args.outdir, "gpu_check.json")
    report = {"machine": machine(), "device": str(device), "budget_minutes": args.minutes,
              "results": []}

    def save(result=None):
        if result is not None and result not in report["results"]:
            report["results"].append(result)
        with open(path, "w") as fh:
            json.dump(report, fh, indent=1)

    print(f"machine: {report['machine']}", flush=True)
    for i, name in enumerate(args.model):
        if i and not budget.fits(60.0):
            report["results"].append({"model": name, "skipped": "time budget"})
            continue
        try:
            result = check_model(name, device, args.ks, args.prompts, budget, save, args)
        except torch.OutOfMemoryError as err:
            report["results"][-1]["error"] = f"out of memory: {err}"[:500]
            save()
            print(f"{name}: out of memory", flush=True)
            continue
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if not args.int8_only:
            print(engine_summary(result) if args.engine_only else summary(result), flush=True)
        if args.engine and not args.engine_only:
            print(engine_summary(result), flush=True)
        if args.int8 or args.int8_only:
            print(int8_summary(result), flush=True)
    save()
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
