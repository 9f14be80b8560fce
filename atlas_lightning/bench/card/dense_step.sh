# The 8B shape's step through `fit` (the suite's `b` stage: two steps, CUDA graphs in the engine, a
# checkpoint every step, validation riding in generation), then the update benchmark on its last
# step's batch (same_batch.sh): the two actor updates side by side. $1 = lora|merged (the sync),
# $2 = this script's cap in s (the step gets all but 100 s, the replay the rest: it took 71 s in
# run 12), then more `fit` overrides. After `NO_HYBRID_FOLDER=1 setup.sh` (README.md here).
source atlas_lightning/bench/card/env.sh
sync=$1; cap=$2; shift 2
start=$(date +%s); step_cap=$((cap - 100))
rm -rf /tmp/runs/b
timeout -s KILL $((step_cap + 10)) python3 -m atlas_lightning.bench.step_suite b --out $OUT/suite --b-s $step_cap \
  --b-extra "trainer.total_steps=2 rollout.enforce_eager=false trainer.save_every=1 callbacks.validation.overlap=true rollout.weight_sync=$sync $*"
echo "step suite exit $?"
folder=$(ls -d /tmp/runs/b/artifacts/h200-8b/train/step_* 2>/dev/null | sort -V | tail -1)
[ -n "$folder" ] && bash atlas_lightning/bench/card/same_batch.sh $OUT/suite/b.log "$folder" dense --models dense8b \
  --deadline-s $((cap - 10 - $(date +%s) + start))
grep -h "micro-step\|matmul rate\|^## RL\|update_actor\|attention ran" $OUT/suite/b/step_bench.md 2>/dev/null
