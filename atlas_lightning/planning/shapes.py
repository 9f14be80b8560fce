"""A base model's shapes, read from its folder's ``config.json`` alone (no weights, no torch).

``ModelShape`` holds what the memory estimate needs: hidden size, layers and their kinds
(full attention, or Gated DeltaNet linear attention for Qwen3.5/3.6), heads, head dims, MLP
width, vocabulary, tied head. From those it derives the parameter counts of the base, of each
decoder layer, of the root (embeddings, final norm, head) and of a LoRA adapter, using the
same module layout as transformers builds (``tests/scale`` checks the counts against models
built on the meta device).

Families: ``qwen3`` (q/k norms), ``qwen2``, ``llama``, ``mistral`` (dense attention + SwiGLU
MLP), and ``qwen3_5`` / ``qwen3_5_text`` (hybrid: linear-attention layers with an output-gated
full-attention layer every ``full_attention_interval``; a Qwen3.5/3.6 checkpoint's config
nests the text model under ``text_config``). Anything else is refused by name.

Who calls it: ``planning.estimate`` (the plan), ``preflight`` (adapter shapes against the base).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional

from atlas_lightning.errors import quoted

DENSE_FAMILIES = ("qwen3", "qwen2", "llama", "mistral")
HYBRID_FAMILIES = ("qwen3_5", "qwen3_5_text")
FULL, LINEAR = "full_attention", "linear_attention"


class ShapeError(ValueError):
    """The model folder's config cannot be read into a shape; the message names the file and field."""


@dataclass(frozen=True)
class Linear:
    """One ``nn.Linear`` of a decoder layer: module name (as peft's target names), in, out."""

    name: str
    in_features: int
    out_features: int
    bias: bool = False

    @property
    def params(self) -> int:
        return self.in_features * self.out_features + (self.out_features if self.bias else 0)


@dataclass(frozen=True)
class ModelShape:
    """The text decoder of a causal LM. ``layer_types[i]`` is ``full_attention`` or
    ``linear_attention``; dense families have only the former."""

    model_type: str
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    #: Qwen3.5/3.6: q_proj also emits a sigmoid gate on the attention output (2x its width).
    attn_output_gate: bool = False
    #: q_norm/k_norm on each head (Qwen3, Qwen3.5).
    qk_norm: bool = False
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    source: str = field(default="", compare=False)

    # ------------------------------------------------------------------ structure
    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def recurrent(self) -> bool:
        """Has linear-attention layers: transformers runs it right-padded (``actor_critic``)."""
        return LINEAR in self.layer_types

    def count(self, kind: str) -> int:
        return sum(1 for t in self.layer_types if t == kind)

    @property
    def q_width(self) -> int:
        """Attention output width ``heads x head_dim`` (o_proj's input)."""
        return self.num_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_conv_dim(self) -> int:
        """Channels of the depthwise causal conv over q, k and v (``2 key_dim + value_dim``)."""
        return 2 * self.linear_key_dim + self.linear_value_dim

    def linears(self, kind: str) -> list[Linear]:
        """The ``nn.Linear`` modules of one decoder layer of ``kind`` (attention block, then MLP)."""
        h, bias = self.hidden_size, self.attention_bias
        if kind == FULL:
            q_out = self.q_width * (2 if self.attn_output_gate else 1)
            mixer = [Linear("q_proj", h, q_out, bias), Linear("k_proj", h, self.kv_width, bias),
                     Linear("v_proj", h, self.kv_width, bias), Linear("o_proj", self.q_width, h, bias and self.model_type != "qwen2")]
        elif kind == LINEAR:
            nv = self.linear_num_value_heads
            mixer = [Linear("in_proj_qkv", h, self.linear_conv_dim), Linear("in_proj_z", h, self.linear_value_dim),
                     Linear("in_proj_b", h, nv), Linear("in_proj_a", h, nv), Linear("out_proj", self.linear_value_dim, h)]
        else:
            raise ShapeError(f"{self.source}: unknown layer type {kind!r}")
        i = self.intermediate_size
        return mixer + [Linear("gate_proj", h, i), Linear("up_proj", h, i), Linear("down_proj", i, h)]

    def layer_params(self, kind: str) -> int:
        """Parameters of one decoder layer of ``kind``: linears, norms and (linear attention)
        the depthwise conv, ``dt_bias``, ``A_log`` and the gated norm."""
        params = sum(lin.params for lin in self.linears(kind)) + 2 * self.hidden_size  # two RMSNorms
        if kind == FULL and self.qk_norm:
            params += 2 * self.head_dim
        if kind == LINEAR:
            params += self.linear_conv_dim * self.linear_conv_kernel_dim  # conv1d, no bias
            params += 2 * self.linear_num_value_heads + self.linear_value_head_dim  # dt_bias, A_log, norm
        return params

    @property
    def root_params(self) -> int:
        """Embeddings, final norm and output head (one matrix when tied): FSDP2's root unit."""
        head = 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size
        return self.vocab_size * self.hidden_size + head + self.hidden_size

    @property
    def base_params(self) -> int:
        return self.root_params + sum(self.layer_params(t) for t in self.layer_types)

    @property
    def largest_layer_params(self) -> int:
        return max(self.layer_params(t) for t in set(self.layer_types))

    @property
    def largest_tensor_params(self) -> int:
        """The largest single parameter (the embedding matrix for every model here)."""
        biggest = max(lin.in_features * lin.out_features for t in set(self.layer_types) for lin in self.linears(t))
        return max(self.vocab_size * self.hidden_size, biggest)

    def adapted_linears(self, kind: str, target_modules: Any) -> list[Linear]:
        """The linears of a ``kind`` layer that LoRA wraps: peft's ``all-linear`` (every linear
        of the decoder; the output head is never one) or a list of module names."""
        linears = self.linears(kind)
        if isinstance(target_modules, str):
            if target_modules == "all-linear":
                return linears
            targets = {target_modules}
        else:
            targets = set(target_modules)
        return [lin for lin in linears if lin.name in targets]

    def lora_params(self, rank: int, target_modules: Any = "all-linear") -> int:
        """Parameters of ONE adapter: ``rank x (in + out)`` for every adapted linear of every layer."""
        return sum(rank * (lin.in_features + lin.out_features)
                   for t in self.layer_types for lin in self.adapted_linears(t, target_modules))

    def linear_names(self) -> set[str]:
        """Every decoder linear's module name (what ``all-linear`` expands to)."""
        return {lin.name for t in set(self.layer_types) for lin in self.linears(t)}

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """KV-cache bytes a token costs in an engine (all full-attention layers, K and V)."""
        return self.count(FULL) * 2 * self.kv_width * dtype_bytes

    def recurrent_state_bytes_per_sequence(self) -> int:
        """Linear-attention state a sequence holds in an engine: the fp32 delta-rule state
        (``value heads x key dim x value dim``) and the conv window, per linear layer."""
        if not self.recurrent:
            return 0
        state = self.linear_num_value_heads * self.linear_key_head_dim * self.linear_value_head_dim * 4
        conv = self.linear_conv_dim * max(self.linear_conv_kernel_dim - 1, 0) * 2
        return self.count(LINEAR) * (state + conv)


# ----------------------------------------------------------------------------- reading


def _text_config(raw: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The text decoder's config: ``text_config`` of a multimodal (Qwen3.5/3.6) checkpoint, else all of it."""
    if not isinstance(raw, Mapping):
        raise ShapeError(f"{where}: not a JSON object")
    text = raw.get("text_config")
    if isinstance(text, Mapping):
        merged = dict(text)
        merged.setdefault("tie_word_embeddings", raw.get("tie_word_embeddings", False))
        merged.setdefault("model_type", raw.get("model_type"))
        return merged
    return dict(raw)


def shape_from_config(raw: Mapping[str, Any], where: str = "config.json") -> ModelShape:
    """A ``ModelShape`` from a transformers ``config.json`` dict (``where`` names it in errors)."""
    cfg = _text_config(raw, where)
    model_type = str(cfg.get("model_type") or "")
    if model_type not in DENSE_FAMILIES + HYBRID_FAMILIES:
        raise ShapeError(
            f"{where}: model_type={model_type!r} is not one the planner knows "
            f"({', '.join(DENSE_FAMILIES + HYBRID_FAMILIES)})"
        )

    def need(key: str) -> int:
        value = cfg.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ShapeError(f"{where}: field {key} must be a positive integer, got {value!r}")
        return value

    hidden, heads = need("hidden_size"), need("num_attention_heads")
    layers = need("num_hidden_layers")
    head_dim = cfg.get("head_dim") or hidden // heads
    kv_heads = cfg.get("num_key_value_heads") or heads
    hybrid = model_type in HYBRID_FAMILIES
    if hybrid:
        types = cfg.get("layer_types")
        if types is None:
            interval = int(cfg.get("full_attention_interval") or 4)
            types = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(layers)]
        if len(types) != layers or any(t not in (FULL, LINEAR) for t in types):
            raise ShapeError(f"{where}: layer_types must list {layers} of {FULL}/{LINEAR}, got {types!r}")
    else:
        types = [FULL] * layers
    linear = {key: int(cfg.get(key) or 0) for key in (
        "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
        "linear_conv_kernel_dim")}
    if hybrid and LINEAR in types:
        for key in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim"):
            need(key)
        linear["linear_conv_kernel_dim"] = linear["linear_conv_kernel_dim"] or 4
    return ModelShape(
        model_type=model_type,
        hidden_size=hidden,
        intermediate_size=need("intermediate_size"),
        vocab_size=need("vocab_size"),
        num_heads=heads,
        num_kv_heads=int(kv_heads),
        head_dim=int(head_dim),
        layer_types=tuple(types),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
        attn_output_gate=hybrid and bool(cfg.get("attn_output_gate", True)),
        qk_norm=model_type in ("qwen3",) + HYBRID_FAMILIES,
        source=where,
        **linear,
    )


def read_model_shape(folder: str | Path) -> ModelShape:
    """The shape of the model in ``folder`` (its ``config.json``); ``ShapeError`` naming the
    file when it is missing, unreadable or of an unknown family."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ShapeError(f"model.path={folder}: no config.json there (a local Hugging Face model folder is needed)")
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ShapeError(f"{path}: cannot read it as JSON: {quoted(str(err))}") from None
    return shape_from_config(raw, str(path))


def safetensors_header(path: str | Path) -> dict[str, Any]:
    """The JSON header of a ``.safetensors`` file (tensor names, dtypes, shapes), without
    reading any tensor data. ``ShapeError`` if the file is not a safetensors file."""
    path = Path(path)
    try:
        with open(path, "rb") as handle:
            size = int.from_bytes(handle.read(8), "little")
            if not 0 < size < 100 * 2**20:
                raise ShapeError(f"{path}: not a safetensors file (header size {size})")
            header = json.loads(handle.read(size))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ShapeError(f"{path}: cannot read its safetensors header: {quoted(str(err))}") from None
    header.pop("__metadata__", None)
    return header


def model_weight_files(folder: str | Path) -> Optional[list[Path]]:
    """The weight files of a model folder (``*.safetensors`` or ``*.bin``), None when there are none."""
    folder = Path(folder)
    found = sorted(folder.glob("*.safetensors")) or sorted(folder.glob("*.bin"))
    return found or None
