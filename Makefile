# dflash-prep: every target creates the venv it needs.
SHELL := /bin/bash
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
DEMO ?= demo
# CPU wheel on this kind of machine; a user with their own CUDA torch sets TORCH_SPEC= to keep it.
TORCH_SPEC ?= torch==2.13.0
export NUMBA_CACHE_DIR ?= $(CURDIR)/.numba_cache

.PHONY: venv demo test test-slow train bench bench-gpu bench-convergence clean

$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	@if [ -n "$(TORCH_SPEC)" ] && ! $(BIN)/python -c "import torch" 2>/dev/null; then \
		echo "installing $(TORCH_SPEC)"; $(BIN)/pip install -q "$(TORCH_SPEC)"; fi
	$(BIN)/pip install -q -e ".[dev,chat]"
	touch $@

venv: $(BIN)/.installed

test: venv
	$(BIN)/python -m pytest -q -m "not slow and not gpu"

test-slow: venv
	$(BIN)/python -m pytest -q -m "slow"

# GPU benchmarks, <= 5 min each: attention kernels vs SDPA/Flex (results/kernels-bench.*),
# then the trainer's benchmark when train/bench.py exists.
bench-gpu: venv
	$(BIN)/python -m kernels.bench --out results/
	@if $(BIN)/python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('train.bench') is None)"; then \
		$(BIN)/python -m train.bench --gpu; else echo "bench-gpu: train.bench not present, skipped"; fi

clean:
	rm -rf $(DEMO) .pytest_cache .numba_cache
