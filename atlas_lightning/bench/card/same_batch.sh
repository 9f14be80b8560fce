# The update benchmark on the batch a step of `fit` trained on (update_bench --batch-from): the same
# sequences, epochs, mini-batches, budget and model keys, planned for the free memory that `fit`'s
# own plan found (read from the run's run.json, else the step's log), so the benchmark's MFU and
# the step's update_actor MFU are figures of the same work; with vLLM's platform imported first, as
# in fit's process (--beside-vllm). $1 = the step's log, $2 = its step folder
# (<paths.root>/artifacts/<name>/train/step_N), $3 = a tag for the output files, then update_bench
# options (--models, --layers, --deadline-s, ...). Needs setup.sh's environment.
source atlas_lightning/bench/card/env.sh
log=$1; folder=$2; tag=$3; shift 3
# the free memory auto's choice measured, as the run recorded it (run.json beside train/: each
# rank's "recompute"); else fit's line "model.checkpoint_layers=auto: ... = F GiB free of a C GiB card"
free=$(python3 -c "import json, sys; ranks = json.load(open(sys.argv[1]))['hosts']['ranks']; \
print(min(r['recompute']['free_gib'] for r in ranks if 'recompute' in r))" "$(dirname "$(dirname "$folder")")/run.json" 2>/dev/null)
[ -n "$free" ] || free=$(grep -m1 -o "= [0-9.]* GiB free of a" "$log" | grep -o "[0-9.]*" | head -1)
echo "fit's plan was made for ${free:-?} GiB free"
python3 -m atlas_lightning.bench.update_bench --sweep-layers 0 --sections peak,batch,profile --paths ours \
  --beside-vllm --batch-repeats 2 --batch-cap-gib "${free:-0}" --batch-from "$folder" --out $OUT/same-batch-$tag.json "$@" \
  > $OUT/same-batch-$tag.log 2>&1
echo "exit $?"
grep -E "batch ours|plan|Error|error:" $OUT/same-batch-$tag.log | cut -c1-300 | tail -12
