"""The training methods, each described once by a :class:`MethodSpec` and registered in one
place: setup.py's ``hpc.methods`` entry-point group (``essa = essa.method:METHOD``). The floors
of ``hpc`` stand below the methods and name none of them; whatever they need of a method (its
config section, job config, memory plan, command, whether its run folder keeps checkpoints)
they read from :func:`methods`.

A spec holds import strings (``'module:attribute'``), so reading the registry imports no
method's code: the run-folder check, ``--help`` and the config loader stay torch-free, and a
method's config module is imported only where a file holds its section.
"""
from __future__ import annotations

import functools
import importlib
import importlib.metadata
from dataclasses import dataclass

METHODS_GROUP = "hpc.methods"


def load_ref(ref: str):
    """The object an import string names: ``'package.module:attribute'``, or ``'package.module'``
    for the module itself."""
    module, _, name = ref.partition(":")
    loaded = importlib.import_module(module)
    return getattr(loaded, name) if name else loaded


@dataclass(frozen=True)
class MethodSpec:
    """One training method as the package sees it.

    ``name``: its config section, its run file (``<name>.h5``) and ``{method}`` in ``run.out``;
    ``command``: its console command; ``about``: the line ``--help`` starts with; ``section``,
    ``job``: its config section class and job config class; ``trainer``: the function a job
    runs (``argv`` in); ``plan``: its memory-plan module (``''``: none; see
    :mod:`hpc.plan.registry`); ``keeps_checkpoints``: its run folder holds ``checkpoints/``,
    which no other method's job may share."""

    name: str
    command: str
    about: str
    section: str
    job: str
    trainer: str
    plan: str = ""
    keeps_checkpoints: bool = True

    def section_class(self) -> type:
        return load_ref(self.section)

    def job_class(self) -> type:
        return load_ref(self.job)

    def plan_module(self):
        """The plan module, or None for a method without one."""
        return load_ref(self.plan) if self.plan else None


@functools.cache
def methods() -> dict[str, MethodSpec]:
    """``{name: spec}`` of the installed methods, in name order."""
    specs = [ep.load() for ep in importlib.metadata.entry_points(group=METHODS_GROUP)]
    return {spec.name: spec for spec in sorted(specs, key=lambda spec: spec.name)}
