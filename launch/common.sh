# Shared by every launch/<run>.sh (sourced, not run). One function does a launch:
#
#   atlas_launch RUN VERB [hydra overrides...]
#
# 1. environment: the Python that has atlas_lightning, the GPUs this node shows;
# 2. the plan (`python -m atlas_lightning.planning`): per-card memory table, outputs/<run>/plan.json;
# 3. the pre-flight (`python -m atlas_lightning.run.preflight`): config, model folder, data, starting
#    adapters, plan, environment -- seconds, nothing loaded; a failure stops the launch (exit 2);
# 4. the run: `python -m atlas_lightning.cli VERB experiment=RUN ...` (Lightning starts one process
#    a card itself; in-process vLLM engines start inside them, colocated, asleep during updates).
#
# Everything printed goes to logs/<run>-<UTC time>.log under the run root as well (tee).
#
# Launcher variables (settings of the launch itself; a config value travels as an override,
# given to the plan, the pre-flight and the run alike, never read from the environment there):
#   ATLAS_ROOT            the run root: paths.root=$ATLAS_ROOT (default: paths.root=... among the
#                         overrides, else $PWD)
#   ATLAS_PYTHON          the interpreter (default: the checkout's .venv/bin/python, else python3)
#   ATLAS_CARD_GIB        memory of one card: plan.card_gib=$ATLAS_CARD_GIB (the schema's default: 80, A100 80GB)
#   ATLAS_BASE_MODEL, ATLAS_DATA_ROOT, ATLAS_INIT_FROM   the report runs' inputs: model.path=,
#                         data.root=, trainer.init_from= where the run reads them (atlas_report_inputs);
#                         overrides given to a launcher come after them and win
#   ATLAS_CPU_PREFLIGHT=1 check a GPU run's config on a CPU machine: the pre-flight's --cpu-preflight
#                         (GPU count not checked)
#   ATLAS_PREFLIGHT_ONLY=1  stop after the pre-flight (nothing is started)
#   ATLAS_GPUS_WANTED     set by each launcher: the GPUs its run needs on this node

ATLAS_REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

atlas_python() {
  if [ -n "${ATLAS_PYTHON:-}" ]; then echo "$ATLAS_PYTHON";
  elif [ -x "$ATLAS_REPO/.venv/bin/python" ]; then echo "$ATLAS_REPO/.venv/bin/python";
  else command -v python3 || command -v python; fi
}

# The run root: the last paths.root=... override, else $ATLAS_ROOT, else the working directory.
atlas_root() {
  local root="${ATLAS_ROOT:-$PWD}" arg
  for arg in "$@"; do
    case "$arg" in paths.root=*) root="${arg#paths.root=}" ;; esac
  done
  echo "$root"
}

# The inputs of experiment RUN as overrides, one a line (for `mapfile`), from the launcher
# variables that are set, where RUN's experiment file reads that input (a Qwen3.6-27B run:
# ATLAS_BASE_MODEL -> model.path; on ATLAS report 25's data: ATLAS_DATA_ROOT -> data.root; starting
# from another run's step: ATLAS_INIT_FROM -> trainer.init_from). None set: the experiment's own paths.
atlas_report_inputs() {
  local file="$ATLAS_REPO/conf/experiment/$1.yaml"
  [ -f "$file" ] || return 0
  if [ -n "${ATLAS_BASE_MODEL:-}" ] && grep -q 'override /model: qwen3_6_27b' "$file"; then echo "model.path=$ATLAS_BASE_MODEL"; fi
  if [ -n "${ATLAS_DATA_ROOT:-}" ] && grep -q 'override /data: r25' "$file"; then echo "data.root=$ATLAS_DATA_ROOT"; fi
  if [ -n "${ATLAS_INIT_FROM:-}" ] && grep -q '^  init_from:' "$file"; then echo "trainer.init_from=$ATLAS_INIT_FROM"; fi
  return 0
}

atlas_check_environment() {
  local py="$1" gpus_wanted="$2"
  "$py" -c "import atlas_lightning" 2>/dev/null || {
    echo "launch: $py cannot import atlas_lightning (install the project: make setup)"; return 2; }
  if [ "$gpus_wanted" -gt 0 ] && [ "${ATLAS_CPU_PREFLIGHT:-0}" = "0" ]; then
    local found=0
    if command -v nvidia-smi >/dev/null 2>&1; then found=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true); fi
    if [ "$found" -lt "$gpus_wanted" ]; then
      echo "launch: this run wants $gpus_wanted GPUs on this node, nvidia-smi shows $found"; return 2
    fi
  fi
}

atlas_launch() {
  local run="$1" verb="$2"; shift 2
  local py root stamp log gpus
  py="$(atlas_python)"
  root="$(atlas_root "$@")"
  local args=("experiment=$run") preflight=() inputs=()
  if [ -n "${ATLAS_ROOT:-}" ]; then args+=("paths.root=$ATLAS_ROOT"); fi
  if [ -n "${ATLAS_CARD_GIB:-}" ]; then args+=("plan.card_gib=$ATLAS_CARD_GIB"); fi
  mapfile -t inputs < <(atlas_report_inputs "$run")
  args+=("${inputs[@]}" "$@")
  if [ "${ATLAS_CPU_PREFLIGHT:-0}" != "0" ]; then preflight+=("--cpu-preflight"); fi
  mkdir -p "$root/logs"
  stamp="$(date -u +%Y%m%d-%H%M%S)"
  log="$root/logs/$run-$stamp.log"
  gpus="${ATLAS_GPUS_WANTED:-0}"
  {
    echo "launch $run ($verb) at $stamp UTC on $(hostname); checkout $(git -C "$ATLAS_REPO" rev-parse --short HEAD 2>/dev/null || echo '?')"
    echo "python $py; root $root; log $log; overrides: ${args[*]}"
    atlas_check_environment "$py" "$gpus" || exit 2
    echo "== plan"
    "$py" -m atlas_lightning.planning "${args[@]}" || { echo "launch: the plan refused $run; nothing was started"; exit 2; }
    echo "== pre-flight"
    "$py" -m atlas_lightning.run.preflight "${preflight[@]}" "${args[@]}" || { echo "launch: pre-flight failed for $run; nothing was started"; exit 2; }
    if [ "${ATLAS_PREFLIGHT_ONLY:-0}" != "0" ]; then echo "launch: ATLAS_PREFLIGHT_ONLY set: stopping here"; exit 0; fi
    echo "== $verb"
    exec "$py" -m atlas_lightning.cli "$verb" "${args[@]}"
  } 2>&1 | tee -a "$log"
  return "${PIPESTATUS[0]}"
}
