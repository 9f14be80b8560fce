#!/usr/bin/env bash
# ATLAS report 28: the cost reward from the 27B base model (fresh adapters) on two cards, one TP2 engine colocated.
#
#   launch/r28-base-cost-2gpu.sh [hydra overrides...]
#
# ATLAS_BASE_MODEL=<Qwen3.6-27B folder> ATLAS_DATA_ROOT=<data/r25> (passed as model.path=... data.root=...).
# Plan and pre-flight first (seconds; nothing starts if they fail), then
# `atlas-lightning fit experiment=r28-base-cost-2gpu`; the log goes to logs/r28-base-cost-2gpu-<UTC time>.log.
# launch/common.sh lists the launcher variables; launch/slurm.sbatch runs it on several nodes.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
ATLAS_GPUS_WANTED=2 atlas_launch r28-base-cost-2gpu fit "$@"
