"""The package's import graph, read from the source (every import statement, function-level
ones included): no module imports itself back through others, essa/ and fgrpo/ never import
each other, and the toy builders stand above hpc.data and hpc.models, which never import them."""
import ast
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("hpc", "essa", "fgrpo")


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


def test_the_graph_sees_function_level_and_relative_imports():
    graph = _graph()
    assert "hpc.runtime.atomic" in graph["hpc.toys.cache"]
    assert "essa.config" in graph["hpc.models.memory_plan"]  # inside plan_job_class
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle():
    assert _cycles(_graph()) == []


def test_essa_and_fgrpo_never_import_each_other():
    graph = _graph()
    for src, dst in (("essa", "fgrpo"), ("fgrpo", "essa")):
        bad = {m: sorted(t for t in ts if t.split(".")[0] == dst)
               for m, ts in graph.items() if m.split(".")[0] == src}
        assert not any(bad.values()), {m: t for m, t in bad.items() if t}


def test_data_and_models_never_reach_the_toy_builders():
    graph = _graph()
    toys = {m for m in graph if m.startswith("hpc.toys")}
    for module in sorted(graph):
        if module.startswith(("hpc.data", "hpc.models")):
            assert _reaches(graph, module, toys) == [], module
