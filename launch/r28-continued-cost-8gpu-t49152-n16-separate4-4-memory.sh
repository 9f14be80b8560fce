#!/usr/bin/env bash
# ATLAS report 28 memory check, asynchronous: 4 cards train, 4 serve one TP4 engine, merged weights in 512 MB buckets.
#
#   launch/r28-continued-cost-8gpu-t49152-n16-separate4-4-memory.sh [hydra overrides...]
#
# Training rank 0 starts one vLLM server (TP4) on cards 4-7; merged weights reach it in 512 MB buckets
# through vLLM's weight-transfer API (nccl); rollout k+1 overlaps update k (layout.max_staleness=1).
# Plan and pre-flight first (seconds; nothing starts if they fail), then
# `atlas-lightning memory-check experiment=r28-continued-cost-8gpu-t49152-n16-separate4-4-memory`; the log goes to logs/r28-continued-cost-8gpu-t49152-n16-separate4-4-memory-<UTC time>.log.
# launch/common.sh lists the launcher variables; launch/slurm.sbatch runs it on several nodes.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
ATLAS_GPUS_WANTED=8 atlas_launch r28-continued-cost-8gpu-t49152-n16-separate4-4-memory memory-check "$@"
