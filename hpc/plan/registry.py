"""The methods' plans, found by registration: each method declares its plan module as an entry
point of ``hpc.method_plans`` (setup.py), beside its config section, so this floor names none
of them and adding a method adds its own ``plan.py``.

A plan module may define ``plan(shape, cfg, ranks, advise=True) -> MethodPlan`` (its phases on
one GPU; ``hpc-plan`` prints it and a job checks it at start) and
``checkpointing_needed(shape, cfg, ranks) -> bool`` (its rule for
``model.activation_checkpointing=auto``).
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import os

from hpc.engine.shape import ModelShape
from hpc.plan.terms import gib, job_has_plan, model_summary, resolve_checkpointing
from hpc.runtime.config import JobConfig, method_sections
from hpc.runtime.errors import UserError

METHOD_PLANS_GROUP = "hpc.method_plans"


@functools.cache
def method_plans() -> dict:
    """``{method name: its plan module}`` of the installed methods."""
    return {ep.name: ep.load()
            for ep in importlib.metadata.entry_points(group=METHOD_PLANS_GROUP)}


def planned_methods() -> dict:
    """``{method name: plan function}`` of the methods that plan their phases."""
    return {name: module.plan for name, module in sorted(method_plans().items())
            if hasattr(module, "plan")}


def plan_job_class():
    """A job config with the sections of every planned method (``hpc-plan``,
    ``hpc-scaling``)."""
    sections = method_sections()
    fields = [(name, sections[name].load(), dataclasses.field(
        default_factory=sections[name].load())) for name in planned_methods()]
    return dataclasses.make_dataclass("PlanJobConfig", fields, bases=(JobConfig,))


def check_job_memory(cfg, method: str, ranks: int, device_type: str) -> None:
    """At job start: UserError (one line) when ``method``'s plan does not fit. Only for a
    planned method on CUDA with a local model folder and ``plan.gpu_memory_gib`` > 0."""
    plan = planned_methods().get(method)
    if plan is None or not job_has_plan(cfg, device_type):
        return
    result = plan(ModelShape.from_folder(cfg.model.path), cfg, ranks)
    if not result.fits:
        raise UserError(f"memory plan: {result.method} needs {gib(result.peak)} per GPU, more "
                        f"than {gib(result.usable)} usable of plan.gpu_memory_gib="
                        f"{cfg.plan.gpu_memory_gib:g}; to fit: {result.advice} (details: "
                        f"hpc-plan with the same config)")


def planned_engine_budget(cfg, method: str, ranks: int, device_type: str) -> int:
    """The engine budget of ``method``'s plan (``MethodPlan.engine_budget``) for a job on CUDA
    with a local model folder and ``plan.gpu_memory_gib`` > 0 (0 otherwise: the job derives it
    from the device, :meth:`hpc.engine.decoder.Decoder.budget`). The job's engines are so
    sized within the very figure the plan's phases were checked with."""
    plan = planned_methods().get(method)
    if plan is None or not job_has_plan(cfg, device_type):
        return 0
    return plan(ModelShape.from_folder(cfg.model.path), cfg, ranks, advise=False).engine_budget


def activation_checkpointing(cfg, method: str, ranks: int, device_type: str) -> bool:
    """``model.activation_checkpointing`` resolved for a job of ``method`` on ``ranks`` ranks
    (:func:`hpc.plan.terms.resolve_checkpointing` with the method's
    ``checkpointing_needed``; a method without one never needs it)."""
    module = method_plans().get(method)
    rule = getattr(module, "checkpointing_needed", None)
    return resolve_checkpointing(
        cfg, device_type, lambda shape: rule is not None and rule(shape, cfg, ranks))


def plan_text(cfg, ranks: int) -> str:
    """The full plan of every planned method for ``cfg`` (a :func:`plan_job_class` config)."""
    if not os.path.isfile(os.path.join(cfg.model.path, "config.json")):
        raise UserError(f"model.path={cfg.model.path!r} is not a folder with a config.json")
    shape = ModelShape.from_folder(cfg.model.path)
    lines = model_summary(shape, cfg) + [f"ranks: {ranks}"]
    for plan in planned_methods().values():
        lines += [""] + plan(shape, cfg, ranks).lines()
    return "\n".join(lines)
