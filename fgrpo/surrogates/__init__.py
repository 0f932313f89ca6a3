"""The per-token policy objectives of F-GRPO, one file each: a surrogate turns the importance
ratio and the advantage of every sampled token into its loss. Each is registered in setup.py's
``fgrpo.surrogates`` entry points (``fgrpo.surrogate`` names one), so adding a surrogate is one
file and one registration; :func:`fgrpo.loss.policy_loss` aggregates what it returns.

A surrogate is a frozen dataclass whose fields are its own parameters, with ``KEYS``: {field:
the ``fgrpo`` config key it is read from}, built by :func:`from_config`, and called as
``surrogate(logp, ratio, adv) -> (per_token, clip_acted, dual)``: logp and ratio (B, T) (zero at
padding), adv (B, 1); per_token (B, T) the loss of each token; clip_acted (B, T) bool where a
clip changed the objective; dual (B, T) bool where a dual clip lowered it.

This module imports no torch (the config reads the names from it); each surrogate's module does.
"""
from __future__ import annotations

import functools
import importlib.metadata

SURROGATES_GROUP = "fgrpo.surrogates"


@functools.cache
def surrogates() -> dict[str, importlib.metadata.EntryPoint]:
    """``{name: entry point of its class}`` of the installed surrogates."""
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=SURROGATES_GROUP)}


def surrogate_class(name: str):
    """The class registered as ``name``; ValueError when none is."""
    if name not in surrogates():
        raise ValueError(f"surrogate must be one of {tuple(surrogates())}, got {name!r}")
    return surrogates()[name].load()


def from_config(f):
    """The surrogate ``f.surrogate`` names, its parameters read from the ``fgrpo`` section
    ``f`` (the keys its ``KEYS`` lists)."""
    cls = surrogate_class(f.surrogate)
    return cls(**{field: getattr(f, key) for field, key in cls.KEYS.items()})
