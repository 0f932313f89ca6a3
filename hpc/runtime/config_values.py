"""A config key's declaration and check: :func:`param` records a key's default, help text and
rule (range or choices); :func:`coerce` checks a value against its declared type and rule and
returns it in that type, or raises a one-line :class:`UserError` naming the key."""
from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import field

from hpc.runtime.errors import UserError, shown

MAX_VALUE_CHARS = 2 ** 16   # one value (a path, a system prompt), a file's or an override's
MAX_LIST_ITEMS = 1024       # items of a list key (module names)


def param(default, help: str, *, min=None, max=None, above=None, choices=None, follows=""):
    """Declare a config field with its default, help text and validation rule: ``min`` and
    ``max`` inclusive, ``above`` a strict lower bound (e.g. a step size that must be > 0).
    Every number has an upper bound too, sized by memory and sense, so a typo such as 1e9
    ends as one line before anything is allocated. ``choices``: the allowed values, a list or
    a registry dict (its keys, read each time a value is checked: a name registered after the
    section was declared is accepted). ``follows``: the dotted key this one was
    split from; a config that sets that key and not this one keeps its old meaning (this key
    takes that value, with a note line: :func:`hpc.runtime.config.load_config`)."""
    meta = {"help": help, "min": min, "max": max, "above": above, "choices": choices,
            "follows": follows}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


class Choices:
    """A key's allowed values read when a value is checked: the ``fixed`` ones (e.g. ``auto``),
    then the names ``registry`` (a plain-dict registry) holds then, so a name registered after
    the key was declared is accepted."""

    def __init__(self, *fixed: str, registry: dict):
        self.fixed, self.registry = fixed, registry

    def __iter__(self):
        return iter([*self.fixed, *self.registry])

    def __contains__(self, value) -> bool:
        return value in self.fixed or value in self.registry

    def __len__(self) -> int:
        return len(self.fixed) + len(self.registry)


def rule_text(meta: dict) -> str:
    """The allowed values of a key as text: 'one of a, b', '>= 1 <= 9' or ''."""
    if meta.get("choices"):
        return f"one of {', '.join(meta['choices'])}"
    return " ".join(s for s in (f">= {meta['min']}" if meta.get("min") is not None else "",
                                f"> {meta['above']}" if meta.get("above") is not None else "",
                                f"<= {meta['max']}" if meta.get("max") is not None else "") if s)


def require_per_rank(key: str, value: int, world, what: str = "") -> None:
    """UserError unless config key ``key`` (``value`` items) gives every rank of ``world`` at
    least one item; ``what`` ends the message (why a rank needs one)."""
    if value < world.size:
        raise UserError(f"{key}={value} is smaller than the {world.size} ranks{what}")


def field_type(section_cls, f: dataclasses.Field):
    return typing.get_type_hints(section_cls)[f.name]


def coerce(key: str, value, ftype, meta):
    """Check ``value`` against the declared type and rule; return it in the declared type."""
    if ftype is bool:
        if isinstance(value, bool):
            out = value
        else:
            raise UserError(f"config key '{key}': expected true/false, got {shown(value)}")
    elif ftype is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise UserError(f"config key '{key}': expected an integer, got {shown(value)}")
        out = value
    elif ftype is float:
        if isinstance(value, str):  # YAML 1.1 reads 1e-5 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UserError(f"config key '{key}': expected a number, got {shown(value)}")
        out = float(value)
        if not math.isfinite(out):
            raise UserError(f"config key '{key}': expected a finite number, got {shown(value)}")
    elif ftype is str:
        if isinstance(value, (dict, list)) or value is None:
            raise UserError(f"config key '{key}': expected a string, got {shown(value)}")
        if isinstance(value, bool) and {"on", "off"} <= set(meta.get("choices") or ()):
            value = "on" if value else "off"  # YAML 1.1 reads on/off (yes/no, true/false) as bools
        out = str(value)
    elif ftype is list:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise UserError(f"config key '{key}': expected a list of strings, got {shown(value)}")
        if not 1 <= len(value) <= MAX_LIST_ITEMS:
            raise UserError(f"config key '{key}': {len(value)} items; it needs 1 to "
                            f"{MAX_LIST_ITEMS}")
        for item in value:
            check_text(key, item)
        out = list(value)
    else:  # pragma: no cover - a declaration error, not a user error
        raise TypeError(f"unsupported config type {ftype} for {key}")
    if isinstance(out, str):
        check_text(key, out)
    if meta.get("choices") is not None:  # a list key: each item
        for item in out if isinstance(out, list) else [out]:
            if item not in meta["choices"]:
                raise UserError(f"config key '{key}': {shown(item)} is not one of "
                                f"{list(meta['choices'])}")
    if meta.get("min") is not None and out < meta["min"]:
        raise UserError(f"config key '{key}': {out} is below the minimum {meta['min']}")
    if meta.get("above") is not None and not out > meta["above"]:
        raise UserError(f"config key '{key}': {out} must be greater than {meta['above']}")
    if meta.get("max") is not None and out > meta["max"]:
        raise UserError(f"config key '{key}': {out} is above the maximum {meta['max']}")
    return out


def check_text(key: str, text: str) -> None:
    """UserError for a value longer than MAX_VALUE_CHARS or not encodable as UTF-8 (a lone
    surrogate: a YAML ``"\\ud800"`` escape, or a byte of a command line that is not UTF-8),
    which no tokenizer, file name or HDF5 attribute takes."""
    if len(text) > MAX_VALUE_CHARS:
        raise UserError(f"config key '{key:.80}': a value of {len(text)} characters, more than "
                        f"{MAX_VALUE_CHARS}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise UserError(f"config key '{key:.80}': character {err.start + 1} of the value is "
                        f"U+{ord(text[err.start]):04X}, a lone surrogate (half of a UTF-16 "
                        f"pair), which is not text") from None
