"""The issue-9 performance benchmark: our PPO update against plain transformers + peft.

Run ``python -m atlas_lightning.bench`` (``--tiny`` on CPU); ``bench/README.md`` says what is
measured and how to read it. Modules: ``shapes`` (random models on the device), ``workload``
(the length mix and PPO inputs), ``flops`` (useful FLOPs), ``measure`` (clocks, ceilings),
``update`` (ours and the baseline), ``build_time`` (the model build's start-up), ``logprob_memory``,
``sync`` (weight export), ``report`` (markdown), ``cli`` (the driver). Imports torch, transformers,
peft and omegaconf (our path is built from ``fit``'s model config); not hydra.
"""
