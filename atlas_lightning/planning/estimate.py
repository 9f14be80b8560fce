"""The per-card memory estimate of a run: ``estimate(model_shape, cfg) -> Plan``.

Pure Python (no torch): it reads a composed config (``config.compose``'s DictConfig or a
``config.RootConfig``; every key is read, none is defaulted here), the engines' arguments as
they will be started (``rollout.engines.args.EngineArgs``), and the shape of the base
(``shapes.ModelShape``, from ``config.json``), and predicts, for every phase of an RL step,
the peak bytes a card holds. Notation (bytes unless said):

* ``W`` training processes (FSDP2 ranks) = ``trainer.devices x trainer.num_nodes``;
* ``b`` base dtype bytes (``model.dtype``); ``c`` compute dtype bytes (bf16 -> 2, fp32 -> 4);
* ``P`` base parameters, ``P_root`` embeddings + final norm + head, ``P_layer`` the largest
  decoder layer, ``R_a``, ``R_c`` the actor's and the critic's LoRA parameters (rank x (in + out)
  over each one's adapted linears: the two may differ, each read from its starting adapter's
  ``adapter_config.json`` when it has one, ``store/lora_shapes.py``), ``R`` the role's own,
  ``H`` hidden, ``V`` vocabulary, ``L`` layers, each under one recompute policy (``layer``,
  ``mixer``, ``mlp``, ``none``: ``model.layer_recompute``, else the first ``model.checkpoint_layers``
  ``layer`` and the rest ``none``; ``auto`` is the plan ``recompute.py`` chooses for the card),
  ``L_ck`` of them ``layer`` (checkpointed whole);
* ``T`` tokens of a micro-batch: ``algorithm.ppo_max_token_len_per_gpu`` for updates,
  ``algorithm.forward_max_token_len_per_gpu`` for forward-only passes (padded layouts count
  ``n x max_len``, which the packer bounds by the same budget); ``N <= T`` response tokens,
  taken as ``T`` (an upper bound); ``C = min(model.logprob_chunk_tokens, N)``;
* ``a(kind)``, ``f(kind)``: saved and forward working-set bytes per token of one layer
  (``activations.py``, which gives their formulas), with the rank and adapted linears of the
  role that runs (actor passes: the actor's LoRA; values and the critic update: the critic's).

Terms of a training card. Held together (summed):

    base weights            P b / W
    FSDP root unsharded     P_root c                (W > 1: the root unit stays gathered)
    FSDP gathered layers    2 P_layer c             (W > 1: the running layer and the prefetched one)
    LoRA states             (R_a + R_c)(4 + 4 + 8) / W  (actor + critic: fp32 params, grads, Adam moments)
    layer inputs            L_ck T H c              (update: what checkpointing keeps)
    saved activations       T sum k(kind, policy)   (update: what each layer not checkpointed whole
                                                    keeps, ``activations.layer_parts``)
    embeddings, final norm  T H (2c + 4) + N H c    (update: layer-0 input, fp32 norm copy, head input)
    residual stream         3 T H c                 (forward-only: a layer's input, output, residual)
    attention mask          T x T (packed) or T x max_len (padded), sdpa/eager only

Transients that follow one another (only the largest is added: the head's backward runs and
frees its buffers before the first layer's backward starts, and a forward-only pass runs the
layers before the head; the H200 measurement shows it, actor and critic peaks being equal):

    log-prob chunks         12 C V + N H c          (actor: bf16 logits, fp32 log-softmax and
                                                    probabilities, bf16 grad; grad of hidden)
    value head input        (4 + c) N H             (critic: fp32 hidden, its grad; 4 N H forward-only)
    one layer recomputed    T max r(kind, policy)   (update: the largest replay, a(kind) for a whole
      + gradients             + 4 T H c              layer, or a kept MLP's backward; and the grads
                                                    of the residual stream in flight)
    one layer working set   T max f(kind)           (forward-only)

Card totals add ``RUNTIME_GIB`` (CUDA context, cuBLAS workspace, NCCL buffers), allocator
slack (``ALLOCATOR_SLACK`` x the tensors) and, in colocated layouts, the engine asleep
(``ENGINE_ASLEEP_GIB``; with ``rollout.enable_sleep_mode=false`` it keeps its whole budget).

Engine (vLLM): its budget is ``rollout.gpu_memory_utilization x card``; inside it, weights
``P 2 / TP``, a reserve for activations and sampler logits (``ENGINE_RESERVE_GIB`` +
``max_num_seqs x V x 4``), and the KV cache: ``full-attention layers x 2 x kv_heads/TP x
head_dim x 2`` bytes a token, plus the linear-attention state of each sequence. Generation on
a colocated card = trainer resident (weights, LoRA states) + the engine budget. A separate
layout with ``layout.share_cards``: the server's budget sits on every training card through every
phase (it is started before the model is built), so the trainer's phases have card x (1 -
utilization) less the runtime.

Model build (``model_build``, before the first step): every rank reads the whole base onto its
card before FSDP2 keeps its share (``models/build.py``): ``P b`` and both adapters' fp32
parameters, beside the engine asleep (or awake, without sleep mode) and the runtime.

Weight sync: ``lora`` gathers the actor's full adapter (``4 R_a``) and reads the exported folder
back onto the card for its check (``4 R_a`` more); ``merged`` holds the engine's weights
awake, a bucket (``max(bucket_mb, largest tensor)``) and one merged copy of the largest tensor.
Separate layout, merged (vLLM's weight-transfer API, ``rollout/engines/weight_transfer.py``): the
sender (training rank 0) also holds vLLM's ``NCCL_NUM_BUFFERS`` packed send buffers of a bucket
each; every serving card holds as many receive buffers beside the engine's budget, and vLLM's
layerwise reload materializes about one layer's weights (``P 2 / layers / TP``) at a time.

Calibration: the log-prob term reproduces the H200 measurement of ``models/logprobs.py``
(hidden 5120, vocabulary 248,320, 49,152 tokens: 2.8 GiB at 1,024-token chunks, 11.4 GiB at
4,096). Against memory-check on an H200 (``tests/scale/device_memory_check.py``; figures in
``tests/scale/h200_memory_check.json``, asserted by ``tests/scale/test_plan_vs_h200.py``) the
dense terms are analytic and land within a few per cent; the torch-fallback linear-attention
terms carry fitted factors (``activations.py``).

Who calls it: ``planning.make_plan`` (the ``plan`` verb, pre-flight), ``memory_check`` (to print
the prediction beside the measurement).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Optional, Sequence

from atlas_lightning.rollout.engines.args import EngineArgs
from atlas_lightning.store.lora_shapes import lora_shapes_or_config

from .activations import POLICIES, LayerParts, forward_bytes_per_token, layer_parts
from .shapes import FULL, ModelShape

GIB = 2**30
RUNTIME_GIB = 1.0
ALLOCATOR_SLACK = 1.05
ENGINE_ASLEEP_GIB = 1.5
ENGINE_RESERVE_GIB = 2.0
GRADIENT_STREAMS = 4
LOGPROB_BYTES_PER_ENTRY = 12
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
#: The overhead term of a training card that a separate layout's server shares (``layout.share_cards``).
SHARED_SERVER = "vLLM server on this card (gpu_memory_utilization x card)"
#: Packed buffers each side of vLLM's nccl weight transfer keeps (``rollout.engines.weight_transfer.NCCL_NUM_BUFFERS``).
NCCL_NUM_BUFFERS = 2
#: ``model.checkpoint_layers``' value that leaves the count to ``recompute.py``.
AUTO = "auto"
#: The overhead term of a training card that the CUDA runtime is.
RUNTIME = "runtime (CUDA context, NCCL)"


@dataclass
class Phase:
    """One phase's peak on one kind of card: ``terms`` (name -> bytes) are torch tensors;
    ``overhead`` (name -> bytes) is what the card holds outside them."""

    name: str
    cards: str
    terms: dict[str, float]
    overhead: dict[str, float] = field(default_factory=dict)
    #: Transients that happen one after another (the head's backward, then the layers'): only
    #: the largest counts at the peak.
    sequential: dict[str, float] = field(default_factory=dict)
    #: Tokens of the micro-batch this phase was estimated at (None: not token-driven).
    tokens: Optional[int] = None
    #: Reserved over allocated bytes of the caching allocator (1.0 where no card is sized).
    slack: float = 1.0

    @property
    def tensors(self) -> float:
        """Bytes of torch tensors: what ``torch.cuda.max_memory_allocated`` measures."""
        return float(sum(self.terms.values())) + max(self.sequential.values(), default=0.0)

    @property
    def card(self) -> float:
        """Bytes of the card in use: tensors with allocator slack, plus the overhead."""
        return self.tensors * self.slack + float(sum(self.overhead.values()))

    def largest(self, k: int = 3) -> list[tuple[str, float]]:
        items = list(self.terms.items())
        if self.sequential:
            items.append(max(self.sequential.items(), key=lambda kv: kv[1]))
        return sorted(items, key=lambda kv: -kv[1])[:k]

    def to_dict(self) -> dict:
        return {"name": self.name, "cards": self.cards, "tokens": self.tokens,
                "tensors_gib": self.tensors / GIB, "card_gib": self.card / GIB,
                "terms_gib": {k: v / GIB for k, v in self.terms.items()},
                "sequential_gib": {k: v / GIB for k, v in self.sequential.items()},
                "overhead_gib": {k: v / GIB for k, v in self.overhead.items()}}


@dataclass
class Plan:
    """What ``estimate`` predicts and what the checks concluded (``refusals`` empty: it may run)."""

    name: str
    device: str  # "gpu" or "cpu"
    card_bytes: float
    model: dict
    phases: list[Phase] = field(default_factory=list)
    refusals: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    engine: dict = field(default_factory=dict)
    #: Largest ``ppo_max_token_len_per_gpu`` whose update phases fit the card (GPU only).
    max_update_tokens: Optional[int] = None
    #: What ``model.checkpoint_layers=auto`` chose for this card (``recompute.RecomputeChoice.to_dict``).
    recompute: Optional[dict] = None

    @property
    def ok(self) -> bool:
        return not self.refusals

    def phase(self, name: str, cards: Optional[str] = None) -> Phase:
        for phase in self.phases:
            if phase.name == name and (cards is None or phase.cards == cards):
                return phase
        raise KeyError(f"no phase {name!r} in the plan of {self.name}")

    def to_dict(self) -> dict:
        return {"name": self.name, "ok": self.ok, "device": self.device, "card_gib": self.card_bytes / GIB,
                "model": self.model, "engine": self.engine, "max_update_tokens": self.max_update_tokens,
                "phases": [p.to_dict() for p in self.phases], "refusals": list(self.refusals),
                "notes": list(self.notes), "recompute": self.recompute}


# ----------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class Inputs:
    """The config values the estimate reads, named (``from_config``)."""

    world: int
    device: str
    colocated: bool
    dtype_bytes: int
    compute_bytes: int
    #: ``{"actor": LoraShape, "critic": LoraShape}`` (``store.lora_shapes``): what each adapter trains.
    lora: dict
    checkpointing: bool
    #: Decoder layers checkpointed (None: all); ``model.checkpoint_layers=auto`` reads as None
    #: here, its choice being ``recompute.py``'s (``estimate``'s ``layer_recompute``).
    checkpoint_layers: Optional[int]
    #: ``model.layer_recompute``: one policy a decoder layer (``activations.POLICIES``), which
    #: overrides ``checkpoint_layers``; None: the count decides.
    layer_recompute: Optional[tuple]
    #: ``model.lean_activations``: bf16 norm inputs, lean MLP tails (``activations.layer_parts``).
    lean: bool
    chunk_tokens: int
    attn: str
    padded: bool
    update_tokens: int
    forward_tokens: int
    max_sequence: int
    use_ref: bool
    serve_cards: int
    #: Separate layout with ``layout.share_cards``: the server keeps its budget on the training cards.
    shares_cards: bool
    weight_sync: str
    bucket_bytes: int
    #: The engines' arguments, as ``rollout.factory`` and ``rollout.separate`` start them.
    engine: EngineArgs
    #: What resolving ``lora`` noted (a starting adapter that could not be read: ``lora_shapes_or_config``).
    lora_notes: tuple = ()

    @property
    def engine_tp(self) -> int:
        return self.engine.tensor_parallel_size

    @property
    def gpu_memory_utilization(self) -> float:
        return self.engine.gpu_memory_utilization

    @property
    def sleep_mode(self) -> bool:
        return self.engine.enable_sleep_mode

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def max_num_seqs(self) -> int:
        return self.engine.max_num_seqs

    @property
    def cpu_kvcache_gib(self) -> float:
        return float(self.engine.cpu_kvcache_gib)

    @classmethod
    def from_config(cls, cfg: Any) -> "Inputs":
        """From a composed config (every key present: the schema holds the defaults)."""
        model, algorithm, rollout = cfg.model, cfg.algorithm, cfg.rollout
        dtype = str(model.dtype)
        layers = model.checkpoint_layers
        lora, notes = lora_shapes_or_config(cfg)  # resolved once: the estimate's terms and the engine's rank
        return cls(
            world=int(cfg.trainer.devices) * int(cfg.trainer.num_nodes),
            device="cpu" if cfg.trainer.accelerator == "cpu" else "gpu",
            colocated=cfg.layout.mode == "colocated",
            dtype_bytes=DTYPE_BYTES[dtype],
            compute_bytes=DTYPE_BYTES[dtype],
            lora=lora,
            checkpointing=bool(model.gradient_checkpointing),
            checkpoint_layers=None if layers is None or layers == AUTO else int(layers),
            layer_recompute=None if model.layer_recompute is None else tuple(str(p) for p in model.layer_recompute),
            lean=bool(model.lean_activations),
            chunk_tokens=int(model.logprob_chunk_tokens),
            attn=str(model.attn_implementation),
            padded=str(model.sequence_layout) == "padded",
            update_tokens=int(algorithm.ppo_max_token_len_per_gpu),
            forward_tokens=int(algorithm.forward_max_token_len_per_gpu),
            max_sequence=int(rollout.max_prompt_length) + int(rollout.max_response_length),
            use_ref=bool(algorithm.use_kl_loss or algorithm.use_kl_in_reward),
            serve_cards=int(cfg.layout.serve_gpus),
            shares_cards=cfg.layout.mode == "separate" and bool(cfg.layout.share_cards),
            weight_sync=str(rollout.weight_sync),
            bucket_bytes=int(rollout.bucket_mb) * 2**20,
            engine=EngineArgs.from_config(cfg, actor_lora=lora["actor"]),
            lora_notes=tuple(notes),
        )


# ----------------------------------------------------------------------------- the estimate


class _Model:
    """The estimate's arithmetic for one shape and config (phase builders)."""

    def __init__(self, shape: ModelShape, inputs: Inputs, linear_kernel: str) -> None:
        self.s, self.i, self.kernel = shape, inputs, linear_kernel
        self.c = inputs.compute_bytes
        #: per role: adapted linears of each layer kind, and LoRA parameters
        self.adapted = {role: {kind: len(shape.adapted_linears(kind, lora.target_modules)) for kind in set(shape.layer_types)}
                        for role, lora in inputs.lora.items()}
        self.lora = {role: shape.lora_params(lora.rank, lora.target_modules) for role, lora in inputs.lora.items()}
        #: One recompute policy a decoder layer, as ``ActorCritic`` resolves them.
        self.policies = recompute_policies(shape.num_layers, inputs)

    @property
    def checkpointed(self) -> list[str]:
        """The kinds of the layers checkpointed whole."""
        return [kind for kind, policy in zip(self.s.layer_types, self.policies) if policy == "layer"]

    def _parts(self, kind: str, role: str) -> LayerParts:
        return layer_parts(self.s, kind, c=self.c, rank=self.i.lora[role].rank, adapted=self.adapted[role][kind],
                           linear_kernel=self.kernel, lean=self.i.lean)

    def _kept(self, role: str) -> float:
        """Bytes a token every layer not checkpointed whole keeps (``activations.layer_parts``)."""
        lean_tails = self.i.lean and self.i.checkpointing
        return sum(self._parts(kind, role).kept(policy, lean_tails) for kind, policy in zip(self.s.layer_types, self.policies))

    def _replayed(self, role: str) -> float:
        """Bytes a token of the largest replay the backward runs (0: nothing is recomputed)."""
        return max((self._parts(kind, role).replayed(policy) for kind, policy in set(zip(self.s.layer_types, self.policies))),
                   default=0.0)

    def _forward(self, kind: str, role: str) -> float:
        return forward_bytes_per_token(self.s, kind, c=self.c, rank=self.i.lora[role].rank,
                                       adapted=self.adapted[role][kind], linear_kernel=self.kernel)

    def resident(self) -> dict[str, float]:
        s, i, c = self.s, self.i, self.c
        terms = {"base weights": s.base_params * i.dtype_bytes / i.world}
        if i.world > 1:
            terms["FSDP root unsharded"] = s.root_params * c
            terms["FSDP gathered layers"] = 2 * s.largest_layer_params * c
        terms["LoRA states (actor+critic)"] = ((self.lora["actor"] + self.lora["critic"]) * 16
                                               + 2 * (s.hidden_size + 1) * 16) / i.world
        return terms

    def _mask(self, tokens: int) -> float:
        if self.i.attn not in ("sdpa", "eager"):
            return 0.0
        if self.i.padded:  # padded (n, max_len): n masks of max_len^2
            return float(tokens) * min(self.i.max_sequence, tokens)
        return float(tokens) * tokens

    def update(self, role: str, tokens: int) -> tuple[dict[str, float], dict[str, float]]:
        """``(terms, sequential)`` of an update micro-step of ``role`` (module doc)."""
        s, c = self.s, self.c
        h, t, n = s.hidden_size, float(tokens), float(tokens)
        terms = self.resident()
        if self.checkpointed:
            terms["layer inputs (checkpointed)"] = len(self.checkpointed) * t * h * c
        kept = self._kept(role)
        if kept:
            terms["saved activations"] = t * kept
        terms["embeddings, final norm"] = t * h * (2 * c + 4) + n * h * c
        mask = self._mask(tokens)
        if mask:
            terms["attention mask"] = mask
        sequential = {}
        if role == "actor":
            chunk = min(self.i.chunk_tokens, tokens)
            sequential["log-prob chunks"] = LOGPROB_BYTES_PER_ENTRY * chunk * s.vocab_size + n * h * c
        else:
            sequential["value head input"] = n * h * (4 + c)
        recompute = t * self._replayed(role)
        sequential["one layer recomputed + gradients" if recompute else "gradients"] = (
            recompute + GRADIENT_STREAMS * t * h * c)
        return terms, sequential

    def forward(self, role: str, tokens: int) -> tuple[dict[str, float], dict[str, float]]:
        """``(terms, sequential)`` of a forward-only pass of ``role`` (module doc)."""
        s, c = self.s, self.c
        h, t = s.hidden_size, float(tokens)
        terms = self.resident()
        terms["residual stream"] = 3 * t * h * c
        mask = self._mask(tokens)
        if mask:
            terms["attention mask"] = mask
        lora_role = "critic" if role == "critic" else "actor"  # the base pass ("ref") runs the actor's shape, adapter off
        sequential = {"one layer working set": t * max(self._forward(kind, lora_role) for kind in set(s.layer_types))}
        if role == "critic":
            sequential["value head input"] = t * h * 4
        else:
            chunk = min(self.i.chunk_tokens, tokens)
            sequential["log-prob chunks"] = LOGPROB_BYTES_PER_ENTRY * chunk * s.vocab_size
        return terms, sequential


def _engine(shape: ModelShape, inputs: Inputs, card_bytes: float) -> dict:
    """The engine's budget and KV capacity per serving card (module doc)."""
    tp = max(inputs.engine_tp, 1)
    budget = inputs.gpu_memory_utilization * card_bytes if inputs.device == "gpu" else inputs.cpu_kvcache_gib * GIB
    weights = shape.base_params * 2 / tp
    reserve = ENGINE_RESERVE_GIB * GIB + inputs.max_num_seqs * shape.vocab_size * 4
    kv_heads = max(1.0, shape.num_kv_heads / tp)
    per_token = shape.count(FULL) * 2 * kv_heads * shape.head_dim * 2
    per_sequence_state = shape.recurrent_state_bytes_per_sequence() / tp
    kv = budget - weights - reserve if inputs.device == "gpu" else budget
    per_sequence = inputs.max_model_len * per_token + per_sequence_state
    return {
        "tensor_parallel_size": tp, "max_num_seqs": inputs.max_num_seqs,
        "budget_gib": budget / GIB, "weights_gib": weights / GIB, "reserve_gib": reserve / GIB,
        "kv_cache_gib": kv / GIB, "kv_bytes_per_token": per_token,
        "state_bytes_per_sequence": per_sequence_state,
        "full_length_sequences": max(kv, 0.0) / per_sequence if per_sequence else float("inf"),
    }


def training_overhead(inputs: Inputs, card: float) -> dict[str, float]:
    """What a training card holds beside the trainer's tensors through the forward passes and the
    updates (name -> bytes; module doc): the runtime, and a colocated engine asleep (its whole
    budget without sleep mode) or a separate layout's server sharing the card. Empty on CPU."""
    overhead: dict[str, float] = {}
    if inputs.device != "gpu":
        return overhead
    overhead[RUNTIME] = RUNTIME_GIB * GIB
    if inputs.colocated:
        asleep = ENGINE_ASLEEP_GIB * GIB if inputs.sleep_mode else inputs.gpu_memory_utilization * card
        overhead["engine asleep" if inputs.sleep_mode else "engine awake (no sleep mode)"] = asleep
    elif inputs.shares_cards:  # the server was started first and keeps its share throughout
        overhead[SHARED_SERVER] = inputs.gpu_memory_utilization * card
    return overhead


def recompute_policies(layers: int, inputs: Inputs) -> list[str]:
    """One policy a decoder layer (``activations.POLICIES``), as ``ActorCritic._recompute_plan``
    resolves the config: ``none`` everywhere without checkpointing, else ``layer_recompute``,
    else the first ``checkpoint_layers`` (None: all) ``layer`` and the rest ``none``."""
    if not inputs.checkpointing:
        return ["none"] * layers
    if inputs.layer_recompute is not None:
        if len(inputs.layer_recompute) != layers:
            raise ValueError(f"model.layer_recompute names {len(inputs.layer_recompute)} policies for {layers} "
                             f"decoder layers")
        return list(inputs.layer_recompute)
    count = layers if inputs.checkpoint_layers is None else min(inputs.checkpoint_layers, layers)
    return ["layer"] * count + ["none"] * (layers - count)


def update_tensors(shape: ModelShape, inputs: Inputs, linear_kernel: str, policies: Sequence[str]) -> float:
    """Bytes of torch tensors at the larger of the two update phases (actor, critic) with one
    recompute policy a decoder layer (``policies``), at ``inputs.update_tokens`` a micro-batch:
    what ``estimate`` puts in ``update_actor`` / ``update_critic``'s ``tensors`` for that plan."""
    model = _Model(shape, replace(inputs, layer_recompute=tuple(policies)), linear_kernel)
    phases = [_update_phase(model, role, inputs.update_tokens, {}) for role in ("actor", "critic")]
    return max(phase.tensors for phase in phases)


def estimate(model_shape: ModelShape, cfg: Any, *, card_gib: Optional[float] = None, linear_kernel: str = "fla",
             name: Optional[str] = None, layer_recompute: Optional[Sequence[str]] = None) -> Plan:
    """Predict every phase's per-card peak for ``cfg`` on cards of ``card_gib`` GiB (None:
    ``plan.card_gib``; module doc for each term's formula) and refuse what cannot fit
    (``Plan.refusals``). ``layer_recompute``: one policy a layer, in place of the config's
    ``model.layer_recompute`` and ``model.checkpoint_layers`` (``auto``'s plan, which ``make_plan``
    passes here from ``recompute.py``; None: the config's, its ``auto`` planned as every layer).

    ``linear_kernel``: which Gated DeltaNet path the trainer will run on a hybrid model,
    ``fla`` (flash-linear-attention installed) or ``torch`` (transformers' fallback).
    Layout consistency (world sizes, TP, separate layouts) is ``checks.layout_refusals``'
    business; this function only sizes memory.
    """
    inputs = Inputs.from_config(cfg)
    if layer_recompute is not None:
        inputs = replace(inputs, layer_recompute=tuple(layer_recompute))
    card = float(cfg.plan.card_gib if card_gib is None else card_gib) * GIB
    model = _Model(model_shape, inputs, linear_kernel)
    s = model_shape
    plan = Plan(
        name=name or str(cfg.name),
        device=inputs.device,
        card_bytes=card,
        model={"model_type": s.model_type, "base_params": s.base_params, "lora_params": dict(model.lora),
               "lora": {role: f"{lora.describe()} ({lora.source})" for role, lora in inputs.lora.items()},
               "layers": s.num_layers, "linear_attention_layers": s.count("linear_attention"),
               "hidden_size": s.hidden_size, "vocab_size": s.vocab_size,
               "layout": "padded" if inputs.padded else "packed",
               "linear_attention_kernel": linear_kernel if s.recurrent else None,
               "checkpointed_layers": len(model.checkpointed),
               "recompute": {p: model.policies.count(p) for p in POLICIES if p in model.policies},
               "world_size": inputs.world},
    )
    plan.notes.extend(inputs.lora_notes)
    train_cards = "every card" if inputs.colocated else "training cards"
    slack = ALLOCATOR_SLACK if inputs.device == "gpu" else 1.0
    overhead = training_overhead(inputs, card)

    # the model build (models/build.py): each rank reads the whole base onto its card, then FSDP2
    # keeps its share; a colocated engine sleeps meanwhile where it sleeps for updates
    build = {"base weights, whole (before sharding)": s.base_params * inputs.dtype_bytes,
             "LoRA parameters, whole (fp32)": (model.lora["actor"] + model.lora["critic"] + s.hidden_size + 1) * 4}
    plan.phases.append(Phase("model_build", train_cards, build, overhead, slack=slack))
    engine = _engine(s, inputs, card)
    plan.engine = engine
    if inputs.colocated or inputs.shares_cards or inputs.device == "cpu":
        resident = model.resident()
        gen_terms = dict(resident)
        gen_overhead = {"engine (gpu_memory_utilization x card)": engine["budget_gib"] * GIB} if inputs.device == "gpu" else {}
        if inputs.device == "gpu":
            gen_overhead[RUNTIME] = RUNTIME_GIB * GIB
        plan.phases.append(Phase("generation", train_cards, gen_terms, gen_overhead, slack=slack))
    else:
        serve_overhead = {"engine (gpu_memory_utilization x card)": engine["budget_gib"] * GIB,
                          RUNTIME: RUNTIME_GIB * GIB}
        plan.phases.append(Phase("generation", "serving cards", {}, serve_overhead))

    for role, phase_name in (("actor", "old_log_prob"), ("critic", "values")):
        terms, sequential = model.forward(role, inputs.forward_tokens)
        plan.phases.append(Phase(phase_name, train_cards, terms, overhead, sequential=sequential,
                                 tokens=inputs.forward_tokens, slack=slack))
    if inputs.use_ref:
        terms, sequential = model.forward("actor", inputs.forward_tokens)
        plan.phases.append(Phase("ref", train_cards, terms, overhead, sequential=sequential,
                                 tokens=inputs.forward_tokens, slack=slack))
    for role in ("critic", "actor"):
        terms, sequential = model.update(role, inputs.update_tokens)
        plan.phases.append(Phase(f"update_{role}", train_cards, terms, overhead, sequential=sequential,
                                 tokens=inputs.update_tokens, slack=slack))

    _add_sync_phases(plan, model, s, inputs, engine, overhead, train_cards, slack)

    _capacity_refusals(plan, model, inputs, engine, card)
    return plan


def _add_sync_phases(plan: Plan, model: "_Model", s: ModelShape, inputs: Inputs, engine: dict, overhead: dict,
                     train_cards: str, slack: float) -> None:
    """The weight sync's phase on the training cards (the adapter gathered, or merged buckets and
    their send buffers) and, for merged weights to a separate server, the serving cards' receive."""
    sync = model.resident()
    if inputs.weight_sync == "merged":
        bucket = max(inputs.bucket_bytes, s.largest_tensor_params * inputs.dtype_bytes)
        sync["merged bucket"] = bucket
        sync["merge copy of one tensor"] = s.largest_tensor_params * inputs.dtype_bytes
        sync_overhead = dict(overhead)
        if inputs.colocated and inputs.device == "gpu":
            sync_overhead["engine weights awake"] = engine["weights_gib"] * GIB
        if not inputs.colocated:
            sync[f"send buffers ({NCCL_NUM_BUFFERS} x bucket, rank 0)"] = NCCL_NUM_BUFFERS * bucket
            plan.phases.append(_receive_phase(s, inputs, engine, bucket))
    else:
        sync["gathered adapter"] = model.lora["actor"] * 4
        sync["exported folder read back (its check)"] = model.lora["actor"] * 4
        sync_overhead = dict(overhead)
    plan.phases.append(Phase("update_weights", train_cards, sync, sync_overhead, slack=slack))


def _receive_phase(s: ModelShape, inputs: Inputs, engine: dict, bucket: float) -> Phase:
    """A serving card while merged weights arrive (module doc): the engine's budget stays
    allocated, receive buffers and the layerwise reload's one layer come on top of it."""
    terms = {f"receive buffers ({NCCL_NUM_BUFFERS} x bucket)": NCCL_NUM_BUFFERS * bucket,
             "layerwise reload (one layer)": s.base_params * 2 / max(s.num_layers, 1) / max(inputs.engine_tp, 1)}
    overhead = {"engine (gpu_memory_utilization x card)": engine["budget_gib"] * GIB}
    if inputs.device == "gpu":
        overhead[RUNTIME] = RUNTIME_GIB * GIB
    return Phase("receive_weights", "serving cards", terms, overhead)


def _capacity_refusals(plan: Plan, model: _Model, inputs: Inputs, engine: dict, card: float) -> None:
    if inputs.device != "gpu":
        plan.notes.append("CPU run: no card to fit; the figures are for information (host memory)")
        return
    budget_name = {"update_critic": "algorithm.ppo_max_token_len_per_gpu",
                   "update_actor": "algorithm.ppo_max_token_len_per_gpu",
                   "old_log_prob": "algorithm.forward_max_token_len_per_gpu",
                   "values": "algorithm.forward_max_token_len_per_gpu",
                   "ref": "algorithm.forward_max_token_len_per_gpu"}
    fits = lambda phase: phase.card <= card  # noqa: E731
    overhead = plan.phase("update_actor").overhead
    plan.max_update_tokens = _largest_fitting(
        lambda t: max(_update_phase(model, role, t, overhead).card for role in ("actor", "critic")), card)
    for phase in plan.phases:
        if fits(phase):
            continue
        top = ", ".join(f"{k} {v / GIB:.1f}" for k, v in phase.largest())
        if phase.name in budget_name:
            largest = plan.max_update_tokens if phase.name.startswith("update") else _largest_fitting(
                lambda t, n=phase.name: _forward_phase(model, "critic" if n == "values" else "actor", t,
                                                       phase.overhead).card, card)
            advice = (f"; the largest {budget_name[phase.name]} that fits is about {largest:,}" if largest
                      else "; no token budget fits: fewer parameters per card are needed (more cards)")
            plan.refusals.append(
                f"{phase.name} on {phase.cards}: needs {phase.card / GIB:.1f} GiB of a {card / GIB:.0f} GiB card at "
                f"{budget_name[phase.name]}={phase.tokens:,} (largest terms, GiB: {top}){advice}")
        elif phase.name == "receive_weights":
            plan.refusals.append(
                f"receive_weights on {phase.cards}: the engine keeps rollout.gpu_memory_utilization="
                f"{inputs.gpu_memory_utilization} x {card / GIB:.0f} GiB and the merged-weight buckets need "
                f"{phase.tensors / GIB:.1f} GiB more ({top}): {phase.card / GIB:.1f} GiB in all; lower "
                f"rollout.bucket_mb or rollout.gpu_memory_utilization")
        elif phase.name == "model_build":
            plan.refusals.append(
                f"model_build on {phase.cards}: each rank reads the whole base onto its card before FSDP2 shards it "
                f"(models/build.py): {phase.card / GIB:.1f} GiB of a {card / GIB:.0f} GiB card (largest terms, GiB: "
                f"{top}); more cards do not lower it: a card that holds the base beside what stays on it "
                f"(rollout.enable_sleep_mode=true puts a colocated engine to sleep meanwhile)")
        elif phase.name == "generation":
            plan.refusals.append(
                f"generation on {phase.cards}: the trainer keeps {phase.tensors / GIB:.1f} GiB and the engine asks for "
                f"rollout.gpu_memory_utilization={inputs.gpu_memory_utilization} x {card / GIB:.0f} GiB = "
                f"{engine['budget_gib']:.1f} GiB: {phase.card / GIB:.1f} GiB in all; lower gpu_memory_utilization")
        else:
            plan.refusals.append(
                f"{phase.name} on {phase.cards}: needs {phase.card / GIB:.1f} GiB of a {card / GIB:.0f} GiB card "
                f"(largest terms, GiB: {top})")
    if engine["kv_cache_gib"] <= 0 or engine["full_length_sequences"] < 1:
        plan.refusals.append(
            f"engine: rollout.gpu_memory_utilization={inputs.gpu_memory_utilization} gives {engine['budget_gib']:.1f} GiB; "
            f"weights take {engine['weights_gib']:.1f} GiB at TP{inputs.engine_tp} and the reserve "
            f"{engine['reserve_gib']:.1f} GiB, leaving {engine['kv_cache_gib']:.1f} GiB of KV cache: "
            f"{engine['full_length_sequences']:.2f} sequences of rollout.max_model_len={inputs.max_model_len}")


def _update_phase(model: _Model, role: str, tokens: int, overhead: dict) -> Phase:
    terms, sequential = model.update(role, tokens)
    return Phase("update", "", terms, overhead, sequential=sequential, slack=ALLOCATOR_SLACK)


def _forward_phase(model: _Model, role: str, tokens: int, overhead: dict) -> Phase:
    terms, sequential = model.forward(role, tokens)
    return Phase("forward", "", terms, overhead, sequential=sequential, slack=ALLOCATOR_SLACK)


def _largest_fitting(card_at, card: float, ceiling: int = 1 << 22) -> Optional[int]:
    """Largest token count (a multiple of 1,024) whose ``card_at(tokens)`` fits ``card``; None if none."""
    if card_at(1024) > card:
        return None
    low, high = 1024, 2048
    while high < ceiling and card_at(high) <= card:
        low, high = high, high * 2
    while high - low > 1024:
        mid = (low + high) // 2 // 1024 * 1024
        if mid <= low:
            break
        low, high = (mid, high) if card_at(mid) <= card else (low, mid)
    return low
