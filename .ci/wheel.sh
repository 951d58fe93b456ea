#!/usr/bin/env bash
# The package as a user installs it: build the sdist and the wheel, install the wheel (not
# editable) into a fresh venv with the CPU build of torch first, as the README says, and use it
# from outside the checkout - the CLI, the planner on a shipped example, and one real eviction
# end to end (examples/actor_group.py: the README's worker and driver lines on a local
# cluster, a SIGTERM, every rank released, the checkpoint committed, the group back warm).
# A module, a data file or an entry point the wheel forgot fails here.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
PYTHON="${PYTHON:-python3}"
TORCH="${TORCH:-torch==2.13.0}"
work=$(mktemp -d /tmp/ray-graceful-wheel-XXXXXX)
trap 'rm -rf "$work"' EXIT

echo "== build: sdist and wheel"
"$PYTHON" -m venv "$work/build-venv"
"$work/build-venv/bin/pip" install --quiet --upgrade pip build
"$work/build-venv/bin/python" -m build --sdist --wheel --outdir "$work/dist" . >"$work/build.log"
version=$("$PYTHON" -c "import ast; print(next(n.value.value for n in ast.parse(open('ray_graceful/__init__.py').read()).body if isinstance(n, ast.Assign) and n.targets[0].id == '__version__'))")
wheel="$work/dist/ray_graceful-$version-py3-none-any.whl"
[ -f "$wheel" ] || { echo "no wheel $wheel: $(ls "$work/dist")"; exit 1; }
[ -f "$work/dist/ray_graceful-$version.tar.gz" ] || { echo "no sdist"; exit 1; }

echo "== the wheel's contents and metadata"
"$PYTHON" - "$wheel" "$repo" "$version" <<'PY'
import pathlib, sys, zipfile
wheel, repo, version = sys.argv[1], pathlib.Path(sys.argv[2]), sys.argv[3]
names = set(zipfile.ZipFile(wheel).namelist())
source = {str(p.relative_to(repo)) for p in (repo / "ray_graceful").rglob("*.py")}
missing = sorted(source - names)
assert not missing, f"modules missing from the wheel: {missing}"
assert "ray_graceful/py.typed" in names, "py.typed is missing: the package is typed"
dist_info = f"ray_graceful-{version}.dist-info"
meta = zipfile.ZipFile(wheel).read(f"{dist_info}/METADATA").decode()
for needed in ("Name: ray-graceful", f"Version: {version}", "Requires-Dist: ray[train]",
               "Requires-Dist: torch", "Requires-Dist: nvidia-ml-py",
               "License-Expression: Apache-2.0", "License-File: LICENSE",
               "Classifier: Typing :: Typed", "Provides-Extra: metrics"):
    assert needed in meta, f"METADATA lacks {needed!r}"
licence = zipfile.ZipFile(wheel).read(f"{dist_info}/licenses/LICENSE").decode()
assert "Apache License" in licence and "Version 2.0" in licence, "the wheel carries no licence"
points = zipfile.ZipFile(wheel).read(f"{dist_info}/entry_points.txt").decode()
assert "ray-graceful = ray_graceful.tools.cli:main" in points, points
print(f"{len(source)} modules, py.typed, metadata and the ray-graceful entry point: present")
PY

echo "== install the wheel into a fresh venv (CPU torch first)"
"$PYTHON" -m venv "$work/venv"
"$work/venv/bin/pip" install --quiet --upgrade pip
"$work/venv/bin/pip" install --quiet "$TORCH"
"$work/venv/bin/pip" install --quiet "$wheel"

echo "== used from outside the checkout"
cd "$work"
export RAY_AUTH_MODE=disabled RAY_TMPDIR="$work/ray"
"$work/venv/bin/python" -c "import ray_graceful, sys; assert '$repo' not in ray_graceful.__file__, ray_graceful.__file__; print('imported from', ray_graceful.__file__)"
"$work/venv/bin/ray-graceful" --version | grep -qx "ray-graceful $version"
"$work/venv/bin/ray-graceful" plan "$repo/examples/scenario.yaml" >"$work/plan.txt"
grep -q "SAVE" "$work/plan.txt" || { cat "$work/plan.txt"; exit 1; }
timeout 300 "$work/venv/bin/python" "$repo/examples/actor_group.py" | tee "$work/eviction.txt"
grep -q "warm restart from step" "$work/eviction.txt"
echo "== the installed wheel: version, planner and a real eviction all passed"
