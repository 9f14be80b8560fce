#!/usr/bin/env bash
# One GPU: the tiny orchestrator at the training of record's batch shape (32 x 32), one training rank,
# an in-process vLLM engine asleep during updates (README, "On one H200").
#
#   launch/h200-tiny.sh [hydra overrides...]        (e.g. rollout.weight_sync=merged)
#
# Needs the built assets (make assets: sample data, tiny model, tiny orchestrator) and vLLM for CUDA.
# Plan and pre-flight first (seconds; nothing starts if they fail), then
# `atlas-lightning fit experiment=h200-tiny`; the log goes to logs/h200-tiny-<UTC time>.log.
# `atlas-lightning bench step-suite a` runs it on the H200 with a SIGKILL and a resume in the middle.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
ATLAS_GPUS_WANTED=1 atlas_launch h200-tiny fit "$@"
