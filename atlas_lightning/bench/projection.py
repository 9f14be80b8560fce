"""A projection of the training of record's RL step from one card's step benchmark.

    python -m atlas_lightning.bench.projection --bench step_bench.json [--step N] [--json OUT]
    python -m atlas_lightning.bench.projection --bench OLD.json --measured-shape qwen3_6_27b --measured-layers 16
    python -m atlas_lightning.bench.projection --peak-tflops P --update-mfu U --forward-mfu F --decode-tokens-per-s D ...

The training of record (ATLAS report 28, the reproduced report): the Qwen3.6-27B base (64 layers,
48 Gated DeltaNet and 16 attention), 8 cards colocated, 32 questions x 32 samples (1,024
trajectories), mini-batches of 8 questions, 2 PPO epochs, two TP4 engines; the report saw
7,351 s a step on 8 A100 80GB. What one card measured (``bench/step.py``: ``fit`` itself) is
carried over phase by phase, each by its own rule (printed beside the figures, ``assumptions``):

* the measured model: the ``bench/shapes.py`` shape and layer count the step ran (the report's
  ``build``, written by ``step.py --build``; ``--measured-shape``/``--measured-layers`` for a
  report without it), on the card the report names (``environment.gpu``; its HBM from
  ``bench/cards.py``, or ``--card-hbm-tbs``). A report that names neither is the 8B-shaped step
  on one H200 (the first step runs), and says it is assumed;
* work: 1,024 trajectories of the benchmark's length mix (``bench/README.md``: 6,707 tokens a
  trajectory, 1,729 of them generated, the rest prompt and tool responses); the trainer's work
  spread evenly over the 8 cards;
* forward-only and update phases: the full 27B shape's useful FLOPs (``bench/flops.py``) of that
  work at the useful MFU the measured step reached (the mean of its two updates', and of its two
  forward-only passes'). That MFU is the step's own useful FLOPs (of
  the model it ran, the truncated hybrid included) over its seconds and its card's measured
  bf16 rate, so the seconds scale by the FLOPs ratio of the full shape's work to the measured
  step's. Counted for the hybrid: every decoder linear (Gated DeltaNet's and attention's
  projections, the MLP), LoRA, the attention layers' s^2 work, the head; not counted: the delta
  rule's chunked recurrence, its conv1d and gates (about 0.6% of a Gated DeltaNet layer's FLOPs
  at these widths), recomputation. The rate divided by: the H200's measured bf16 rate (the
  measured card's own when that is an H200), the A100's nominal 312 TFLOP/s;
* generation: the measured decode rate (plain ``generate``, times the agent loop's measured rate
  over it: the loop's own rate) for one engine of two, at the measured concurrency (no credit
  for the report's higher one), by one of two rules (``decode_scaling``; by default ``layers``
  for an engine that ran eager, ``bytes`` for one with CUDA graphs):
  - ``bytes``: decoding reads every weight once a token step, so the rate scales with the
    bytes a card reads (measured model on one card / 27B on one TP4 card) and the card's HBM;
  - ``layers``: an eager engine's token step is bound by per-layer kernel launches and host
    work, not by HBM: its time scales with the layers each card runs (TP4 shards a layer's work,
    not its launches) and not with the card; the whole step is counted as per-layer work (the
    sampler over the vocabulary and the scheduler are per step, so this errs long);
  both x a TP efficiency (0.85); prefill (prompts and tool responses, each prefilled once
  thanks to the prefix cache) at the forward MFU over the 4 cards of an engine;
* sleep, wake, weight sync, the checkpoint (the report saves every step), records and the rest:
  the measured seconds, scaled by what they move (sleep and wake: weights per card, and the
  card's HBM; LoRA sync and checkpoint: adapter size; a merged sync: the weight bytes an engine's
  card receives, 27B over TP4 against the measured model on one card; records, batch assembly and the rest:
  trajectories, all written by rank 0); validation left out (every 5 steps; its own cost).

It is a projection, not a measurement: no 27B engine, no 8 cards, no real episode ran here.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Optional

from atlas_lightning.errors import quoted

from .cards import A100_HBM_TBS, A100_TFLOPS, H200_HBM_TBS, H200_MEASURED_TFLOPS, hbm_tbs
from .step_names import CHECKPOINT_CALLBACKS, SYNC_CALLBACK, VALIDATION_CALLBACK

#: The benchmark's length mix (bench/README.md): 7 trajectories, 46,950 tokens, 12,100 generated.
MIX_TOKENS = 46950 / 7
MIX_GENERATED = 12100 / 7
REPORT_STEP_S = 7351.0
TP_EFFICIENCY = 0.85
#: The training of record: its model, trajectories, cards, engines and their tensor parallelism.
RECORD_SHAPE, TRAJECTORIES, CARDS, ENGINES, TP = "qwen3_6_27b", 1024, 8, 2, 4
#: The premise of a report that does not say what it ran: the 8B-shaped step on one H200.
LEGACY_SHAPE, LEGACY_CARD = "dense8b", "NVIDIA H200 (assumed)"
DECODE_RULES = ("bytes", "layers")
#: what a step may not have measured, as the assumptions say it (the option that supplies it)
UNMEASURED = {"rest_s": "the step has no wall time, so the rest lacks the loop's own time (--rest-s)",
              "checkpoint_s": "the step wrote no checkpoint: its seconds are 0 (--checkpoint-s)"}


@lru_cache(maxsize=None)
def _flops_of(shape_name: str, layers: Optional[int] = None, rank: int = 64):
    """``(ModelFlops, parameters, decoder layers)`` of ``shape_name`` cut to its first ``layers``
    decoder layers, built on the meta device (no memory, no weights)."""
    import torch

    from .flops import model_flops
    from .shapes import build_model, shape_by_name

    model = build_model(shape_by_name(shape_name), device=torch.device("meta"), dtype=torch.bfloat16,
                        attn_implementation="sdpa", layers=layers)
    params = sum(p.numel() for p in model.parameters())
    return model_flops(model, rank), params, int(model.config.num_hidden_layers)


@dataclass
class Measured:
    """What one card measured on a step of ``fit`` (``inputs_from_bench`` reads a
    ``step_bench.json``; the README names where each figure came from)."""

    peak_tflops: float  # the card's bf16 matmul rate, the MFU denominator
    update_mfu: float  # useful MFU of the critic and actor updates
    forward_mfu: float  # useful MFU of the forward-only passes (old log-probs, values)
    decode_tokens_per_s: float  # the engine's generation rate (plain generate, or the loop's)
    loop_efficiency: float = 1.0  # the agent loop's rate over plain generate's (1.0: decode rate is the loop's)
    sleep_s: float = 0.0  # sleep + wake of the engine (level 1: the weights copied to the host)
    sync_s: float = 0.0  # the weight sync ...
    weight_sync: str = "lora"  # ... of the adapter ("lora") or of the merged weights ("merged")
    checkpoint_s: float = 0.0  # one checkpoint (adapters + trainable state)
    rest_s: float = 0.0  # batch assembly, records, figures, the loop's own time ...
    rest_trajectories: int = 1  # ... for this many trajectories
    step: Optional[int] = None
    measured_shape: str = LEGACY_SHAPE  # the bench/shapes.py shape the step ran ...
    measured_layers: Optional[int] = None  # ... cut to its first N decoder layers (None: all)
    card: str = LEGACY_CARD  # the card it ran on (CUDA's name)
    card_hbm_tbs: Optional[float] = H200_HBM_TBS  # that card's HBM bandwidth
    decode_scaling: str = "bytes"  # "bytes" (an engine with CUDA graphs) or "layers" (eager): module doc
    concurrency: Optional[int] = None  # requests the engine had in flight
    assumed: list[str] = field(default_factory=list)  # which of the above were not read from the report


def read_bench(path: Path, step: Optional[int] = None) -> Measured:
    """``inputs_from_bench`` of the ``step_bench.json`` at ``path``; ``InputError`` naming the
    file and what it lacks (not JSON, no such step, a missing field) instead of a traceback."""
    from atlas_lightning.errors import InputError

    try:
        bench = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise InputError(f"--bench {path}: not a readable step_bench.json ({quoted(str(err))})") from None
    try:
        return inputs_from_bench(bench, step)
    except ValueError as err:
        raise InputError(f"--bench {path}: {err}") from None
    except KeyError as err:
        raise InputError(f"--bench {path}: not a step_bench.json of bench/step.py (no field {err})") from None
    except (TypeError, AttributeError) as err:  # a field of another kind (a list where a table goes)
        raise InputError(f"--bench {path}: not a step_bench.json of bench/step.py ({err})") from None


def _loop_efficiency(bench: dict) -> float:
    """The agent loop's generation rate over plain ``generate``'s on the same requests: the
    report's ``gen_vs_plain``, or, for a report written before a step that did not finish had a
    rate, the replayed step's generated tokens over its ``gen`` seconds; 1.0 when not measured."""
    plain = bench.get("plain_generate") or {}
    if plain.get("gen_vs_plain"):
        return plain["gen_vs_plain"]
    row = next((r for r in bench["steps"] if r["step"] == plain.get("step")), None)
    if row and plain.get("tokens_per_s") and row.get("generated_tokens") and row["phases_s"].get("gen"):
        return row["generated_tokens"] / row["phases_s"]["gen"] / plain["tokens_per_s"]
    return 1.0


def _what_ran(bench: dict) -> dict[str, Any]:
    """The measured model and card as the report names them (``build``, ``environment``), the
    legacy premise for what it does not name (listed in ``assumed``)."""
    build = bench.get("build") or {}
    env = bench.get("environment") or {}
    out: dict[str, Any] = {"assumed": []}
    if build.get("shape"):
        out["measured_shape"], out["measured_layers"] = build["shape"], build.get("layers")
    else:
        out["assumed"].append("measured_shape")
    if env.get("gpu"):
        out["card"] = env["gpu"]
        out["card_hbm_tbs"] = env.get("card_hbm_tbs") or hbm_tbs(env["gpu"])
    else:
        out["assumed"].append("card")
    if (bench.get("engine") or {}).get("enforce_eager"):
        out["decode_scaling"] = "layers"
    return out


def inputs_from_bench(bench: dict, step: Optional[int] = None) -> Measured:
    """``Measured`` from a ``bench/step.py`` report (its ``step`` row, default the last);
    ``ValueError`` when it has no such step."""
    rows = bench["steps"]
    steps = [r["step"] for r in rows]
    if not rows or (step is not None and step not in steps):
        raise ValueError(f"no measured step {step} (it has steps {steps})" if rows else "no measured step")
    row = next(r for r in rows if r["step"] == step) if step is not None else rows[-1]
    mfu = row.get("useful_mfu") or {}
    plain = bench.get("plain_generate") or {}
    phases, callbacks = row["phases_s"], row.get("callbacks_s", {})
    rest = (row.get("other_s") or 0) + phases.get("assemble", 0) + phases.get("adv", 0) + sum(
        s for name, s in callbacks.items() if name not in (SYNC_CALLBACK, VALIDATION_CALLBACK, *CHECKPOINT_CALLBACKS))
    in_flight = (bench.get("engine") or {}).get("max_in_flight")
    ran = _what_ran(bench)
    checkpoint = sum(callbacks.get(name, 0) for name in CHECKPOINT_CALLBACKS)
    # what this step did not measure: its loop's own time (no wall time: the step did not end), a checkpoint
    # (under 10 ms: the callbacks ran but saved nothing this step)
    ran["assumed"] += (["rest_s"] if row.get("other_s") is None else []) + (["checkpoint_s"] if checkpoint < 0.01 else [])
    return Measured(
        peak_tflops=bench.get("peak_bf16_tflops") or 790.0,
        update_mfu=(mfu.get("update_critic", 0) + mfu.get("update_actor", 0)) / 2,
        forward_mfu=(mfu.get("old_log_prob", 0) + mfu.get("values", 0)) / 2,
        decode_tokens_per_s=plain.get("tokens_per_s") or row.get("gen_tokens_per_s"),
        loop_efficiency=_loop_efficiency(bench) if plain.get("tokens_per_s") else 1.0,
        sleep_s=phases.get("sleep", 0) + phases.get("wake", 0) + phases.get("wake_rollout", 0),
        sync_s=phases.get("update_weights", 0), weight_sync=(bench.get("engine") or {}).get("weight_sync") or "lora",
        checkpoint_s=checkpoint,
        rest_s=rest, rest_trajectories=max(int(row["trajectories"]), 1), step=row["step"],
        concurrency=min(int(row["trajectories"]), int(in_flight or row["trajectories"])), **ran)


def check_measured(m: Measured) -> None:
    """``InputError`` naming the option that supplies what ``m`` lacks or gets wrong, before
    anything is computed: a step without useful MFU or a generation rate, a step off the H200
    that does not name its model, an unknown shape or layer count, a card whose HBM is not known."""
    from atlas_lightning.errors import InputError

    from .shapes import shape_by_name

    for name in ("update_mfu", "forward_mfu", "decode_tokens_per_s", "peak_tflops"):
        value = getattr(m, name)
        if not isinstance(value, (int, float)) or value <= 0:
            raise InputError(f"no {name.replace('_', ' ')} measured (the step has none): give --{name.replace('_', '-')}")
    if "measured_shape" in m.assumed and "H200" not in m.card:
        raise InputError(f"the step names no model build (bench/step.py --build) and ran on {m.card}, not the H200 "
                         "of the 8B-shaped steps: give --measured-shape and --measured-layers")
    try:
        shape = shape_by_name(m.measured_shape)
    except ValueError as err:
        raise InputError(f"--measured-shape: {err}") from None
    if m.measured_layers is not None and not 1 <= m.measured_layers <= shape.num_layers:
        raise InputError(f"--measured-layers {m.measured_layers}: {m.measured_shape} has {shape.num_layers} "
                         f"decoder layers (1..{shape.num_layers})")
    if m.weight_sync not in ("lora", "merged"):
        raise InputError(f"the measured sync is {m.weight_sync!r}: give --weight-sync lora or merged")
    if m.decode_scaling not in DECODE_RULES:
        raise InputError(f"--decode-scaling {m.decode_scaling!r}: one of {', '.join(DECODE_RULES)}")
    if not m.card_hbm_tbs or m.card_hbm_tbs <= 0:
        raise InputError(f"the HBM bandwidth of the measured card ({m.card}) is not known: give --card-hbm-tbs")


def _targets(m: Measured) -> dict[str, dict[str, float]]:
    """The cards projected to: bf16 rate (the measured one where the measured card is an H200,
    the H200's measured rate otherwise; the A100's nominal) and HBM."""
    h200_rate = m.peak_tflops if "H200" in m.card else H200_MEASURED_TFLOPS
    return {"h200": {"tflops": h200_rate, "hbm_tbs": H200_HBM_TBS},
            "a100": {"tflops": A100_TFLOPS, "hbm_tbs": A100_HBM_TBS}}


def _compute_phases(m: Measured, record, tflops: float) -> dict[str, float]:
    """Seconds of the forward-only and update phases on one card of the record at ``tflops``:
    the full shape's useful FLOPs of its share of the work at the measured MFU."""
    tokens = MIX_TOKENS
    seq, n_seq, scored = [int(tokens)], TRAJECTORIES / CARDS, int(tokens - 1536)  # response tokens a trajectory
    rate = tflops * 1e12
    return {"old_log_prob": record.forward("actor", seq, scored) * n_seq / (m.forward_mfu * rate),
            "values": record.forward("critic", seq, scored) * n_seq / (m.forward_mfu * rate),
            "update_critic": 2 * record.train_step("critic", seq, scored) * n_seq / (m.update_mfu * rate),
            "update_actor": 2 * record.train_step("actor", seq, scored) * n_seq / (m.update_mfu * rate)}


def _engine_rate(m: Measured, scale: dict[str, float], hbm: float) -> float:
    """Generated tokens a second of one 27B TP4 engine on a card of HBM ``hbm`` (module doc)."""
    rate = m.decode_tokens_per_s * TP_EFFICIENCY * m.loop_efficiency
    if m.decode_scaling == "bytes":
        return rate * scale["bytes"] * hbm / m.card_hbm_tbs
    return rate * scale["layers"]


def project(measured: Measured) -> dict[str, Any]:
    """The projected seconds of each phase of one step of the training of record (module doc)."""
    m = measured
    check_measured(m)
    record, record_params, record_layers = _flops_of(RECORD_SHAPE)
    ran, ran_params, ran_layers = _flops_of(m.measured_shape, m.measured_layers)
    card_bytes = record_params * 2 / TP
    scale = {"bytes": ran_params * 2 / card_bytes, "layers": ran_layers / record_layers}
    generated, prompt = TRAJECTORIES * MIX_GENERATED / ENGINES, TRAJECTORIES * (MIX_TOKENS - MIX_GENERATED) / ENGINES
    # what the record's card moves against the measured one: its weights (sleep, wake, a merged
    # sync) and its adapters (a LoRA sync, the checkpoint)
    weights, adapters = card_bytes / (ran_params * 2), record.lora_params / ran.lora_params
    phases, detail = {}, {}
    for name, card in _targets(m).items():
        out = _compute_phases(m, record, card["tflops"])
        engine = _engine_rate(m, scale, card["hbm_tbs"])
        decode_s = generated / engine
        prefill_s = prompt * 2 * (record.linear_params + record.lora_params) / (m.forward_mfu * card["tflops"] * 1e12 * TP)
        out["gen"] = decode_s + prefill_s
        out["sleep_wake"] = m.sleep_s * weights * m.card_hbm_tbs / card["hbm_tbs"]
        out["update_weights"] = m.sync_s * (weights if m.weight_sync == "merged" else adapters)
        out["checkpoint"] = m.checkpoint_s * adapters  # the report saves every step
        out["records_and_rest"] = m.rest_s * TRAJECTORIES / m.rest_trajectories
        phases[name] = out
        floor = None
        if m.concurrency:  # every weight read once a token step, at the measured concurrency
            floor = generated / (m.concurrency * card["hbm_tbs"] * 1e12 / card_bytes)
        detail[name] = {"tflops": card["tflops"], "hbm_tbs": card["hbm_tbs"], "engine_decode_tokens_per_s": engine,
                        "decode_s": decode_s, "prefill_s": prefill_s, "decode_bandwidth_floor_s": floor}
    h200, a100 = phases["h200"], phases["a100"]
    return {"phases_h200_s": h200, "total_h200_s": sum(h200.values()), "phases_a100_s": a100,
            "total_a100_s": sum(a100.values()), "report_a100_s": REPORT_STEP_S,
            "inputs": {**asdict(m), "engine_decode_tokens_per_s": detail["h200"]["engine_decode_tokens_per_s"],
                       "decode_s": detail["h200"]["decode_s"], "prefill_s": detail["h200"]["prefill_s"],
                       "params_27b": record_params, "params_measured": ran_params, "layers_27b": record_layers,
                       "layers_measured": ran_layers, "targets": detail},
            "assumptions": assumptions(m, ran_layers, record_layers)}


def assumptions(m: Measured, ran_layers: int, record_layers: int) -> list[str]:
    """Every rule the projection applied to ``m``, one line each (module doc)."""
    made = " (assumed: the report does not say; --measured-shape)" if "measured_shape" in m.assumed else ""
    decode = (f"decode ({m.decode_scaling}): the measured rate x the loop's efficiency ({m.loop_efficiency:.2f}) x "
              + ("the bytes a card reads (measured model on one card / 27B on a TP4 card) x HBM target / measured"
                 if m.decode_scaling == "bytes" else
                 f"layers ({ran_layers} measured / {record_layers}; an eager engine's token step bound by per-layer launches "
                 "and host work, the same on every card)")
              + f" x TP efficiency {TP_EFFICIENCY}, at the measured concurrency ({m.concurrency or '?'} requests); "
              "two engines")
    sync_and_checkpoint = ("the merged sync by the weight bytes an engine's card receives (27B over TP4 / the measured "
                       "model; the gather across 8 ranks not measured), the checkpoint" if m.weight_sync == "merged"
                       else "LoRA sync and the checkpoint")
    return [
        f"measured: {m.measured_shape}, {ran_layers} decoder layers{made}, on {m.card} "
        f"(bf16 {m.peak_tflops:.0f} TFLOP/s measured, HBM {m.card_hbm_tbs} TB/s)",
        f"1,024 trajectories of {MIX_TOKENS:,.0f} tokens ({MIX_GENERATED:,.0f} generated): the benchmark's mix",
        "the trainer's tokens evenly over 8 cards; 2 PPO epochs; actor and critic both updated",
        "compute: the 27B shape's useful FLOPs (bench/flops.py: Gated DeltaNet's projections counted, its "
        "recurrence, conv1d and gates not) at the measured useful MFU; the MFU carried to the target card "
        f"(H200 at {H200_MEASURED_TFLOPS:.0f} TFLOP/s measured, A100 at {A100_TFLOPS:.0f} nominal)",
        decode,
        "prefill of prompts and tool responses once each, at the forward-only MFU on an engine's 4 cards",
        f"sleep/wake scaled by weight bytes per card and HBM, {sync_and_checkpoint} (every step, as the report) by "
        "adapter size, records and the rest by trajectories; validation out",
    ] + [UNMEASURED[name] for name in ("rest_s", "checkpoint_s") if name in m.assumed]


def markdown(result: dict) -> str:
    lines = ["| phase | 8 x H200 s | 8 x A100 s |", "|---|---|---|"]
    for key, seconds in result["phases_h200_s"].items():
        lines.append(f"| {key} | {seconds:,.0f} | {result['phases_a100_s'][key]:,.0f} |")
    lines.append(f"| **step** | **{result['total_h200_s']:,.0f}** | **{result['total_a100_s']:,.0f}** "
                 f"(report: {result['report_a100_s']:,.0f}) |")
    inputs, h200 = result["inputs"], result["inputs"]["targets"]["h200"]
    floor = h200.get("decode_bandwidth_floor_s")
    lines += ["", f"inputs: update MFU {inputs['update_mfu']:.1%}, forward MFU {inputs['forward_mfu']:.1%}, "
                  f"measured decode {inputs['decode_tokens_per_s']:,.0f} tokens/s (27B TP4 engine: "
                  f"{inputs['engine_decode_tokens_per_s']:,.0f} on an H200), agent loop at "
                  f"{inputs['loop_efficiency']:.0%} of plain generate; sleep+wake {inputs['sleep_s']:.2f} s, sync "
                  f"{inputs['sync_s']:.2f} s, checkpoint {inputs['checkpoint_s']:.2f} s, rest {inputs['rest_s']:.2f} s "
                  f"for {inputs['rest_trajectories']} trajectories"]
    if floor:
        lines.append(f"decode at the H200's weight-bandwidth bound (every weight read once a token step, "
                     f"{inputs['concurrency']} requests in flight): {floor:,.0f} s, against {h200['decode_s']:,.0f} s")
    return "\n".join(lines + ["", "assumptions:"] + [f"- {a}" for a in result["assumptions"]])


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m atlas_lightning.bench.projection", description=__doc__.splitlines()[0])
    parser.add_argument("--bench", type=Path, default=None, help="a step_bench.json of bench/step.py")
    parser.add_argument("--step", type=int, default=None, help="which measured step (default: the last)")
    for name in ("peak-tflops", "update-mfu", "forward-mfu", "decode-tokens-per-s", "loop-efficiency", "sleep-s",
                 "sync-s", "checkpoint-s", "rest-s", "rest-trajectories", "card-hbm-tbs", "concurrency"):
        parser.add_argument(f"--{name}", type=float, default=None, help="replaces the benchmark's figure")
    parser.add_argument("--measured-shape", default=None, help="the bench/shapes.py shape the step ran")
    parser.add_argument("--measured-layers", type=int, default=None, help="its first N decoder layers")
    parser.add_argument("--card", default=None, help="the card the step ran on (CUDA's name)")
    parser.add_argument("--decode-scaling", default=None, help="bytes (CUDA graphs) or layers (eager engine)")
    parser.add_argument("--weight-sync", choices=("lora", "merged"), default=None,
                        help="what the measured sync moved (default: the benchmark's rollout.weight_sync)")
    parser.add_argument("--json", type=Path, default=None, help="also write the projection here")
    args = parser.parse_args(argv)
    from atlas_lightning.run.exit_codes import exit_code

    return exit_code(parser.prog, lambda: _project(parser, args))


def _project(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """``main`` after parsing: the measured inputs, the projection, its table (and ``--json``)."""
    given = {k: v for k, v in vars(args).items() if k in Measured.__dataclass_fields__ and v is not None}
    if args.bench:
        measured = read_bench(args.bench, step=args.step)
        assumed = [a for a in measured.assumed if a not in given]
        measured = Measured(**{**asdict(measured), **given, "assumed": assumed})
    else:
        missing = [f for f in ("peak_tflops", "update_mfu", "forward_mfu", "decode_tokens_per_s") if f not in given]
        if missing:
            parser.error(f"without --bench, give --{', --'.join(f.replace('_', '-') for f in missing)}")
        measured = Measured(**given)
    for name in ("rest_trajectories", "concurrency"):
        if name in given:
            setattr(measured, name, int(given[name]))
    if "card" in given and "card_hbm_tbs" not in given:
        measured.card_hbm_tbs = hbm_tbs(measured.card)
    if args.bench:
        from atlas_lightning.errors import InputError

        try:
            check_measured(measured)
        except InputError as err:  # where: the report and its step
            raise InputError(f"--bench {args.bench} (step {measured.step}): {err}") from None
    result = project(measured)
    if args.json:
        from atlas_lightning.store.atomic import atomic_write_json

        atomic_write_json(args.json, result)
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
