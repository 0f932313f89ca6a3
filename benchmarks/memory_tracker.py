"""Peak GPU memory of the package's own code paths, measured by torch's memory tracker on fake
tensors: no weights, no GPU, any model shape (Qwen2.5-1.5B to 32B) in seconds.

    python benchmarks/memory_tracker.py [CONFIG.yaml] model.path=FOLDER [key=value ...]
        [--ranks N] [--cases essa,evaluation,after_evaluation,fgrpo]
    python benchmarks/memory_tracker.py configs/cluster/math.yaml --qwen25 1.5B \
        fgrpo.parallel.strategy=fsdp2 fgrpo.full_finetune=true --cases fgrpo --device cuda \
        --json benchmarks/results/gpu_memory-h200.json
    python benchmarks/memory_tracker.py configs/cluster/math.yaml --qwen25 1.5B \
        --cases essa_job --job-steps 1 --device cuda \
        --json benchmarks/results/gpu_handover-h200.json

The second form is the GPU check of the plan: the same code on real tensors (weights drawn at
random), one rank, every layer, each phase's ``torch.cuda.max_memory_allocated`` printed beside
the plan's figure (``--device cpu``: torch's tracker on real CPU tensors); the third is the GPU
check of the hand-overs: an ESSA job's start evaluation -> scoring -> final evaluation, its
decode steps captured as CUDA graphs as the job captures them.

* ``essa_load``, ``fgrpo_load``: the job's own load (``model.load=streamed``,
  :func:`load_phases`): the model built without weights, wrapped in its LoRA, sharded over the
  fake group under FSDP2 and its settling forward, the weights streamed in from a checkpoint
  that only gives fake tensors (:class:`FakeCheckpoint`), each linear quantised (ESSA) or
  copied quantised (F-GRPO) as it arrives;

The other cases build the model from ``model.path``'s ``config.json`` (no weights needed) under ``FakeTensorMode`` (``from_config`` in
the config's ``model.dtype``; tensors on the ``cpu`` device: on a CPU-only torch a fake ``cuda``
leaf that needs a gradient aborts the process) and runs, under
``torch.distributed._tools.mem_tracker.MemTracker``, what a job runs:

* ``essa``: one scoring pass as :func:`essa.population.score_members` drives the decoding
  engine: ``engine_for`` with ``min(model.decode_batch, essa.minibatch) * k`` slots of
  ``plan.max_prompt_tokens + task.max_new_tokens`` positions and k stacked members, one
  prefill of as many prompts as the scheduler admits at once (``PREFILL_TOKENS``), then one
  decode step over every slot at the full context;
* ``evaluation``: the held-out evaluation's sampled pass (``eval.batch_size * eval.n_samples``
  rows) on the job's own adapter (k = 1);
* ``after_evaluation``: the evaluation, then an ESSA scoring pass: what the job holds once the
  start evaluation's engine has (or has not) been given back;
* ``essa_job``, ``fgrpo_job``: a whole job's phases in order in one tracker, as
  :func:`hpc.job.loop.run_loop` runs them (:func:`essa_job`, :func:`fgrpo_job`): the start
  evaluation (greedy, then sampled), ``--job-steps`` steps with a periodic evaluation after
  the first, the final evaluation and the export, every engine change of hands included
  (``--legacy-handover``: as before the old engine was released first, the reference);
  each phase's parts (an engine's build, a prefill, a decode step) are measured apart so
  that each part's peak is one event, affine in the layer count;
* ``fgrpo``: one F-GRPO step on one rank as :mod:`fgrpo.trainer` runs it from its second step
  on: the rollout's engine pass (``min(model.decode_batch, prompts per rank) * G`` rows), then (gradients and AdamW moments allocated): AdamW on the trainable parameters (fgrpo.policy.build_model's LoRA or full fine-tuning),
  :func:`fgrpo.gradients.accumulate_gradients` over two micro-batches of full-length rows, the
  gradient all-reduce (:func:`hpc.runtime.dist.all_reduce_mean_` over torch's fake process
  group when ``--ranks`` > 1) and the AdamW step of
  :class:`hpc.models.parallelize.TrainedWeights` (fp32 masters for a 16-bit full fine-tune).
  The state a step starts from (fp32 masters, AdamW moments) is made before the tracker
  starts and counted as it enters. ``fgrpo.parallel.strategy=fsdp2``: the model is built in fp32 on
  fake storage and sharded by :func:`hpc.models.parallelize.shard_model` over the fake group
  (its settling forward runs too), the rollout decodes inside
  :func:`hpc.models.parallelize.decoding` with ``fgrpo.parallel.offload`` resolved as the job
  resolves it (what moves goes to ``meta``, not counted), and the step ends after the backward: on
  fake tensors every operation on a DTensor (gradient norm, AdamW over the shards) shows a
  transient of the parameter's global size, which a real run does not have (checked under
  torchrun with gloo: the norm and AdamW over sharded gradients add nothing beyond the
  shards), so the AdamW step of a sharded model is the plan's alone.

Host reads of tensor values (``float(loss)``, ``.tolist()``) get 1 (:class:`HostReadsOne`):
memory does not depend on them. Figures are live tensor bytes only: no CUDA context, library
workspaces or allocator fragmentation (the plan's ``USABLE_SHARE`` keeps room for those).

Layers: ``layers=n`` builds n decoder layers only; :func:`peak_bytes` with ``layers_from``
measures two small layer counts and extends the line through them to the model's count (exact
for a case whose peak is affine in the layer count, which tests/test_memory_plan.py checks).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import tempfile

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils._python_dispatch import TorchDispatchMode

from common import machine  # also puts the repository on sys.path

GIB = 2 ** 30
CASES = ("essa_load", "fgrpo_load", "essa", "evaluation", "after_evaluation", "fgrpo",
         "essa_job", "fgrpo_job")
JOB_CASES = ("essa_job", "fgrpo_job")
LOAD_CASES = ("essa_load", "fgrpo_load")
PART = " | "  # between a job phase and its part: "start evaluation | engine"
_JOB = {"tracker": None, "phase": ""}  # the job case's tracker and phase, while one runs


def job_phase(tracker, name: str) -> None:
    """Start job phase ``name`` on ``tracker``; its parts (:func:`job_part`) follow."""
    _JOB.update(tracker=tracker, phase=name)
    tracker.phase = name


def job_part(name: str) -> None:
    """Within a job case, the current phase's part ``name`` (an engine's build, a prefill, a
    decode step) is measured apart: each part's peak is one event, affine in the layer count,
    so :func:`phase_peaks` can extend it; a phase's peak is the largest of its parts'."""
    if _JOB["tracker"] is not None:
        _JOB["tracker"].phase = _JOB["phase"] + PART + name


class HostReadsOne(TorchDispatchMode):
    """Under FakeTensorMode: every read of a tensor's value on the host (``item``, ``float``,
    ``bool``, ``tolist``) gives 1, so code that logs statistics or checks finiteness runs."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            return 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def fake_tensors():
    """Fake tensors on the ``cpu`` device stand for the GPU's; what fgrpo.parallel.offload moves to
    host memory goes to ``meta`` instead, which the tracker's ``cpu`` figure does not count."""
    from hpc.models import offload

    saved = offload.host_buffer
    offload.host_buffer = lambda nbytes, device: torch.empty(nbytes, dtype=torch.uint8,
                                                             device="meta")
    try:
        with FakeTensorMode(allow_non_fake_inputs=True), HostReadsOne():
            yield
    finally:
        offload.host_buffer = saved


def fake_model(config: dict, cfg, case: str, ranks: int, stack: contextlib.ExitStack,
               layers: int | None = None, device: str = "fake"):
    """The model of ``config`` (a config.json dict) as the job builds it, in eval mode: in
    ``model.dtype``, with the job's fresh LoRA adapter
    unless F-GRPO fine-tunes every weight, and for F-GRPO with activation checkpointing where
    it resolves to on (and torch's fake process group of ``ranks`` entered in ``stack``).
    Built on the meta device, then given fake storage under :func:`fake_tensors` (entered in
    ``stack`` too), or with ``device`` cpu or cuda real storage (weights drawn N(0, 0.02),
    LoRA B zero, one real rank: ``ranks`` must be 1); for ESSA the base linears quantised at
    ``model.quantize`` (torchao). ``layers`` overrides ``num_hidden_layers``."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from hpc.models.loading import DTYPES, attach_lora, enable_activation_checkpointing
    from hpc.plan.registry import activation_checkpointing
    from hpc.models.parallelize import load_dtype, shard_model

    training = case in ("fgrpo", "fgrpo_job")
    sharded = training and cfg.fgrpo.parallel.strategy == "fsdp2"
    shape = Qwen2Config(**dict(config, num_hidden_layers=layers or config["num_hidden_layers"]))
    shape._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = Qwen2ForCausalLM._from_config(
            shape, dtype=DTYPES[load_dtype(cfg.fgrpo.parallel.strategy if training else "ddp",
                                           cfg.model.dtype)])
        if not (training and cfg.fgrpo.full_finetune):
            model = attach_lora(model, cfg.lora.rank, cfg.lora.alpha, cfg.lora.targets)
    real = device != "fake"
    if training:
        stack.enter_context(one_real_rank(device) if real else fake_process_group(ranks))
        if activation_checkpointing(cfg, "fgrpo", ranks, "cuda"):
            enable_activation_checkpointing(model)
    mesh = init_device_mesh(device if real else "cpu", (ranks,)) if sharded else None
    if real:
        model = model.to_empty(device=device)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.zero_() if "lora_B" in name else p.normal_(0.0, 0.02)
    else:
        stack.enter_context(fake_tensors())
        model = model.to_empty(device="cpu")
    model.eval()
    if not training:  # ESSA's base linears at model.quantize, as the job loads them
        from hpc.models.quantize import quantize_base

        quantize_base(model, cfg.model.quantize)
    if sharded:  # on fake storage: its settling forward runs, its collectives return at once
        shard_model(model, cfg.model.dtype, mesh)
    return model


def _member_factors(model, k: int) -> dict:
    """{module: (A (k, r, in), B (k, out, r))} of k members, the adapter's dtype."""
    from hpc.engine.runner import adapter_ranks

    out = {}
    for name in adapter_ranks(model):
        module = model.get_submodule(name)
        a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
        out[name] = (a.new_zeros((k,) + a.shape), b.new_zeros((k,) + b.shape))
    return out


def tracked_decoder(cfg):
    """The decoder of a measured job: its engines' slots are set per pass
    (:func:`_decode_pass`) from the model's full shape, so its byte budget is no limit here;
    CUDA graphs as the job's config has them (on a GPU their pool is counted)."""
    from hpc.engine.config import EngineConfig
    from hpc.engine.engine_backend import EngineBackend

    return EngineBackend(EngineConfig(cuda_graphs=cfg.model.cuda_graphs, planned_budget=1 << 60))


def _decode_pass(decoder, model, cfg, rows: int, k: int, budget: int, sampled: bool,
                 members: int = 0) -> None:
    """One pass as :meth:`hpc.engine.engine_backend.EngineBackend.decode` runs it: ``engine_for``
    for ``rows`` rows, at most the slots the model's full shape gets within ``budget`` bytes
    (:func:`hpc.plan.terms.engine_slots`; kept by ``decoder``), members loaded, one
    prefill of the rows admitted at once, one decode step over every slot at the full context,
    and (for ``sampled`` phases) the keyed sampling of its tokens. ``members``: the factors of
    that many members are made first and live through the pass (ESSA's rank's members)."""
    from hpc.engine.memory import PREFILL_TOKENS
    from hpc.plan.terms import engine_slots
    from hpc.models.sampling import Sampling, pick_tokens

    prompt, seq = _lengths(cfg)
    # the slots the budget gives the model's full shape (not the fewer layers built here)
    slots = engine_slots(_shape(cfg), cfg, rows, k, budget)
    job_part(f"engine of {rows} rows, {k} members")
    decoder.config = dataclasses.replace(decoder.config, slots=slots)
    engine = decoder.engine_for(model, rows, seq, k, most=rows)
    with torch.inference_mode():
        factors = _member_factors(model, max(members, k)) if members or k > 1 else None
        if k:
            engine.set_members(None if factors is None else
                               {m: (a[:k], b[:k]) for m, (a, b) in factors.items()})
        job_part("prefill")
        n = max(1, min(engine.slots, PREFILL_TOKENS // prompt))
        device = engine.device
        ids = torch.zeros((n, prompt), dtype=torch.int64, device=device)
        admitted = torch.arange(n, device=device)
        engine.prefill(ids, torch.full((n,), prompt, device=device), admitted,
                       admitted % max(k, 1))
        engine.positions[:] = seq - 1
        job_part("decode step")
        logits = engine.step(engine.slots, engine.cache.max_len)
        if sampled:
            keys = torch.zeros(engine.slots, dtype=torch.int64, device=device)
            pick_tokens(logits, Sampling(1.0, 1.0, 0), keys, keys, keys)


def _lengths(cfg) -> tuple:
    prompt = cfg.plan.max_prompt_tokens
    return prompt, prompt + cfg.task.max_new_tokens


def _shape(cfg):
    from hpc.engine.shape import ModelShape

    return ModelShape.from_folder(cfg.model.path)


def _essa_budget(cfg, ranks: int) -> int:
    """The engine budget an ESSA job decodes within (its plan's, as the job takes it)."""
    from essa.plan import plan as essa_plan

    return essa_plan(_shape(cfg), cfg, ranks, advise=False).engine_budget


def essa_scoring_rows(cfg, ranks: int) -> tuple:
    """(rows, k) of a scoring pass (essa.trainer.ESSA.step_decode)."""
    from essa.plan import members_per_pass as essa_members_per_pass

    k = essa_members_per_pass(cfg, ranks)
    return min(cfg.model.decode_batch, cfg.essa.minibatch) * k, k


def essa_pass(decoder, model, cfg, ranks: int) -> None:
    rows, k = essa_scoring_rows(cfg, ranks)
    _decode_pass(decoder, model, cfg, rows, k, _essa_budget(cfg, ranks), sampled=False)


def evaluation_pass(decoder, model, cfg, ranks: int) -> None:
    from hpc.plan.terms import evaluation_rows

    _decode_pass(decoder, model, cfg, evaluation_rows(cfg), 1, _essa_budget(cfg, ranks),
                 sampled=True)


def evaluation(decoder, model, cfg, budget: int, sampled: bool, next_decode: tuple) -> None:
    """The held-out evaluation as :func:`hpc.evaluate.evaluate` runs it: the greedy pass
    (``eval.batch_size`` rows), for ``sampled`` the sampled one (``eval.batch_size x
    eval.n_samples`` rows), then :meth:`hpc.engine.engine_backend.EngineBackend.end_phase` with the next
    phase's (rows, members)."""
    from hpc.engine.runner import adapter_ranks
    from hpc.plan.terms import evaluation_rows

    k = 1 if adapter_ranks(model) else 0
    _decode_pass(decoder, model, cfg, cfg.eval.batch_size, k, budget, sampled=False)
    if sampled:
        _decode_pass(decoder, model, cfg, evaluation_rows(cfg), k, budget, sampled=True)
    job_part("end")
    decoder.end_phase(*next_decode)


@contextlib.contextmanager
def legacy_handover():
    """Within the block, engines change hands as before release-before-build: the old engine
    stays alive while :meth:`hpc.engine.engine_backend.EngineBackend.engine_for` builds the new one, and an
    evaluation's engine is not released at its end (its next phase replaces it). The reference
    the whole-job test holds the fix against (``--legacy-handover``)."""
    from hpc.engine.engine_backend import EngineBackend

    build, end = EngineBackend.engine_for, EngineBackend.end_phase

    def engine_for(self, model, *args, **kwargs):
        old = self.engine
        held = dict(vars(old)) if old is not None else {}  # noqa: F841 (through the build)
        return build(self, model, *args, **kwargs)

    EngineBackend.engine_for, EngineBackend.end_phase = engine_for, lambda self, *args, **kwargs: False
    try:
        yield
    finally:
        EngineBackend.engine_for, EngineBackend.end_phase = build, end


def essa_job(decoder, model, cfg, ranks: int, tracker, steps: int = 2) -> None:
    """An ESSA job's phases in order (:func:`hpc.job.loop.run_loop`): the start evaluation,
    ``steps`` generations (this rank's members' factors, a scoring pass), a periodic held-out
    evaluation (greedy, the mean's and the best member's) after the first, the final
    evaluation, the export (the adapter's tensors copied one by one)."""
    budget = _essa_budget(cfg, ranks)
    rows, k = essa_scoring_rows(cfg, ranks)
    job_phase(tracker, "start evaluation")
    evaluation(decoder, model, cfg, budget, True, (rows, k))
    for step in range(1, steps + 1):
        job_phase(tracker, f"step {step} scoring")
        _decode_pass(decoder, model, cfg, rows, k, budget, sampled=False,
                     members=-(-cfg.essa.population // ranks))
        if step == 1:
            job_phase(tracker, "periodic evaluation")
            for _ in ("mean", "best"):
                evaluation(decoder, model, cfg, budget, False, (rows, k))
    job_phase(tracker, "final evaluation")
    evaluation(decoder, model, cfg, budget, True, (0, 1))
    job_phase(tracker, "export")
    _export(model)


def _export(model) -> None:
    """The export's device work: each trained (or adapter) tensor gathered and copied in turn
    (:func:`hpc.models.parallelize.save_gathered_adapter`; a host copy is not counted)."""
    from hpc.models.parallelize import _full

    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad or "lora_" in name:
                _full(p.detach()).clone()


class _NoModules:
    """Stands in for MemTracker's ModTracker: no module hooks, no module statistics."""

    parents: set = set()
    is_bw = False

    def register_user_hooks(self, *hooks):
        pass

    def clear_user_hooks(self):
        pass

    def get_known_fqn(self, module):
        return ""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


class LiveBytesTracker(MemTracker):
    """MemTracker of the whole process's live tensor bytes, without its per-module statistics:
    the engine calls a model's modules many times and one by one (the module statistics refuse
    a second call), and under inference mode their gradient hooks fail."""

    def __init__(self):
        super().__init__()
        self._mod_tracker = _NoModules()
        self.phase = "all"
        self.peaks: dict = {}  # phase -> the most live bytes (cpu) seen while it ran

    def _update_snap(self, *args, **kwargs) -> None:
        super()._update_snap(*args, **kwargs)
        now = self._curr_mem_snap.get(torch.device("cpu"), {}).get("Total", 0)
        self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), now)


class CudaPhasePeaks:
    """What :class:`LiveBytesTracker` gives, from the CUDA caching allocator of a real run:
    ``peaks[phase]`` = ``torch.cuda.max_memory_allocated`` while ``phase`` ran (the peak
    statistics are reset as each phase starts)."""

    def __init__(self):
        self._phase, self.peaks = "all", {}

    def track_external(self, *objects) -> None:
        pass  # the allocator sees every tensor

    @property
    def phase(self) -> str:
        return self._phase

    @phase.setter
    def phase(self, name: str) -> None:
        self._close()
        self._phase = name
        torch.cuda.reset_peak_memory_stats()

    def _close(self) -> None:
        torch.cuda.synchronize()
        self.peaks[self._phase] = max(self.peaks.get(self._phase, 0),
                                      torch.cuda.max_memory_allocated())

    def __enter__(self):
        torch.cuda.reset_peak_memory_stats()
        return self

    def __exit__(self, *exc):
        self._close()


class _OneRankWorld:
    """The World that accumulate_gradients needs: ``size`` ranks with identical counts."""

    def __init__(self, size: int):
        self.size, self.rank, self.timeout_s = size, 0, 60.0

    def allgather(self, value, tag=""):
        return [value] * self.size

    def arrive(self, *args, **kwargs):
        pass

    def count(self, *args, **kwargs):
        pass


@contextlib.contextmanager
def one_real_rank(device: str):
    """A real process group of one rank (NCCL on CUDA, gloo on CPU) for the duration."""
    import torch.distributed as dist

    dist.init_process_group("nccl" if device == "cuda" else "gloo", store=dist.HashStore(),
                            rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def fake_process_group(ranks: int):
    """torch's fake process group of ``ranks`` (collectives return at once) for the duration."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if ranks == 1:
        yield
        return
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=ranks)
    try:
        yield
    finally:
        dist.destroy_process_group()


class _Step:
    """What an F-GRPO job holds for its steps on rank 0 of ``ranks`` (fgrpo.trainer.FGRPO):
    TrainedWeights with the state of a step after the first (AdamW moments, masters), two
    micro-batches of full-length rollouts, the plan's engine budget, fgrpo.parallel.offload and the
    rollout engine's fate as the job resolves them, and a rollout's (rows, members)."""

    def __init__(self, decoder, model, cfg, ranks: int):
        from fgrpo.rollout import Rollouts
        from fgrpo.plan import _engine_kept, fgrpo_rollout_rows, plan as fgrpo_plan
        from fgrpo.plan import rollout_offload
        from hpc.models.parallelize import TrainedWeights

        f = cfg.fgrpo
        _, seq = _lengths(cfg)
        self.cfg, self.ranks, self.model, self.decoder = cfg, ranks, model, decoder
        params = [p for p in model.parameters() if p.requires_grad]
        self.rows = rows = 2 * f.optim.micro_batch
        self.device = device = next(model.parameters()).device
        ids = torch.zeros((rows, seq), dtype=torch.int64, device=device)
        groups = torch.zeros((max(1, rows // f.sampling.num_generations),
                              f.sampling.num_generations))
        self.rollouts = Rollouts(ids, torch.ones_like(ids), torch.ones((rows, seq), device=device),
                                 groups, torch.zeros_like(groups), torch.full((rows,), seq),
                                 torch.zeros((rows,), dtype=torch.bool))
        self.world = _OneRankWorld(ranks)
        shape = _shape(cfg)
        self.budget = fgrpo_plan(shape, cfg, ranks, advise=False).engine_budget
        self.offload = rollout_offload(cfg, ranks, "cuda", planned=True)
        self.keep_engine = _engine_kept(shape, cfg, ranks)
        self.decode = (fgrpo_rollout_rows(cfg, ranks), 0 if f.full_finetune else 1)
        self.weights = TrainedWeights(params, f.optim.learning_rate, f.optim.weight_decay)
        for p in params:  # the state of a step after the first: AdamW moments (and masters)
            p.grad = torch.zeros_like(p)
        self.weights.reduce_gradients(self.world)
        self.weights.step(f.optim.max_grad_norm)
        self.weights.free_gradients()

    def decoding(self):
        from hpc.models.parallelize import decoding

        self.model.eval()
        return decoding(self.model, self.weights, self.offload, self.decoder)

    def rollout(self) -> None:
        """The rollout's engine pass; then its engine released where the plan says so."""
        with self.decoding():
            _decode_pass(self.decoder, self.model, self.cfg, *self.decode, self.budget,
                         sampled=True)
        if not self.keep_engine:
            self.decoder.release()

    def train(self, tracker, step: bool, step_phase: str | None = None) -> None:
        """accumulate_gradients over the micro-batches; with ``step`` the gradient reduction
        and AdamW step (as phase ``step_phase`` if given); the gradients freed."""
        from fgrpo.gradients import accumulate_gradients

        cfg, w = self.cfg, self.weights
        self.model.train()
        w.zero_grad()
        accumulate_gradients(self.model, self.rollouts, torch.ones(self.rows, device=self.device),
                             cfg, self.world, cfg.task.max_new_tokens)
        if step:
            if step_phase:
                job_phase(tracker, step_phase)
            w.reduce_gradients(self.world)
            w.step(cfg.fgrpo.optim.max_grad_norm)
        w.free_gradients()

    def evaluation(self, sampled: bool, next_decode: tuple) -> None:
        with self.decoding():
            evaluation(self.decoder, self.model, self.cfg, self.budget, sampled, next_decode)


def _tracked_state(tracker, model, s: _Step) -> None:
    from hpc.models.parallelize import _local

    tracker.track_external(model, s.weights.opt, *[_local(m) for m in s.weights.masters])


def fgrpo_step(decoder, model, cfg, ranks: int, tracker, real: bool = False) -> None:
    """One F-GRPO step on rank 0 of ``ranks`` (module docstring); ``real``: on real tensors,
    where the sharded AdamW step is measured too (phase ``step``)."""
    s = _Step(decoder, model, cfg, ranks)
    tracker.phase = "rollout"
    _tracked_state(tracker, model, s)
    with tracker:
        s.rollout()
        tracker.phase = "training"
        s.train(tracker, real or cfg.fgrpo.parallel.strategy != "fsdp2",  # see the module docstring
                "step" if real else None)


def fgrpo_job(decoder, model, cfg, ranks: int, tracker, real: bool = False,
              steps: int = 2) -> None:
    """An F-GRPO job's phases in order (:func:`hpc.job.loop.run_loop`): the start evaluation,
    ``steps`` steps (rollout, training, step), a periodic held-out evaluation (greedy) after
    the first, the final evaluation and the export, on the state of :class:`_Step`."""
    s = _Step(decoder, model, cfg, ranks)
    step = real or cfg.fgrpo.parallel.strategy != "fsdp2"
    job_phase(tracker, "start evaluation")
    _tracked_state(tracker, model, s)
    with tracker:
        s.evaluation(True, s.decode)
        for i in range(1, steps + 1):
            job_phase(tracker, f"step {i} rollout")
            s.rollout()
            job_phase(tracker, f"step {i} training")
            s.train(tracker, step, f"step {i} gradient reduction and AdamW step")
            if i == 1:
                job_phase(tracker, "periodic evaluation")
                s.evaluation(False, s.decode)
        job_phase(tracker, "final evaluation")
        s.evaluation(True, (0, 1))
        job_phase(tracker, "export")
        _export(model)


class FakeCheckpoint:
    """What the load reads (``files`` of :func:`hpc.models.streaming.stream_weights`), under
    fake tensors: each tensor of the model of ``folder``'s config.json in its stored dtype
    (config.json's ``dtype``), whole or a block of its rows; no file is read."""

    def __init__(self, folder: str):
        from transformers import AutoConfig, AutoModelForCausalLM

        from hpc.engine.shape import ModelShape
        from hpc.models.loading import DTYPES

        config = AutoConfig.from_pretrained(folder)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
            model.tie_weights()
        self.shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
        stored = ModelShape.from_folder(folder).stored_bytes
        self.dtype = DTYPES["float32" if stored == 4 else "bfloat16"]

    def names(self) -> list:
        return list(self.shapes)

    def read(self, name: str, rows: tuple | None = None) -> torch.Tensor:
        shape = self.shapes[name]  # on meta: a host read, not the device's memory
        return torch.empty(shape if rows is None else (rows[1] - rows[0], *shape[1:]),
                           dtype=self.dtype, device="meta")


def load_phases(case: str, cfg, ranks: int, layers: int | None,
                stack: contextlib.ExitStack) -> dict:
    """{"load": peak live bytes} of the job's own load (:func:`hpc.models.streaming.
    streamed_model`, ``model.load=streamed``) on fake tensors, rank 0 of ``ranks``: ESSA's model
    with its adapter (a fresh LoRA of the same shapes), each decoder linear quantised at
    ``model.quantize`` as it arrives; F-GRPO's policy in its load dtype, sharded over torch's
    fake process group under FSDP2 (its settling forward included), its rollout copy made as
    the linears arrive. The reads are :class:`FakeCheckpoint`'s."""
    from torch.distributed.device_mesh import init_device_mesh

    from hpc.models.loading import DTYPES, attach_lora
    from hpc.models.parallelize import load_dtype, settle, shard_units
    from hpc.models.quantize import GenerationCopy, QuantizeInPlace
    from hpc.models.streaming import shard_skeleton, skeleton, stream_weights

    training = case == "fgrpo_load"
    sharded = training and cfg.fgrpo.parallel.strategy == "fsdp2"
    folder = cfg.model.path
    if layers:
        folder = tempfile.mkdtemp(prefix="load-case-")
        with open(os.path.join(folder, "config.json"), "w") as fh:
            config = {k: v for k, v in model_config(cfg).items() if k != "layer_types"}
            json.dump(dict(config, num_hidden_layers=layers), fh)
    dtype = load_dtype(cfg.fgrpo.parallel.strategy if training else "ddp", cfg.model.dtype)
    wrap = None if training and cfg.fgrpo.full_finetune else (
        lambda m: attach_lora(m, cfg.lora.rank, cfg.lora.alpha, cfg.lora.targets))
    shard = None
    if sharded:
        stack.enter_context(fake_process_group(ranks))
        mesh = init_device_mesh("cpu", (ranks,))
        shard = lambda m: shard_units(m, cfg.model.dtype, mesh)  # noqa: E731
    files = FakeCheckpoint(folder)
    arrival = GenerationCopy if training else QuantizeInPlace
    # streamed_model's steps; the skeleton (its parameters take no memory) and its LoRA are
    # made before the fake tensors start (peft's move of the factors to the base's device
    # swaps tensors, which fake ones refuse) and counted as they enter the tracker
    cpu = torch.device("cpu")
    model = skeleton(folder, DTYPES[dtype], cpu)
    model = wrap(model) if wrap else model
    stack.enter_context(fake_tensors())
    tracker = LiveBytesTracker()
    with tracker:
        tracker.track_external(model)
        if sharded:
            shard_skeleton(model, shard, cpu)
        stream_weights(model, folder, arrival(model, cfg.model.quantize), files)
        if sharded:
            settle(model)
    return {"load": tracker.peaks.get("all", 0)}


def essa_space(model, cfg) -> list:
    """The tensors of ESSA's search space over ``model``'s adapter (``essa.space``), which an
    ESSA job builds after its load and holds to its end."""
    from hpc.models.adapter_space import LoraEntrySpace, SingularValueSpace

    space = (SingularValueSpace.from_peft(model, cfg.essa.alpha, cfg.lora.targets)
             if cfg.essa.space == "sv" else LoraEntrySpace.from_peft(model))
    return space.held_tensors()


def model_config(cfg) -> dict:
    with open(f"{cfg.model.path}/config.json") as fh:
        return json.load(fh)


def measure_phases(case: str, cfg, ranks: int = 1, layers: int | None = None,
                   device: str = "fake", steps: int = 2) -> dict:
    """Peak live bytes by phase of ``case`` (:data:`CASES`) for the model of
    ``cfg.model.path`` under job config ``cfg`` (with essa and fgrpo sections) on rank 0 of
    ``ranks``: {"rollout": ..., "training": ...} for fgrpo (+ "step" on a real ``device``),
    {phase or phase | part: ...} for a job case of ``steps`` steps, {"all": ...} otherwise.
    ``device``: fake tensors, or real ones on cpu (torch's tracker) or cuda (the allocator's
    peaks)."""
    if case not in CASES:
        raise ValueError(f"case {case!r} is not one of {CASES}")
    config = model_config(cfg)
    if case in LOAD_CASES:
        if device != "fake":
            raise ValueError(f"case {case} runs on fake tensors only (a real load: "
                             f"tests/mpi/load_check.py)")
        with contextlib.ExitStack() as stack:
            return load_phases(case, cfg, ranks, layers, stack)
    with contextlib.ExitStack() as stack:
        model = fake_model(config, cfg, case, ranks, stack, layers, device)
        tracker = CudaPhasePeaks() if device == "cuda" else LiveBytesTracker()
        decoder = tracked_decoder(cfg)
        if device == "cuda":
            torch.cuda.empty_cache()
        if case == "fgrpo":
            fgrpo_step(decoder, model, cfg, ranks, tracker, real=device != "fake")
        elif case == "fgrpo_job":
            fgrpo_job(decoder, model, cfg, ranks, tracker, real=device != "fake", steps=steps)
        elif case == "essa_job":
            model.requires_grad_(False)
            space = essa_space(model, cfg)  # held to the end, as the job holds it
            tracker.track_external(model, *space)
            with tracker:
                essa_job(decoder, model, cfg, ranks, tracker, steps)
        else:  # ESSA loads its adapter frozen (is_trainable=False)
            model.requires_grad_(False)
            space = essa_space(model, cfg)  # held to the end, as the job holds it
            tracker.track_external(model, *space)
            with tracker:
                if case in ("evaluation", "after_evaluation"):
                    evaluation_pass(decoder, model, cfg, ranks)
                if case in ("essa", "after_evaluation"):
                    essa_pass(decoder, model, cfg, ranks)
        _JOB.update(tracker=None, phase="")
        peaks = dict(tracker.peaks)
        if case in JOB_CASES:
            peaks.pop("all", None)  # the state as the tracker took it in, before the job
        return peaks


def measure(case: str, cfg, ranks: int = 1, layers: int | None = None,
            device: str = "fake") -> int:
    """Peak live bytes of ``case`` over all its phases (:func:`measure_phases`)."""
    return max(measure_phases(case, cfg, ranks, layers, device).values())


def phase_peaks(case: str, cfg, ranks: int = 1, layers_from: tuple = (),
                steps: int = 2) -> dict:
    """:func:`measure_phases` at the model's layer count; with ``layers_from`` (two small
    counts) each phase's (or its parts') peak measured at those and extended linearly to it."""
    if not layers_from:
        return _whole_phases(measure_phases(case, cfg, ranks, steps=steps))
    (l1, l2), target = layers_from, model_config(cfg)["num_hidden_layers"]
    p1, p2 = (measure_phases(case, cfg, ranks, n, steps=steps) for n in (l1, l2))
    return _whole_phases({k: p1[k] + (p2[k] - p1[k]) * (target - l1) // (l2 - l1) for k in p1})


def _whole_phases(peaks: dict) -> dict:
    """{phase: the largest of its parts' peaks} of {phase or phase | part: peak}, in order."""
    out: dict = {}
    for key, nbytes in peaks.items():
        phase = key.split(PART)[0]
        out[phase] = max(out.get(phase, 0), nbytes)
    return out


def peak_bytes(case: str, cfg, ranks: int = 1, layers_from: tuple = ()) -> int:
    """The largest of :func:`phase_peaks` (the phase that peaks at a few layers need not be
    the one that peaks at all of them)."""
    return max(phase_peaks(case, cfg, ranks, layers_from).values())


def _size(nbytes: int) -> str:
    return f"{nbytes / GIB:8.2f} GiB" if nbytes >= GIB else f"{nbytes / 2 ** 20:8.2f} MiB"


def planned_phases(case: str, cfg, ranks: int) -> dict:
    """The plan's figure for each phase :func:`measure_phases` reports."""
    from essa.plan import plan as essa_plan
    from fgrpo.plan import plan as fgrpo_plan

    if case in JOB_CASES:
        return job_plan(case, cfg, ranks)
    if case in LOAD_CASES:
        plan = (fgrpo_plan if case == "fgrpo_load" else essa_plan)(_shape(cfg), cfg, ranks)
        return {"load": plan.phase("load").peak}
    if case != "fgrpo":
        plan = essa_plan(_shape(cfg), cfg, ranks)
        return {"all": {"essa": plan.phase("ESSA scoring").peak,
                        "evaluation": plan.phase("evaluation").peak,
                        "after_evaluation": plan.peak}[case]}
    plan = fgrpo_plan(_shape(cfg), cfg, ranks)
    train = next(p.peak for p in plan.phases if p.name.startswith("training"))
    step = next((p.peak for p in plan.phases if p.name.startswith("gradient reduction")), train)
    return {"rollout": plan.phase("rollout").peak, "training": train, "step": step}


def job_plan(case: str, cfg, ranks: int) -> dict:
    """{job phase (:func:`essa_job`, :func:`fgrpo_job`): the plan's figure}: the plan's phase
    of the same work; the export: what stays resident (the decoding phases less their
    engines); ``"job"``: the plan's peak, which the whole sequence's peak is held to."""
    from essa.plan import plan as essa_plan
    from fgrpo.plan import plan as fgrpo_plan

    shape = _shape(cfg)
    plan = (essa_plan if case == "essa_job" else fgrpo_plan)(shape, cfg, ranks)
    by_kind = {"evaluation": plan.phase("evaluation").peak,
               "export": sum(b for label, b in plan.phase("evaluation").parts[:-2]
                             if not label.startswith("gathered"))}
    if case == "essa_job":
        by_kind["scoring"] = plan.phase("ESSA scoring").peak
    else:
        by_kind["rollout"] = plan.phase("rollout").peak
        by_kind["training"] = next(p.peak for p in plan.phases
                                   if p.name.startswith("training"))
        by_kind["AdamW step"] = next((p.peak for p in plan.phases
                                      if p.name.startswith("gradient reduction")),
                                     by_kind["training"])
    return dict(by_kind, job=plan.peak)


def planned_for(phase: str, planned: dict) -> int:
    """The plan's figure of a measured ``phase`` in :func:`planned_phases`'s ``planned``."""
    if phase in planned:
        return planned[phase]
    return next((b for kind, b in planned.items() if phase.endswith(kind)),
                max(planned.values()))


def main(argv=None):
    from hpc.job.config import plan_job_class
    from hpc.engine.shape import QWEN25
    from hpc.runtime.config import load_config

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("items", nargs="*", metavar="CONFIG.yaml | section.key=value")
    p.add_argument("--ranks", type=int, default=1)
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--layers-from", type=int, nargs=2, default=(2, 4), metavar=("L1", "L2"),
                   help="measure at these layer counts and extend linearly (0 0: every layer)")
    p.add_argument("--device", choices=["fake", "cpu", "cuda"], default="fake",
                   help="fake tensors (any shape, no memory), or a real run of one rank at "
                        "every layer: cpu (torch's tracker) or cuda (the allocator's peak, "
                        "torch.cuda.max_memory_allocated, per phase)")
    p.add_argument("--job-steps", type=int, default=2, metavar="N",
                   help="steps of the job cases (1: the start evaluation, one step, the "
                        "final evaluation and the export)")
    p.add_argument("--legacy-handover", action="store_true",
                   help="engines change hands as before the fix (legacy_handover), to see "
                        "the hand-over peaks of the job cases")
    p.add_argument("--json", metavar="PATH", help="also write each phase's figure and the "
                                                  "plan's beside it as JSON")
    p.add_argument("--qwen25", choices=sorted(QWEN25), help="the released Qwen2.5 shape of "
                   "this size (its config.json written to a temporary folder) as model.path")
    args = p.parse_intermixed_args(argv)  # keys may follow the options
    overrides = [i for i in args.items if "=" in i]
    if args.qwen25:
        folder = tempfile.mkdtemp(prefix=f"qwen2.5-{args.qwen25}-")
        with open(os.path.join(folder, "config.json"), "w") as fh:
            json.dump(dict(QWEN25[args.qwen25], model_type="qwen2",
                           architectures=["Qwen2ForCausalLM"]), fh)
        overrides.append(f"model.path={folder}")
    cfg = load_config(plan_job_class(), next((i for i in args.items if "=" not in i), None),
                      overrides)
    if args.device != "fake" and args.ranks != 1:
        raise SystemExit("--device cpu/cuda runs one real rank: use --ranks 1")
    layers = tuple(args.layers_from) if all(args.layers_from) and args.device == "fake" else ()
    print(f"machine: {machine()}")
    results = []
    for case in args.cases.split(","):
        with legacy_handover() if args.legacy_handover else contextlib.nullcontext():
            measured = (phase_peaks(case, cfg, args.ranks, layers, args.job_steps)
                        if args.device == "fake" else _whole_phases(measure_phases(
                            case, cfg, args.ranks, None, args.device, args.job_steps)))
        planned = planned_phases(case, cfg, args.ranks)
        if case in JOB_CASES:  # the whole sequence, hand-overs included, against the plan
            measured["job"] = max(measured.values())
        for phase, nbytes in measured.items():
            plan = planned_for(phase, planned)
            label = case if phase == "all" else f"{case} {phase}"
            print(f"{label:<40} {_size(nbytes)}   plan {_size(plan)} "
                  f"({(plan - nbytes) / nbytes:+.1%})")
            results.append({"case": case, "phase": phase, "measured_bytes": int(nbytes),
                            "planned_bytes": int(plan)})
    overrides = [i for i in overrides if not i.startswith("model.path=")]
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"machine": machine(), "device": args.device, "ranks": args.ranks,
                       "legacy_handover": args.legacy_handover,
                       "model": args.qwen25 and f"Qwen2.5-{args.qwen25} (random weights)"
                       or cfg.model.path, "overrides": overrides,
                       "results": results}, fh, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    sys.exit(main())
