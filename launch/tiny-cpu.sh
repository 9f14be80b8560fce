#!/usr/bin/env bash
# The embedded default: the tiny model, the bundled sample, CPU only, a real vLLM engine, a few steps.
#
#   launch/tiny-cpu.sh [hydra overrides...]
#
# Needs the tiny model and the sample (make assets, or atlas-lightning data tiny-model/sample).
# Plan and pre-flight first (seconds; nothing starts if they fail), then
# `atlas-lightning fit experiment=tiny-cpu`; the log goes to logs/tiny-cpu-<UTC time>.log.
# launch/common.sh lists the launcher variables; launch/slurm.sbatch runs it on several nodes.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
ATLAS_GPUS_WANTED=0 atlas_launch tiny-cpu fit "$@"
