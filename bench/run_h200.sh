#!/usr/bin/env bash
# The H200 benchmark of issue 9 (bench/README.md). Run from the repository root on a machine
# with torch + transformers + peft (no hydra, omegaconf, vLLM or network needed).
# Results: $OUT/bench.json (rewritten after every measurement) and $OUT/bench.md.
# Run 1 (bench/results/run1.*) used: --models dense8b,qwen3_6_27b --layers qwen3_6_27b=16
#   --sweep-layers 8 --reps 2 --sweep-reps 1 --deadline-s 390 (and the defaults below).
set -euo pipefail
OUT=${OUT:-bench-out}
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
python3 -m atlas_lightning.bench \
  --models dense8b,qwen3_6_27b --layers qwen3_6_27b=16 \
  --sweep-layers 8 --sweep ours,ours_selective,unfused_lora,flex_attention \
  --tokens 49152 --forward-tokens 98304 --rank 64 --chunk 1024 \
  --reps 2 --sweep-reps 1 --deadline-s "${DEADLINE_S:-480}" \
  --out "$OUT/bench.json" "$@" 2>&1 | tee "$OUT/bench.log"
