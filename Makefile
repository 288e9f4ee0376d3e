# Two entry points, both self-contained on a fresh machine with only Python:
#   make run   -- set up, then run the main job
#   make test  -- set up, then lint and run the test suite (every tier)
#   make test-fast -- set up, then run the unit tier only (tests/unit: pure logic, no launches)
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup run test test-fast lint

setup: $(VENV)/.installed

# The venv sees system site-packages so an existing (e.g. CUDA) torch is reused; only when no
# torch is importable do we install torch==2.13.0, whose CPU wheel lies on these machines (any
# other spec may pull a multi-GB CUDA build).
$(VENV)/.installed: pyproject.toml
	$(PY) -m venv --system-site-packages $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test,report,hf,vlm]'
	touch $@

# A fresh run folder each time: the job refuses to overwrite an earlier run's results.
run: setup
	$(BIN)/raggedfsdp train --out runs/$$(date +%Y%m%d-%H%M%S)

lint: setup
	$(BIN)/python -m ruff check src tests benchmarks experiments tools
	$(BIN)/python -m ruff format --check src tests benchmarks experiments tools
	$(BIN)/lint-imports

# Two workers, each running whole files (their multi-rank grids are module fixtures): on two
# cores the launches' waits (rendezvous, restarts, process start-up) overlap the other worker's
# compute, 13 minutes become under 10. JOBS=0 runs the suite in this process.
JOBS ?= 2
test: lint
	$(BIN)/python -m pytest -q -n $(JOBS) --dist loadfile

test-fast: setup
	$(BIN)/python -m pytest -q tests/unit
