"""Base + LoRA actor, critic value head, packed sequences, chunked log-probs, adapter
import/export, FSDP2 wrapping and merged weights for the engines.

Modules (one responsibility each):

* ``packing``: ``PackedBatch``, ``pack_sequences``, ``pack_padded`` (verl layout <-> packed).
* ``logprobs``: ``token_logprobs_and_entropy`` (chunked, checkpointed lm_head + log-softmax).
* ``actor_critic``: ``ActorCritic`` (one frozen base, adapters ``actor``/``critic``, value head).
* ``adapter_switch``: per-forward adapter selection that never flips ``requires_grad``.
* ``sharding``: ``shard`` (FSDP2 ``fully_shard`` per decoder layer, value head, root).
* ``weights``: ``adapter_state``, ``merged_weights``, ``bucket_weights``, ``merged_weight_buckets``.
* ``adapters``: ``save_adapter``, ``save_adapters``, ``load_adapter`` (PEFT folders, base identity checks).
* ``probe``: ``probe_logprobs`` (the actor's log-probs of one sequence, the weight-sync check).
* ``identity``, ``checkpoint_names``: what identifies a base; checkpoint parameter names.
* ``tiny``: ``save_tiny_causal_lm`` (random tiny Qwen3 / Qwen3.5 folders for tests).
* ``linear_attention``: Qwen3.5/3.6 Gated DeltaNet layers over packed rows (fla varlen kernels
  or transformers' torch reference per sequence); ``linear_kernels``: which of the two runs
  (``model.linear_attention_kernel``); ``fla_tuning``: fla's autotuning once per shape.
* ``recompute``: per-layer recomputation finer than a whole layer (mixer, MLP gate/up, the
  SwiGLU tail without a GEMM replay).
* ``fused_kernels``: liger-kernel's fused RMSNorm, SwiGLU product and rotary on CUDA
  (``model.elementwise_kernels``); ``kernel_choice``: the auto/package/torch rule of both kernel
  keys; ``attention``: ``sdpa_varlen``, per-sequence attention over
  packed rows, lengths bucketed on CUDA (``model.attention_length_bucket``).

Submodules import torch, transformers and peft; this package file imports nothing heavy.
"""
