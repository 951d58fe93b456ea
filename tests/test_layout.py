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
