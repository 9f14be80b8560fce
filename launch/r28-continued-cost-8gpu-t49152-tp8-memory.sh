#!/usr/bin/env bash
# ATLAS report 28 memory check: 49,152 tokens a card, one TP8 engine; synthetic steps at the full budget, each card's peak per phase.
#
#   launch/r28-continued-cost-8gpu-t49152-tp8-memory.sh [hydra overrides...]
#
# ATLAS_BASE_MODEL=<Qwen3.6-27B folder> ATLAS_DATA_ROOT=<data/r25> (passed as model.path=... data.root=...);
# writes outputs/<run>/memory_check.json.
# Plan and pre-flight first (seconds; nothing starts if they fail), then
# `atlas-lightning memory-check experiment=r28-continued-cost-8gpu-t49152-tp8-memory`; the log goes to logs/r28-continued-cost-8gpu-t49152-tp8-memory-<UTC time>.log.
# launch/common.sh lists the launcher variables; launch/slurm.sbatch runs it on several nodes.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
ATLAS_GPUS_WANTED=8 atlas_launch r28-continued-cost-8gpu-t49152-tp8-memory memory-check "$@"
