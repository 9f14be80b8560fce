# Sourced by each device call after setup.sh: fla's Triton 3.7.1 first, then the extras, then vLLM's set.
export PYTHONPATH=/tmp/site-fla:/tmp/site-extra:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export VLLM_ATTENTION_BACKEND=${VLLM_ATTENTION_BACKEND:-FLASH_ATTN}
# The assets setup.sh copied (tiny-model, sample-data): $C, and fit's paths.cache by default.
C=$HOME/.cache/atlas-lightning; export ATLAS_LIGHTNING_CACHE=$C
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false WANDB_MODE=disabled
# Compiled kernels kept in /tmp, which survives between calls while the machine stays warm: the
# engine's init on the hybrid (108-118 s) is mostly the profile run's cold Triton compilation.
export TRITON_CACHE_DIR=/tmp/cache/triton VLLM_CACHE_ROOT=/tmp/cache/vllm
# No core files: an aborted process (the hybrid's graph fault, exit 134) may otherwise leave one of
# tens of GB on the machine's disk, which the next folder or checkpoint then lacks (the tenth
# attempt in bench/README.md).
ulimit -c 0
# Uninstalled, the checkout's callbacks/ and conf/ are linked into the package, so that every call
# that sources this file imports atlas_lightning.conf (a call without it fails in seconds).
python3 -c "from atlas_lightning.bench.step_suite import link_checkout_packages as l; l()"
