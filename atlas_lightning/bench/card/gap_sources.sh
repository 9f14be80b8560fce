# `bench gap-sources` on the hybrid folder setup.sh built ($LAYERS layers, 16 unless set): the same
# engine-sampled tokens scored by the engine and by the trainer in bf16 (fla, torch) and float32;
# $1 = cap s, then fit overrides (after the step's: LoRA sync, CUDA graphs); GAP_OPTIONS: the
# benchmark's own options (--requests, --max-tokens, ...); GAP_TAG: a suffix of the output files'
# names (a second run on the same folder, e.g. GAP_TAG=f32head with model.head_dtype=float32)
source atlas_lightning/bench/card/env.sh
cap=$1; shift
L=${LAYERS:-16}${GAP_TAG:+-$GAP_TAG}
timeout -s KILL $cap python3 -m atlas_lightning.bench.gap_sources $GAP_OPTIONS --out $OUT/gap-$L.json --scores $OUT/gap-$L-scores.json -- \
  experiment=h200-8b model.path=/tmp/qwen3_6_27b model.linear_attention_kernel=fla rollout.weight_sync=lora \
  rollout.enforce_eager=false paths.cache=$C logger.mode=disabled "$@" > $OUT/gap-$L.log 2>&1
echo "exit $?"
grep -A16 "^pair" $OUT/gap-$L.log
grep -E "Error|error:|gap_sources" $OUT/gap-$L.log | cut -c1-300 | tail -12
