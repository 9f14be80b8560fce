"""A projection of the training of record's RL step from the one-card step benchmark.

    python -m atlas_lightning.bench.projection --bench step_bench.json [--update-mfu X ...]
    python -m atlas_lightning.bench.projection --peak-tflops P --update-mfu U --forward-mfu F --decode-tokens-per-s D ...

The training of record (ATLAS report 28, the reproduced report): the Qwen3.6-27B base, 8 cards colocated, 32 questions x 32
samples (1,024 trajectories), mini-batches of 8 questions, 2 PPO epochs, two TP4 engines; the
report saw 7,351 s a step on 8 A100 80GB. What one H200 measured (``bench/step.py`` on the
8B-shaped model, ``experiment=h200-8b``) is carried over phase by phase, each with its own
assumption (printed beside its figure, and in ``ASSUMPTIONS``):

* work: 1,024 trajectories of the benchmark's length mix (``bench/README.md``: 6,707 tokens a
  trajectory, 1,729 of them generated, the rest prompt and tool responses); the trainer's work
  spread evenly over the 8 cards;
* forward-only and update phases: useful FLOPs of the 27B shape (``bench/flops.py``; the
  Gated DeltaNet recurrence not counted) at a useful MFU: by default the one the 8B step
  measured (dense layers; what the hybrid reaches once its linear-attention kernels are as
  good), or ``--update-mfu`` (e.g. 0.088, the 27B shape's measured MFU with transformers' torch
  fallback for Gated DeltaNet, bench run 4);
* generation: decoding reads every weight once a step, so an engine's decode rate scales with
  the bytes it reads per token step: the 8B engine's measured plain-``generate`` rate x (8B bytes
  on one card / 27B bytes on one TP4 card) x a TP efficiency (0.85), at the concurrency measured
  (no credit for the report's higher one), times the agent loop's measured efficiency against
  plain ``generate``; two engines share the trajectories; prefill (prompts and tool responses,
  each turn prefilled once thanks to the prefix cache) at the forward-only MFU over the 4 cards
  of an engine;
* sleep, wake, weight sync, the checkpoint (the report saves every step), records and the rest:
  the 8B step's seconds, scaled by what they move (sleep and wake: weights per card; LoRA sync
  and checkpoint: adapter size; records, batch assembly and the rest: trajectories, all written
  by rank 0); validation left out (every 5 steps; its own cost);
* A100 80GB: compute phases x (the H200's measured bf16 rate / 312 TFLOP/s), decode and
  sleep/wake x (4.8 / 2.04 TB/s of HBM).

It is a projection, not a measurement: no 27B engine, no 8 cards, no real episode ran here.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from dataclasses import asdict, dataclass
from typing import Any, Optional

from .step_names import CHECKPOINT_CALLBACKS, SYNC_CALLBACK, VALIDATION_CALLBACK

#: The benchmark's length mix (bench/README.md): 7 trajectories, 46,950 tokens, 12,100 generated.
MIX_TOKENS = 46950 / 7
MIX_GENERATED = 12100 / 7
REPORT_STEP_S = 7351.0
A100_TFLOPS = 312.0
H200_HBM_TBS, A100_HBM_TBS = 4.8, 2.04
TP_EFFICIENCY = 0.85

ASSUMPTIONS = [
    f"1,024 trajectories of {MIX_TOKENS:,.0f} tokens ({MIX_GENERATED:,.0f} generated): the benchmark's mix",
    "the trainer's tokens evenly over 8 cards; 2 PPO epochs; actor and critic both updated",
    "27B useful FLOPs (bench/flops.py; Gated DeltaNet recurrence not counted)",
    f"decode: the 8B engine's measured rate x bytes ratio x TP efficiency {TP_EFFICIENCY}, at the measured "
    "concurrency; x the agent loop's measured efficiency; two engines",
    "prefill of prompts and tool responses once each, at the forward-only MFU on an engine's 4 cards",
    "sleep/wake scaled by weight bytes per card, LoRA sync and the checkpoint (every step, as the report) by "
    "adapter size, records and the rest by trajectories; validation out",
    f"A100: compute x measured H200 TFLOP/s / {A100_TFLOPS:.0f}, decode and sleep/wake x "
    f"{H200_HBM_TBS} / {A100_HBM_TBS} TB/s",
]


def _flops_of(shape_name: str, rank: int = 64):
    import torch

    from .flops import model_flops
    from .shapes import build_model, shape_by_name

    model = build_model(shape_by_name(shape_name), device=torch.device("meta"), dtype=torch.bfloat16,
                        attn_implementation="sdpa")
    params = sum(p.numel() for p in model.parameters())
    return model_flops(model, rank), params


@dataclass
class Measured:
    """What one H200 measured on the 8B-shaped step (``inputs_from_bench`` reads a
    ``step_bench.json``; the README names where each figure came from)."""

    peak_tflops: float  # the card's bf16 matmul rate, the MFU denominator
    update_mfu: float  # useful MFU of the critic and actor updates
    forward_mfu: float  # useful MFU of the forward-only passes (old log-probs, values)
    decode_tokens_per_s: float  # the 8B engine's generation rate (plain generate, or the loop's)
    loop_efficiency: float = 1.0  # the agent loop's rate over plain generate's (1.0: decode rate is the loop's)
    sleep_s: float = 0.0  # sleep + wake of the 8B engine (level 1: the weights copied to the host)
    sync_s: float = 0.0  # the LoRA weight sync
    checkpoint_s: float = 0.0  # one checkpoint (adapters + trainable state)
    rest_s: float = 0.0  # batch assembly, records, figures, the loop's own time ...
    rest_trajectories: int = 1  # ... for this many trajectories
    step: Optional[int] = None


def read_bench(path: Path, step: Optional[int] = None) -> Measured:
    """``inputs_from_bench`` of the ``step_bench.json`` at ``path``; ``InputError`` naming the
    file and what it lacks (not JSON, no such step, a missing field) instead of a traceback."""
    from atlas_lightning.errors import InputError

    try:
        bench = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise InputError(f"--bench {path}: not a readable step_bench.json ({err})") from None
    try:
        return inputs_from_bench(bench, step)
    except ValueError as err:
        raise InputError(f"--bench {path}: {err}") from None
    except KeyError as err:
        raise InputError(f"--bench {path}: not a step_bench.json of bench/step.py (no field {err})") from None
    except (TypeError, AttributeError) as err:  # a field of another kind (a list where a table goes)
        raise InputError(f"--bench {path}: not a step_bench.json of bench/step.py ({err})") from None


def inputs_from_bench(bench: dict, step: Optional[int] = None) -> Measured:
    """``Measured`` from a ``bench/step.py`` report (its ``step`` row, default the last);
    ``ValueError`` when it has no such step."""
    rows = bench["steps"]
    steps = [r["step"] for r in rows]
    if not rows or (step is not None and step not in steps):
        raise ValueError(f"no measured step {step} (it has steps {steps})" if rows else "no measured step")
    row = next(r for r in rows if r["step"] == step) if step is not None else rows[-1]
    mfu = row.get("useful_mfu") or {}
    plain = bench.get("plain_generate", {})
    phases, callbacks = row["phases_s"], row.get("callbacks_s", {})
    rest = row.get("other_s", 0) + phases.get("assemble", 0) + phases.get("adv", 0) + sum(
        s for name, s in callbacks.items() if name not in (SYNC_CALLBACK, VALIDATION_CALLBACK, *CHECKPOINT_CALLBACKS))
    return Measured(
        peak_tflops=bench.get("peak_bf16_tflops") or 790.0,
        update_mfu=(mfu.get("update_critic", 0) + mfu.get("update_actor", 0)) / 2,
        forward_mfu=(mfu.get("old_log_prob", 0) + mfu.get("values", 0)) / 2,
        decode_tokens_per_s=plain.get("tokens_per_s") or row.get("gen_tokens_per_s"),
        loop_efficiency=plain.get("gen_vs_plain") or 1.0,
        sleep_s=phases.get("sleep", 0) + phases.get("wake", 0) + phases.get("wake_rollout", 0),
        sync_s=phases.get("update_weights", 0), checkpoint_s=sum(callbacks.get(name, 0) for name in CHECKPOINT_CALLBACKS),
        rest_s=rest, rest_trajectories=max(int(row["trajectories"]), 1), step=row["step"])


def project(measured: Measured) -> dict[str, Any]:
    """The projected seconds of each phase of one step of the training of record (module doc)."""
    m = measured
    flops27, params27 = _flops_of("qwen3_6_27b")
    flops8, params8 = _flops_of("dense8b")
    trajectories, cards, engines, tp = 1024, 8, 2, 4
    tokens, generated = MIX_TOKENS, MIX_GENERATED
    per_card = trajectories * tokens / cards
    seq = [int(tokens)]
    n_seq = per_card / tokens
    scored = tokens - 1536  # response tokens a trajectory
    fwd = {role: flops27.forward(role, seq, int(scored)) * n_seq for role in ("actor", "critic")}
    upd = {role: 2 * flops27.train_step(role, seq, int(scored)) * n_seq for role in ("actor", "critic")}
    rate = m.peak_tflops * 1e12
    out: dict[str, float] = {
        "old_log_prob": fwd["actor"] / (m.forward_mfu * rate),
        "values": fwd["critic"] / (m.forward_mfu * rate),
        "update_critic": upd["critic"] / (m.update_mfu * rate),
        "update_actor": upd["actor"] / (m.update_mfu * rate),
    }
    bytes_ratio = (params8 * 2) / (params27 * 2 / tp)
    engine_decode = m.decode_tokens_per_s * bytes_ratio * TP_EFFICIENCY * m.loop_efficiency
    decode_s = trajectories * generated / (engines * engine_decode)
    prefill_tokens = trajectories * (tokens - generated) / engines
    prefill_s = prefill_tokens * 2 * (flops27.linear_params + flops27.lora_params) / (m.forward_mfu * rate * tp)
    out["gen"] = decode_s + prefill_s
    weight_ratio = (params27 * 2 / tp) / (params8 * 2)
    out["sleep_wake"] = m.sleep_s * weight_ratio
    lora_ratio = flops27.lora_params / flops8.lora_params
    out["update_weights"] = m.sync_s * lora_ratio
    out["checkpoint"] = m.checkpoint_s * lora_ratio  # the report saves every step
    out["records_and_rest"] = m.rest_s * trajectories / m.rest_trajectories
    a100 = dict(out)
    for key in ("old_log_prob", "values", "update_critic", "update_actor"):
        a100[key] = out[key] * m.peak_tflops / A100_TFLOPS
    a100["gen"] = decode_s * H200_HBM_TBS / A100_HBM_TBS + prefill_s * m.peak_tflops / A100_TFLOPS
    a100["sleep_wake"] = out["sleep_wake"] * H200_HBM_TBS / A100_HBM_TBS
    return {"phases_h200_s": out, "total_h200_s": sum(out.values()), "phases_a100_s": a100,
            "total_a100_s": sum(a100.values()), "report_a100_s": REPORT_STEP_S,
            "inputs": {**asdict(m), "engine_decode_tokens_per_s": engine_decode, "decode_s": decode_s,
                       "prefill_s": prefill_s, "params_27b": params27, "params_8b": params8},
            "assumptions": ASSUMPTIONS}


def markdown(result: dict) -> str:
    lines = ["| phase | 8 x H200 s | 8 x A100 s |", "|---|---|---|"]
    for key, seconds in result["phases_h200_s"].items():
        lines.append(f"| {key} | {seconds:,.0f} | {result['phases_a100_s'][key]:,.0f} |")
    lines.append(f"| **step** | **{result['total_h200_s']:,.0f}** | **{result['total_a100_s']:,.0f}** "
                 f"(report: {result['report_a100_s']:,.0f}) |")
    inputs = result["inputs"]
    lines += ["", f"inputs: update MFU {inputs['update_mfu']:.1%}, forward MFU {inputs['forward_mfu']:.1%}, "
                  f"8B decode {inputs['decode_tokens_per_s']:,.0f} tokens/s (27B TP4 engine: "
                  f"{inputs['engine_decode_tokens_per_s']:,.0f}), agent loop at {inputs['loop_efficiency']:.0%} of plain "
                  f"generate", "", "assumptions:"] + [f"- {a}" for a in result["assumptions"]]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m atlas_lightning.bench.projection", description=__doc__.splitlines()[0])
    parser.add_argument("--bench", type=Path, default=None, help="a step_bench.json of the 8B-shaped step")
    parser.add_argument("--step", type=int, default=None, help="which measured step (default: the last)")
    for name in ("peak-tflops", "update-mfu", "forward-mfu", "decode-tokens-per-s", "loop-efficiency", "sleep-s",
                 "sync-s", "checkpoint-s", "rest-s", "rest-trajectories"):
        parser.add_argument(f"--{name}", type=float, default=None, help="replaces the benchmark's figure")
    parser.add_argument("--json", type=Path, default=None, help="also write the projection here")
    args = parser.parse_args(argv)
    from atlas_lightning.run.exit_codes import exit_code

    return exit_code(parser.prog, lambda: _project(parser, args))


def _project(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """``main`` after parsing: the measured inputs, the projection, its table (and ``--json``)."""
    given = {k: v for k, v in vars(args).items() if k in Measured.__dataclass_fields__ and v is not None}
    if args.bench:
        measured = read_bench(args.bench, step=args.step)
        measured = Measured(**{**asdict(measured), **given})
    else:
        missing = [f for f in ("peak_tflops", "update_mfu", "forward_mfu", "decode_tokens_per_s") if f not in given]
        if missing:
            parser.error(f"without --bench, give --{', --'.join(f.replace('_', '-') for f in missing)}")
        measured = Measured(**given)
    if "rest_trajectories" in given:
        measured.rest_trajectories = int(measured.rest_trajectories)
    result = project(measured)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
