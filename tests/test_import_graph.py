"""The package's import graph, read from the source (every import statement, function-level
ones included): no module imports itself back through others, essa/ and fgrpo/ never import
each other, and no module imports one on a floor above its own (:data:`FLOORS`)."""
import ast
import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("hpc", "sft", "essa", "fgrpo", "compare")

# The floors of the package, bottom first: a module imports its own floor and those below only.
FLOORS = (
    ("runtime", ("hpc.runtime",)),  # MPI world, dist bootstrap, config, HDF5 store, checkpoints
    ("models", ("hpc.models",)),  # loading, adapters, sampling, quantisation, parallelism
    ("engine", ("hpc.engine",)),  # the decoding engine, its model shape and memory arithmetic
    ("plan", ("hpc.plan",)),  # the memory plan of a job's phases
    ("data", ("hpc.data",)),  # tasks, prompts (chat templates from hpc.models.chat), rewards
    ("toys", ("hpc.toys",)),  # the built-in toy models, built with models and data
    ("job", ("hpc.job",)),  # a job's lifecycle and step loop
    ("methods", ("hpc.evaluate", "hpc.gradient_method", "sft", "essa", "fgrpo")),
    ("commands", ("hpc.commands", "hpc.analysis", "hpc.doctor", "hpc.data.check", "sft.__main__",
                  "essa.__main__", "fgrpo.__main__", "compare")),
)


def _module_files() -> dict:
    """{dotted module name: file path} of every .py file in the packages."""
    modules = {}
    for package in PACKAGES:
        for folder, _, files in os.walk(os.path.join(REPO, package)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    parts = os.path.relpath(path, REPO)[:-3].split(os.sep)
                    modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _imported(module: str, path: str, modules: dict) -> set:
    """The package modules that ``module`` imports anywhere in its file: ``import a.b`` gives
    ``a.b``; ``from a import b`` gives ``a.b`` if that is a module, else ``a``; relative imports
    are resolved against the module's package."""
    is_package = path.endswith("__init__.py")
    found = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = module.split(".")[: len(module.split(".")) - node.level + is_package]
                base = ".".join(parent + ([base] if base else []))
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                     for alias in node.names]
        else:
            continue
        found.update(name for name in names if name in modules)
    found.discard(module)
    return found


def _graph() -> dict:
    modules = _module_files()
    return {name: _imported(name, path, modules) for name, path in modules.items()}


def _cycles(graph: dict) -> list:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(node):
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _reaches(graph: dict, start: str, targets: set) -> list:
    """One import chain from ``start`` to a module in ``targets`` ([] if none)."""
    parent, todo = {start: None}, [start]
    while todo:
        node = todo.pop()
        for nxt in sorted(graph[node]):
            if nxt not in parent:
                parent[nxt] = node
                if nxt in targets:
                    chain = [nxt]
                    while parent[chain[-1]] is not None:
                        chain.append(parent[chain[-1]])
                    return chain[::-1]
                todo.append(nxt)
    return []


def floor(module: str) -> int:
    """Index in :data:`FLOORS` of the floor ``module`` stands on (its longest matching prefix)."""
    if module == "hpc":  # the package's own __init__: imports nothing
        return 0
    best, level = -1, None
    for index, (_, prefixes) in enumerate(FLOORS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, level = len(prefix), index
    assert level is not None, f"{module} stands on no floor: add it to FLOORS"
    return level


def test_the_graph_sees_function_level_and_relative_imports():
    graph = _graph()
    assert "hpc.runtime.atomic" in graph["hpc.toys.cache"]
    assert "hpc.plan.registry" in graph["hpc.commands"]  # inside plan
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle():
    assert _cycles(_graph()) == []


def test_essa_and_fgrpo_never_import_each_other():
    graph = _graph()
    for src, dst in (("essa", "fgrpo"), ("fgrpo", "essa")):
        bad = {m: sorted(t for t in ts if t.split(".")[0] == dst)
               for m, ts in graph.items() if m.split(".")[0] == src}
        assert not any(bad.values()), {m: t for m, t in bad.items() if t}


DISTRIBUTION = "essa-hpc"  # the package's name on disk and in metadata, not the method


def _method_names() -> set:
    """The registered methods' names (setup.py's one ``hpc.methods`` group)."""
    from hpc.runtime.methods import methods

    return set(methods())


def _named_methods(path: str, names: set) -> list:
    """``line: text`` of each string in the code of the file at ``path`` (docstrings aside)
    that holds a method's name as a word, and of each ``cfg.<method>`` reference."""
    source = open(path).read()
    tree = ast.parse(source, path)
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                       ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant)}
    found = [f"{node.lineno}: {node.value[:60]!r}" for node in ast.walk(tree)
             if isinstance(node, ast.Constant) and isinstance(node.value, str)
             and id(node) not in docstrings
             and names & set(re.findall(r"[A-Za-z0-9_]+", node.value.replace(DISTRIBUTION, "")))]
    word = "|".join(sorted(names))
    found += [f"{i}: {line.strip()[:60]}" for i, line in enumerate(source.splitlines(), 1)
              if re.search(rf"cfg\.({word})\b", line)]
    return found


def test_the_method_names_come_from_the_registry():
    assert _method_names() >= {"sft", "essa", "fgrpo"}
    assert _named_methods.__doc__ and _named_methods(__file__, {"fgrpo"})  # this file names it


def test_the_shared_floor_names_no_method():
    """hpc/ imports no method, and spells no method's name in its code: each method registers
    one MethodSpec (hpc/runtime/methods.py, setup.py's hpc.methods) and stands on hpc/, which
    reads whatever it needs of a method from that registry."""
    names = _method_names()
    graph = _graph()
    up = sorted(f"{m} -> {t}" for m, ts in graph.items() if m.split(".")[0] == "hpc"
                for t in ts if t.split(".")[0] in names | {"compare"})
    assert up == [], up
    named = [f"{os.path.relpath(path, REPO)}:{hit}"
             for module, path in sorted(_module_files().items()) if module.startswith("hpc")
             for hit in _named_methods(path, names)]
    assert named == [], "\n".join(named)


def test_every_module_stands_on_a_floor():
    assert floor("essa.__main__") == floor("compare.scaling") == len(FLOORS) - 1
    assert floor("hpc.runtime.world") < floor("hpc.engine.engine_backend") < floor("hpc.job.loop")
    assert floor("essa.trainer") == floor("sft.trainer") == [n for n, _ in FLOORS].index("methods")
    for module in _graph():
        floor(module)


def test_no_import_runs_up_a_floor():
    """Every edge goes to the same floor or below: runtime imports nothing of models, data,
    toys or the job; models nothing of data or toys; nothing below the methods imports one."""
    names = [name for name, _ in FLOORS]
    upward = sorted(f"{src} ({names[floor(src)]}) -> {dst} ({names[floor(dst)]})"
                    for src, targets in _graph().items() for dst in targets
                    if floor(dst) > floor(src))
    assert upward == [], upward


def test_the_preflight_imports_no_method():
    """hpc-doctor reads the methods' config classes through setup.py's entry points only."""
    graph = _graph()
    methods = {m for m in graph if m.split(".")[0] in ("essa", "fgrpo")}
    for module in sorted(m for m in graph if m.startswith("hpc.doctor")):
        assert _reaches(graph, module, methods) == [], module


def test_data_and_models_never_reach_the_toy_builders():
    graph = _graph()
    toys = {m for m in graph if m.startswith("hpc.toys")}
    for module in sorted(graph):
        if module.startswith(("hpc.data", "hpc.models")):
            assert _reaches(graph, module, toys) == [], module


def _module_level_calls(tree: ast.AST, name: str) -> list:
    """The calls to ``name`` (``name(...)`` or ``x.name(...)``) that run when the module is
    imported: those outside every function and class body (a default argument or decorator of
    a top-level def runs at import too, and is counted)."""
    found, todo = [], [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            todo += getattr(node, "decorator_list", []) + node.args.defaults
            todo += [default for default in node.args.kw_defaults if default]
            continue
        if isinstance(node, ast.ClassDef):
            todo += node.decorator_list + node.bases + [k.value for k in node.keywords]
            continue
        if isinstance(node, ast.Call):
            func = node.func
            called = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
            if called == name:
                found.append(node.lineno)
        todo += ast.iter_child_nodes(node)
    return sorted(found)


def test_the_entry_point_check_sees_module_level_calls_only():
    source = ("import importlib.metadata as md\nEPS = md.entry_points(group='g')\n"
              "def f(x=entry_points()):\n    return md.entry_points(group='h')\n"
              "class C:\n    def g(self):\n        entry_points()\n")
    assert _module_level_calls(ast.parse(source), "entry_points") == [2, 3]


def test_no_module_reads_entry_points_at_import():
    """importlib.metadata.entry_points() reads every installed distribution's metadata: at
    module level it runs in each process that imports the module (each rank, each command),
    and makes what the module is depend on what is installed. Read them in a function, when
    they are needed (hpc/plan/registry.py, hpc/models/loading.py)."""
    found = [f"{os.path.relpath(path, REPO)}:{line}: entry_points() at module level"
             for path in sorted(_module_files().values())
             for line in _module_level_calls(ast.parse(open(path).read(), path), "entry_points")]
    assert found == [], "\n".join(found)
