"""The per-token policy objectives of F-GRPO, one file each: a surrogate turns the importance
ratio and the advantage of every sampled token into its loss. Each is registered in setup.py's
``fgrpo.surrogates`` entry points (``fgrpo.loss.surrogate`` names one), so adding a surrogate is
one file and one registration; :func:`fgrpo.loss.policy_loss` aggregates what it returns.

A surrogate is a dataclass whose fields are its own parameters, declared with
:func:`hpc.runtime.config.param`: the class is its config section too, nested in the loss's as
``fgrpo.loss.<name>`` (``fgrpo.loss.clip.epsilon``), and the object that section holds is the
one the loss calls: ``surrogate(logp, ratio, adv) -> (per_token, clip_acted, dual)``, logp and
ratio (B, T) (zero at padding), adv (B, 1); per_token (B, T) the loss of each token; clip_acted
(B, T) bool where a clip changed the objective; dual (B, T) bool where a dual clip lowered it.
An optional ``check(key)`` raises :class:`hpc.runtime.errors.UserError` for values that
contradict each other (``key``: the section's name, for the message).

The config reads the surrogates' declarations without torch (``fgrpo --help`` and a bad key end
before it is imported): a surrogate's module imports torch inside its call.
"""
from __future__ import annotations

import dataclasses
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


def surrogate_sections() -> dict:
    """``{name: class}`` of the registered surrogates that have parameters (a dataclass with
    fields), in name order: the sections ``fgrpo.loss`` nests."""
    classes = {name: surrogate_class(name) for name in sorted(surrogates())}
    return {name: cls for name, cls in classes.items()
            if dataclasses.is_dataclass(cls) and dataclasses.fields(cls)}


def from_config(loss):
    """The surrogate ``loss.surrogate`` names, with its parameters: its section of the
    ``fgrpo.loss`` section ``loss``, or the class's object where it has none."""
    section = getattr(loss, loss.surrogate, None)
    return section if section is not None else surrogate_class(loss.surrogate)()
