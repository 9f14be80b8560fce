# Partial rollouts on ONE card through fit: the trainer and a vLLM server share it (layout=separate_one_card,
# the server started first with rollout.gpu_memory_utilization of the card), LoRA sync by folder, the decoupled
# loss; $1 = cap s, then overrides (e.g. model.path=$C/tiny-orchestrator, trainer.total_steps=6). Prints what
# interruption costs, the idle shares, staleness and drops per step (the run export's history.csv).
source atlas_lightning/bench/card/env.sh
cap=$1; shift
R=/tmp/runs/onecard
rm -rf $R
timeout -s KILL $cap python3 -m atlas_lightning.cli fit experiment=h200-tiny name=onecard-partial \
  layout=separate_one_card rollout=vllm_server_gpu layout.partial_rollouts=true algorithm.off_policy_loss=decoupled \
  rollout.weight_sync=lora model.path=$C/tiny-model paths.root=$R paths.cache=$C logger.mode=disabled \
  trainer.total_steps=4 trainer.val_every=0 trainer.val_before_train=false trainer.save_every=0 \
  callbacks.validation.val_on_last_step=false "$@" > $OUT/onecard.log 2>&1
echo "exit $?"
cp $R/runs/onecard-partial/*/history.csv $OUT/onecard-history.csv 2>/dev/null
python3 - $OUT/onecard-history.csv <<'PY'
import csv, re, sys
try:
    rows = list(csv.DictReader(open(sys.argv[1])))
except OSError:
    sys.exit("no history.csv: the run logged no step")
keys = [k for k in rows[0] if re.search(r"reprefill|idle_share|staleness_mean|dropped|^timing_s/(step|rollout|gen)$|"
                                        r"card_used_gib", k)]
print("step " + " ".join(keys))
for row in rows:
    print(row["_step"], " ".join(row[k] or "-" for k in keys))
PY
grep -hE "Error|error:|Available KV|KV cache|gpu_memory_utilization|Free memory|CUDA out of memory" \
  $OUT/onecard.log $R/logs/vllm-server-onecard-partial-separate.log 2>/dev/null | cut -c1-300 | tail -25
