# kvfleet developer entry points. Every target sets up its own virtual environment first
# (idempotent: redone only when pyproject.toml changes or the environment is missing).
#
#   make serve   prepare everything, then start the local stack
#   make test    prepare everything, then lint and run the test suite
#   make lint    ruff + mypy (strict on the pure cores)

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# NOTE: the CPU build of exactly this version lies on the machine's disk; an unpinned torch
# would pull a CUDA build of several GB from the registry.
TORCH_CPU := torch==2.13.0
EXTRAS ?= all,dev
STAMP := $(VENV)/.kvfleet-$(EXTRAS).stamp
PYTEST_ARGS ?=
MODEL ?= smollm2

.PHONY: help venv models serve test lint clean

help:
	@echo "make serve   prepare the environment and the model, then start the local stack"
	@echo "make test    prepare the environment and the model, then lint and run the tests"
	@echo "make lint    ruff and mypy"
	@echo "make clean   remove $(VENV) and build leftovers (the model cache stays)"

venv: $(STAMP)

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || \
		{ echo "kvfleet needs Python >= 3.11; $(PYTHON) is $$($(PYTHON) -V 2>&1)"; exit 1; }
	@if [ ! -x $(BIN)/python ]; then echo "==> creating $(VENV)"; $(PYTHON) -m venv $(VENV); fi
	@echo "==> upgrading pip and setuptools"
	@$(BIN)/python -m pip install -q --upgrade pip "setuptools>=68"
	@if nvidia-smi -L >/dev/null 2>&1; then \
		echo "==> CUDA GPU found: torch comes from the registry with the engine extra"; \
	else \
		echo "==> no CUDA GPU: installing the CPU build $(TORCH_CPU)"; \
		$(BIN)/python -m pip install -q "$(TORCH_CPU)"; \
	fi
	@echo "==> installing kvfleet[$(EXTRAS)] (editable)"
	@$(BIN)/python -m pip install -q -e ".[$(EXTRAS)]"
	@touch $@
	@echo "==> $(VENV) ready: $$($(BIN)/kvfleet --version)"

models: venv
	@$(BIN)/kvfleet models fetch $(MODEL)

serve: venv models
	@$(BIN)/kvfleet serve $(MODEL)

lint: venv
	@echo "==> ruff"
	@$(BIN)/ruff check .
	@$(BIN)/ruff format --check .
	@echo "==> mypy"
	@mkdir -p $(VENV)/mypy-src/kvfleet
	@for c in cli engine gateway operator bench; do ln -sfn "$(CURDIR)/$$c" "$(VENV)/mypy-src/kvfleet/$$c"; done
	@MYPYPATH=$(VENV)/mypy-src $(BIN)/mypy --cache-dir $(VENV)/mypy-cache \
		-p kvfleet.cli -p kvfleet.engine -p kvfleet.gateway -p kvfleet.operator -p kvfleet.bench

# NOTE: pytest exits 5 when it collects no tests; that is not a failure of the suite.
test: venv models lint
	@echo "==> pytest"
	@rc=0; $(BIN)/python -m pytest $(PYTEST_ARGS) || rc=$$?; \
		if [ $$rc -eq 5 ]; then echo "no tests collected"; rc=0; fi; exit $$rc

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache

# Pinned dependency sets of the container images (engine/, gateway/, operator/ Dockerfiles):
# the full resolution of each extra for Python 3.11, kvfleet itself and torch/triton left out.
.PHONY: locks
locks: venv
	@for extra in engine gateway operator; do \
		echo "==> $$extra/requirements.lock"; \
		$(BIN)/python -m pip install -q --dry-run --ignore-installed \
			--report $(VENV)/lock-$$extra.json ".[$$extra]" \
			$$( [ $$extra = engine ] && echo "$(TORCH_CPU)" ); \
		$(BIN)/python .ci/lock_images.py $(VENV)/lock-$$extra.json $$extra > $$extra/requirements.lock; \
	done
