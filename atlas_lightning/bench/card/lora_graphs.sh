# The hybrid's LoRA step with CUDA graphs through fit_trace: as fit runs it (cuBLAS's workspaces
# kept), then with Lightning's set-up freeing them (the cause of the fault, shown in the tenth attempt).
# $1 = cap s for each; then the variants to run (default: kept cleared; a cold machine's first call
# has room for one); LAYERS as setup.sh built the folder (16 unless set). After setup.sh. bench
# README, "Ninth attempt"; run/accelerator.py.
source atlas_lightning/bench/card/env.sh
cap=$1; shift; variants=${*:-kept cleared}
mkdir -p $C && cp -r .carry/cache/* $C/
for variant in $variants; do
  switch=$([ $variant = cleared ] && echo --lightning-clears-workspaces)
  rm -rf /tmp/runs/lg-$variant
  timeout -s KILL $cap python3 -m atlas_lightning.bench.fit_trace $switch -- --out $OUT/lg-$variant \
    --build qwen3_6_27b --layers ${LAYERS:-16} --model-dir /tmp/qwen3_6_27b --tokenizer-from $C/tiny-model --replay-step 2 -- \
    experiment=h200-8b name=lg-$variant model.path=/tmp/qwen3_6_27b model.linear_attention_kernel=fla \
    rollout.weight_sync=lora rollout.enforce_eager=false paths.root=/tmp/runs/lg-$variant logger.mode=disabled \
    paths.cache=$C trainer.val_every=0 callbacks.validation.val_on_last_step=false \
    rollout.max_tokens_per_turn=512 trainer.total_steps=2 > $OUT/lg-$variant.log 2>&1
  echo "$variant: exit $?"
  grep -E "illegal memory|raised:|RL step [0-9]+:|tokens/s/GPU as NeMo" $OUT/lg-$variant.log | cut -c1-200 | head -8
done
