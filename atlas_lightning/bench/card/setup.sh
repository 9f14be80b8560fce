# The device call after the wheel transfers: install, check, assets, the 27B-shaped hybrid folder
# (its first $LAYERS decoder layers, 16 unless set; README.md here).
T0=$(date +%s); t() { echo "[setup $(( $(date +%s) - T0 ))s] $*"; }
mkdir -p /tmp/dw && cp .device-wheels/vllm/c8/* /tmp/dw/
source .device-wheels/install.sh > $OUT/install.log 2>&1; tail -1 $OUT/install.log
mkdir -p /tmp/dwf; cp .device-wheels/fla/c4/* /tmp/dwf/
# always re-assembled: a call without fla/c4 leaves a short wheel behind, which pip then refuses
for f in /tmp/dwf/*.part00; do w=${f%.part00}; rm -f "$w"; cat "$w".part* > "$w"; done
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-extra .whl/*.whl >> $OUT/install.log 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-fla /tmp/dwf/*.whl >> $OUT/install.log 2>&1
source atlas_lightning/bench/card/env.sh
bash atlas_lightning/bench/card/cache.sh unpack
t installed
python3 -c "import triton, fla, vllm, torch, hydra, liger_kernel; print('triton', triton.__version__, 'fla', fla.__version__, 'vllm', vllm.__version__, 'torch', torch.__version__)"
python3 -c "from atlas_lightning.models.linear_kernels import fla_problem as p; print('fla:', p() or 'usable')"
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader
mkdir -p ~/.cache/atlas-lightning && cp -r .carry/cache/* ~/.cache/atlas-lightning/ && t assets
if [ -z "$NO_HYBRID_FOLDER" ]; then  # NO_HYBRID_FOLDER=1: a call that runs no 27B-shaped step saves ~55 s
  python3 -c "from pathlib import Path; from atlas_lightning.bench.step import build_model_folder as b; b('qwen3_6_27b', Path('/tmp/qwen3_6_27b'), Path.home() / '.cache/atlas-lightning/tiny-model', ${LAYERS:-16})" > $OUT/folder.log 2>&1
  t folder; tail -3 $OUT/folder.log; du -sh /tmp/qwen3_6_27b; df -h /tmp | tail -1
fi
if [ -n "$ADAPTER_TESTS" ]; then
  timeout 240 python3 -m pytest -q -s -p no:randomly -p no:cacheprovider tests/rollout/test_hybrid_adapter_in_vllm.py > $OUT/adapter.log 2>&1
  t adapter tests; grep -E "hybrid,|passed|failed|Error" $OUT/adapter.log | tail -8
fi
