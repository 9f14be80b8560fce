#!/usr/bin/env bash
# ATLAS report 28 memory check, asynchronous: 6 cards train (uneven FSDP2 shards), 2 serve one TP2 engine.
#
#   launch/r28-continued-cost-8gpu-t98304-separate6-2-memory.sh [hydra overrides...]
#
# Training rank 0 starts one vLLM server (TP2) on cards 6-7; merged weights reach it in 512 MB buckets
# through vLLM's weight-transfer API (nccl). Merged weights are exact at FSDP2 world size 6 with uneven
# shards (tests/scale/test_merged_weights_world_sizes.py), so the reference's NaN entropies do not recur.
# 98,304 tokens a card need H200s (plan refuses them on 80 GB cards).
# Plan and pre-flight first (seconds; nothing starts if they fail), then
# `atlas-lightning memory-check experiment=r28-continued-cost-8gpu-t98304-separate6-2-memory`; the log goes to logs/r28-continued-cost-8gpu-t98304-separate6-2-memory-<UTC time>.log.
# launch/common.sh lists the launcher variables; launch/slurm.sbatch runs it on several nodes.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
ATLAS_GPUS_WANTED=8 atlas_launch r28-continued-cost-8gpu-t98304-separate6-2-memory memory-check "$@"
