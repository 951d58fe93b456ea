# Two commands on a fresh machine (README): `make demo` runs the main job, `make test` the tests
# (every documented path; `make test-long`, which CI adds, the fault rows, soaks and real hosts).
# Both install into .venv first. torch is pinned to the CPU build that these machines carry
# (`pip install torch==2.13.0`); installing it first keeps pip from fetching a CUDA wheel.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0

.PHONY: demo test test-long lint install clean

# ray_graceful/__init__.py: the version is read from it into the installed metadata
$(BIN)/.installed: pyproject.toml ray_graceful/__init__.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH)"
	$(BIN)/pip install --quiet -e ".[test,demo]"
	touch $@

install: $(BIN)/.installed

demo: $(BIN)/.installed
	$(BIN)/ray-graceful demo

# The unit bulk (no Ray cluster) on both cores, then everything that needs the session's one
# Ray cluster, in one process: 2:45 of unit tests took 1:54 this way (2026-11-30).
test: $(BIN)/.installed
	$(BIN)/python -m pytest -q -m "unit and not long" -n 2
	$(BIN)/python -m pytest -q -m "cluster and not long"

# The fault rows, the soaks and the real hosts (network namespaces, root): CI runs them after
# `make test`.
test-long: $(BIN)/.installed
	$(BIN)/python -m pytest -q -m long
	$(BIN)/python -m pytest -q --hosts tests/hosts

lint: $(BIN)/.installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

clean:
	rm -rf $(VENV) demo-output bench-output
