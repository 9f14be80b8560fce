#!/usr/bin/env bash
# One GPU: a Qwen3-8B-shaped model at the training of record's token budgets, two RL steps
# (the step benchmark's workload; README, "On one H200").
#
#   ATLAS_8B_PATH=<model folder> launch/h200-8b.sh [hydra overrides...]
#
# The folder holds the model both trainer and engine load: `python -m atlas_lightning.bench.step
# --build dense8b --model-dir DIR --tokenizer-from <tiny-model> --out OUT -- experiment=h200-8b
# model.path=DIR` builds it (random weights) and runs this fit timed phase by phase.
# Plan and pre-flight first (seconds; nothing starts if they fail), then
# `atlas-lightning fit experiment=h200-8b`; the log goes to logs/h200-8b-<UTC time>.log.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
ATLAS_GPUS_WANTED=1 atlas_launch h200-8b fit "$@"
