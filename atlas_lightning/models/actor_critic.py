"""Actor and critic as two LoRA adapters on ONE frozen base, plus the critic's value head.

One copy of the base weights serves three passes over a ``PackedBatch``:

* ``actor_forward``: adapter ``actor``; per-response-token log-probs (and entropy) of the
  tempered policy, computed from the final hidden states in chunks (``logprobs.py``).
* ``critic_forward``: adapter ``critic``; per-response-token values from the value head.
* ``base_forward``: no adapter (the reference policy for the KL), always without grad.

Contracts (``N`` = response tokens of the batch, packed order; see ``packing.py``):

* outputs are ``(N,)`` fp32; ``PackedBatch.scatter_responses`` gives verl's
  ``(bs, response_length)``;
* position ``t - 1`` scores response token ``t`` for log-probs AND values: the value of
  response token ``j`` is ``V`` of the state before it was emitted, as verl's critic takes
  ``values[:, -response_length - 1 : -1]``;
* the value head is ``Linear(hidden, 1)`` kept in fp32 and applied to the fp32-cast last
  hidden state (fp32 because returns and advantages are differences of values: bf16's 3
  significant digits would show in GAE). Under FSDP2 it is its own unit with an fp32 policy.
  It starts as a token-classification head does (normal(0, initializer_range), bias 0);
* LoRA weights follow peft: fp32 when the base is bf16/fp16 (``autocast_adapter_dtype``);
  both adapters are initialised from ``init_seed`` under a forked RNG, so every rank builds
  the same adapters before sharding;
* both adapters stay trainable at the same time: ``actor_parameters()`` and
  ``critic_parameters()`` are disjoint, the selection of an adapter never flips
  ``requires_grad``, and a forward only touches the selected adapter, so each loss's
  gradients reach only its own adapter (``adapter_switch.py``, which also keeps gradient
  checkpointing replays on the adapter that ran the forward);
* gradient checkpointing: non-reentrant, per decoder layer, active in ``train()`` mode only.

Attention and sequence boundaries (what transformers 5.19 does, checked in its source):

* ``packed`` layout (default for attention-only models such as Qwen3): one ``(1, T)`` row,
  ``position_ids`` restarting at 0, no attention mask, no cache. ``masking_utils`` then finds
  the sequences (``find_packed_sequence_indices``) and each attends only to itself. With
  ``sdpa``/``eager`` this materialises a dense ``(1, 1, T, T)`` mask (2.4 GB of bool at
  T = 49,152: fine on CPU tests, wasteful on GPUs); ``flex_attention`` builds a BlockMask
  (O(T^2 / 128^2)); ``flash_attention_2/3`` take the varlen kernel with ``cu_seqlens`` derived
  from ``position_ids``, no mask at all. On GPUs use ``flex_attention`` or flash: measured
  on an H200 (torch 2.11) for a 49,152-token row of 12 sequences, a forward's peak was
  11.4 GiB with ``sdpa`` and 0.3 GiB with ``flex_attention`` (tiny model, so the mask is
  all of it), both exact at sequence boundaries (fp32, 7e-6).
* models with recurrent layers (``_is_stateful`` in transformers, e.g. Qwen3.5/3.6's Gated
  DeltaNet linear attention) are packed too: transformers' own layer would leak conv and
  recurrent state from one sequence into the next in a packed row (measured: 4e-2 logit error
  on a tiny Qwen3.5), so each such layer gets ``linear_attention.py``'s forward, which reads
  the boundaries (``attention.SEQ_LENS_KWARG`` and ``linear_attention.CU_SEQLENS_KWARG``) and
  runs the conv and the delta rule per sequence: with flash-linear-attention's varlen kernels
  (``linear_attention_kernel="fla"``) or transformers' reference code (``"torch"``); ``"auto"``
  takes fla where it imports on a GPU (``linear_kernels.py``). ``self.linear_attention_kernel``
  says which ran (None for a model without such layers).
* ``padded`` layout (on request): right-padded ``(n, max_len)`` rows with an attention mask,
  exact by causality (padding only follows real tokens), at the cost of padding compute;
  the layers run transformers' own forward.

Speed paths (``bench/README.md`` has the measurements):

* ``fused_lora=True`` (default): every LoRA-wrapped linear runs as one autograd function in
  the compute dtype (``fused_lora.py``) instead of peft's separate fp32 adapter path;
* ``attn_implementation="sdpa_varlen"``: one causal FlashAttention call per packed sequence,
  no mask, nothing compiled (``attention.py``); the packed forward passes the sequence
  lengths to it through the decoder's kwargs;
* ``checkpoint_layers=k``: with gradient checkpointing on, only the first ``k`` decoder
  layers are recomputed in the backward (``None``: all of them); the others keep their
  activations, trading memory for the recomputation time. ``auto`` is resolved for the card
  before the build into a ``layer_recompute`` plan, and plans of smaller micro-batches that
  ``enable_recompute_tiers`` takes (``planning/recompute.py``, ``run/recompute.py``);
  unresolved, every layer;
* ``layer_recompute``: finer than all or nothing, one policy a decoder layer (overrides
  ``checkpoint_layers``): ``layer`` (checkpointed whole), ``mixer`` (only the attention or
  Gated DeltaNet recomputed), ``mlp`` (only the MLP's gate and up projections recomputed) or
  ``none`` (``recompute.py``);
* ``elementwise_kernels="auto"`` (default): liger-kernel's fused Triton kernels for the RMSNorms,
  the SwiGLU product and Qwen3's rotary embedding where liger-kernel and Triton import and the
  model is on a CUDA device, else PyTorch's ops (``fused_kernels.py``); equal within bf16 rounding;
* ``attention_length_bucket=None``: ``sdpa_varlen`` pads each sequence's q/k/v to a multiple of
  it (None: 1024 on CUDA, exact lengths elsewhere): cuDNN's attention builds a graph per new
  length (~0.1 s), bucketed lengths reuse a few (``attention.py``); exact by causality;
* ``lean_activations=True`` (default): RMSNorms that save their input in bf16 rather than
  fp32 and, in the layers kept out of checkpointing, an MLP tail whose product (the down
  projection's input) is recomputed element-wise in the backward, not saved: about half a
  layer's saved bytes for no GEMM replayed (``lean_activations.py``,
  ``recompute.SwiGLUDownFunction``); forward results unchanged.

Built by ``build.build_actor_critic`` (the one builder: ``fit``, memory-check and the benchmarks),
which places the base on the training device first, so every ``auto`` above resolves for the
card that trains. Who calls it: the PPO module (forward passes, optimizers over the two
parameter lists), ``sharding.shard`` (FSDP2), ``adapters`` and ``weights`` (export/import).
"""

from __future__ import annotations

import copy
from dataclasses import asdict, is_dataclass
from typing import Any, Mapping, Optional, Sequence

import torch
from torch import Tensor, nn

from . import attention
from .adapter_switch import checkpoint_keeping_adapter, selected_adapter, tuner_layers
from .checkpoint_names import name_map
from .fused_kernels import resolve as resolve_elementwise_kernels
from .fused_lora import install_fused_lora
from .lean_activations import install_fused_kernels, install_lean_activations, install_lean_tails
from .linear_attention import CU_SEQLENS_KWARG, install_packed_linear_attention, linear_attention_modules
from .linear_kernels import resolve as resolve_linear_kernel
from .recompute import RECOMPUTE, install_mixer_checkpoints, install_mlp_recompute, mixer_of
from .identity import base_identity
from .logprobs import token_logprobs_and_entropy
from .packing import PackedBatch

ACTOR = "actor"
CRITIC = "critic"
ADAPTERS = (ACTOR, CRITIC)
SEQUENCE_LAYOUTS = ("auto", "packed", "padded")


def peft_lora_config(spec: Any):
    """A ``peft.LoraConfig`` (task CAUSAL_LM) from a LoRA spec: a ``peft.LoraConfig``, the
    project's ``config.LoraConfig`` (``rank, alpha, dropout, target_modules``), a DictConfig
    or a mapping with those keys (peft's names ``r, lora_alpha, lora_dropout`` also work).
    ``target_modules="all-linear"`` is peft's: every linear layer except the output head."""
    from peft import LoraConfig

    if isinstance(spec, LoraConfig):
        config = copy.deepcopy(spec)
        config.task_type = "CAUSAL_LM"
        return config
    if type(spec).__module__.startswith("omegaconf"):
        from omegaconf import OmegaConf

        spec = OmegaConf.to_container(spec, resolve=True)
    elif is_dataclass(spec):
        spec = asdict(spec)
    if not isinstance(spec, Mapping):
        raise ValueError(f"LoRA spec must be a mapping, dataclass or peft.LoraConfig, got {type(spec).__name__}")

    def pick(*names, default=None):
        for name in names:
            if name in spec and spec[name] is not None:
                return spec[name]
        return default

    rank, alpha = pick("rank", "r"), pick("alpha", "lora_alpha")
    if not isinstance(rank, int) or rank <= 0:
        raise ValueError(f"LoRA spec: rank={rank!r} must be a positive integer")
    if not isinstance(alpha, (int, float)) or alpha <= 0:
        raise ValueError(f"LoRA spec: alpha={alpha!r} must be a positive number")
    dropout = float(pick("dropout", "lora_dropout", default=0.0))
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"LoRA spec: dropout={dropout} must be within [0, 1)")
    target = pick("target_modules", default="all-linear")
    if not isinstance(target, str):
        target = sorted(target)
    return LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=target, task_type="CAUSAL_LM")


class ActorCritic(nn.Module):
    """Frozen base + LoRA adapters ``actor`` and ``critic`` + fp32 value head (module doc)."""

    def __init__(self, config: Any, base: nn.Module, lora: Mapping[str, Any], *, seed: int = 0) -> None:
        """``config``: the model config (``config.ModelConfig`` or the OmegaConf node typed by it);
        this constructor is the one reader of its keys that shape the wrapper (chunking, layout,
        LoRA path, recomputation, kernels), ``build.load_base`` of those that shape the base
        (path, dtype, attention). ``base``: the transformers causal LM, already where it trains
        (``build.load_base``); it is frozen and LoRA is injected into it. ``lora``: the LoRA spec
        of each role (``actor``, ``critic``; ``peft_lora_config`` reads each), resolved by the
        builder from the config or a starting adapter's folder. ``seed``: both adapters' and the
        value head's initialisation.

        Every ``auto`` kernel choice resolves for the device ``base`` sits on (the training
        card where ``build.build_actor_critic`` placed it), never for the host."""
        super().__init__()
        from peft import get_peft_model

        chunk_tokens = int(config.logprob_chunk_tokens)
        if chunk_tokens <= 0:
            raise ValueError(f"logprob_chunk_tokens={chunk_tokens} must be positive")
        if config.sequence_layout not in SEQUENCE_LAYOUTS:
            raise ValueError(f"sequence_layout={config.sequence_layout!r} is not one of {', '.join(SEQUENCE_LAYOUTS)}")
        missing = [role for role in ADAPTERS if lora.get(role) is None]
        if missing:
            raise ValueError(f"no LoRA spec for {', '.join(missing)} (one a role: {', '.join(ADAPTERS)})")
        self.logprob_chunk_tokens = chunk_tokens
        #: ``model.head_dtype=float32``: logits never rounded to the weights' dtype (``logprobs.py``)
        self.float32_head = str(getattr(config, "head_dtype", "model")) == "float32"
        #: Where the base was built (the training device): every kernel choice below is made for it.
        self.built_on = next(base.parameters()).device
        self.base_path = str(getattr(base.config, "_name_or_path", "") or f"<in-memory {type(base).__name__}>")
        self.varlen_attention = base.config._attn_implementation == attention.NAME
        base.requires_grad_(False)
        base.config.use_cache = False
        #: Identity of the base (identity.py), taken before LoRA and sharding.
        self.base_identity = base_identity(base)
        #: Loaded name -> checkpoint name (checkpoint_names.py), or None with the reason.
        self.checkpoint_names, self.checkpoint_names_problem = name_map(base, self.base_path)
        self.sequence_layout = self._choose_layout(base, config.sequence_layout)

        accelerators = [self.built_on.index or 0] if self.built_on.type == "cuda" else []
        with torch.random.fork_rng(devices=accelerators):
            torch.manual_seed(seed)  # seeds the accelerator's generator too: LoRA A is drawn there
            peft_model = get_peft_model(base, peft_lora_config(lora[ACTOR]), adapter_name=ACTOR)
            peft_model.add_adapter(CRITIC, peft_lora_config(lora[CRITIC]))
            hidden_size = base.get_output_embeddings().weight.shape[1]
            self.value_head = nn.Linear(hidden_size, 1, dtype=torch.float32, device=self.built_on)
            nn.init.normal_(self.value_head.weight, std=float(getattr(base.config, "initializer_range", 0.02)))
            nn.init.zeros_(self.value_head.bias)
        self.peft_model = peft_model
        self._tuner_layers = tuner_layers(peft_model)
        # peft left only the first adapter trainable; both are trained, each by its own loss.
        for name in ADAPTERS:
            for param in self.adapter_parameters(name):
                param.requires_grad_(True)
        self._install_speed_paths(config)
        self.train()

    def _install_speed_paths(self, config: Any) -> None:
        """The fused LoRA, the kernels (resolved for ``self.built_on``), the recompute plan and the
        lean activations that ``config`` asks for (module doc, "Speed paths")."""
        if config.fused_lora:
            install_fused_lora(self._tuner_layers)
        #: ``fla`` or ``torch`` on a model with Gated DeltaNet layers (``linear_kernels.py``), else None.
        self.linear_attention_kernel = None
        if linear_attention_modules(self.decoder_layers()):
            self.linear_attention_kernel = resolve_linear_kernel(config.linear_attention_kernel, self.built_on.type)
            install_packed_linear_attention(self.decoder_layers(), self.linear_attention_kernel)
        #: Sequences' attention lengths padded up to a multiple of this (0: exact lengths;
        #: ``attention._causal``); None: 1024 where ``sdpa_varlen`` runs on CUDA, else 0.
        bucket = config.attention_length_bucket
        if bucket is None:
            bucket = 1024 if self.built_on.type == "cuda" and self.varlen_attention else 0
        self.attention_length_bucket = int(bucket)
        attention.set_length_bucket(self._attention_modules(), self.attention_length_bucket)
        #: ``liger`` (fused RMSNorm, SwiGLU product and rotary kernels) or ``torch`` (``fused_kernels.py``).
        self.elementwise_kernels = resolve_elementwise_kernels(config.elementwise_kernels, self.built_on.type)
        if self.elementwise_kernels == "liger":  # before the mixer checkpoints bind the attention forward they replay
            install_fused_kernels(self.decoder_layers())
        checkpointing = bool(config.gradient_checkpointing)
        layer_recompute = config.layer_recompute
        #: Per decoder layer: ``layer``, ``mixer``, ``mlp`` or ``none`` (``recompute.RECOMPUTE``).
        self.layer_recompute = self._recompute_plan(checkpointing, config.checkpoint_layers,
                                                    list(layer_recompute) if layer_recompute is not None else None)
        #: Decoder layers recomputed whole in the backward; 0 without checkpointing.
        self.checkpointed_layers = self.layer_recompute.count("layer")
        #: ``(tokens, plan)`` ascending, one plan a micro-batch size (``enable_recompute_tiers``);
        #: empty: ``layer_recompute`` for every micro-batch.
        self.recompute_tiers: list[tuple[int, list[str]]] = []
        self.active_recompute = list(self.layer_recompute)
        self._lean, self._checkpointing = bool(config.lean_activations), checkpointing
        layers = self.decoder_layers()
        if checkpointing:
            self.hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            for layer, policy in zip(layers, self.layer_recompute):
                layer._gradient_checkpointing_func = checkpoint_keeping_adapter(tuner_layers(layer))
                layer.gradient_checkpointing = policy == "layer"
            install_mixer_checkpoints(layers, [i for i, p in enumerate(self.layer_recompute) if p == "mixer"])
        if config.lean_activations:
            # MLP tails are lean only where nothing else replays the MLP (a whole-layer checkpoint or policy mlp)
            tails = [checkpointing and policy in ("none", "mixer") for policy in self.layer_recompute]
            install_lean_activations(layers, tails)
        install_mlp_recompute(layers, [i for i, p in enumerate(self.layer_recompute) if p == "mlp"])

    # ------------------------------------------------------------------ structure
    @property
    def hf_model(self) -> nn.Module:
        """The transformers causal LM (LoRA layers injected in place)."""
        return self.peft_model.base_model.model

    def _attention_modules(self) -> list[nn.Module]:
        """The decoder layers' softmax-attention modules (those with ``q_proj`` and ``o_proj``)."""
        return [m for layer in self.decoder_layers() for m in layer.modules() if hasattr(m, "q_proj")
                and hasattr(m, "o_proj")]

    def attention_backends(self) -> list[str]:
        """The SDPA backends this model's attention ran (``attention.chosen_backends``; empty
        before its first forward, or without ``sdpa_varlen``)."""
        return attention.chosen_backends(self._attention_modules())

    def resolved_keys(self) -> dict[str, Any]:
        """What the model's ``auto`` keys became where it was built: its kernels, its attention
        length bucket and its recompute plan (policies counted; the micro-batch sizes of its
        tiers). The run's record keeps it (``run.json``, each rank's entry)."""
        return {"built_on": str(self.built_on), "elementwise_kernels": self.elementwise_kernels,
                "linear_attention_kernel": self.linear_attention_kernel,
                "attention_length_bucket": self.attention_length_bucket,
                "layer_recompute": {p: self.layer_recompute.count(p) for p in sorted(set(self.layer_recompute))},
                "recompute_tiers": [int(tokens) for tokens, _ in self.recompute_tiers]}

    def decoder_layers(self) -> nn.ModuleList:
        """The decoder's layer list: FSDP2 units and gradient-checkpointing units."""
        layers = getattr(self.hf_model.base_model, "layers", None)
        if not isinstance(layers, nn.ModuleList):
            raise TypeError(f"{type(self.hf_model).__name__}: cannot find the decoder's `layers` list")
        return layers

    def adapter_parameters(self, adapter: str) -> list[nn.Parameter]:
        """The LoRA parameters of ``adapter`` (``actor`` or ``critic``), in layer order."""
        params = []
        for layer in self._tuner_layers:
            for attr in layer.adapter_layer_names:
                container = getattr(layer, attr)
                if adapter in container:
                    item = container[adapter]
                    params.extend([item] if isinstance(item, nn.Parameter) else item.parameters())
        if not params:
            raise KeyError(f"no LoRA parameters for adapter {adapter!r}")
        return params

    def actor_parameters(self) -> list[nn.Parameter]:
        """The actor adapter's LoRA parameters (what the actor optimizer steps)."""
        return self.adapter_parameters(ACTOR)

    def critic_parameters(self) -> list[nn.Parameter]:
        """The critic adapter's LoRA parameters and the value head's."""
        return self.adapter_parameters(CRITIC) + list(self.value_head.parameters())

    def _recompute_plan(self, checkpointing: bool, checkpoint_layers: Optional[int | str],
                        layer_recompute: Optional[Sequence[str]]) -> list[str]:
        """One policy a layer from ``checkpoint_layers`` (the first k whole) or ``layer_recompute``.
        ``auto`` arrives here only unresolved (the PPO module resolves it for the card before the
        build; a builder that does not, as on CPU): every layer, as ``None``."""
        count = len(self.decoder_layers())
        if checkpoint_layers == "auto":
            checkpoint_layers = None
        if not checkpointing:
            if checkpoint_layers is not None or layer_recompute is not None:
                raise ValueError(f"checkpoint_layers={checkpoint_layers} / layer_recompute={layer_recompute}: "
                                 f"each needs gradient_checkpointing=True")
            return ["none"] * count
        if layer_recompute is not None:
            plan = list(layer_recompute)
            if len(plan) != count or any(p not in RECOMPUTE for p in plan):
                raise ValueError(f"layer_recompute={plan} must name one of {', '.join(RECOMPUTE)} for each of the "
                                 f"{count} decoder layers")
            return plan
        k = count if checkpoint_layers is None else int(checkpoint_layers)
        if not 0 <= k <= count:
            raise ValueError(f"checkpoint_layers={checkpoint_layers} must be within 0..{count} (decoder layers)")
        return ["layer"] * k + ["none"] * (count - k)

    def enable_recompute_tiers(self, tiers: Sequence[tuple[int, Sequence[str]]]) -> None:
        """Recompute per micro-batch: ``tiers`` are ``(tokens, plan)``, one policy a layer of
        ``layer``, ``mixer`` or ``none`` (``mlp`` replaces an MLP's forward at the build and stays
        ``layer_recompute``'s); ``use_recompute_for`` then runs a micro-batch of ``tokens`` under
        the plan of the smallest tier that holds it, or the largest tier's. The model keeps the plan
        it was built with until then. Wraps the mixers and gives the lean MLP tails that some tier
        needs and the build did not install (both inert where a plan does not use them)."""
        if not tiers:
            return
        if not self._checkpointing:
            raise ValueError("recompute tiers need gradient_checkpointing=True")
        layers = self.decoder_layers()
        if "mlp" in self.layer_recompute:
            raise ValueError(f"recompute tiers need a build without policy mlp (layer_recompute={self.layer_recompute})")
        for tokens, plan in tiers:
            if len(plan) != len(layers) or any(p not in ("layer", "mixer", "none") for p in plan):
                raise ValueError(f"recompute tier at {tokens} tokens: {list(plan)} must name layer, mixer or none "
                                 f"for each of the {len(layers)} decoder layers")
        mixers = {i for _, plan in tiers for i, p in enumerate(plan) if p == "mixer"}
        install_mixer_checkpoints(layers, sorted(i for i in mixers if not hasattr(mixer_of(layers[i]), "_atlas_mixer_forward")))
        if self._lean:
            install_lean_tails(layers, sorted({i for _, plan in tiers for i, p in enumerate(plan) if p in ("none", "mixer")}))
        self.recompute_tiers = sorted((int(tokens), list(plan)) for tokens, plan in tiers)
        self._apply_recompute(self.layer_recompute)

    def use_recompute_for(self, tokens: int) -> list[str]:
        """Switch to the tier that holds a micro-batch of ``tokens`` (``enable_recompute_tiers``);
        returns the plan now in force. Without tiers, the built plan."""
        if not self.recompute_tiers:
            return self.active_recompute
        plan = next((plan for limit, plan in self.recompute_tiers if tokens <= limit), self.recompute_tiers[-1][1])
        if plan != self.active_recompute:
            self._apply_recompute(plan)
        return plan

    def _apply_recompute(self, plan: Sequence[str]) -> None:
        for layer, policy in zip(self.decoder_layers(), plan):
            layer.gradient_checkpointing = policy == "layer"
            mixer = mixer_of(layer)
            if hasattr(mixer, "_atlas_mixer_active"):
                mixer._atlas_mixer_active = policy == "mixer"
        self.active_recompute = list(plan)

    @staticmethod
    def _choose_layout(base: nn.Module, requested: str) -> str:
        # every layer kind sees packed boundaries (attention.py, linear_attention.py)
        return "packed" if requested == "auto" else requested

    # ------------------------------------------------------------------ passes
    def actor_forward(
        self, packed: PackedBatch, temperature: float = 1.0, compute_entropy: bool = True
    ) -> tuple[Tensor, Optional[Tensor]]:
        """Actor adapter: ``(log_probs (N,), entropy (N,) or None)``, fp32, of
        ``softmax(logits / temperature)``. Differentiable w.r.t. the actor's LoRA."""
        return self(packed, mode=ACTOR, temperature=temperature, compute_entropy=compute_entropy)

    def critic_forward(self, packed: PackedBatch) -> Tensor:
        """Critic adapter + value head: ``values (N,)`` fp32. Differentiable w.r.t. the critic."""
        return self(packed, mode=CRITIC)

    def base_forward(self, packed: PackedBatch, temperature: float = 1.0) -> Tensor:
        """Adapters off: the base policy's ``log_probs (N,)`` fp32, no grad (KL reference)."""
        with torch.no_grad():
            log_probs, _ = self(packed, mode="base", temperature=temperature, compute_entropy=False)
        return log_probs

    def forward(self, packed: PackedBatch, mode: str = ACTOR, temperature: float = 1.0, compute_entropy: bool = True):
        """Dispatch used by the three passes above (a module call, so FSDP2's hooks run)."""
        if mode not in (ACTOR, CRITIC, "base"):
            raise ValueError(f"mode={mode!r} is not one of actor, critic, base")
        if not isinstance(packed, PackedBatch):
            raise TypeError(f"expected a PackedBatch, got {type(packed).__name__}")
        with selected_adapter(self._tuner_layers, None if mode == "base" else mode):
            hidden = self._scoring_hidden_states(packed)
            if mode == CRITIC:
                # not a view: FSDP2 hooks the root's outputs, and an in-place op on a view would skip them
                return self.value_head(hidden.to(torch.float32)).squeeze(-1).clone()
            head = self.hf_model.get_output_embeddings()
            return token_logprobs_and_entropy(
                hidden,
                head.weight,
                packed.target_ids,
                chunk_tokens=self.logprob_chunk_tokens,
                temperature=temperature,
                compute_entropy=compute_entropy,
                bias=head.bias,
                float32_head=self.float32_head,
            )

    def _scoring_hidden_states(self, packed: PackedBatch) -> Tensor:
        """``(N, H)`` final (normed) hidden states at ``packed.logit_index``."""
        decoder = self.hf_model.base_model
        if self.sequence_layout == "packed":
            extra = {}
            if self.varlen_attention or self.linear_attention_kernel:
                extra[attention.SEQ_LENS_KWARG] = tuple(packed.seq_lens)
            if self.linear_attention_kernel:
                extra[CU_SEQLENS_KWARG] = packed.cu_seqlens.to(device=packed.input_ids.device, dtype=torch.long)
            out = decoder(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False, **extra)
            return out.last_hidden_state[0].index_select(0, packed.logit_index)
        ids, mask, positions, flat_index = packed.padded_layout()
        out = decoder(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False)
        hidden = out.last_hidden_state.reshape(-1, out.last_hidden_state.shape[-1])
        return hidden.index_select(0, flat_index[packed.logit_index])
