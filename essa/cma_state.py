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
reach both; an array that is a view into another (``es.dC``, the diagonal of ``es.sm.C``) is
restored as the same view (offset, shape, strides, writeable flag) of the restored array:
restored as a copy it would stop following the in-place updates of ``sm.C`` and the run would
drift by ~1e-10 a generation after a resume. An array in Fortran order (``sm.B`` from
``numpy.linalg.eigh``) is restored in Fortran order: BLAS sums a product in another order for
each layout, so a C-ordered copy of ``B`` changes the last bits of every later sample. The
only pycma object created after construction, the wall-clock timer, is rebuilt by its own
constructor. Bitwise resume is tested in tests/test_essa.py and tests/test_faults.py (from
every checkpoint of a 20-generation run).

A checkpoint may be damaged or crafted, so before anything is written every path it names must
be one a strategy of the same constructor arguments has after a generation (no method such as
``tell``, no dunder name, no object), with a value of the same kind and shape, and an alias
must join two arrays of the same shape; anything else is one line (a :class:`UserError`).
"""
from __future__ import annotations

import functools
import inspect
import re
from copy import deepcopy

import numpy as np

from essa.cma_import import cma
from hpc.runtime.errors import UserError

ElapsedWCTime = cma.utilities.utils.ElapsedWCTime

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


def _address(array: np.ndarray) -> int:
    return array.__array_interface__["data"][0]


def es_state(es) -> dict:
    """{"objects": {path: class name}, "values": {path: data}, "aliases": {path: path},
    "ranges": {path: [start, stop, step]}, "views": {path: {"of": path, "offset": bytes,
    "shape": [...], "strides": [...], "writeable": bool}}, "layouts": {path: "F"}} of ``es``;
    a path is the attribute chain below ``es``, e.g. ``"sm.C"``."""
    objects, values, aliases, ranges, views, layouts = {}, {}, {}, {}, {}, {}
    seen_objects, seen_arrays, originals = {id(es)}, {}, {}

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
                    originals[path] = value
                    if value.flags.f_contiguous and not value.flags.c_contiguous:
                        layouts[path] = "F"
                    value = value.copy()  # a snapshot: pycma updates its arrays in place
                else:
                    value = deepcopy(value)  # and arrays in its lists (e.g. ``pop``)
                values[path] = value

    walk(es, "")
    owners = {path: a for path, a in originals.items() if a.base is None and a.size}
    for path, view in originals.items():
        owner = next((p for p, a in owners.items() if view.base is not None and
                      view.dtype == a.dtype and np.shares_memory(view, a)), None)
        if owner is not None:
            del values[path]
            views[path] = {"of": owner, "offset": _address(view) - _address(owners[owner]),
                           "shape": list(view.shape), "strides": list(view.strides),
                           "writeable": bool(view.flags.writeable)}
            layouts.pop(path, None)
    return {"objects": objects, "values": values, "aliases": aliases, "ranges": ranges,
            "views": views, "layouts": layouts}


def _view(owner: np.ndarray, spec: dict) -> np.ndarray:
    """The view ``spec`` (from :func:`es_state`) into ``owner``; ValueError or TypeError if it
    does not lie inside ``owner``."""
    if not (isinstance(spec, dict) and set(spec) == {"of", "offset", "shape", "strides",
                                                      "writeable"} and
            type(spec["offset"]) is int and type(spec["writeable"]) is bool and
            all(isinstance(spec[k], list) and all(type(n) is int for n in spec[k])
                for k in ("shape", "strides"))):
        raise ValueError("not an offset, a shape, strides and a writeable flag")
    if not owner.flags.c_contiguous:
        raise ValueError("the array it views is not contiguous")
    view = np.ndarray(tuple(spec["shape"]), owner.dtype, buffer=owner, offset=spec["offset"],
                      strides=tuple(spec["strides"]))
    view.flags.writeable = spec["writeable"]
    return view


def _references(es) -> list:
    """``es_state`` of ``es`` (freshly built) and of a copy of it after each of two
    generations: the paths a strategy of these constructor arguments has, and the kinds and
    shapes of their values (pycma creates attributes at the first tells, e.g. ``mean_old``,
    ``mean_old_old``, ``pop``, ``timer``, and fills others that start as None or 0-d). The
    global numpy RNG, which pycma's ``ask`` draws from, is left as it was."""
    copy, states = deepcopy(es), [es_state(es)]
    outer = np.random.get_state()
    try:
        for _ in range(2):
            population = copy.ask()
            # fitness of both signs, so that what follows the fitness is of both signs too
            copy.tell(population, [i - len(population) / 2 for i in range(len(population))])
            states.append(es_state(copy))
    finally:
        np.random.set_state(outer)
    return states


_NUMBERS = (type(None), bool, int, float, np.bool_, np.integer, np.floating)


def _same_kind(value, likes: list) -> bool:
    """Whether checkpoint ``value`` may stand where the references hold ``likes``: an array of
    the shape and dtype kind of one of them, a number for a number (None included: pycma
    starts counters and bests as None), a string for a string, a list or tuple (histories
    grow) whose items are each like an item of theirs (plain numbers if they are empty), a
    dict with the keys of one of them and values like its."""
    for like in likes:
        if isinstance(like, np.ndarray):
            # (1,) for (): checkpoints of earlier versions stored 0-d arrays so
            if (isinstance(value, np.ndarray) and value.dtype.kind == like.dtype.kind and
                    (value.shape == like.shape or like.shape == () and value.shape == (1,))):
                return True
        elif isinstance(like, (list, tuple)):
            items = [item for other in likes if type(other) is type(value) for item in other]
            if type(value) is type(like) and all(
                    _same_kind(v, items) if items else isinstance(v, _NUMBERS) for v in value):
                return True
        elif isinstance(like, dict):
            if isinstance(value, dict) and value.keys() == like.keys() and all(
                    _same_kind(value[key], [like[key]]) for key in like):
                return True
        elif isinstance(like, str):
            if isinstance(value, str):
                return True
        elif isinstance(value, _NUMBERS) and isinstance(like, _NUMBERS):
            return True
    return False


def _check(es, state, references: list) -> None:
    """UserError (one line) unless ``state`` restores only paths one of ``references`` has,
    each with a value of the same kind and shape as there; an alias only between arrays of the
    same shape. One exception, for what pycma adds late in a run (e.g. ``_stoptolxstagnation.x``
    of sep-cma after ~250 generations): plain data in an attribute the object does not have
    yet, which its class's own code assigns (``self.<name> = ``) and does not define as a
    method, property or class attribute."""
    def refuse(what: str) -> UserError:
        return UserError(f"CMA-ES checkpoint {what}; it was damaged or written by another "
                         f"version of pycma; refusing to restore it")

    parts = ("objects", "values", "aliases", "ranges", "views", "layouts")
    if isinstance(state, dict):  # checkpoints of earlier versions have neither
        state = {"views": {}, "layouts": {}, **state}
    if not (isinstance(state, dict) and set(state) == set(parts) and
            all(isinstance(state[p], dict) for p in parts)):
        raise refuse(f"is not a dict of {', '.join(parts)}")
    for part in parts:
        for path in state[part]:
            if not isinstance(path, str) or any(n.startswith("__") or not n.isidentifier()
                                                for n in path.split(".")):
                raise refuse(f"names the attribute {path!r}")
    known, objects, ranges = {}, {}, set()  # path -> [values like it], class names, ranges
    for ref in references:
        for path, value in list(ref["values"].items()) + [
                (path, ref["values"][target]) for path, target in ref["aliases"].items()] + [
                (path, _view(ref["values"][spec["of"]], spec))
                for path, spec in ref["views"].items()]:
            known.setdefault(path, []).append(value)
        objects.update(ref["objects"])
        ranges.update(ref["ranges"])
    for path, cls_name in state["objects"].items():
        if objects.get(path) != cls_name:
            raise refuse(f"has a {cls_name} at {path!r}, which a fresh strategy has not")
    for path, value in state["values"].items():
        if not _is_data(value):
            raise refuse(f"value at {path!r} is not plain data")
        if path not in known:
            parent, name = _parent(es, path)
            if hasattr(parent, name) or name not in _assigned_names(type(parent)):
                raise refuse(f"names {path!r}, which a fresh strategy does not have as data")
        elif not _same_kind(value, known[path]):
            raise refuse(f"value at {path!r} is {_describe(value)}, a fresh strategy's "
                         f"{' or '.join(_describe(like) for like in known[path])}")
    for path, value in state["values"].items():
        if path in known:
            why = _out_of_range(path, value, known[path])
            if why:
                raise refuse(f"value at {path!r} {why}")
    for path, target in state["aliases"].items():
        source = state["values"].get(target)
        if not (isinstance(source, np.ndarray) and any(
                isinstance(like, np.ndarray) and like.shape == source.shape
                for like in known.get(path, []))):
            raise refuse(f"aliases {path!r} to {target!r}, which is not an array of its shape")
    for path, spec in state["views"].items():
        owner = state["values"].get(spec.get("of") if isinstance(spec, dict) else None)
        try:
            if not isinstance(owner, np.ndarray):
                raise ValueError("it names no array of the checkpoint")
            view = _view(owner, spec)
        except (ValueError, TypeError) as err:
            raise refuse(f"view at {path!r} is unusable ({err})") from None
        if path in state["values"] or not _same_kind(view, known.get(path, [])):
            raise refuse(f"view at {path!r} is {_describe(view)}, not what a fresh strategy "
                         f"has there")
    for path, layout in state["layouts"].items():
        if layout != "F" or not isinstance(state["values"].get(path), np.ndarray):
            raise refuse(f"layout at {path!r} is {layout!r}, not 'F' for an array")
    for path, bounds in state["ranges"].items():
        if path not in ranges or not (
                isinstance(bounds, list) and len(bounds) == 3 and
                all(type(b) is int for b in bounds)):
            raise refuse(f"range at {path!r} is not one of a fresh strategy or not three "
                         f"integers")


# Set by the constructor arguments alone: must equal the fresh strategy's (``sp``: pycma's
# CMAParameters, learning rates, weights, mu, popsize).
_CONSTANTS = ("N", "sm.dimension", "sigma_vec.dim", "sigma0", "x0", "mean0")
# Float scalars that are never negative: the step-size adaptation's rates, the condition limit.
_NEVER_NEGATIVE = ("adapt_sigma.cs", "adapt_sigma.damps", "sm.condition_limit")


def _numbers(value) -> np.ndarray:
    """The numbers in ``value`` (a number, an array, a list or tuple of numbers) as a float64
    array; an empty one for anything else."""
    if isinstance(value, np.ndarray) and value.dtype.kind in "iuf":
        return value.astype(np.float64).reshape(-1)
    if isinstance(value, (list, tuple)):
        parts = [_numbers(v) for v in value]
        return np.concatenate(parts) if parts else np.zeros(0)
    if isinstance(value, _NUMBERS) and value is not None and not isinstance(value, (bool,
                                                                                 np.bool_)):
        return np.array([float(value)])
    return np.zeros(0)


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _out_of_range(path: str, value, likes: list) -> str | None:
    """Why ``value`` cannot stand at ``path`` where the references hold ``likes`` (None if it
    can): a constant of the constructor arguments changed, a float for an integer (counts,
    sizes), NaN or infinity where no reference has one, a negative integer where every
    reference is >= 0 (counts and sizes; a float statistic such as the step-size path's
    ``adapt_sigma.s`` turns negative in a later generation, so floats are held to the named
    rules only), a step size or
    covariance that is not positive (definite)."""
    if path.startswith("sp.") or path in _CONSTANTS:
        fresh = likes[0]
        same = (np.array_equal(value, fresh) if isinstance(fresh, np.ndarray) else
                type(value) is type(fresh) and (value == fresh or value != value and
                                                fresh != fresh))
        if not same:
            return "differs from what the constructor arguments give"
    if all(_is_int(like) for like in likes if like is not None) and any(
            like is not None for like in likes) and value is not None and not _is_int(value):
        return f"is {value!r}, not an integer"
    numbers = _numbers(value)
    reference = np.concatenate([_numbers(like) for like in likes])
    if not numbers.size or not reference.size:
        return None
    if not np.isfinite(numbers).all() and np.isfinite(reference).all():
        return "holds NaN or infinite values"
    if numbers.size == 1 and (_is_int(value) or path in _NEVER_NEGATIVE) and \
            numbers.min() < 0 <= reference.min():
        return f"holds the negative value {numbers.min()!r}; it is never negative"
    if path == "sigma" and not numbers[0] > 0:
        return "is not a positive step size"
    if path in ("C", "sm.C") and isinstance(value, np.ndarray) and value.ndim == 2:
        scale = np.abs(value).max()  # pycma's updates keep C symmetric to rounding only
        if not (np.abs(value - value.T).max() <= 1e-10 * scale and
                np.linalg.eigvalsh((value + value.T) / 2).min() > 0):
            return "is not a symmetric positive definite covariance matrix"
    if path in ("sm.D", "D", "dC", "sigma_vec.scaling") and not numbers.min() > 0:
        return "holds a value that is not positive"
    return None


@functools.lru_cache(maxsize=None)
def _assigned_names(cls) -> frozenset:
    """Instance attributes the code of ``cls`` and its pycma bases assigns (``self.x = ``),
    less the names they define as methods, properties or class attributes."""
    names = set()
    for klass in cls.__mro__:
        if klass.__module__.split(".")[0] == "cma":
            names.update(re.findall(r"self\.(\w+)\s*=(?!=)", inspect.getsource(klass)))
    return frozenset(name for name in names if not hasattr(cls, name))


def _describe(value) -> str:
    if isinstance(value, np.ndarray):
        return f"a {value.dtype} array of shape {value.shape}"
    return f"a {type(value).__name__}"


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
    """Write ``es_state`` output into ``es``, built with the original constructor arguments.
    Nothing is written unless every entry passes :func:`_check` against ``es``'s own paths."""
    _check(es, state, _references(es))
    for path, cls_name in sorted(state["objects"].items(), key=lambda kv: kv[0].count(".")):
        parent, name = _parent(es, path)
        current = getattr(parent, name, None)
        if current is None and cls_name in _CREATED_AFTER_INIT:
            setattr(parent, name, _CREATED_AFTER_INIT[cls_name]())
        elif type(current).__name__ != cls_name:
            raise UserError(f"CMA-ES checkpoint has a {cls_name} at {path!r}, this pycma a "
                            f"{type(current).__name__}; resume with the pycma that wrote it")
    layouts = state.get("layouts", {})
    for path, value in state["values"].items():
        parent, name = _parent(es, path)
        setattr(parent, name, np.asfortranarray(value) if path in layouts else _plain(value))
    for path, bounds in state["ranges"].items():
        parent, name = _parent(es, path)
        setattr(parent, name, range(*bounds))
    for path, target in state["aliases"].items():
        parent, name = _parent(es, path)
        source, source_name = _parent(es, target)
        setattr(parent, name, getattr(source, source_name))
    for path, spec in state.get("views", {}).items():
        parent, name = _parent(es, path)
        source, source_name = _parent(es, spec["of"])
        setattr(parent, name, _view(getattr(source, source_name), spec))
