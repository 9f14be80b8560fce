"""The step benchmark's report as markdown (``step_bench.md``): per RL step the table of phases
(seconds, share of the step, the trainer's peak beside ``plan``'s tensors, useful MFU), each
callback's seconds, the rest, a validation riding with the next rollout, the shares, the card's
memory and tokens/s/GPU as NeMo-RL counts them; then the plain-``generate`` replay and the
versions. Rendering only: ``step.build_report`` computes every figure."""

from __future__ import annotations

from typing import Any, Optional

from .step_names import VALIDATION_CALLBACK

#: Plan phase for a measured phase (``planning.estimate``'s names).
PLAN_PHASES = {"old_log_prob": "old_log_prob", "values": "values", "ref": "ref", "update_critic": "update_critic",
               "update_actor": "update_actor", "gen": "generation", "update_weights": "update_weights"}


def _card_split(memory: dict) -> str:
    """The card's use at generation and asleep, each with this process's PyTorch allocator then,
    less the engine's pool (``rollout/datamodule._card_used``): reserved beyond allocated is
    cached blocks."""
    parts = []
    for key, when in (("gen", "at generation"), ("asleep", "asleep")):
        line = f"{when} the card held {_fmt(memory.get(f'card_used_gib/{key}'), '.2f')} GiB"
        if f"torch_reserved_gib/{key}" in memory:
            line += (f" (PyTorch here: {_fmt(memory[f'torch_reserved_gib/{key}'], '.2f')} reserved, "
                     f"{_fmt(memory.get(f'torch_allocated_gib/{key}'), '.2f')} allocated)")
        parts.append(line)
    return "; ".join(parts)


def _fmt(value: Optional[float], spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def _phase_lines(row: dict, wall: Optional[float], plan: Any) -> list[str]:
    """The step table's phase rows: seconds, share of the step, peak memory beside the plan, useful
    MFU. A validation that rode with the next step's rollout (``validation_seconds``) is logged
    under this step but spent in the next: its rows have no share of this step."""
    step, ride = row["step"], row.get("validation") or {}
    lines = []
    for phase, seconds in row["phases_s"].items():
        peak = row["memory_gib"].get(f"peak_allocated_gib/{phase}")
        if phase == "gen":
            peak = row["memory_gib"].get("card_used_gib/gen")
        planned = plan.get(PLAN_PHASES.get(phase, "")) if isinstance(plan, dict) else None
        if isinstance(planned, dict):  # the engine's card use against the plan's card; tensors elsewhere
            planned = planned["card_gib" if phase == "gen" else "tensors_gib"]
        mfu = (row.get("useful_mfu") or {}).get(phase)
        label = phase + {"gen": " (card used)", "wake": " (in the weight sync)", "update_weights":
                         " (in the weight sync)", "testing": " (in validation)"}.get(phase, "")
        share = f"{_fmt(seconds / wall * 100 if wall else None)}%"
        if phase == "gen" and ride.get("carried"):
            label = (f"gen (card used; step {step - 1}'s validation riding: its last {ride['rider_tail_s']:.2f} s, "
                     "after the training trajectories)")
        if phase == "testing" and ride.get("rides"):
            label = (f"testing (validation riding with step {step + 1}'s rollout: its marginal seconds, "
                     f"its tail in step {step + 1}'s gen and its gathering at that step's start)")
            share = f"in step {step + 1}"
        lines.append(f"| {label} | {_fmt(seconds, '.2f')} | {share} | {_fmt(peak, '.2f')} | {_fmt(planned, '.2f')} | "
                     f"{_fmt(mfu * 100 if mfu else None)}{'%' if mfu else ''} |")
    if ride.get("rides"):
        lines.append(f"| validation riding with step {step + 1}'s rollout, overlapped (under its training "
                     f"trajectories, inside its gen) | {_fmt(ride['overlapped_s'], '.2f')} | in step {step + 1} | | | |")
    return lines


def _ride_sentences(row: dict) -> list[str]:
    """Where a ridden validation's seconds are: in the step it validated, what it cost and what
    that step amortises; in the step it rode with, what is set apart (``validation_seconds``)."""
    ride, step = row.get("validation") or {}, row["step"]
    lines = []
    if ride.get("carried"):
        gen = row["phases_s"].get("gen", 0.0) - ride["rider_tail_s"]
        lines += [f"step {step - 1}'s validation rode with this rollout: the last {ride['rider_tail_s']:.2f} s of gen "
                  f"and {ride['rider_recorded_s']:.2f} s of callback {VALIDATION_CALLBACK} (its recording, at this "
                  f"batch's start) are its seconds, in this step's validation share and costed at step {step - 1}; "
                  f"the generation share and rate are the training trajectories' {gen:.2f} s", ""]
    if ride.get("rides"):
        lines += [f"step {step}'s validation rode with step {step + 1}'s rollout: {_fmt(ride['overlapped_s'], '.2f')} s "
                  f"under its training trajectories (how much its company slowed them stays in step {step + 1}'s gen: "
                  f"not measured), {_fmt(ride['testing_s'], '.2f')} s marginal as logged; it cost {ride['cost_s']:.2f} s "
                  f"(its deferral here, its tail in step {step + 1}'s gen, its recording at step {step + 1}'s batch "
                  "start), amortised here", ""]
    return lines


def markdown(report: dict) -> str:
    """Per step: each phase's seconds, share of the step and peak memory beside the plan; then
    the shares and generation against plain vLLM."""
    lines = [f"# step benchmark: {report['name']}", ""]
    for row in report["steps"]:
        wall = row.get("wall_s")
        plan = row["plan_tensors_gib"].get("step_micro_batches") or {}
        lines += [f"## RL step {row['step']}: {_fmt(wall)} s, {row['trajectories']} trajectories, "
                  f"{row['tokens']:,} tokens ({row['generated_tokens'] or 0:,} generated); largest micro-batches "
                  f"{row['micro_batch_tokens']['update'] or 0:,} (update) / {row['micro_batch_tokens']['forward'] or 0:,} "
                  f"(forward) tokens", "",
                  "| phase | s | share | peak allocated GiB | plan GiB (tensors; gen: card) | useful MFU |",
                  "|---|---|---|---|---|---|"]
        lines += _phase_lines(row, wall, plan)
        for name, seconds in row["callbacks_s"].items():
            lines.append(f"| callback {name} | {_fmt(seconds, '.2f')} | {_fmt(seconds / wall * 100 if wall else None)}% | | | |")
        if "other_s" in row:
            parts = row.get("other_parts") or {}
            where = ", ".join(f"{name} {seconds:.2f}" for name, seconds in parts.items() if seconds is not None)
            lines.append(f"| other (loop, hand-over{': ' + where if where else ''}) | {_fmt(row['other_s'], '.2f')} | "
                         f"{_fmt(row['other_s'] / wall * 100)}% | | | |")
        lines += _micro_step_lines(row)
        lines += _card_rate_lines(row, report.get("peak_bf16_tflops"))
        if row.get("sync_s"):
            lines += ["", "weight sync by part (s): " + ", ".join(f"{name} {seconds:.2f}"
                                                                for name, seconds in row["sync_s"].items())]
        shares = row.get("shares")
        if shares:
            lines += ["", f"generation {shares['generation']:.1%}, update compute {shares['update_compute']:.1%}, "
                          f"the rest {shares['overhead']:.1%} (validation {shares['validation']:.1%} and checkpoint "
                          f"{shares['checkpoint']:.1%} apart; with both amortised over their periods: "
                          f"{shares['overhead_with_periodic_amortised']:.1%}); "
                          f"{_card_split(row['memory_gib'])}", ""]
        lines += _ride_sentences(row)
        rate = row.get("tokens_per_s_per_gpu")
        if rate:
            lines += [f"tokens/s/GPU as NeMo-RL counts them (all {row['tokens']:,} tokens / (step s x {rate['gpus']} "
                      f"GPUs)): {rate['step']:,.0f} this step; {_fmt(rate['without_periodic'], ',.0f')} without its "
                      f"validation and checkpoint; {_fmt(rate['amortised'], ',.0f')} with them amortised over "
                      f"their periods; {_fmt(rate.get('report_periods'), ',.0f')} over the report's (a checkpoint "
                      "every step, validation every 5)", ""]
    lines += _profile_lines(report.get("update_profile") or {})
    edges = report.get("fit_edges_s")
    if edges:
        lines += [f"fit around its steps: opening {_fmt(edges.get('opening'), '.1f')} s (its call to the first rollout: "
                  f"the engine's start, the trainer's build, the starting sync), closing {_fmt(edges.get('closing'), '.1f')} "
                  "s (the end of training to its return: the last checkpoint's wait, the engine's shutdown)", ""]
    plain = report.get("plain_generate", {})
    if plain.get("done"):
        lines.append(f"plain vllm.LLM.generate on step {plain['step']}'s {plain['requests']} requests: "
                     f"{plain['generated_tokens']:,} tokens in {plain['seconds']:.1f} s ({plain['tokens_per_s']:,.0f} "
                     f"tokens/s); " + (f"the agent loop reached {plain['gen_vs_plain'] * 100:.1f}% of it"
                                       if plain.get("gen_vs_plain") else
                                       f"no comparison: step {plain['step']}'s record has no generation rate"))
    else:
        lines.append(f"plain vllm.LLM.generate: not measured ({plain.get('why')})")
    env = report.get("environment", {})
    if "attention_backends" in report:
        lines += ["", f"the trainer's attention ran (SDPA's backend): {', '.join(report['attention_backends']) or '-'}"]
    lines += ["", "versions: " + ", ".join(f"{k} {v}" for k, v in env.items())]
    return "\n".join(lines)



def _profile_lines(profile: dict) -> list[str]:
    """Each profiled update (``StepBenchCallback``'s ``profile_update_step``): its wall under the
    profiler, its kernels' seconds, the card's idle share and the largest categories."""
    lines = []
    for role in ("critic", "actor"):
        summary = profile.get(role)
        if not summary:
            continue
        top = ", ".join(f"{name} {part['s']:.2f} s" for name, part in list(summary["categories"].items())[:5])
        lines.append(f"step {profile['step']}'s update_{role} under the profiler: {summary['wall_s_under_profiler']:.2f} s, "
                     f"kernels {summary['device_s']:.2f} s, the card idle {summary['idle_share']:.1%} ({top}); "
                     f"the allocator: {_fmt_counts(summary.get('allocator') or {})}")
    return lines + [""] if lines else []


def _fmt_counts(counts: dict) -> str:
    return ", ".join(f"{key} {value}" for key, value in counts.items()) or "-"


def _card_rate_lines(row: dict, at_setup: Optional[float]) -> list[str]:
    """The card's matmul rate at the step's end beside the set-up rate the MFU column uses, and
    the updates' MFU on it: a card slower by then shows apart from the code."""
    rate = row.get("card_tflops_after")
    if not rate:
        return []
    mfu = row.get("useful_mfu_at_card_rate_after") or {}
    updates = ", ".join(f"{p} {mfu[p]:.1%}" for p in ("update_critic", "update_actor") if p in mfu)
    return ["", f"the card's bf16 matmul rate at the step's end: {rate:.1f} TFLOP/s (at set-up, the MFU column's: "
                f"{_fmt(at_setup)})" + (f"; useful MFU on it: {updates}" if updates else "")]


def _micro_step_lines(row: dict) -> list[str]:
    """Each role's update by micro-step (``ppo/micro_timing.py``'s metrics), where logged."""
    metrics, phases = row.get("metrics", {}), row.get("phases_s", {})
    parts = []
    for role in ("critic", "actor"):
        m = {k[len(f"perf/{role}_"):]: v for k, v in metrics.items() if k.startswith(f"perf/{role}_")}
        if "micro_batches" not in m:
            continue
        text = f"{role} {m['micro_batches']:.0f} micro-batches"
        if "micro_tokens_max" in m:
            text += f" (largest {m['micro_tokens_max']:,.0f} tokens)"
        if "micro_steps_s" in m and phases.get(f"update_{role}"):
            text += f", micro-steps {m['micro_steps_s']:.2f} s of the phase's {phases[f'update_{role}']:.2f} s"
        if "micro_step_fixed_s" in m:
            text += f", fixed cost {m['micro_step_fixed_s']:.3f} s a micro-step"
        if "layers_replayed" in m:
            text += f", replayed {m['layers_replayed']:.1f} layers and {m['mixers_replayed']:.1f} mixers a micro-step"
        parts.append(text)
    return ["", "the updates by micro-step: " + "; ".join(parts)] if parts else []
