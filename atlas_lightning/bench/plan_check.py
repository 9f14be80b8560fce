"""The plan's memory figures against what the card measured, for the benchmark's sweep configs.

``plan_tensors_gib`` asks ``planning.estimate`` (the ``plan`` verb's model) for the
``update_actor`` phase of one card running the sweep's stack: the bench shape's config with its
layer count, bf16, LoRA r64 on all linears, every layer or none checkpointed, the sweep's
micro-batch tokens, and the linear-attention kernel the model ran. The phase's tensors are
what ``torch.cuda.max_memory_allocated`` measures, except the Adam moments (the sweep takes no
optimizer step): those are subtracted. ``update_bench.py`` stores the figure beside each
measured peak (``plan_predicted_gib``), which is what the plan's fla calibration is checked against.

Who calls it: ``update_bench.py``. Pure Python (the planner never imports torch).
"""

from __future__ import annotations

from typing import Optional

from omegaconf import OmegaConf

from atlas_lightning.config import RootConfig
from atlas_lightning.planning import estimate, shape_from_config

GIB = 2.0**30


def plan_tensors_gib(shape_config: dict, arch: str, layers: int, tokens: int, checkpoint_layers: int,
                     linear_kernel: str, rank: int = 64, chunk: int = 1024, policy: Optional[str] = None) -> float:
    """The ``update_actor`` phase's tensors less the Adam moments, GiB (module doc); ``policy``:
    every layer under that recompute policy (``models/recompute.py``) instead of the count."""
    raw = dict(shape_config) | {"model_type": "qwen3_5_text" if arch == "qwen3_5" else arch,
                                "num_hidden_layers": layers}
    if "layer_types" in raw:
        raw["layer_types"] = list(raw["layer_types"])[:layers]
    elif arch == "qwen3_5":
        raw["layer_types"] = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
    shape = shape_from_config(raw, where=f"bench shape ({layers} layers)")
    settings = {"model": {"dtype": "bfloat16", "lora": {"rank": rank, "target_modules": "all-linear"},
                          "gradient_checkpointing": True, "checkpoint_layers": checkpoint_layers,
                          "logprob_chunk_tokens": chunk, "attn_implementation": "sdpa_varlen",
                          "layer_recompute": None if policy is None else [policy] * layers},
                "algorithm": {"ppo_max_token_len_per_gpu": tokens, "forward_max_token_len_per_gpu": tokens},
                "trainer": {"devices": 1, "num_nodes": 1, "accelerator": "gpu"}}
    # the planner reads the typed config (every other setting at its schema default)
    cfg = OmegaConf.merge(OmegaConf.structured(RootConfig), settings)
    plan = estimate(shape, cfg, card_gib=1e6, linear_kernel=linear_kernel)
    adam = 2 * 2 * shape.lora_params(rank) * 4  # two fp32 moments of both adapters: no optimizer step here
    return (plan.phase("update_actor").tensors - adam) / GIB
