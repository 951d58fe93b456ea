"""The package's layout holds: no import circle (``TYPE_CHECKING`` ones included), every module
imports on its own, the coordinator side never needs torch, ``worker/`` and ``coordinator/``
never import each other, no function on the main path is over 60 lines, and no class is over
500."""

from __future__ import annotations

import ast
import os
import pkgutil
import subprocess
import sys

import ray_graceful

PACKAGE = os.path.dirname(ray_graceful.__file__)


def _modules() -> list[str]:
    names = ["ray_graceful"]
    for info in pkgutil.walk_packages([PACKAGE], prefix="ray_graceful."):
        names.append(info.name)
    return names


def _imports(path: str, module: str) -> set[str]:
    """Every ray_graceful module ``path`` names in an import: at the top, in a function, or
    under ``if TYPE_CHECKING:`` alike (a circle hidden there is still one in the design)."""
    with open(path) as f:
        tree = ast.parse(f.read())
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}
    return {name for name in found if name.startswith(("ray_graceful", "benchmarks"))}


HARNESSES = os.path.join(os.path.dirname(PACKAGE), "benchmarks")


def import_circles() -> list[list[str]]:
    """The strongly connected sets of modules (more than one) of the import graph: the package
    and the project's harnesses (``benchmarks/``) together."""
    paths = {}
    for base, _dirs, files in (*os.walk(PACKAGE), *os.walk(HARNESSES)):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(base, name)
                rel = os.path.relpath(path, os.path.dirname(PACKAGE))[:-3].replace(os.sep, ".")
                paths[rel.removesuffix(".__init__")] = path

    def nearest(name: str) -> str:  # "pkg.mod.Name" is the module "pkg.mod"
        while name and name not in paths:
            name = name.rpartition(".")[0]
        return name

    edges = {
        m: {
            t
            for t in map(nearest, _imports(p, m))
            if t and t != m and not m.startswith(t + ".")  # a module's own package: no edge
        }
        for m, p in paths.items()
    }
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in edges[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for module in sorted(edges):
        if module not in index:
            visit(module)
    return circles


def test_no_import_circles_type_checking_ones_included():
    assert not import_circles(), f"import circles: {import_circles()}"


def test_the_package_never_imports_the_harnesses():
    """``benchmarks/`` is not installed: nothing in the package may need it."""
    for base, _dirs, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(base, name)
                found = {n for n in _imports(path, "ray_graceful.x") if n.startswith("benchmarks")}
                assert not found, f"{path} imports {sorted(found)}"


def test_the_circle_check_sees_a_type_checking_circle(tmp_path):
    """The guard can fail: two modules importing each other, one only for type checking."""
    a = tmp_path / "a.py"
    a.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\n")
    assert _imports(str(a), "ray_graceful.x.a") == {"ray_graceful.x.b", "ray_graceful.x.b.B"}


def test_worker_and_coordinator_never_import_each_other():
    for side, other in (("worker", "coordinator"), ("coordinator", "worker")):
        for base, _dirs, files in os.walk(os.path.join(PACKAGE, side)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(base, name)
                    module = "ray_graceful." + os.path.relpath(path, PACKAGE)[:-3].replace(
                        os.sep, "."
                    )
                    crossing = {
                        n for n in _imports(path, module) if n.startswith(f"ray_graceful.{other}")
                    }
                    assert not crossing, f"{path} imports {sorted(crossing)}"


MAIN_PATH_FUNCTION_LINES = 60
NOT_THE_MAIN_PATH = ("tools",)  # the CLI, the demo and the bench harnesses: run by hand


def long_functions(package: str = PACKAGE, limit: int = MAIN_PATH_FUNCTION_LINES) -> dict:
    """Every function on the main path whose body, its docstring not counted, is over
    ``limit`` lines: "module:function" -> lines."""
    over = {}
    for base, _dirs, files in os.walk(package):
        rel_base = os.path.relpath(base, package)
        if rel_base.split(os.sep)[0] in NOT_THE_MAIN_PATH:
            continue
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(base, name)
            with open(path) as f:
                tree = ast.parse(f.read())
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    first = node.body[0]
                    docstring = isinstance(first, ast.Expr) and isinstance(
                        getattr(first, "value", None), ast.Constant
                    )
                    start = first.end_lineno + 1 if docstring else first.lineno
                    lines = node.end_lineno - start + 1
                    if lines > limit:
                        over[f"{os.path.relpath(path, package)}:{node.name}"] = lines
    return over


def test_no_function_on_the_main_path_over_60_lines():
    """A file is cut by concept, not by size (one concept per module); what keeps it readable
    is that each function reads on one screen."""
    over = long_functions()
    assert not over, f"functions over {MAIN_PATH_FUNCTION_LINES} lines: {over}"


def test_the_function_length_check_sees_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(61))
    (tmp_path / "long.py").write_text(f'def f():\n    """Why."""\n{body}\n')
    (tmp_path / "short.py").write_text("def g():\n    return 1\n")
    assert long_functions(str(tmp_path)) == {"long.py:f": 61}


def test_every_module_imports_on_its_own():
    """Each module first in a fresh interpreter state: an import cycle fails one of them.

    Two interpreters, each taking every other module (each import brings the whole package:
    about 0.25 s a module, 25 s in one interpreter on these two cores)."""
    modules = _modules()
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", _import_each(modules[half::2])],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for half in (0, 1)
    ]
    for run in runs:
        out, err = run.communicate(timeout=300)
        assert run.returncode == 0, out + err[-2000:]


def _import_each(names: list[str]) -> str:
    """A script importing each of ``names`` with no module of the package loaded before it."""
    return (
        "import importlib, sys\n"
        "failed = []\n"
        f"for name in {names!r}:\n"
        "    for loaded in [m for m in sys.modules if m.startswith('ray_graceful')]:\n"
        "        del sys.modules[loaded]\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except Exception as exc:\n"
        "        failed.append(f'{name}: {exc!r}')\n"
        "print('\\n'.join(failed))\n"
        "sys.exit(1 if failed else 0)\n"
    )


def test_the_coordinator_side_imports_no_torch():
    """The coordinator actor runs where no GPU or torch is needed; it stays light."""
    script = "import sys, ray_graceful.coordinator; print('torch' in sys.modules)"
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.stdout.strip() == "False", done.stdout + done.stderr


def test_no_class_of_500_lines():
    for base, _dirs, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(base, name)
                with open(path) as f:
                    tree = ast.parse(f.read())
                for node in ast.walk(tree):
                    if isinstance(node, ast.ClassDef):
                        lines = node.end_lineno - node.lineno + 1
                        assert lines < 500, f"{path}: class {node.name} has {lines} lines"


# torch names ray_graceful needs that torch does not document; torch_adapter.py owns them all.
TORCH_PRIVATE = {"_device_types", "_get_backend", "_abort_process_group", "get_group_store"}


def _torch_private_uses(tree: ast.AST) -> list[str]:
    """Private attributes of a torch module alias, and the known private names, in ``tree``."""
    torch_names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            torch_names |= {
                (a.asname or a.name.split(".")[0]) for a in node.names if a.name.startswith("torch")
            }
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
            torch_names |= {a.asname or a.name for a in node.names}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            private = node.attr.startswith("_") and not node.attr.startswith("__")
            on_torch = isinstance(node.value, ast.Name) and node.value.id in torch_names
            if (private and on_torch) or node.attr in TORCH_PRIVATE:
                found.append(f"line {node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Constant) and node.value in TORCH_PRIVATE:
            found.append(f"line {node.lineno}: {node.value!r}")
    return found


def test_torch_private_names_only_in_the_torch_adapter():
    offenders = {}
    for base, _dirs, files in os.walk(PACKAGE):
        for name in files:
            path = os.path.join(base, name)
            if name.endswith(".py") and path != os.path.join(PACKAGE, "torch_adapter.py"):
                with open(path) as f:
                    uses = _torch_private_uses(ast.parse(f.read()))
                if uses:
                    offenders[os.path.relpath(path, PACKAGE)] = uses
    assert not offenders, offenders
    # ... and the check itself sees them where they are.
    with open(os.path.join(PACKAGE, "torch_adapter.py")) as f:
        assert len(_torch_private_uses(ast.parse(f.read()))) >= len(TORCH_PRIVATE)


def test_ray_private_names_only_in_the_ray_adapter():
    """The package, its tools and the tests reach Ray's internals only through ray_adapter."""
    root = os.path.dirname(PACKAGE)
    adapter = os.path.join(PACKAGE, "ray_adapter.py")
    private = ("ray." + "_private", "ray." + "_raylet")  # spelled apart: this file is scanned
    offenders = []
    for top in (PACKAGE, HARNESSES, os.path.join(root, "tests"), os.path.join(root, "examples")):
        for base, _dirs, files in os.walk(top):
            for name in files:
                path = os.path.join(base, name)
                if not name.endswith(".py") or path == adapter:
                    continue
                with open(path) as f:
                    for number, line in enumerate(f, 1):
                        if any(name in line for name in private):
                            offenders.append(f"{os.path.relpath(path, root)}:{number}")
    assert not offenders, offenders


def test_the_version_is_written_once_and_everything_else_reads_it():
    """The example job pinned ray-graceful 0.1.0 under a 0.2.0 driver, and the package said 0.2.0
    while its changelog listed the next release's changes: each now follows
    ``ray_graceful.__version__`` - pyproject.toml reads it, the newest released section of
    the changelog is it, and the example job pins it."""
    import pathlib
    import re
    from importlib.metadata import version

    import yaml

    import ray_graceful

    root = pathlib.Path(__file__).resolve().parents[1]
    ours = ray_graceful.__version__
    assert version("ray-graceful") == ours, "pyproject.toml reads ray_graceful.__version__"
    pyproject = (root / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in pyproject and not re.search(r'(?m)^version = "', pyproject)
    released = re.findall(r"(?m)^## \[(\d+\.\d+\.\d+)\]", (root / "CHANGELOG.md").read_text())
    assert released and released[0] == ours, f"newest released section {released[:1]}, not {ours}"
    job = yaml.safe_load((root / "examples" / "anyscale_job.yaml").read_text())
    pins = [r for r in job["requirements"] if r.startswith("ray-graceful")]
    assert pins == [f"ray-graceful=={ours}"], pins


def test_the_benchmarks_page_keeps_to_its_latest_runs_in_rows_a_reader_can_read():
    """docs/benchmarks.md had grown to 2,269 lines of dated runs, with table rows of over 400
    characters: the current figures and the latest run of each harness stay there, the history
    has a page of its own."""
    import pathlib

    docs = pathlib.Path(__file__).resolve().parents[1] / "docs"
    page = (docs / "benchmarks.md").read_text().splitlines()
    long_rows = [i + 1 for i, line in enumerate(page) if line.startswith("|") and len(line) > 400]
    assert long_rows == [], f"table rows over 400 characters at lines {long_rows}"
    assert len(page) < 1200, f"{len(page)} lines: move the older runs to benchmarks-history.md"
    assert "(benchmarks-history.md)" in "\n".join(page)
    assert (docs / "benchmarks-history.md").exists()
