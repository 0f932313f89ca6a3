"""A job's inputs, checked before it imports torch (in about a second, on every rank alike):
``run.report_to``'s packages, the task's data files row by row, ``model.path`` (a built-in
model's name, a folder with config.json, weights and tokenizer files, or a Hugging Face Hub id
found in the local cache: :mod:`hpc.models.hub`) and ``lora.adapter`` (a peft adapter's folder
or Hub id). A mistake in any ends the job here, instead of after the imports, the toy build,
the task and the weights load, and before the run folder exists.
:func:`hpc.runtime.cli.job_command` runs :func:`check_inputs`; :func:`hpc.job.lifecycle.start_job`
resolves the ids again on rank 0 (:func:`resolve_sources`), so every rank loads the same
snapshot, and the run file records it (:meth:`InputSources.attrs`)."""
from __future__ import annotations

import os
from dataclasses import dataclass

from hpc.data.mathdata import check_task_files
from hpc.models.folders import check_adapter_folder, check_model_folder
from hpc.models.hub import Source, local_or_cached
from hpc.runtime.config import BUILT_IN_MODEL_NAMES
from hpc.runtime.report_to import check_report_to


@dataclass(frozen=True)
class InputSources:
    """Where ``model.path`` and ``lora.adapter`` lie (adapter None: a fresh LoRA)."""

    model: Source
    adapter: Source | None

    def apply(self, cfg) -> None:
        """Point ``cfg.model.path`` and ``cfg.lora.adapter`` at the folders (a Hub id becomes
        its snapshot folder; what the loaders and the memory plan read)."""
        cfg.model.path = self.model.path
        if self.adapter is not None:
            cfg.lora.adapter = self.adapter.path

    def attrs(self) -> dict:
        """Run-file attributes: each folder (absolute; a built-in model's name) and the commit
        of its cached snapshot ('' for a folder of the user's)."""
        out = {"model_folder": (self.model.path if self.model.path in BUILT_IN_MODEL_NAMES
                                else os.path.abspath(self.model.path)),
               "model_revision": self.model.revision}
        if self.adapter is not None:
            out.update(adapter_folder=os.path.abspath(self.adapter.path),
                       adapter_revision=self.adapter.revision)
        return out


def resolve_sources(cfg) -> InputSources:
    """The :class:`InputSources` of ``cfg`` (UserError for an id the cache lacks)."""
    path = cfg.model.path
    model = (Source(path, path) if path in BUILT_IN_MODEL_NAMES else
             local_or_cached(path, "config key 'model.path'"))
    adapter = getattr(getattr(cfg, "lora", None), "adapter", "")
    return InputSources(model, local_or_cached(adapter, "config key 'lora.adapter'")
                        if adapter else None)


def check_inputs(cfg) -> None:
    """UserError (one line) for the first of ``cfg``'s inputs that a job could not use."""
    check_report_to(cfg.run.report_to)
    check_task_files(cfg)
    sources = resolve_sources(cfg)
    if sources.model.path not in BUILT_IN_MODEL_NAMES:
        check_model_folder(sources.model.path)
    if sources.adapter is not None:
        check_adapter_folder(sources.adapter.path)
