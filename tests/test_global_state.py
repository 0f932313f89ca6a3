"""No mutable state at module level in the package: what a job decides (its decoder, budget,
graph switch, token count) lives on objects the job passes, read from the source.

A module holds mutable global state when its code rebinds a module-level name (``global``),
mutates a module-level container (``X[k] = v``, ``X.update(...)``, ``del X[k]``, ``X[k] += 1``,
from its own module or through an import), or stashes state on another object's ``__dict__``.
Constant tables (a dict nobody writes) are not state. The exceptions are process-wide by
nature and named in :data:`ALLOWED` with why."""
import ast

from test_import_graph import _module_files
MUTATORS = {"append", "extend", "insert", "pop", "popitem", "remove", "clear", "update",
            "setdefault", "add", "discard", "sort", "reverse", "__setitem__", "__delitem__"}
CONTAINERS = {"dict", "list", "set", "defaultdict", "OrderedDict", "Counter", "deque"}

# (module, name): why this one piece of state is the process's own
ALLOWED = {
    ("hpc.runtime.world", "_WORLD"): "MPI is initialised once per process; the world wraps "
                                     "its COMM_WORLD",
    ("hpc.runtime.preempt", "_installed"): "signal handlers belong to the process",
    ("hpc.job.run_folder", "_held_lock"): "the run folder's flock is held until the process "
                                         "exits, however it exits",
    ("hpc.models.quantize", "__dict__"): "the quantised generation copy of a training model's "
                                         "linears lives on that model (it is its weights)",
}


def _modules() -> dict:
    """{dotted module name: parsed tree} of every .py file of the packages."""
    modules = {}
    for module, path in _module_files().items():
        with open(path) as fh:
            modules[module] = ast.parse(fh.read(), path)
    return modules


def _containers(tree) -> set:
    """Module-level names bound to a mutable container (a display, a comprehension or a
    container constructor call)."""
    names = set()
    for node in tree.body:
        targets, value = [], None
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        mutable = isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp,
                                     ast.SetComp)) or (
            isinstance(value, ast.Call) and isinstance(value.func, ast.Name)
            and value.func.id in CONTAINERS)
        if mutable:
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


def _imported_names(tree, module: str, containers: dict) -> dict:
    """{local name: (module, name)} of module-level containers this module imports by name,
    and {local name: module} of the package's modules it imports (``from hpc.x import y``)."""
    found = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                local = alias.asname or alias.name
                if alias.name in containers.get(node.module, ()):
                    found[local] = (node.module, alias.name)
                elif f"{node.module}.{alias.name}" in containers:
                    found[local] = (f"{node.module}.{alias.name}", None)
    return found


def _target(expr, module: str, own: set, imported: dict, containers: dict):
    """(module, name) of the module-level container ``expr`` denotes, or None."""
    if isinstance(expr, ast.Name):
        if expr.id in own:
            return module, expr.id
        hit = imported.get(expr.id)
        return hit if hit and hit[1] is not None else None
    if isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name):
        hit = imported.get(expr.value.id)
        if hit and hit[1] is None and expr.attr in containers.get(hit[0], ()):
            return hit[0], expr.attr
    return None


def global_state(modules: dict) -> set:
    """{(module, name, line)} of every write to module-level state (module docstring)."""
    containers = {m: _containers(t) for m, t in modules.items()}
    found = set()
    for module, tree in modules.items():
        own, imported = containers[module], _imported_names(tree, module, containers)

        def hit(expr, line):
            target = _target(expr, module, own, imported, containers)
            if target:
                found.add((target[0], target[1], f"{module}:{line}"))

        for node in ast.walk(tree):
            if isinstance(node, ast.Global):
                found.update((module, n, f"{module}:{node.lineno}") for n in node.names)
            elif isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete, ast.AnnAssign)):
                targets = (node.targets if isinstance(node, (ast.Assign, ast.Delete))
                           else [node.target])
                for t in targets:
                    if isinstance(t, ast.Subscript):
                        hit(t.value, node.lineno)
                        if isinstance(t.value, ast.Attribute) and t.value.attr == "__dict__":
                            found.add((module, "__dict__", f"{module}:{node.lineno}"))
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and node.func.attr in MUTATORS):
                hit(node.func.value, node.lineno)
    return found


def test_the_check_sees_every_kind_of_write():
    source = {
        "pkg.settings": "SETTINGS = {'a': 1}\nCOUNT = dict()\nTABLE = {'x': 2}\n",
        "pkg.user": ("from pkg.settings import SETTINGS\nfrom pkg import settings\n"
                     "_CACHE: dict = {}\nN = 0\n"
                     "def f(model):\n"
                     "    global N\n"
                     "    SETTINGS['a'] = 2\n"
                     "    settings.COUNT.update(x=1)\n"
                     "    _CACHE.setdefault('k', 1)\n"
                     "    del _CACHE['k']\n"
                     "    model.__dict__['_engine'] = 1\n"
                     "    local = {}\n"
                     "    local['k'] = 1\n"
                     "    return settings.TABLE['x']\n"),
    }
    found = {(m, n) for m, n, _ in global_state({m: ast.parse(s) for m, s in source.items()})}
    assert found == {("pkg.user", "N"), ("pkg.settings", "SETTINGS"),
                     ("pkg.settings", "COUNT"), ("pkg.user", "_CACHE"),
                     ("pkg.user", "__dict__")}


def test_no_mutable_module_level_state_outside_the_allowed():
    found = global_state(_modules())
    unexpected = sorted(f"{where}: {module}.{name}" for module, name, where in found
                        if (module, name) not in ALLOWED)
    assert unexpected == [], unexpected
    used = {(module, name) for module, name, _ in found}
    assert set(ALLOWED) <= used, f"allowed but gone: {sorted(set(ALLOWED) - used)}"
