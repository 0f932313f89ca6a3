"""The per-token policy objectives of F-GRPO, one file each: a surrogate turns the importance
ratio and the advantage of every sampled token into its loss. :data:`SURROGATES` names the
in-tree ones (``fgrpo.loss.surrogate`` chooses one), so adding a surrogate is one file and one
line there; :func:`fgrpo.loss.policy_loss` aggregates what it returns. Another package may add
one through the ``fgrpo.surrogates`` entry-point group (docs/fgrpo.md), read when
:func:`surrogates` is first called; an in-tree name always wins over an entry point's.

A surrogate is a dataclass whose fields are its own parameters, declared with
:func:`hpc.runtime.config.param`: the class is its config section too, nested in the loss's as
``fgrpo.loss.<name>`` (``fgrpo.loss.clip.epsilon``), and the object that section holds is the
one the loss calls: ``surrogate(logp, ratio, adv) -> (per_token, clip_acted, dual)``, logp and
ratio (B, T) (zero at padding), adv (B, 1); per_token (B, T) the loss of each token; clip_acted
(B, T) bool where a clip changed the objective; dual (B, T) bool where a dual clip lowered it.
An optional ``check(key)`` raises :class:`hpc.runtime.errors.UserError` for values that
contradict each other (``key``: the section's name, for the message).

The config reads the surrogates' declarations without torch (``fgrpo --help`` and a bad key end
before it is imported): a surrogate's module imports torch inside its call. fgrpo.config shapes
its ``fgrpo.loss`` section from :func:`surrogates` when it is imported, so a surrogate is
registered before that.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.metadata

from fgrpo.surrogates.cispo import CISPO
from fgrpo.surrogates.clip import Clip

# name -> class of the in-tree surrogates
SURROGATES = {"clip": Clip, "cispo": CISPO}
PLUGIN_GROUP = "fgrpo.surrogates"  # the entry-point group other packages declare theirs in


@functools.cache
def plugins() -> dict[str, importlib.metadata.EntryPoint]:
    """``{name: entry point}`` of the installed packages' ``fgrpo.surrogates`` group."""
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=PLUGIN_GROUP)}


def surrogates() -> dict:
    """``{name: class or entry point}``: :data:`SURROGATES`, then the plug-ins whose names it
    does not hold (a stale or foreign ``clip`` entry point cannot replace the in-tree one)."""
    return SURROGATES | {name: ep for name, ep in plugins().items() if name not in SURROGATES}


def surrogate_class(name: str):
    """The class of surrogate ``name``; ValueError when none has that name."""
    found = surrogates()
    if name not in found:
        raise ValueError(f"surrogate must be one of {tuple(found)}, got {name!r}")
    entry = found[name]
    return entry.load() if isinstance(entry, importlib.metadata.EntryPoint) else entry


def surrogate_sections() -> dict:
    """``{name: class}`` of the surrogates that have parameters (a dataclass with fields), in
    name order: the sections ``fgrpo.loss`` nests."""
    classes = {name: surrogate_class(name) for name in sorted(surrogates())}
    return {name: cls for name, cls in classes.items()
            if dataclasses.is_dataclass(cls) and dataclasses.fields(cls)}


def from_config(loss):
    """The surrogate ``loss.surrogate`` names, with its parameters: its section of the
    ``fgrpo.loss`` section ``loss``, or the class's object where it has none."""
    section = getattr(loss, loss.surrogate, None)
    return section if section is not None else surrogate_class(loss.surrogate)()
