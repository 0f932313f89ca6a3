"""Job configuration: dataclass sections, a YAML file plus ``key=value`` overrides, validated.

A job config is a dataclass whose fields are sections (``model``, ``lora``, ``task``, ``run``,
``eval`` and the method's own). A section's field is a key, declared with :func:`param`, which
records its allowed range or choices and a help text, or a section nested in it, split by
concern (a method's section may hold ``section.nested.key`` keys, a nested section may nest
another); :func:`config_keys` walks them all. :func:`reference_markdown` renders the config reference
(``docs/config.md``, written by ``make docs``) from those declarations, so the two never drift
apart. A section class may map keys it has moved to their new place (``RENAMED``): an old
config file or command line still runs, with one line naming each new key, and a run file's
stored config is read in today's layout (:func:`stored_config`).

Any unknown key, wrong type or out-of-range value raises :class:`UserError` naming the key,
before any model is loaded (:mod:`hpc.runtime.config_values`); so do a key given twice in one
YAML mapping (YAML would keep the last without a word), a list key with no item, and a file,
value or nesting beyond the bounds of :mod:`hpc.runtime.config_yaml`, checked before the text
is parsed.

This floor holds the machinery only. Each section lives beside its owner: ``model`` in
:mod:`hpc.engine.config` (beside the backends' registry its ``engine`` key names), ``lora`` in
:mod:`hpc.models.config`, ``task`` and ``reward`` in :mod:`hpc.data.config`,
``plan`` in :mod:`hpc.plan.config`, ``eval``, ``run`` and the job config every job extends in
:mod:`hpc.job.config`, a method's own in its package (:mod:`hpc.runtime.methods`).
"""
from __future__ import annotations

import dataclasses
import difflib
import functools

import yaml

# param, rule_text and require_per_rank: a config section module takes them from here with
# the loader
from hpc.runtime.config_values import (coerce, field_type, param,  # noqa: F401
                                       require_per_rank, rule_text)
from hpc.runtime.config_yaml import parse_override, read_config_file
from hpc.runtime.errors import UserError, shown
from hpc.runtime.methods import methods


def is_section(value) -> bool:
    """Whether a config field's value is a section (a dataclass object), not a key's value."""
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def config_keys(section, prefix: str = ""):
    """``(key, the section object holding it, its dataclasses.Field)`` of every key of
    ``section`` and of the sections nested in it, in declaration order; ``key`` is dotted from
    ``prefix`` (``config_keys(job.model, "model.")`` yields ``model.path``, ...; a method's
    section with nested ones yields ``section.nested.key``)."""
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if is_section(value):
            yield from config_keys(value, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", section, f


def get_key(section, key: str):
    """The value of the dotted ``key`` below ``section`` (``get_key(cfg, "model.path")``)."""
    return functools.reduce(getattr, key.split("."), section)


def set_key(section, key: str, value) -> None:
    """Set the dotted ``key`` below ``section`` to ``value`` (unchecked: for resolved values)."""
    *path, name = key.split(".")
    setattr(get_key(section, ".".join(path)) if path else section, name, value)


def _set(cfg, key: str, value, from_file: bool = False, notes: list | None = None) -> str:
    """Set ``key`` (section.key, or section.nested.key) of ``cfg`` to ``value``, checked; the
    key's name today is returned (a renamed key is read at its new place, a line for ``notes``).
    A key of another method's section is checked against that method's declaration and skipped
    when it comes from a config file (``from_file``: a file several methods share), refused on
    the command line."""
    section_name, _, rest = key.partition(".")
    sections = {f.name: f for f in dataclasses.fields(cfg)}
    if not rest:
        raise UserError(f"config key '{key:.80}' must be section.key (sections: "
                        f"{', '.join(sections)})")
    if section_name in methods() and section_name not in sections:
        if not from_file:
            raise UserError(f"config key '{key:.80}' is not read by this job (its sections: "
                            f"{', '.join(sections)}); a config file may hold the sections of "
                            f"other methods, the command line only this job's keys")
        return _set_in(methods()[section_name].section_class()(), section_name, rest, value,
                       notes)
    if section_name not in sections:
        raise UserError(f"config key '{key:.80}': unknown section '{section_name:.80}' "
                        f"(sections: {', '.join(sections)})")
    return _set_in(getattr(cfg, section_name), section_name, rest, value, notes)


def _set_in(section, path: str, rest: str, value, notes: list | None, top=None) -> str:
    """Set key ``rest`` (dotted) of the section object ``section``, named ``path``, to
    ``value``, checked; returns the key's full name today. ``top``: (the top section, its
    name), where a misspelt key's closest is looked for."""
    top = top or (section, path)
    renamed = getattr(type(section), "RENAMED", {})
    if rest in renamed:
        note = (f"config key '{path}.{rest}' is now '{path}.{renamed[rest]}' (read as that; "
                f"the run file's config has the new name)")
        if notes is not None and note not in notes:
            notes.append(note)
        rest = renamed[rest]
    name, _, deeper = rest.partition(".")
    fields = {f.name: f for f in dataclasses.fields(section)}
    if name not in fields:
        raise UserError(f"config key '{path}.{rest:.80}' does not exist "
                        f"(keys of {path}: {', '.join(fields)})"
                        f"{_close_key(section, path, rest) or _close_key(*top, rest)}")
    current = getattr(section, name)
    if is_section(current):
        if not deeper:
            raise UserError(f"config key '{path}.{name}' is a section, not a key (its keys: "
                            f"{', '.join(f.name for f in dataclasses.fields(current))})")
        return _set_in(current, f"{path}.{name}", deeper, value, notes, top)
    key = f"{path}.{name}"
    if deeper:
        raise UserError(f"config key '{path}.{rest:.80}': {key} is a key, not a section")
    f = fields[name]
    setattr(section, name, coerce(key, value, field_type(type(section), f), f.metadata))
    return key


def _close_key(section, path: str, rest: str) -> str:
    """'; did you mean KEY?' for the key below ``section`` (named ``path``, nested sections
    included) whose last name is closest to the last name of ``rest``, where one is close."""
    keys = {key.rsplit(".", 1)[1]: key for key, _, _ in config_keys(section, f"{path}.")}
    close = difflib.get_close_matches(rest.rsplit(".", 1)[-1], list(keys), n=1)
    return f"; did you mean {keys[close[0]]}?" if close else ""


def _file_keys(prefix: str, values: dict):
    """``(dotted key, value)`` of a config file's mapping ``values`` under ``prefix``, nested
    mappings (sections in sections) flattened."""
    for name, value in values.items():
        if isinstance(value, dict):
            yield from _file_keys(f"{prefix}.{name}", value)
        else:
            yield f"{prefix}.{name}", value


def load_config(job_cls, path: str | None = None, overrides: list[str] = (),
                notes: list | None = None):
    """Build ``job_cls`` from defaults, then the YAML file at ``path``, then ``overrides``;
    then each section with a ``resolve(job, given, notes)`` method resolves what depends on
    other keys (``given``: the keys below that section the file or command line set, dotted,
    e.g. a preset fills only the others; with a config file it may add a line to ``notes``:
    the file may have been written for an earlier preset), and the job's
    ``validate()`` checks the keys together. A renamed key is read at its new place and a line saying so appended to ``notes`` (the job
    prints them on rank 0).

    Raises UserError for a missing or malformed file and for any invalid key or value.
    """
    cfg, given = job_cls(), set()
    if path:
        data = read_config_file(path)
        for section_name, values in data.items():
            if not isinstance(values, dict):
                raise UserError(f"config section {shown(section_name)} in {path} must be a "
                                f"mapping")
            for key, value in _file_keys(str(section_name), values):
                given.add(_set(cfg, key, value, from_file=True, notes=notes))
    for text in overrides:
        key, value = parse_override(text)
        given.add(_set(cfg, key, value, notes=notes))
    _follow_split_keys(cfg, given, notes)
    for f in dataclasses.fields(cfg):
        section = getattr(cfg, f.name)
        if hasattr(section, "resolve"):
            section.resolve(cfg, frozenset(key.split(".", 1)[1] for key in given
                                           if key.startswith(f"{f.name}.")),
                            notes if path else None)  # a config file may predate a preset
    if hasattr(cfg, "validate"):
        cfg.validate()
    return cfg


def _follow_split_keys(cfg, given: set, notes: list | None) -> None:
    """A key split off an older one (``param(follows=...)``) that neither the file nor the
    command line sets takes the older key's value where they set that one, as before the
    split, with a line for ``notes``."""
    for key, section, f in config_keys(cfg):
        old = f.metadata.get("follows")
        if old and old in given and key not in given:
            value = coerce(key, get_key(cfg, old), field_type(type(section), f), f.metadata)
            setattr(section, f.name, value)
            note = (f"note: {key}={value}, from {old} as before {key} existed; give {key} "
                    f"to set the two apart")
            if notes is not None and note not in notes:
                notes.append(note)


def config_to_yaml(cfg) -> str:
    """The effective config as YAML text (stored in the run file, reloadable by load_config)."""
    return yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False)


def stored_config(text: str) -> dict:
    """A run file's stored config (:func:`config_to_yaml`'s text) as a dict in today's layout:
    keys a section has moved since (its class's ``RENAMED``, for the installed methods'
    sections) are read at their new place, so a report reads old and new run files alike."""
    data = yaml.safe_load(text or "") or {}
    if not isinstance(data, dict):
        return {}
    for name, spec in methods().items():
        values = data.get(name)
        renamed = getattr(spec.section_class(), "RENAMED", {}) if isinstance(values, dict) else {}
        for old, new in renamed.items():
            if old in values and not isinstance(values[old], dict):
                *path, last = new.split(".")
                functools.reduce(lambda d, k: d.setdefault(k, {}), path, values)[last] = \
                    values.pop(old)
    return data


def reference_markdown(job_cls, sections=None) -> str:
    """A markdown table of the keys of ``job_cls`` (of ``sections`` only, if given): default,
    rule and help."""
    rows = ["| key | default | allowed | meaning |", "|---|---|---|---|"]
    cfg = job_cls()
    for sf in dataclasses.fields(cfg):
        if sections is not None and sf.name not in sections:
            continue
        for key, section, f in config_keys(getattr(cfg, sf.name), f"{sf.name}."):
            rows.append(f"| `{key}` | `{getattr(section, f.name)!r}` | "
                        f"{rule_text(f.metadata)} | {f.metadata['help']} |")
    return "\n".join(rows)
