"""The benchmarks, shipped with the package: ``atlas-lightning bench [NAME]`` (``verb.py``; ``bench
--help`` lists them) or ``python -m atlas_lightning.bench.<module>``. Each measures through the
package's own model build, kernels and config, what ``fit`` runs. ``README.md`` here says what is
measured and how to read it, with the results; ``NOTES.md`` the attempts, run by run; ``results/``
the raw files (in the repository, not in the wheel).

* The update benchmark, ours against plain transformers + peft (``update_bench.py``, the default;
  ``update_suite.py``: its recorded runs in one process): ``shapes`` (random models on the device),
  ``workload`` (the length mix and PPO inputs), ``flops`` (useful FLOPs), ``measure`` (clocks,
  ceilings), ``update`` (ours and the baseline), ``batch`` (a whole batch's update with its optimizer
  step), ``plan_check`` (the plan's figure beside each peak; the recomputation is ``fit``'s own
  choice, ``run/recompute.py``), ``probes`` (profile, autotuning), ``logprob_memory``, ``sync`` (weight export),
  ``report`` (markdown), ``build_time`` (the model build's start-up).
* The RL step: ``step`` (``fit`` itself, phase by phase), ``step_names``, ``projection`` (to the
  training of record), ``cards`` (the cards' HBM and bf16 rates), ``step_suite`` (the stages on one card); ``learning`` (does the embedded
  default learn).
* Kernel probes: ``attention_lengths``, ``elementwise_kernels``, ``merge_packing``, ``digest_cost``.

The update benchmark imports torch, transformers, peft and omegaconf (our path is built from
``fit``'s model config), not hydra; ``learning`` and
``projection`` need neither.
"""
