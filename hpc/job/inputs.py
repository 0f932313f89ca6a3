"""A job's inputs, checked before it imports torch (in about a second, on every rank alike):
``run.report_to``'s packages, the task's data files row by row, ``model.path`` (a built-in
model's name, a folder with config.json, weights and tokenizer files, or a Hugging Face Hub id
found in the local cache: :mod:`hpc.models.hub`), ``lora.adapter`` (a peft adapter's folder
or Hub id) and the run folder (:mod:`hpc.job.run_folder`). A mistake in any ends the job here,
instead of after the imports, the toy build, the task and the weights load, and before the run
folder exists. :func:`hpc.runtime.cli.job_command` runs :func:`check_inputs`;
:func:`hpc.job.lifecycle.start_job` resolves the ids again on rank 0
(:func:`resolve_sources`), so every rank loads the same snapshot, and the run file records it
(:meth:`InputSources.attrs`); a resumed run keeps the snapshot its run file records."""
from __future__ import annotations

import os
from dataclasses import dataclass

from hpc.data.mathdata import check_task_files
from hpc.job.run_folder import check_run_folder
from hpc.models.folders import check_adapter_folder, check_model_folder
from hpc.models.hub import Source, hub_id, local_or_cached
from hpc.plan.terms import reward_model_folder
from hpc.models.folders import BUILT_IN_MODELS
from hpc.runtime.config import stored_config
from hpc.runtime.errors import UserError
from hpc.runtime.report_to import check_report_to


@dataclass(frozen=True)
class InputSources:
    """Where ``model.path``, ``lora.adapter`` and ``reward.model`` lie (adapter None: a fresh
    LoRA; reward None: the task's own reward); ``notes``: lines for rank 0 to print (a resumed
    run's id kept at the snapshot it began with)."""

    model: Source
    adapter: Source | None
    reward: Source | None = None
    notes: tuple = ()

    def apply(self, cfg) -> None:
        """Point ``cfg.model.path``, ``cfg.lora.adapter`` and ``cfg.reward.model`` at the
        folders (a Hub id becomes its snapshot folder; what the loaders and the memory plan
        read)."""
        cfg.model.path = self.model.path
        if self.adapter is not None:
            cfg.lora.adapter = self.adapter.path
        if self.reward is not None:
            cfg.reward.model = self.reward.path

    def attrs(self) -> dict:
        """Run-file attributes: each folder (absolute; a built-in model's name) and the commit
        of its cached snapshot ('' for a folder of the user's)."""
        out = {"model_folder": (self.model.path if self.model.path in BUILT_IN_MODELS
                                else os.path.abspath(self.model.path)),
               "model_revision": self.model.revision}
        if self.adapter is not None:
            out.update(adapter_folder=os.path.abspath(self.adapter.path),
                       adapter_revision=self.adapter.revision)
        if self.reward is not None:
            out.update(reward_model_folder=os.path.abspath(self.reward.path),
                       reward_model_revision=self.reward.revision)
        return out


def resolve_sources(cfg, recorded: dict | None = None) -> InputSources:
    """The :class:`InputSources` of ``cfg`` (UserError for an id the cache lacks).

    ``recorded``: ``{config key: (as given, revision)}`` from the run file of the run being
    resumed. An id given as then, without ``@revision``, stays at the snapshot the run began
    with, so that a ``hf download`` since (which moves the cache's refs/main) does not put the
    checkpoint's LoRA onto other weights; ``org/name@revision`` resumes on another snapshot."""
    recorded = recorded or {}
    path = cfg.model.path
    adapter = getattr(getattr(cfg, "lora", None), "adapter", "")
    model, model_note = ((Source(path, path), "") if path in BUILT_IN_MODELS else
                         _source("model.path", path, recorded.get("model.path")))
    lora, lora_note = (_source("lora.adapter", adapter, recorded.get("lora.adapter"))
                       if adapter else (None, ""))
    scorer = getattr(getattr(cfg, "reward", None), "model", "")
    reward, reward_note = (_source("reward.model", scorer, recorded.get("reward.model"))
                           if scorer else (None, ""))
    return InputSources(model, lora, reward, tuple(
        note for note in (model_note, lora_note, reward_note) if note))


def _source(key: str, given: str, recorded: tuple | None) -> tuple:
    """``(Source, note)`` of config key ``key`` = ``given``; ``recorded``: ``(as given, revision)``
    in the run file of a resumed run (see :func:`resolve_sources`)."""
    what = f"config key '{key}'"
    then, revision = recorded or ("", "")
    found = hub_id(given)
    if not revision or then != given or found is None or found[1] or os.path.exists(given):
        return local_or_cached(given, what), ""
    kept = local_or_cached(f"{given}@{revision}", f"--resume: {what} (the snapshot the run "
                           f"began with; {key}={given}@<revision> resumes on another)")
    try:
        now = local_or_cached(given, what).revision
    except UserError:  # refs/main names no snapshot here: the kept one is all there is
        now = revision
    note = (f"--resume: {key}={given} stays at revision {revision}, the snapshot the run "
            f"began with (refs/main in the cache names {now} now; {key}={given}@<revision> "
            f"resumes on another)" if now != revision else "")
    return Source(given, kept.path, kept.revision), note


def _recorded(run_file: str) -> tuple:
    """(config as a dict, attributes) the run file of a run to resume records; ({}, {}) where
    there is no readable run file (the checkpoint's copy replaces a damaged one later)."""
    import h5py
    import yaml

    try:
        with h5py.File(run_file, "r", locking=False) as f:
            attrs = {key: f.attrs.get(key, "") for key in (
                "config", "model_revision", "adapter_revision", "reward_model_revision")}
        attrs = {k: v.decode() if isinstance(v, bytes) else str(v) for k, v in attrs.items()}
        config = yaml.safe_load(attrs["config"]) or {}
    except (OSError, RuntimeError, KeyError, ValueError, yaml.YAMLError):
        return {}, {}
    return (config if isinstance(config, dict) else {}), attrs


def recorded_sources(run_file: str) -> dict:
    """``{config key: (as given, revision)}`` of ``model.path``, ``lora.adapter`` and
    ``reward.model`` as the run file of a run to resume records them (:func:`resolve_sources` keeps that snapshot); empty
    where there is no readable run file."""
    config, attrs = _recorded(run_file)
    if not attrs:
        return {}

    def given(section: str, key: str) -> str:
        part = config.get(section)
        return str(part.get(key) or "") if isinstance(part, dict) else ""

    return {"model.path": (given("model", "path"), attrs["model_revision"]),
            "lora.adapter": (given("lora", "adapter"), attrs["adapter_revision"]),
            "reward.model": (given("reward", "model"), attrs["reward_model_revision"])}


def _flat(config: dict, prefix: str = "") -> dict:
    """``{"section.key": value}`` of a nested config dict."""
    out = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def resume_notes(run_file: str, config_text: str) -> list:
    """A line for each key whose value in the config a run resumes with (``config_text``, as
    the user gave it) differs from the one its run file records: the run goes on with the new
    value, which is what a changed preset or default would otherwise do silently. Keys the
    run file has not (an earlier version's) are left out; moved keys are compared at their
    place today (:func:`hpc.runtime.config.stored_config`)."""
    before = _flat(stored_config(_recorded(run_file)[1].get("config", "")))
    now = _flat(stored_config(config_text))
    return [f"note: --resume: {key}={now[key]!r} here, {before[key]!r} in the run file; the "
            f"run goes on with {now[key]!r} (give {key}={before[key]} to keep the run's value)"
            for key in sorted(now) if key in before and now[key] != before[key]]


def check_inputs(cfg, method: str = "", resume: bool = False) -> None:
    """UserError (one line) for the first of ``cfg``'s inputs that a job could not use; given
    the job's ``method``, also for its run folder (:func:`hpc.job.run_folder.check_run_folder`;
    ``resume``: the job was started with ``--resume``)."""
    check_report_to(cfg.run.report_to)
    check_task_files(cfg)
    sources = resolve_sources(cfg)
    if sources.model.path not in BUILT_IN_MODELS:
        check_model_folder(sources.model.path)
    if sources.adapter is not None:
        check_adapter_folder(sources.adapter.path)
    if cfg.reward.model:
        reward_model_folder(cfg.reward)
    if method:
        check_run_folder(cfg.run.out, method, resume)
