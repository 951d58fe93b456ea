#!/usr/bin/env bash
# The versions pyproject.toml declares, tested: `make test` runs everything on the newest Ray
# (what `pip install` resolves today); this runs the unit tests and a few real end-to-end cluster
# tests - the README's adoption, a teardown through Ray's intended exit, the Ray Train callback
# (and its warm path's fallback where Ray has no replica groups)
# and a warm restart - on the oldest Ray the package accepts, in a venv of its own.
# torch: the CPU build these machines carry (2.13.0) on both; other CPU builds are not on PyPI.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
TORCH="${TORCH:-torch==2.13.0}"
oldest=$("$PYTHON" - <<'PY'
import re, tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
print(next(re.search(r">=([\d.]+)", d).group(1) for d in deps if d.startswith("ray[")))
PY
)
venv="${VERSIONS_VENV:-/tmp/ray-graceful-ray-$oldest}"
echo "== Ray $oldest (the oldest pyproject.toml accepts), $TORCH, in $venv"
rm -rf "$venv"
"$PYTHON" -m venv "$venv"
"$venv/bin/pip" install --quiet --upgrade pip
"$venv/bin/pip" install --quiet "$TORCH"
"$venv/bin/pip" install --quiet "ray[train]==$oldest"
"$venv/bin/pip" install --quiet -e ".[test]"
"$venv/bin/python" -c "import ray, torch; print('ray', ray.__version__, 'torch', torch.__version__)"
"$venv/bin/python" -m pytest -q -p no:cacheprovider -m unit
"$venv/bin/python" -m pytest -q -p no:cacheprovider \
  tests/test_doc_snippets.py \
  "tests/test_worker_teardown.py::test_blocked_rank_exits_zero_fast_with_report" \
  tests/test_train.py \
  "tests/test_train_warm.py::test_without_replica_groups_train_restarts_the_group_from_the_committed_step" \
  "tests/test_warm_restart.py::test_survivors_keep_their_processes_and_a_spare_takes_the_evicted_slot"
