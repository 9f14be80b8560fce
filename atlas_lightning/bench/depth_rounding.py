"""What bf16 costs the per-token log-prob against float32, by depth: a hybrid Gated DeltaNet +
attention model (Qwen3.5's layout, three Gated DeltaNet layers to one attention layer) and a dense
one (Qwen3's) of the same width, random weights, transformers' own modules. Runs on a CPU.

    atlas-lightning bench depth-rounding > depth-rounding.json          # under a minute on 2 cores
    atlas-lightning bench depth-rounding --depths 24 --sublayers        # which sublayer carries it
    atlas-lightning bench depth-rounding --width full --device cuda --depths 8 16 24   # on a card

``--width full``: the report's widths instead of the narrow one, the hybrid Qwen3.6-27B's text
shape and the dense Qwen3-8B's (``planning/named_shapes.py``), built on ``--device`` (float32, TF32
off; the bf16 twin converted in place, so a card holds one copy: 24 hybrid layers take 46 GB),
tokens from the vocabulary both share. transformers' own modules, no fla: the rounding of the
architecture at the width the card's step runs, without either side's kernels.

For each depth L it builds the model once (seeded), takes float32 log-probs of fixed random tokens
as the reference and reports the mean and largest |bf16 - float32| per token, and that mean over
sqrt(L). ``--sublayers`` also runs the hybrid with one kind of sublayer at a time (Gated DeltaNet
mixers, attention, MLPs, norms) in float32 inside the bf16 model.

Why: the trainer's and the engine's log-probs on the 27B hybrid part by 0.052 at 16 layers and
0.065 at 24 (``bench/results/h100-27b24-lora-graphs-512.json``), more with depth, where the
dense 8B's stay at 0.053. Both sides run in bf16, each with its own roundings; if each is off float32 by e, they are
off each other by about sqrt(2) e. Seen on this machine's CPU (2026-12-07,
``bench/results/depth-rounding-cpu.json``): the hybrid's bf16 error is 0.0029-0.0031 x sqrt(L)
from 4 to 32 layers, the dense model's stays at 0.0064-0.0089; at 24 layers the MLPs in float32
take 18% of it away, the Gated DeltaNet mixers 9%, attention and norms nothing. So the growth is
how the hybrid carries roundings from layer to layer, not one kernel's: 16 -> 24 layers predicts a
gap 1.22 times larger (the card measured 1.24), and the 64-layer model's about twice the 16
layers'. At the full widths on an H100 (``bench/results/depth-rounding-full-h100.json``, 8-32
layers) both kinds grow as sqrt(L), the hybrid by 0.015-0.016 and the dense 8B shape by
0.024-0.026: here the weights are rounded too, which the engine and the trainer never differ by
(both hold the checkpoint's bf16 weights); ``bench gap-sources`` measures that compute-only part.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
from typing import Callable, Iterable

import torch

from .gap_sources import exact_float32

#: a narrow model: the depth, not the width, is what is asked about
WIDTH = dict(hidden_size=512, intermediate_size=1536, vocab_size=8192, num_attention_heads=4,
             num_key_value_heads=2, head_dim=128)
HYBRID = dict(linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64)


#: ``--width full``: each kind's shape (``bench/shapes.py``)
FULL_SHAPES = {"hybrid": "qwen3_6_27b", "dense": "dense8b"}


def config(kind: str, layers: int, width: str = "narrow"):
    """The transformers config of a ``kind`` (``hybrid`` or ``dense``) model of ``layers`` layers,
    ``width`` ``narrow`` (``WIDTH``) or ``full`` (``FULL_SHAPES``)."""
    from transformers import Qwen3_5TextConfig, Qwen3Config

    types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
    types[-1] = "full_attention"  # at least one (transformers' cache needs it): the same below 4 layers
    if width == "full":
        from .shapes import shape_by_name, transformers_config

        made = transformers_config(shape_by_name(FULL_SHAPES[kind]), layers)
        if kind == "hybrid":
            made.layer_types = types
        return made
    if kind == "hybrid":
        return Qwen3_5TextConfig(num_hidden_layers=layers, layer_types=types, **WIDTH, **HYBRID)
    return Qwen3Config(num_hidden_layers=layers, **WIDTH)


def build(kind: str, layers: int, width: str = "narrow", device: str = "cpu") -> torch.nn.Module:
    """A seeded random ``kind`` causal LM of ``layers`` layers (``config``), float32, on ``device``."""
    from transformers import Qwen3_5ForCausalLM, Qwen3ForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        return (Qwen3_5ForCausalLM if kind == "hybrid" else Qwen3ForCausalLM)(config(kind, layers, width))


def token_logprobs(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Each next token's log-prob under ``model``, in float32."""
    with torch.no_grad():
        logprobs = model(input_ids=ids).logits.float().log_softmax(-1)
        return logprobs[:, :-1].gather(-1, ids[:, 1:, None])[..., 0].cpu()


def in_float32(module: torch.nn.Module) -> None:
    """Run float32 ``module`` inside a bf16 model: its floating inputs cast up, its outputs down."""

    def cast(x, dtype):
        return x.to(dtype) if torch.is_tensor(x) and x.is_floating_point() else x

    def before(mod, args, kwargs):
        return tuple(cast(a, torch.float32) for a in args), {k: cast(v, torch.float32) for k, v in kwargs.items()}

    def after(mod, args, kwargs, out):
        return tuple(cast(o, torch.bfloat16) for o in out) if isinstance(out, tuple) else cast(out, torch.bfloat16)

    module.register_forward_pre_hook(before, with_kwargs=True)
    module.register_forward_hook(after, with_kwargs=True)


def rounding(reference_model: torch.nn.Module, reference: torch.Tensor, ids: torch.Tensor,
             kept: Callable[[torch.nn.Module], Iterable[torch.nn.Module]] = lambda layer: (),
             in_place: bool = False) -> dict:
    """|bf16 - float32| per token: ``reference_model`` (float32, whose log-probs of ``ids`` are
    ``reference``) in bf16, with ``kept(layer)``'s modules in float32 (their weights the
    reference's, never rounded to bf16). ``in_place``: ``reference_model`` itself is rounded
    (no copy: a card holds one model; it is bf16 afterwards; ``kept`` keeps nothing then)."""
    model = reference_model.to(torch.bfloat16) if in_place else copy.deepcopy(reference_model).to(torch.bfloat16)
    for layer, original in zip(model.model.layers, reference_model.model.layers):
        for module, weights in zip(kept(layer), kept(original)):
            module.float().load_state_dict(weights.state_dict())
            in_float32(module)
    gap = (token_logprobs(model, ids) - reference).abs()
    layers = len(model.model.layers)
    return {"layers": layers, "mean": gap.mean().item(), "max": gap.max().item(),
            "mean_over_sqrt_layers": gap.mean().item() / math.sqrt(layers)}


SUBLAYERS = {
    "gated_deltanet": lambda layer: [layer.linear_attn] if hasattr(layer, "linear_attn") else [],
    "attention": lambda layer: [layer.self_attn] if hasattr(layer, "self_attn") else [],
    "mlp": lambda layer: [layer.mlp],
    "norms": lambda layer: [layer.input_layernorm, layer.post_attention_layernorm],
}


def _rows(args: argparse.Namespace, ids: torch.Tensor) -> list[dict]:
    """Each kind's rows by depth, then (``--sublayers``) the hybrid's with each sublayer kind in
    float32, by kind and depth; each float32 model built and run once, then rounded in place."""
    plain, kept_rows = [], {name: [] for name in SUBLAYERS}
    for kind in ("hybrid", "dense"):
        for layers in args.depths:
            model = build(kind, layers, args.width, args.device).eval()
            reference = token_logprobs(model, ids)
            if args.sublayers and kind == "hybrid":
                for name, kept in SUBLAYERS.items():
                    kept_rows[name].append({"model": kind, **rounding(model, reference, ids, kept=kept), "float32": name})
            plain.append({"model": kind, **rounding(model, reference, ids, in_place=True)})
            print(json.dumps(plain[-1]), file=sys.stderr, flush=True)  # a card run that dies keeps its rows
            del model
            if torch.device(args.device).type == "cuda":
                torch.cuda.empty_cache()
    return plain + [row for rows in kept_rows.values() for row in rows]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="atlas-lightning bench depth-rounding", description=__doc__.split("\n\n")[0])
    parser.add_argument("--depths", type=int, nargs="+", default=[4, 8, 16, 24, 32])
    parser.add_argument("--sequences", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=384)
    parser.add_argument("--sublayers", action="store_true", help="also the hybrid with each sublayer kind in float32")
    parser.add_argument("--width", choices=("narrow", "full"), default="narrow",
                        help="narrow (a CPU's minutes) or the report's models' widths (module doc)")
    parser.add_argument("--device", default="cpu", help="where the models are built and run (cuda on a card)")
    args = parser.parse_args(argv)
    if min(args.depths) < 1 or args.sequences < 1 or args.tokens < 2:
        print("atlas-lightning bench depth-rounding: --depths >= 1, --sequences >= 1, --tokens >= 2", file=sys.stderr)
        return 2
    if args.sublayers and args.width == "full":
        print("atlas-lightning bench depth-rounding: --sublayers copies each model: --width narrow only", file=sys.stderr)
        return 2
    vocab = min(config(kind, 1, args.width).vocab_size for kind in ("hybrid", "dense"))
    ids = torch.randint(0, vocab, (args.sequences, args.tokens), generator=torch.Generator().manual_seed(1))
    with exact_float32():  # the reference is float32 itself: no TF32 (cuDNN's default allows it)
        rows = _rows(args, ids.to(args.device))
    card = torch.cuda.get_device_name(args.device) if torch.device(args.device).type == "cuda" else None
    print(json.dumps({"torch": torch.__version__, "width": args.width, "device": args.device, "card": card,
                      "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
