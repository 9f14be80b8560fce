# Which call of the hybrid engine's life faults under CUDA graphs (bench/engine_graphs.py): each
# order in a process of its own, with fla's Triton 3.7.1 first on the path (as fit runs), then the
# image's Triton 3.6 with the trainer's torch kernels. $1 = cap s per process, then overrides.
# Prints the last line each process reached, its exit code and each traceback's frames.
source atlas_lightning/bench/card/env.sh
cap=$1; shift
common="experiment=h200-8b model.path=/tmp/qwen3_6_27b rollout.enforce_eager=false paths.cache=$C paths.root=/tmp/runs/graphs"
try() {  # label, PYTHONPATH, order, extra overrides
  label=$1; path=$2; order=$3; shift 3
  # synchronous launches: the faulting kernel is the one in the traceback (the crash log had none)
  CUDA_LAUNCH_BLOCKING=1 PYTHONPATH=$path timeout -s KILL $cap python3 -m atlas_lightning.bench.engine_graphs --order $order -- \
    $common "$@" > $OUT/graphs-$label.log 2>&1
  echo "$label: exit $? | $(grep '^\[engine_graphs' $OUT/graphs-$label.log | tail -1)"
}
with_fla=$PYTHONPATH
without_fla=${PYTHONPATH#/tmp/site-fla:}
# probe (no sleep first) ran clean on an H100 on 2026-12-06, and an engine alone through sleep,
# wake and the probe did not fault in a standalone reproduction: what fit does while the engine
# sleeps (the trainer's build, its first passes) comes first
try fla-train-between "$with_fla" train-between "$@"
try fla-build-between "$with_fla" build-between "$@"
try fla-sleep-first "$with_fla" sleep-first "$@"
try triton36-train-between "$without_fla" train-between model.linear_attention_kernel=torch "$@"
grep -hE "illegal memory|Error" $OUT/graphs-*.log | cut -c1-200 | sort | uniq -c | head -10
for f in $OUT/graphs-*.log; do echo "== $f"; grep -hB2 -A25 "Traceback" $f | grep -E "File|Error" | tail -12; done
