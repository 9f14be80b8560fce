# the hybrid's step benchmark straight through step.py (step 2 replayed), under a cap; $1 = lora|merged, $2 = cap s;
# LAYERS as setup.sh built the folder (16 unless set)
source atlas_lightning/bench/card/env.sh
sync=$1; cap=$2; shift 2
rm -rf /tmp/runs/h-$sync  # a fresh run each time: fit refuses to start afresh over an earlier one
timeout -s KILL $cap python3 -m atlas_lightning.bench.step --out $OUT/h-$sync --build qwen3_6_27b --layers ${LAYERS:-16} \
  --model-dir /tmp/qwen3_6_27b --tokenizer-from $C/tiny-model --replay-step 2 -- \
  experiment=h200-8b name=h200-27b-$sync model.path=/tmp/qwen3_6_27b model.linear_attention_kernel=fla \
  rollout.weight_sync=$sync paths.root=/tmp/runs/h-$sync logger.mode=disabled paths.cache=$C \
  trainer.val_every=0 callbacks.validation.val_on_last_step=false "$@" > $OUT/h-$sync.log 2>&1
echo "exit $?"
cat $OUT/h-$sync/step_bench.md 2>/dev/null
grep -E "Error|error:|StartingCheck|took .* seconds to fall asleep|Sleep mode freed|Available KV|init engine" $OUT/h-$sync.log | cut -c1-300 | tail -25
# the Gated DeltaNet state's dtype in the engine (rollout.mamba_ssm_cache_dtype), as vLLM took it
grep -o -E "'mamba_ssm_cache_dtype': '[a-z0-9]+'|mamba_ssm_cache_dtype=[a-z0-9]+" $OUT/h-$sync.log | sort | uniq -c | head -3
