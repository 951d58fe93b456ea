"""The package's layout holds: every module imports on its own (no import cycle), the
coordinator side never needs torch, and no class grows past 500 lines."""

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


def test_every_module_imports_on_its_own():
    """Each module first in a fresh interpreter state: an import cycle fails one of them."""
    script = (
        "import importlib, sys\n"
        "failed = []\n"
        f"for name in {_modules()!r}:\n"
        "    for loaded in [m for m in sys.modules if m.startswith('ray_graceful')]:\n"
        "        del sys.modules[loaded]\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except Exception as exc:\n"
        "        failed.append(f'{name}: {exc!r}')\n"
        "print('\\n'.join(failed))\n"
        "sys.exit(1 if failed else 0)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]


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
    for top in (PACKAGE, os.path.join(root, "tests"), os.path.join(root, "examples")):
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
