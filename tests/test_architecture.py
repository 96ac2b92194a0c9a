"""The shape of the package (docs/DESIGN.md), checked by reading its source.

- No import circles: the modules of ``meshpipe`` form a graph without cycles. Every import
  counts, also one inside a function or a module-level ``__getattr__``.
- One import path per name: a function or class is imported from the module that defines
  it (or from its package's ``__init__``, the package's public names), in ``src/``, the tests
  and the benchmarks; no module only hands out names defined elsewhere.
- ``meshpipe.schedules`` is Python and numpy: none of its modules imports torch.
- A module (or benchmark script) longer than ``LONG_MODULE`` lines says in its docstring why
  it is one module.
- What a rank imports to start leaves out what only some runs use, and loads it on use.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

SOURCE = Path(__file__).resolve().parent.parent / "src"
BENCHMARKS = SOURCE.parent / "benchmarks"
LONG_MODULE = 500
LENGTH_REASON = "One module because"


def _modules() -> dict[str, Path]:
    modules = {}
    for path in sorted((SOURCE / "meshpipe").rglob("*.py")):
        parts = list(path.relative_to(SOURCE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _imported(tree: ast.Module, module: str, is_package: bool,
              modules: dict[str, Path]) -> set[str]:
    """The modules ``tree`` imports, resolved (a package's ``__init__`` only where a name
    defined there is imported, not for each of its submodules)."""
    package = module if is_package else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:  # a submodule, else a name defined in ``target``
                names.add(f"{target}.{alias.name}" if f"{target}.{alias.name}" in modules
                          else target)
    return names


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {}
    for module, path in modules.items():
        imported = _imported(ast.parse(path.read_text()), module, path.name == "__init__.py",
                             modules)
        graph[module] = {name for name in imported if name in modules and name != module}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph[node]):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
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


def test_the_package_has_no_import_circles():
    assert _cycles(_graph()) == []


def test_the_circle_finder_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]


def test_the_import_reader_sees_imports_inside_functions_and_module_getattr():
    source = ("def helper():\n    from pkg import b\n"
              "def __getattr__(name):\n    import pkg.c\n    return pkg.c\n")
    modules = {"pkg": Path("pkg/__init__.py"), "pkg.a": Path("pkg/a.py"),
               "pkg.b": Path("pkg/b.py"), "pkg.c": Path("pkg/c.py")}
    assert _imported(ast.parse(source), "pkg.a", False, modules) == {"pkg.b", "pkg.c"}


def _meshpipe_imports(path: Path) -> list[tuple[int, str, str]]:
    """``(line, module, name)`` of every ``from meshpipe... import name`` in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and not node.level and node.module and (
                node.module == "meshpipe" or node.module.startswith("meshpipe.")):
            found.extend((node.lineno, node.module, alias.name) for alias in node.names)
    return found


def _second_paths(files: list[Path]) -> list[str]:
    """Imports of a function or class from a module (not a package) that did not define it."""
    found = []
    for path in files:
        for line, module_name, name in _meshpipe_imports(path):
            module = importlib.import_module(module_name)
            value = getattr(module, name, None)
            if hasattr(module, "__path__") or not (inspect.isclass(value)
                                                   or inspect.isfunction(value)):
                continue
            if value.__module__ != module_name:
                found.append(f"{path}:{line}: {name} from "
                             f"{module_name}, defined in {value.__module__}")
    return found


def test_every_name_is_imported_from_the_module_that_defines_it():
    pytest.importorskip("transformers")  # meshpipe.models.hf imports it
    files = [path for folder in (SOURCE, SOURCE.parent / "tests", BENCHMARKS)
             for path in sorted(folder.rglob("*.py"))]
    assert _second_paths(files) == []


def test_the_second_path_finder_finds_a_name_imported_through_another_module(tmp_path):
    script = tmp_path / "uses.py"
    script.write_text("from meshpipe.comm.errors import P2PError\n"
                      "from meshpipe.comm.p2p import P2PError, P2PTransport\n")
    assert _second_paths([script]) == [
        f"{script}:2: P2PError from meshpipe.comm.p2p, defined in meshpipe.comm.errors"]


def _only_hands_out_names(tree: ast.Module) -> bool:
    """Whether a module's body is imports (and ``__all__``) and nothing it defines."""
    statements = [node for node in tree.body if not (
        isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))]
    defines = [node for node in statements if not isinstance(node, (ast.Import, ast.ImportFrom))
               and not (isinstance(node, ast.Assign)
                        and [getattr(t, "id", None) for t in node.targets] == ["__all__"])]
    return bool(statements) and not defines


def test_no_module_only_hands_out_names_defined_elsewhere():
    """Such a module is a second path to every name it holds (a package's ``__init__`` is
    its public names)."""
    assert [module for module, path in _modules().items() if path.name != "__init__.py"
            and _only_hands_out_names(ast.parse(path.read_text()))] == []


def test_a_module_of_imports_only_is_found():
    assert _only_hands_out_names(ast.parse(
        '"""Moved."""\nfrom a.b import c, d\n__all__ = ["c", "d"]\n'))
    assert not _only_hands_out_names(ast.parse("from a.b import c\n\ndef e():\n    return c\n"))


def test_schedules_import_no_torch():
    offenders = {}
    modules = _modules()
    for module, path in modules.items():
        if module.startswith("meshpipe.schedules"):
            imported = _imported(ast.parse(path.read_text()), module,
                                 path.name == "__init__.py", modules)
            torch = sorted(name for name in imported if name.split(".")[0] == "torch")
            if torch:
                offenders[module] = torch
    assert offenders == {}


def test_every_long_module_says_why_it_is_one():
    """Also every benchmark script and piece (no benchmark outgrows the code it measures)."""
    unexplained = {}
    benchmarks = {f"benchmarks/{path.name}": path for path in sorted(BENCHMARKS.glob("*.py"))}
    for module, path in {**_modules(), **benchmarks}.items():
        text = path.read_text()
        lines = len(text.splitlines())
        if lines > LONG_MODULE and LENGTH_REASON not in (ast.get_docstring(ast.parse(text))
                                                         or ""):
            unexplained[module] = lines
    assert unexplained == {}, (
        f"split these modules, or say in the docstring why each is one ('{LENGTH_REASON} "
        f"...'): {unexplained}")


DEFERRED = {"torch._dynamo": "imported by --compile only: 1.5 s",
            "torch.distributed.checkpoint": "imported at the first save or load: 1 s"}


@pytest.mark.distributed
def test_a_ranks_start_leaves_out_compile_and_checkpoints():
    """The graph-break marks cost nothing until --compile, and checkpoints nothing until a
    save or a load: each import would add its seconds (``DEFERRED``) to every rank's start."""
    probe = ("import sys, meshpipe.cli, meshpipe.train.loop.trainer, "
             "meshpipe.train.supervisor.launch, "
             f"meshpipe.models.hf; print([m for m in {sorted(DEFERRED)!r} if m in sys.modules])")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          check=True)
    assert done.stdout.strip() == "[]"


def test_no_script_or_test_module_shadows_the_standard_library():
    """benchmarks/ and tests/ are first on the path of what runs there: a tokenize.py beside
    a benchmark broke every other benchmark (torch imports inspect, which imports tokenize)."""
    root = SOURCE.parent
    shadowing = sorted(str(path.relative_to(root)) for folder in ("benchmarks", "tests")
                       for path in (root / folder).rglob("*.py")
                       if path.stem in sys.stdlib_module_names)
    assert shadowing == []
