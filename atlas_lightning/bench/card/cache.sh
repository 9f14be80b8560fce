# Compiled kernels across machines: Triton's cache (the engine's kernels, fla's, with fla's
# autotuning timings) and vLLM's, all under /tmp/cache (env.sh). A fresh machine spends about
# 2 minutes compiling the engine's kernels and 2.5 more autotuning fla's; the cache holds both
# for any Hopper card (Triton keys it on the compiler, the kernel, the arch and the tuning key).
#   bash cache.sh pack     # at the end of a call: $OUT/kernel-cache/part-* (15 MiB each, what comes back)
#   bash cache.sh unpack   # in setup.sh: the parts a transfer call put in /tmp/kc, if any
case $1 in
  pack)
    mkdir -p $OUT/kernel-cache
    tar -C /tmp -czf - cache | split -b 15M -d -a 1 - $OUT/kernel-cache/part-
    ls -la $OUT/kernel-cache | tail -n +2 ;;
  unpack)
    if ls /tmp/kc/part-* > /dev/null 2>&1; then
      cat /tmp/kc/part-* | tar -C /tmp -xzf - && echo "kernel cache: $(du -sh /tmp/cache | cut -f1) from $(ls /tmp/kc | wc -l) parts"
    else
      echo "kernel cache: none sent (a cold start)"
    fi ;;
  *) echo "usage: cache.sh pack|unpack" >&2; exit 2 ;;
esac
