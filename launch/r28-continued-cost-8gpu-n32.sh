#!/usr/bin/env bash
# ATLAS report 28, the training of record: continued from r25-base-2gpu's global_step_29 (both adapters), 8 cards synchronous, two TP4 engines colocated, 32 x 32 a step, 40 steps, 49,152 tokens a card.
#
#   launch/r28-continued-cost-8gpu-n32.sh [hydra overrides...]
#
# ATLAS_BASE_MODEL=<Qwen3.6-27B folder> ATLAS_DATA_ROOT=<data/r25>
# ATLAS_INIT_FROM=<.../checkpoints/r25-base-2gpu/global_step_29> (its actor/ and critic/lora_adapter),
# passed as model.path=, data.root=, trainer.init_from= (default: <paths.root>/checkpoints/r25-base-2gpu/global_step_29).
# Plan and pre-flight first (seconds; nothing starts if they fail), then
# `atlas-lightning fit experiment=r28-continued-cost-8gpu-n32`; the log goes to logs/r28-continued-cost-8gpu-n32-<UTC time>.log.
# launch/common.sh lists the launcher variables; launch/slurm.sbatch runs it on several nodes.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
ATLAS_GPUS_WANTED=8 atlas_launch r28-continued-cost-8gpu-n32 fit "$@"
