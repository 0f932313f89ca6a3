"""Decoding backends: the one interface every decoding call goes through, and
``model.engine=auto``.

Methods, evaluation and the job loop hold a :class:`DecodeBackend` (a job's ``Job.decoder``,
built once by :func:`make_backend`) and call only :meth:`DecodeBackend.decode` and its phase
methods. A backend is one file plus one line in the plain-dict registry
:data:`hpc.engine.config.BACKENDS`, whose names ``model.engine`` takes; the registry holds
import strings, so naming a backend imports nothing (this module loads without torch).

``BACKENDS`` is also the order ``auto`` prefers: the first installed backend that runs the
model's ``config.json`` (:meth:`DecodeBackend.refuses`) decodes the job.
"""
from __future__ import annotations

import json
import os
from abc import ABC, abstractmethod
from typing import ClassVar

from hpc.engine.config import BACKENDS, EngineConfig
from hpc.runtime.errors import UserError
from hpc.runtime.methods import load_ref

# The backends that hold, from their start, their whole memory budget as a KV pool and a copy
# of the base weights of their own (vLLM): what the memory plan charges them
# (hpc/plan/terms.py, which reads this without importing torch)
OWN_WEIGHTS_AND_POOL = ("vllm",)

class DecodeBackend(ABC):
    """What decodes a job's completions (a job holds one, ``Job.decoder``).

    Subclasses set :attr:`name` and implement :meth:`decode`; the phase methods default to
    holding nothing between calls. The base counts decoded tokens and keeps why the backend's
    fast path (CUDA graphs) went off, for the job loop to share between ranks."""

    name: ClassVar[str] = ""
    package: ClassVar[str] = ""  # the distribution whose version the run file records
    quantize_modes: ClassVar[tuple] = ("none", "int8", "int4")  # model.quantize it decodes

    def __init__(self, config: EngineConfig | None = None):
        self.config = config or EngineConfig(backend=self.name)
        self.graph_failure = ""  # why the fast path (CUDA graphs) is off ('' while it is on)
        self._tokens = 0  # completion tokens decoded since the last take_generated_tokens

    @classmethod
    def installed(cls) -> bool:
        """Whether this backend can run in this environment (its package imports)."""
        return True

    @classmethod
    def version(cls) -> str:
        """``<package> <version>`` of what decodes (recorded in the run file)."""
        from importlib.metadata import version
        return f"{cls.package} {version(cls.package)}"

    @classmethod
    def refuses(cls, config: dict, max_len: int) -> str:
        """'' when this backend decodes the model of ``config`` (its ``config.json``) for rows of
        up to ``max_len`` tokens; else one line saying why and which backend does."""
        return ""

    @abstractmethod
    def decode(self, model, requests: list, eos: list, sampling, rows: int,
               members: dict | None = None) -> list:
        """Each :class:`hpc.engine.scheduler.Request`'s new token ids, in request order, through
        its first token of ``eos`` (included) if any.

        ``sampling``: None for greedy, else a :class:`hpc.models.sampling.Sampling`, keyed by
        (seed, ``request.prompt_index``, ``request.sample_index``) so a sample does not depend
        on its batch or the rank count. ``rows``: the most rows the caller wants decoding at
        once. ``members``: {name of a peft LoRA layer in ``model``: (A' (k, r, in), B' (k, out,
        r))}: member m's delta ``scaling * B'_m A'_m x`` (the layer's own scaling) in place of
        the adapter's on the rows of ``request.member == m``; None: ``model`` as it is now (its
        peft adapter, if any, with its current weights)."""

    def release(self, above: int = 0) -> bool:
        """Drop what is held between calls (for the engine: an engine of more than ``above``
        slots); True when something went."""
        return False

    def end_phase(self, next_rows: int = 0, next_k: int = 1) -> bool:
        """After a phase that decoded: keep what the next phase (``next_rows`` rows at once,
        ``next_k`` members; 0 rows: none) can reuse, release the rest; True when something
        went."""
        return self.release()

    def close(self) -> None:
        """At the job's end: release everything."""
        self.release()

    def count_tokens(self, completions: list) -> None:
        """Add ``completions`` (token lists) to the decoded-token count."""
        self._tokens += sum(len(c) for c in completions)

    def take_generated_tokens(self) -> int:
        """Completion tokens decoded (eos included, repeated greedy samples counted once) since
        the last call; resets the count."""
        n, self._tokens = self._tokens, 0
        return n

    def disable_graphs(self, reason: str, *, replace: bool = False) -> None:
        """The fast path off for everything decoded from now on; the first reason is kept
        unless ``replace`` (every rank then records the failing rank's reason)."""
        self.graph_failure = reason if replace else (self.graph_failure or reason)


def backend_class(name: str) -> type:
    """The backend class registered as ``name`` (imported now)."""
    if name not in BACKENDS:
        raise ValueError(f"decoding backend {name!r} is not one of {tuple(BACKENDS)}")
    return load_ref(BACKENDS[name])


def make_backend(config: EngineConfig | str | None = None) -> DecodeBackend:
    """A backend for ``config`` (an :class:`EngineConfig` or just a registered name); default
    the package's engine."""
    if not isinstance(config, EngineConfig):
        config = EngineConfig(backend=config or "engine")
    return backend_class(config.backend)(config)


def resolve_backend(name: str, model_folder: str, max_len: int, quantize: str = "none") -> str:
    """The backend that decodes a job: ``name`` itself, checked against the model's
    ``config.json`` in ``model_folder`` and ``model.quantize``, or for ``auto`` the first of
    :data:`BACKENDS` that is installed and runs it. UserError (one line) when the named
    backend refuses the model or is not installed."""
    path = os.path.join(model_folder, "config.json")
    config = None  # a built-in model not built yet: the engine runs every built-in one
    if os.path.isfile(path):
        with open(path) as fh:
            config = json.load(fh)
    names = list(BACKENDS) if name == "auto" else [name]
    for candidate in names:
        cls = backend_class(candidate)
        if not cls.installed():
            if name != "auto":
                raise UserError(f"model.engine={name}: its package ({cls.package}) is not "
                                f"installed here")
            continue
        refusal = cls.refuses(config, max_len) if config is not None else ""
        if quantize not in cls.quantize_modes:
            refusal = f"it does not decode model.quantize={quantize}: use model.engine=engine"
        if not refusal:
            return candidate
        if name != "auto":
            raise UserError(f"model.engine={name}: {refusal}")
    raise UserError(f"model.engine=auto: no installed backend decodes {path}")
