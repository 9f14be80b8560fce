#!/usr/bin/env bash
# The whole RL step on one H200 (README, "On one H200"): `atlas-lightning fit` through the CLI
# with FSDP2 at world 1 and an in-process vLLM engine that sleeps through each update.
#
#   bench/run_h200_step.sh STAGE [STAGE ...]        (from the repository root, on the card)
#
# Stages, each under its own time cap (seconds: A_S, KR_S, MERGED_S, B_S); a failed stage never stops
# the next, and every stage writes what it measured to $OUT as it goes:
#   a       fit experiment=h200-tiny (LoRA sync, 32 x 32 a step, validation at 0, 5, 10); SIGKILL
#           once the step-5 checkpoint is complete, then `trainer.resume=auto` to step 10; the
#           learning figure (validation objective 10 vs 0, paired by question) -> a.json, a.log
#   kr      merged sync (sleep level 2) at a smaller batch (KR_N samples a question): SIGKILL after the
#           step-1 checkpoint, resume to step 2 -> kr.json, kr.log
#   merged  the same with rollout.weight_sync=merged (sleep level 2), 2 steps, through the step
#           benchmark (its plain-vLLM comparison included) -> merged/step_bench.*, merged.log
#   b       the step benchmark on a Qwen3-8B-shaped model built on the card (experiment=h200-8b)
#           -> b/step_bench.json, b/step_bench.md, b.log (B_EXTRA: more overrides, e.g. trainer.total_steps=1)
#
# Needs on the card: vLLM 0.26.0 and its dependencies on PYTHONPATH (.device-wheels/install.sh),
# hydra-core, omegaconf and antlr4 (pure Python; HYDRA_SITE), the built assets under CACHE
# (sample-data, tiny-model, tiny-orchestrator). No W&B (logger.mode=disabled). EXTRA: overrides
# appended to every fit (a CPU dry run of the stages: EXTRA="trainer.accelerator=cpu ...").
set -u
OUT=${OUT:-/tmp/out}
CACHE=${CACHE:-$HOME/.cache/atlas-lightning}
RUNS=${RUNS:-/tmp/runs}
A_S=${A_S:-480}
KR_S=${KR_S:-240}
MERGED_S=${MERGED_S:-240}
B_S=${B_S:-540}
mkdir -p "$OUT" "$RUNS"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false WANDB_MODE=disabled ATLAS_LIGHTNING_CACHE="$CACHE"
export PYTHONPATH="$PWD${HYDRA_SITE:+:$HYDRA_SITE}${PYTHONPATH:+:$PYTHONPATH}"
# the package's callbacks/ and conf/ live at the top level (pyproject's package-dir); uninstalled, link them
[ -e atlas_lightning/callbacks ] || ln -s ../callbacks atlas_lightning/callbacks
[ -e atlas_lightning/conf ] || ln -s ../conf atlas_lightning/conf
FIT=${FIT:-"python3 -m atlas_lightning.cli fit"}
COMMON="logger.mode=disabled paths.cache=$CACHE ${EXTRA:-}"
T0=$(date +%s)
note() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a "$OUT/summary.txt"; }
# a stage that failed: the end of its log, errors first, into the summary
failed() { { echo "--- $1 (exit $2): errors, then the end of the log"; grep -a -E "Error|error:|Traceback|Killed|OOM" "$1" | tail -n 15
             tail -n 25 "$1"; } | cut -c1-400 >>"$OUT/summary.txt"; }

# kill_resume LABEL NAME STEP CAP_S OVERRIDES...: fit NAME; SIGKILL its process group 5 s after the
# step-STEP checkpoint is complete (the next step is under way); fit again with trainer.resume=auto
# within CAP_S in all; LABEL.json: the run's history, checkpoints and, with two validations or
# more, the learning figure (bench/learning.py: the last validation against the first, paired).
kill_resume() {
  local label=$1 name=$2 at=$3 cap=$((SECONDS + $4)); shift 4
  local root=$RUNS/$label log=$OUT/$label.log
  local marker=$root/checkpoints/$name/global_step_$at/checkpoint.json
  note "$label: fit $name ($*), SIGKILL after the step-$at checkpoint"
  setsid $FIT name=$name paths.root=$root "$@" >"$log" 2>&1 &
  local pid=$!
  while [ ! -f "$marker" ] && kill -0 $pid 2>/dev/null && [ $SECONDS -lt $cap ]; do sleep 1; done
  if [ -f "$marker" ] && kill -0 $pid 2>/dev/null; then
    sleep 5; kill -9 -- -$pid; wait $pid 2>/dev/null; note "$label: killed during step $((at + 1)) (pid $pid)"
    echo "=== SIGKILL; resume ===" >>"$log"
    timeout -s KILL $((cap - SECONDS)) $FIT name=$name paths.root=$root "$@" trainer.resume=auto >>"$log" 2>&1
    local code=$?; note "$label: resumed run exit $code"; [ $code = 0 ] || failed "$log" $code
  else
    kill -9 -- -$pid 2>/dev/null; wait $pid 2>/dev/null; local code=$?
    note "$label: no step-$at checkpoint before the cap, or the run ended (exit $code)"; failed "$log" $code
  fi
  python3 - "$root" "$name" "$OUT/$label.json" <<'EOF' >>"$log" 2>&1
import csv, json, sys
from pathlib import Path
from atlas_lightning.bench.learning import read_step, summarize, val_steps
root, name, out = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
result = {"run": name}
steps = val_steps(root, name)
result["validation_steps"] = list(steps)
if len(steps) >= 2:
    result["learning"] = summarize({s: read_step(f) for s, f in steps.items()})
history = {}
for path in sorted((root / "runs" / name).glob("*/history.csv")):
    for row in csv.DictReader(path.open()):
        step = int(row["_step"])
        history.setdefault(step, {}).update({k: float(v) for k, v in row.items() if v not in ("", None) and (
            k.startswith(("timing_s/", "memory/", "rollout/", "perf/", "val/", "critic/score", "actor/",
                          "response_length")) or k.endswith(("/objective", "/acc")))})
result["history"] = history
checkpoints = root / "checkpoints" / name
result["checkpoints"] = sorted(p.name for p in checkpoints.glob("global_step_*") if (p / "checkpoint.json").exists())
result["lightning_state"] = {p.name: sorted(q.name for q in (p / "lightning").iterdir())[:6]
                             for p in checkpoints.glob("global_step_*") if (p / "lightning").is_dir()}
out.write_text(json.dumps(result, indent=1) + "\n")
print("learning:", json.dumps(result.get("learning", {}), indent=1)[:3000])
EOF
  note "$label: done"
}

stage_a() { kill_resume a h200-tiny "${A_KILL_AT:-5}" "$A_S" experiment=h200-tiny $COMMON; }

# merged sync (sleep level 2), SIGKILL after step 1, resume to step 2: a smaller batch (KR_N samples)
stage_kr() {
  kill_resume kr h200-tiny-kr 1 "$KR_S" experiment=h200-tiny $COMMON model.path="$CACHE/${KR_MODEL:-tiny-orchestrator}" \
    rollout.weight_sync=merged trainer.total_steps=2 trainer.save_every=1 trainer.val_every=0 \
    trainer.val_before_train=false callbacks.validation.val_on_last_step=false rollout.n="${KR_N:-8}"
}

stage_merged() {
  note "merged: fit h200-tiny with rollout.weight_sync=merged, 2 steps, step benchmark"
  timeout -s KILL $MERGED_S python3 -m atlas_lightning.bench.step --out "$OUT/merged" -- experiment=h200-tiny \
    name=h200-tiny-merged paths.root=$RUNS/merged $COMMON rollout.weight_sync=merged trainer.total_steps=2 \
    trainer.val_every=0 trainer.val_before_train=false trainer.save_every=0 >"$OUT/merged.log" 2>&1
  local code=$?; note "merged: exit $code"; [ $code = 0 ] || failed "$OUT/merged.log" $code
}

stage_b() {
  note "b: Qwen3-8B shape, step benchmark"
  timeout -s KILL $B_S python3 -m atlas_lightning.bench.step --out "$OUT/b" --build dense8b --model-dir /tmp/dense8b \
    --tokenizer-from "$CACHE/tiny-model" -- experiment=h200-8b model.path=/tmp/dense8b paths.root=$RUNS/b $COMMON ${B_EXTRA:-} \
    >"$OUT/b.log" 2>&1
  local code=$?; note "b: exit $code"; [ $code = 0 ] || failed "$OUT/b.log" $code
}

python3 -c "import importlib.metadata as m; print(*(f'{p} {m.version(p)}' for p in ('torch', 'vllm', 'transformers', 'peft', 'lightning', 'hydra-core')))" 2>&1 | tail -1 | tee -a "$OUT/summary.txt"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee -a "$OUT/summary.txt"
for stage in "$@"; do
  "stage_$stage"
done
for f in "$OUT"/*.log; do  # keep the ends of long logs (vLLM is verbose)
  [ -f "$f" ] && [ "$(stat -c %s "$f")" -gt 8000000 ] && { tail -c 8000000 "$f" >"$f.tmp"; mv "$f.tmp" "$f"; }
done
cat "$OUT/summary.txt"
for f in "$OUT"/*/step_bench.md; do [ -f "$f" ] && cat "$f"; done
