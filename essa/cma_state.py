"""pycma's CMAEvolutionStrategy as plain data (arrays, numbers, strings), and back, without pickle.

pycma has no state API, and pickling it would let a checkpoint carry code. Instead
:func:`es_state` walks the strategy's attributes and those of the pycma objects it holds
(sampler, step-size adaptation, recombination weights, archives, ...) and keeps every value
that is plain data; :func:`restore_es_state` builds nothing from the file: it writes those
values back into a freshly constructed strategy with the same constructor arguments, whose
objects, functions and options are therefore the program's own. Values that are not plain
data (functions, the option dict, caches keyed by tuples) are the same in the fresh strategy,
since they depend on the constructor arguments only (caches are recomputed). A ``range`` is
kept as its three integers. An array held under two attributes (e.g.
``es.C`` and ``es.sm.C``) is restored as one array, as pickle would, so in-place updates still
reach both. The only pycma object created after construction, the wall-clock timer, is
rebuilt by its own constructor. Bitwise resume is tested in tests/test_essa.py.
"""
from __future__ import annotations

import numpy as np
from cma.utilities.utils import ElapsedWCTime

from hpc.runtime.errors import UserError

_SCALARS = (type(None), bool, int, float, str)
_CREATED_AFTER_INIT = {"ElapsedWCTime": ElapsedWCTime}  # class name -> no-argument constructor


def _is_pycma(obj) -> bool:
    return hasattr(obj, "__dict__") and type(obj).__module__.split(".")[0] == "cma"


def _is_data(value) -> bool:
    if isinstance(value, _SCALARS):
        return True
    if isinstance(value, (np.ndarray, np.generic)):
        return value.dtype.kind in "biuf"
    if isinstance(value, (list, tuple)):
        return all(_is_data(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_data(v) for k, v in value.items())
    return False


def es_state(es) -> dict:
    """{"objects": {path: class name}, "values": {path: data}, "aliases": {path: path},
    "ranges": {path: [start, stop, step]}} of ``es``; a path is the attribute chain below
    ``es``, e.g. ``"sm.C"``."""
    objects, values, aliases, ranges = {}, {}, {}, {}
    seen_objects, seen_arrays = {id(es)}, {}

    def walk(obj, prefix):
        for name, value in vars(obj).items():
            path = prefix + name
            if _is_pycma(value):
                if id(value) not in seen_objects:  # a second path to one object: skipped
                    seen_objects.add(id(value))
                    objects[path] = type(value).__name__
                    walk(value, path + ".")
            elif isinstance(value, range):
                ranges[path] = [value.start, value.stop, value.step]
            elif isinstance(value, np.ndarray) and id(value) in seen_arrays:
                aliases[path] = seen_arrays[id(value)]
            elif _is_data(value):
                if isinstance(value, np.ndarray):
                    seen_arrays[id(value)] = path
                    value = value.copy()  # a snapshot: pycma updates its arrays in place
                values[path] = value

    walk(es, "")
    return {"objects": objects, "values": values, "aliases": aliases, "ranges": ranges}


def _plain(value):
    """A decoded checkpoint value as the plain containers pycma had."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    if isinstance(value, np.ndarray):
        return value.copy()  # the strategy must not share arrays with the state it came from
    return value


def _parent(es, path: str):
    *chain, name = path.split(".")
    obj = es
    for step in chain:
        obj = getattr(obj, step, None)
        if not _is_pycma(obj):
            raise UserError(f"CMA-ES checkpoint names {path!r}, which this pycma "
                            f"({type(es).__module__}) does not have; resume with the pycma "
                            f"version that wrote it")
    return obj, name


def restore_es_state(es, state: dict) -> None:
    """Write ``es_state`` output into ``es``, built with the original constructor arguments."""
    for path, cls_name in sorted(state["objects"].items(), key=lambda kv: kv[0].count(".")):
        parent, name = _parent(es, path)
        current = getattr(parent, name, None)
        if current is None and cls_name in _CREATED_AFTER_INIT:
            setattr(parent, name, _CREATED_AFTER_INIT[cls_name]())
        elif type(current).__name__ != cls_name:
            raise UserError(f"CMA-ES checkpoint has a {cls_name} at {path!r}, this pycma a "
                            f"{type(current).__name__}; resume with the pycma that wrote it")
    for path, value in state["values"].items():
        parent, name = _parent(es, path)
        if _is_pycma(getattr(parent, name, None)) or not _is_data(value):
            raise UserError(f"CMA-ES checkpoint value at {path!r} is not plain data")
        setattr(parent, name, _plain(value))
    for path, bounds in state["ranges"].items():
        parent, name = _parent(es, path)
        if not (isinstance(bounds, list) and len(bounds) == 3 and
                all(type(b) is int for b in bounds)):
            raise UserError(f"CMA-ES checkpoint range at {path!r} is not three integers")
        setattr(parent, name, range(*bounds))
    for path, target in state["aliases"].items():
        parent, name = _parent(es, path)
        source, source_name = _parent(es, target)
        setattr(parent, name, getattr(source, source_name))
