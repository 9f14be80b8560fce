# The hybrid learning figure (bench README, the paragraph "The hybrid learning figure"), under a cap; $1 = cap s,
# more arguments: overrides for every fit. Needs setup.sh on this machine (an earlier call). Three
# phases, each skipped when done, so the same command sent in calls that follow each other goes on
# where the last one stopped:
#  1. the tiny hybrid orchestrator built on the card into $C (SFT_STEPS, the recipe's 800 by
#     default), packed into $OUT/tiny-hybrid-orchestrator.tgz (unpack it into .carry/cache here:
#     setup.sh copies it, and later sessions skip the build);
#  2. a warm-up fit of one step on it (the engine's kernels compiled, fla's autotuning), unless
#     the marker in /tmp/cache says a call ran it (cache.sh carries it along with the kernels);
#  3. step_suite's stage a on it, A_STEPS steps (6: SIGKILL after step 3's checkpoint, resume,
#     validation at 0, 3 and 6: the schedule of the dense run 3's stage a, bench README), when at
#     least A_MIN seconds are left, else it says to call again (A_STEPS=10: h200-tiny's own 10).
# Prints the SFT's summary, the learning figure with its paired SE, the per-step table, exit codes.
[ -n "$1" ] || { echo "usage: hybrid_learning.sh CAP_S [override ...]"; exit 2; }
source atlas_lightning/bench/card/env.sh
T0=$(date +%s); cap=$1; shift
left() { echo $(( cap - $(date +%s) + T0 )); }
t() { echo "[hybrid-learning $(( $(date +%s) - T0 ))s, $(left)s left] $*"; }
M=$C/tiny-hybrid-orchestrator; WARM=/tmp/cache/hybrid-learning-warm
A_STEPS=${A_STEPS:-6}; half=$(( A_STEPS / 2 )); A_MIN=${A_MIN:-$(( 200 + 35 * A_STEPS ))}
if [ ! -d /tmp/site-fla ] || [ ! -d $C/sample-data ]; then
  echo "no /tmp/site-fla or $C/sample-data: run setup.sh on this machine first"; exit 3
fi
more=""; [ $# -gt 0 ] && more=$(printf ' %q' "$@")

if [ -f $M/sft_summary.json ]; then
  t "orchestrator already built: $M"
else
  t "building the tiny hybrid orchestrator (${SFT_STEPS:-800} SFT steps, cuda)"
  timeout -s KILL $(( $(left) - 20 )) python3 -m atlas_lightning.demo.tiny_hybrid_orchestrator --out $M \
    --device cuda --steps ${SFT_STEPS:-800} > $OUT/hybrid-sft.log 2>&1
  code=$?; t "build exit $code"
  if [ $code -ne 0 ]; then grep -E "Error|error:|Traceback" $OUT/hybrid-sft.log | cut -c1-300 | tail -12; exit $code; fi
  tar -C $C -czf $OUT/tiny-hybrid-orchestrator.tgz tiny-hybrid-orchestrator
fi
python3 - $M/sft_summary.json <<'EOF'
import json, sys
s = json.load(open(sys.argv[1]))
e = s["eval"]
print(f"SFT: {s['steps']} steps, loss {s['first_loss']:.3f} -> {s['final_loss']:.3f}, val demo loss "
      f"{e['val_demo_loss']:.3f}, seconds {s['seconds']}")
for mode in ("greedy", "sampled"):
    if mode in e:
        m = e[mode]
        print(f"  {mode}: objective {m['objective']:+.3f} acc {m['acc']:.3f} explores {m['mean_explores']:.2f} "
              f"ends {m['terminal_reasons']}")
EOF

fits="model.path=$M model.linear_attention_kernel=fla"
if [ ! -f $WARM ] && [ $(left) -ge 90 ]; then
  t "warm-up: one step of experiment=h200-tiny (engine kernels, fla autotuning)"
  rm -rf /tmp/runs/hl-warm
  timeout -s KILL $(( $(left) - 10 )) python3 -m atlas_lightning.cli fit experiment=h200-tiny name=hl-warm \
    paths.root=/tmp/runs/hl-warm logger.mode=disabled paths.cache=$C $fits trainer.total_steps=1 \
    trainer.val_before_train=false trainer.val_every=0 callbacks.validation.val_on_last_step=false \
    trainer.save_every=0 "$@" > $OUT/hl-warm.log 2>&1
  code=$?; t "warm-up exit $code"
  # cut by the cap (137), it still compiled and tuned most kernels: stage a finishes the rest
  case $code in 0|137) mkdir -p /tmp/cache && touch $WARM ;; esac
  grep -E "Error|error:|init engine|took .* seconds to fall asleep|Available KV" $OUT/hl-warm.log | cut -c1-300 | tail -10
  python3 - /tmp/runs/hl-warm/runs/hl-warm <<'EOF'
import csv, glob, sys
for path in sorted(glob.glob(sys.argv[1] + "/*/history.csv")):
    for row in csv.DictReader(open(path)):
        print("warm-up step " + row["_step"] + ": " + ", ".join(f"{k.split('/', 1)[1]} {float(v):.1f}" for k, v in row.items()
              if k.startswith("timing_s/") and v not in ("", None)))
EOF
  [ $(stat -c %s $OUT/hl-warm.log) -gt 8000000 ] && tail -c 8000000 $OUT/hl-warm.log > /tmp/hl-warm.tail && mv /tmp/hl-warm.tail $OUT/hl-warm.log
fi

if [ $(left) -lt $A_MIN ]; then
  t "stage a ($A_STEPS steps) needs about ${A_MIN}s, $(left)s left: send this command again"; exit 0
fi
t "stage a: $A_STEPS steps, SIGKILL after step $half's checkpoint, resume"
rm -rf /tmp/runs/hl/a
extra="$fits trainer.total_steps=$A_STEPS trainer.val_every=$half trainer.save_every=$half$more"
# the suite's own start (compose, nvidia-smi) and a killed group's exit (up to 30 s) come on top of --a-s
timeout -s KILL $(( $(left) - 5 )) python3 -m atlas_lightning.bench.step_suite a --out $OUT/hl --runs /tmp/runs/hl \
  --a-s $(( $(left) - 40 )) --a-kill-at $half --extra "$extra" > /dev/null 2>&1
code=$?; t "step_suite exit $code"
[ -f $OUT/hl/a.json ] && mkdir -p /tmp/cache && touch $WARM
cut -c1-300 $OUT/hl/summary.txt 2>/dev/null | tail -30
python3 - $OUT/hl/a.json <<'EOF'
import json, sys
try:
    a = json.load(open(sys.argv[1]))
except OSError as err:
    sys.exit(f"no a.json: {err}")
print(f"checkpoints {a.get('checkpoints')}, validated steps {a.get('validation_steps')}")
ln = a.get("learning")
if ln:
    for step, c in sorted(ln["curve"].items(), key=lambda kv: int(kv[0])):
        print(f"  validation step {step}: objective {c['objective']:+.3f} acc {c['acc']:.3f} cost ${c['cost_usd']:.3f} "
              f"explores {c['explores']:.2f} ({c['questions']} questions)")
    print(f"LEARNING: gain {ln['objective_gain']:+.3f} +- {ln['gain_se']:.3f} (paired SE, {ln['paired_questions']} "
          f"questions, step {ln['first_step']} -> {ln['last_step']}), z {ln['z']:.1f}")
else:
    print("LEARNING: fewer than two validations, no figure")
cols = [("objective", "reward/objective"), ("acc", "reward/acc"), ("step s", "timing_s/step"),
        ("gen", "timing_s/gen"), ("old lp", "timing_s/old_log_prob"), ("values", "timing_s/values"),
        ("actor", "timing_s/update_actor"), ("critic", "timing_s/update_critic"), ("sync", "timing_s/update_weights"),
        ("sleep", "timing_s/sleep"), ("val", "timing_s/testing"), ("ckpt", "timing_s/checkpoint")]
print("| step | " + " | ".join(name for name, _ in cols) + " |")
for step, row in sorted(a.get("history", {}).items(), key=lambda kv: int(kv[0])):
    print(f"| {step} | " + " | ".join(f"{row[key]:.3f}" if key in row and name in ("objective", "acc")
                                       else f"{row[key]:.1f}" if key in row else "-" for name, key in cols) + " |")
EOF
exit $code
