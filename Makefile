# relaytrain: `make demo` trains the embedded default, `make test` runs the tests.
# Both create .venv in the checkout when it is missing and install the project into it.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Reproducible CPU installs pin torch (a CPU build of 2.13.0); override for CUDA machines:
#   make test TORCH_SPEC='torch==2.13.0'  (from an index with CUDA wheels)
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=
# The suites run on this many pytest workers (pytest-xdist), a file's tests on one worker so that
# its module and session fixtures (the conformance matrix's cells) are made once. Measured on a
# 2-core VM: 2 workers 469 s, 3 workers 527 s, 1 (PYTEST_WORKERS=0, in this process) 846 s
# (2026-11-26); 2 workers 482 s, 3 workers 501 s (2026-11-29, docs/design.md).
PYTEST_WORKERS ?= 2
XDIST = $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --dist loadfile)

.PHONY: demo test test-slow test-gpu bench bench-compare lint install clean gpu-wheels gpu-install bench-gpu

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# An editable install of relaytrain. setuptools prints a notice that it serves the package through
# an import finder, which it must: configs/ is mapped into the package (pyproject.toml), so a plain
# .pth cannot. It is by design and says nothing to act on, so the install output stays clean.
EDITABLE = PYTHONWARNINGS="ignore:Editable installation" $(BIN)/python -m pip install --quiet -e

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(EDITABLE) .
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(EDITABLE) ".[dev]"
	touch $@

# The `fast` extra (DeepSpeed's cpu_adam op, built with ninja on first use) and the `lowbit` one
# (torchao, optim.state_bits): the slow step runs their tests. Not in dev: where torchao is
# installed, transformers imports it in every process that builds a model (1.3 s each here).
$(VENV)/.installed-fast: $(VENV)/.installed-dev
	$(EDITABLE) ".[fast,lowbit]"
	touch $@

# The `mlflow` and `wandb` extras (log.mlflow, log.wandb): the slow step's tests read their runs back.
# Not in dev: ~100 s to install on a 2-core VM, MLflow ~5 s to import.
$(VENV)/.installed-trackers: $(VENV)/.installed-dev
	$(EDITABLE) ".[mlflow,wandb]"
	touch $@

$(VENV)/.installed-bench: $(VENV)/.installed
	$(EDITABLE) ".[bench]"
	touch $@

install: $(VENV)/.installed

demo: $(VENV)/.installed
	$(BIN)/relaytrain train

test: $(VENV)/.installed-dev
	$(BIN)/python -m pytest -q $(XDIST) $(PYTEST_ARGS)

# Longer end-to-end checks (multi-step sweeps, wheel install, many-block memory bounds, the
# DeepSpeed kernel against torch's, runs logged to MLflow and W&B).
test-slow: $(VENV)/.installed-fast $(VENV)/.installed-trackers
	$(BIN)/python -m pytest -q -m "slow or extras" $(XDIST) $(PYTEST_ARGS) || [ $$? -eq 5 ]

# GPU acceptance run (docs/benchmarks.md, "GPU acceptance run"). Here, online: `make gpu-wheels`
# gathers into .whl/ what the GPU machine lacks. There, offline, in one command each:
# `make gpu-install test-gpu` and `make gpu-install bench-gpu`. gpu-install uses that machine's
# own interpreter (GPU_PY, which holds its CUDA torch) and installs into GPU_SITE with --target:
# no venv, no TORCH_SPEC, no index. Its python3 is itself a venv, where --user would be ignored.
GPU_PY ?= python3
GPU_SITE ?= /tmp/relaytrain-gpu-site
GPU_WHEELS ?= .whl
BENCH_GPU_OUT ?= bench_gpu.json
BENCH_GPU_ARGS ?=
# The interpreter test-gpu and bench-gpu run: the checkout's venv where there is one or where
# gpu-install has not run (CPU machines, CI), else GPU_PY over GPU_SITE (the GPU machine: .venv
# is ignored by git, so it never travels there). An existing venv is asked about CUDA before
# anything is installed into it, so a CPU machine only prints that it has no GPU.
GPU_PYTHON = if [ -x $(BIN)/python ] || [ ! -d $(GPU_SITE)/relaytrain ]; then \
	  [ -x $(BIN)/python ] || $(MAKE) --no-print-directory -s $(VENV)/.installed-dev || exit; \
	  py=$(BIN)/python; venv=1; \
	else py="env PYTHONPATH=$(GPU_SITE)$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PY)"; venv=; fi
# Exit 3 with one line where torch sees no CUDA device: the target then reports it and passes.
NO_CUDA = import sys, torch; ok = torch.cuda.is_available(); \
	ok or print(f"{sys.argv[1]}: no CUDA device visible to torch {torch.__version__} here; nothing run"); \
	sys.exit(0 if ok else 3)

test-gpu:
	@$(GPU_PYTHON); $$py -c '$(NO_CUDA)' $@; rc=$$?; [ $$rc -eq 3 ] && exit 0; [ $$rc -eq 0 ] || exit $$rc; \
	[ -z "$$venv" ] || $(MAKE) --no-print-directory -s $(VENV)/.installed-dev || exit; \
	$$py -m pytest -q -m gpu $(PYTEST_ARGS)

# GPU_WHEELS_ARGS=--with-deepspeed also carries DeepSpeed and accelerate (bench_gpu.py's ZeRO-3
# offload contestant), at the versions the fast and dev extras install here.
GPU_WHEELS_ARGS ?=
gpu-wheels: $(VENV)/.installed $(if $(findstring --with-deepspeed,$(GPU_WHEELS_ARGS)),$(VENV)/.installed-fast)
	$(BIN)/python scripts/gpu_wheels.py $(GPU_WHEELS) $(GPU_WHEELS_ARGS)

gpu-install:
	$(GPU_PY) scripts/gpu_wheels.py --check $(GPU_WHEELS)
	$(GPU_PY) -m pip install --quiet --disable-pip-version-check --no-index --no-deps --no-compile \
	  --no-cache-dir --upgrade --target $(GPU_SITE) $(GPU_WHEELS)/*.whl
	PYTHONPATH=$(GPU_SITE) $(GPU_PY) scripts/gpu_wheels.py --verify

bench-gpu:
	@$(GPU_PYTHON); $$py scripts/bench_gpu.py --out $(BENCH_GPU_OUT) $(BENCH_GPU_ARGS)

bench: $(VENV)/.installed-bench
	$(BIN)/python scripts/bench.py

# The same benchmarks from BASE (a commit) and from this checkout, alternating, and each headline's
# ratio HEAD/BASE: make bench-compare BASE=2788acc [ONLY=data_parallel,axonn] [ROUNDS=2]
BASE ?=
ONLY ?=
ROUNDS ?= 2
bench-compare: $(VENV)/.installed-bench
	@[ -n "$(BASE)" ] || { echo "bench-compare: name the commit to compare against, e.g. make bench-compare BASE=2788acc"; exit 2; }
	$(BIN)/python scripts/bench_compare.py --base $(BASE) --rounds $(ROUNDS) $(if $(ONLY),--only $(ONLY))

lint: $(VENV)/.installed-dev
	$(BIN)/ruff check src tests scripts

clean:
	rm -rf $(VENV) build dist src/*.egg-info outputs multirun .pytest_cache
