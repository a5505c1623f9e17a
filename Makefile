# relaytrain: `make demo` trains the embedded default, `make test` runs the tests.
# Both create .venv in the checkout when it is missing and install the project into it.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Reproducible CPU installs pin torch (a CPU build of 2.13.0); override for CUDA machines:
#   make test TORCH_SPEC='torch==2.13.0'  (from an index with CUDA wheels)
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: demo test test-slow test-gpu bench lint install clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e .
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $@

$(VENV)/.installed-bench: $(VENV)/.installed
	$(BIN)/python -m pip install --quiet -e ".[bench]"
	touch $@

install: $(VENV)/.installed

demo: $(VENV)/.installed
	$(BIN)/relaytrain train

test: $(VENV)/.installed-dev
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

# Longer end-to-end checks (multi-step sweeps, wheel install, many-block memory bounds).
test-slow: $(VENV)/.installed-dev
	$(BIN)/python -m pytest -q -m slow $(PYTEST_ARGS) || [ $$? -eq 5 ]

test-gpu: $(VENV)/.installed-dev
	$(BIN)/python -m pytest -q -m gpu $(PYTEST_ARGS)

bench: $(VENV)/.installed-bench
	$(BIN)/python scripts/bench.py

lint: $(VENV)/.installed-dev
	$(BIN)/ruff check src tests scripts

clean:
	rm -rf $(VENV) build dist src/*.egg-info outputs multirun .pytest_cache
