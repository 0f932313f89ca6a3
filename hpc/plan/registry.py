"""The methods' plans, found by registration: each method's spec names its plan module
(:class:`hpc.runtime.methods.MethodSpec`, ``plan``), so this floor names none of them and
adding a method adds its own ``plan.py``.

A plan module may define ``plan(shape, cfg, ranks, advise=True) -> MethodPlan`` (its phases on
one GPU; ``hpc-plan`` prints it and a job checks it at start),
``checkpointing_needed(shape, cfg, ranks) -> bool`` (its rule for
``model.activation_checkpointing=auto``) and ``choices(cfg, ranks, device_type) -> dict`` (the
other decisions its plan takes for a job, e.g. F-GRPO's offload).

A job computes its plan once, at its start (:func:`job_plan`, after its inputs are checked and
before any weight loads): a frozen :class:`JobPlan` that holds the verdict, the figures and
every decision the plan takes (the engine budget, activation checkpointing, the method's
choices); whoever needs one reads it there, and the run file records it.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os

from hpc.engine.shape import ModelShape
from hpc.plan.terms import gib, job_has_plan, model_summary, resolve_checkpointing
from hpc.runtime.errors import UserError
from hpc.runtime.methods import methods


@functools.cache
def method_plans() -> dict:
    """``{method name: its plan module}`` of the installed methods that have one."""
    return {name: spec.plan_module() for name, spec in methods().items() if spec.plan}


def planned_methods() -> dict:
    """``{method name: plan function}`` of the methods that plan their phases."""
    return {name: module.plan for name, module in sorted(method_plans().items())
            if hasattr(module, "plan")}


@dataclasses.dataclass(frozen=True)
class JobPlan:
    """A job's memory plan and the decisions it takes, computed once at the job's start
    (:func:`job_plan`) and read by whoever needs a figure or a decision.

    ``enforced``: the plan binds the job (a planned method on CUDA with a local model folder and
    ``plan.gpu_memory_gib`` > 0): the job started only because it fits, its engines are sized
    within ``engine_budget`` and its ``auto`` choices follow the plan. Otherwise the figures
    (where the model folder has a ``config.json``) are for the record and the choices are the
    unplanned defaults. ``host_load``: the host memory a rank holds during the load. ``phases``: ((phase name, bytes), ...) per GPU; ``text``: ``hpc-plan``'s
    lines of the method; ``choices``: the method's other decisions (F-GRPO's offload and
    whether its rollout engine is kept)."""

    method: str
    enforced: bool = False
    text: str = ""
    phases: tuple = ()
    peak: int = 0
    usable: int = 0
    engine_budget: int = 0
    host_load: int = 0  # host bytes a rank holds during the load
    activation_checkpointing: bool = False
    choices: tuple = ()

    def choice(self, name: str):
        return dict(self.choices)[name]

    def attrs(self) -> dict:
        """The run file's record of the plan: ``plan`` (JSON: the fields above)."""
        return {"plan": json.dumps(dict(dataclasses.asdict(self), phases=dict(self.phases),
                                        choices=dict(self.choices)))}


def job_plan(cfg, method: str, ranks: int, device_type: str) -> JobPlan:
    """``method``'s plan for a job of ``cfg`` on ``ranks`` ranks of ``device_type``: the one
    computation of a job's plan. UserError (one line) when an enforced plan does not fit."""
    module = method_plans().get(method)
    has_plan = module is not None and hasattr(module, "plan")
    enforced = has_plan and job_has_plan(cfg, device_type)
    decisions = dict(activation_checkpointing=activation_checkpointing(cfg, method, ranks,
                                                                       device_type),
                     choices=tuple(sorted(getattr(module, "choices", lambda *_: {})(
                         cfg, ranks, device_type).items())))
    if not has_plan or not os.path.isfile(os.path.join(cfg.model.path, "config.json")):
        return JobPlan(method, **decisions)
    result = module.plan(ModelShape.from_folder(cfg.model.path), cfg, ranks)
    if enforced and not result.fits:
        need = (f"needs {gib(result.peak)} per GPU, more than {gib(result.usable)} usable"
                if result.peak > result.usable else
                f"has no room for one decoding row within its engine budget of "
                f"{gib(result.engine_budget)}, of {gib(result.usable)} usable")
        raise UserError(f"memory plan: {result.method} {need} of plan.gpu_memory_gib="
                        f"{cfg.plan.gpu_memory_gib:g}; to fit: {result.advice} (details: "
                        f"hpc-plan with the same config)")
    return JobPlan(method, enforced, "\n".join(result.lines()),
                   tuple((p.name, p.peak) for p in result.phases), result.peak, result.usable,
                   result.engine_budget if enforced else 0, result.host_load, **decisions)


def activation_checkpointing(cfg, method: str, ranks: int, device_type: str) -> bool:
    """``model.activation_checkpointing`` resolved for a job of ``method`` on ``ranks`` ranks
    (:func:`hpc.plan.terms.resolve_checkpointing` with the method's
    ``checkpointing_needed``; a method without one never needs it)."""
    module = method_plans().get(method)
    rule = getattr(module, "checkpointing_needed", None)
    return resolve_checkpointing(
        cfg, device_type, lambda shape: rule is not None and rule(shape, cfg, ranks))


def plan_text(cfg, ranks: int) -> str:
    """The full plan of every planned method for ``cfg`` (a :func:`hpc.job.config.plan_job_class` config)."""
    if not os.path.isfile(os.path.join(cfg.model.path, "config.json")):
        raise UserError(f"model.path={cfg.model.path!r} is not a folder with a config.json")
    shape = ModelShape.from_folder(cfg.model.path)
    lines = model_summary(shape, cfg) + [f"ranks: {ranks}"]
    for plan in planned_methods().values():
        lines += [""] + plan(shape, cfg, ranks).lines()
    return "\n".join(lines)
