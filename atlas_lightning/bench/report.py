"""The update benchmark's markdown tables, from its JSON results (``update_bench.Bench.results``)."""

from __future__ import annotations


def _f(value, digits=2, scale=1.0) -> str:
    if value is None:
        return "-"
    if isinstance(value, (int, float)):
        return f"{value * scale:,.{digits}f}"
    return str(value)


def _update_row(model: str, path: str, layers, entry: dict, options: dict) -> str:
    if "error" in entry or "skipped" in entry:
        return f"| {model} | {path} | {layers} | {entry.get('error', entry.get('skipped'))} |||||||||"
    opts = ", ".join(f"{k}={v}" for k, v in options.items())
    return (f"| {model} | {path} | {layers} | {entry.get('real_tokens')} ({entry.get('padded_tokens')}) | "
            f"{entry.get('micro_batches')} | {_f(entry.get('critic_s'))} + {_f(entry.get('actor_s'))} | "
            f"{_f(entry.get('tokens_per_s'), 0)} | {_f(entry.get('useful_tflops'), 0)} | "
            f"{_f(entry.get('useful_mfu'), 1, 100)}% | {_f(entry.get('peak_gib'), 1)} | {opts} |")


def markdown(results: dict) -> str:
    lines = []
    env = results.get("environment", {})
    peak = results.get("matmul_peak", {})
    copy = results.get("copy_bandwidth", {})
    lines.append(f"Device: {env.get('gpu', 'cpu')}; torch {env.get('torch')}, transformers {env.get('transformers')}, "
                 f"peft {env.get('peft')}. bf16 matmul {_f(peak.get('tflops'), 1)} TFLOP/s, "
                 f"copy {_f(copy.get('gbps'), 0)} GB/s (read + write), measured in this run.")
    lines.append("")
    lines.append("PPO update (critic then actor, forward + backward), one micro-batch of the length mix:")
    lines.append("")
    lines.append("| model | path | layers | real (padded) tokens | micro-batches | critic + actor s | tokens/s | "
                 "useful TFLOP/s | useful MFU | peak GiB | options |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|")
    fwd_rows, sync_rows, probe_rows, batch_rows, choice_rows = [], [], [], [], []
    for model, out in results.get("models", {}).items():
        sweep = out.get("sweep", {})
        for option, entry in sweep.items():
            if not isinstance(entry, dict) or option == "policy_flops":
                continue
            opts = {k: entry[k] for k in ("fused_lora", "attention") if k in entry}
            if "layer_recompute" in entry:
                opts["recompute"] = _plan(entry["layer_recompute"])
            lines.append(_update_row(model, f"sweep: {option}", sweep.get("layers"), entry, opts))
        for path in ("ours", "baseline"):
            full = out.get(path)
            if not full:
                continue
            if "skipped" in full:
                lines.append(f"| {model} | {path} | - | skipped: {full['skipped']} |||||||||")
                continue
            options = dict(full.get("options", {}))
            if "layer_recompute" in options:
                options["layer_recompute"] = _plan(options["layer_recompute"])
            lines.append(_update_row(model, path, full.get("layers"), full.get("update", {}), options))
            if path == "ours" and out.get("recompute_choice"):
                choice_rows.append(f"* {model}: {_choice_text(out['recompute_choice'])}"
                                   f"{_ran_text(full.get('update', {}), full.get('recompute'))}")
            for probe in ("autotune", "profile"):
                if probe in full:
                    probe_rows.append((model, probe, full[probe]))
            fwd_rows += _forward_rows(model, path, full.get("forward", {}))
            if full.get("weight_sync"):
                sync_rows += _sync_rows(model, full["weight_sync"])
    for model, out in results.get("models", {}).items():
        batch = out.get("batch")
        if batch:
            batch_rows.append(_batch_lines(model, batch))
    if choice_rows:
        lines += ["", "Our recomputation: model.checkpoint_layers=auto as fit resolves it, for the card's free memory "
                      "(or the cap):", "", *choice_rows]
    if batch_rows:
        lines += ["", "Batch update (actor micro-batches + clip + AdamW step), one whole batch:", ""]
        for block in batch_rows:
            lines += block
    for model, probe, entry in probe_rows:
        lines += ["", f"{model} {probe}:", "", _probe_text(probe, entry)]
    if fwd_rows:
        lines += ["", "Forward-only passes (no grad; actor with entropy):", "",
                  "| model | path | pass | real tokens | micro-batches | s | tokens/s | useful MFU | peak GiB |",
                  "|---|---|---|---|---|---|---|---|---|", *fwd_rows]
    rows = results.get("logprob_memory", [])
    if rows:
        lines += ["", "Token log-probs, forward + backward from hidden states (peak above inputs):", "",
                  "| tokens | hidden | vocab | kind | peak GiB | s | fp32 logits would be GiB |",
                  "|---|---|---|---|---|---|---|"]
        for r in rows:
            lines.append(f"| {r['tokens']} | {r['hidden']} | {r['vocab']} | {r['kind']} | "
                         f"{r.get('error') or _f(r.get('peak_above_inputs_gib'), 2)} | {_f(r.get('seconds'), 3)} | "
                         f"{_f(r.get('logits_fp32_gib'), 1)} |")
    if sync_rows:
        lines += ["", "Weight sync (actor adapter; one GPU, nothing to gather):", "",
                  "| model | path | bytes | s | rate | of copy bandwidth |", "|---|---|---|---|---|---|", *sync_rows]
    lines += ["", f"Useful FLOPs: {results.get('useful_flops_formula', '')}.", ""]
    return "\n".join(lines)


def _forward_rows(model: str, path: str, fwd: dict) -> list[str]:
    rows = []
    for role in ("actor", "critic"):
        if role in fwd:
            e = fwd[role]
            rows.append(f"| {model} | {path} | {role} | {fwd.get('real_tokens')} | {fwd.get('micro_batches')} | "
                        f"{_f(e.get('median_s'))} | {_f(e.get('tokens_per_s'), 0)} | "
                        f"{_f(e.get('useful_mfu'), 1, 100)}% | {_f(e.get('peak_gib'), 1)} |")
    if "error" in fwd:
        rows.append(f"| {model} | {path} | {fwd['error']} |||||||")
    return rows


def _sync_rows(model: str, ws: dict) -> list[str]:
    if "error" in ws:
        return [f"| {model} | {ws['error']} ||||"]
    a = ws.get("adapter_state", {})
    s = ws.get("save_adapter", {})
    rows = [f"| {model} | adapter_state | {_f(a.get('bytes'), 2, 1e-9)} GB | "
            f"{_f(a.get('seconds'), 3)} | {_f(a.get('gbps'), 1)} GB/s | - |",
            f"| {model} | save_adapter (disk) | {_f(a.get('bytes'), 2, 1e-9)} GB | "
            f"{_f(s.get('seconds'), 3)} | {_f(s.get('gbps'), 1)} GB/s | - |"]
    for key in ("merged_cat", "merged_packs"):
        m = ws.get(key, {})
        rows.append(f"| {model} | {key} | {_f(m.get('bytes'), 2, 1e-9)} GB | {_f(m.get('seconds'), 3)} | "
                    f"{_f(m.get('gbps_out'), 0)} GB/s out, {_f(m.get('gbps_moved'), 0)} GB/s moved | "
                    f"{_f(m.get('fraction_of_copy_bandwidth'), 0, 100)}% |")
    return rows


def _plan(plan) -> str:
    """``['layer', 'layer', 'none']`` -> ``layer x2, none x1``."""
    if not plan:
        return str(plan)
    runs, last = [], None
    for policy in plan:
        if runs and policy == last:
            runs[-1][1] += 1
        else:
            runs.append([policy, 1])
        last = policy
    return ", ".join(f"{p} x{n}" for p, n in runs)


def _counts(counts: dict) -> str:
    return ", ".join(f"{p} x{n}" for p, n in counts.items())


def _choice_text(choice: dict) -> str:
    """One line of the JSON's ``recompute_choice`` / ``choice`` (``update.plan_record``): the
    budget's plan, its predicted peak against the room, the plans of smaller micro-batches."""
    if not choice.get("plan"):
        return str(choice.get("why", "no plan"))
    limits = "".join(f", {key.split('_')[0]} {choice[key]:g} GiB" for key in ("cap_gib", "margin_gib") if choice.get(key))
    text = (f"{choice.get('tokens', 0):,} tokens: {_counts(choice.get('counts', {}))}, predicted "
            f"{_f(choice.get('need_gib'))} GiB {'fits' if choice.get('fits') else 'does NOT fit'} in "
            f"{_f(choice.get('room_gib'))} ({_f(choice.get('free_gib'))} GiB free of "
            f"{_f(choice.get('card_gib'), 1)}{limits})")
    shown, last = [], None
    for tier in choice.get("tier_plans", [])[1:]:
        if tier["counts"] != last:
            shown.append(f"<= {tier['tokens']:,}: {_counts(tier['counts'])} ({tier['replayed_share']:.0%} replayed)")
        last = tier["counts"]
    return text + ("; smaller micro-batches: " + "; ".join(shown) if shown else "")


def _ran_text(update: dict, label) -> str:
    """What ours' micro-steps replayed (``recompute_per_micro_step``), and the attempt that ran."""
    steps = update.get("recompute_per_micro_step") or []
    ran = "; ".join(f"{s['tokens']:,} tokens: {s['layers_replayed']} layers + {s['mixers_replayed']} mixers replayed"
                    for s in steps)
    return (f". Ran: {label}" if label and label != "auto" else "") + (f". Micro-steps: {ran}" if ran else "")


def _batch_lines(model: str, batch: dict) -> list[str]:
    source = batch.get("source", "sampled")
    source = "sampled" if source == "sampled" else (f"the batch fit trained on ({source}), {batch.get('epochs')} "
                                                    f"epochs x {batch.get('mini_batches')} mini-batches")
    lines = [f"{model}: {batch.get('sequences')} sequences, {batch.get('real_tokens')} real tokens (longest "
             f"{batch.get('longest')}), {batch.get('layers')} layers, cap {batch.get('cap_gib')} GiB; "
             f"speedup {_f(batch.get('speedup'), 2)}x; {source}", "",
             "| path | micro-batches | s | tokens/s | useful MFU | peak GiB | plan |", "|---|---|---|---|---|---|---|"]
    for path in ("ours", "baseline"):
        entry = batch.get(path, {})
        update = entry.get("update", {})
        attempt = (entry.get("attempts") or [{}])[-1]
        plan = attempt.get("layer_recompute") or attempt.get("micro_batch_sequences")
        plan = _plan(plan) if isinstance(plan, list) else plan
        detail = f"budget {attempt.get('budget')}: {plan}" if "budget" in attempt else f"{plan} sequences a micro-batch"
        if "error" in update or not update:
            lines.append(f"| {path} | {update.get('error', entry.get('skipped', attempt.get('error', '-')))} ||||||")
            continue
        lines.append(f"| {path} | {update.get('micro_batches')} | {_f(update.get('seconds'))} | "
                     f"{_f(update.get('tokens_per_s'), 0)} | {_f(update.get('useful_mfu'), 1, 100)}% | "
                     f"{_f(update.get('peak_gib'), 1)} | {detail} |")
    if batch.get("choice"):
        ours = batch.get("ours", {})
        label = ((ours.get("attempts") or [{}])[-1]).get("attempt")
        lines += ["", f"Ours' plan (model.checkpoint_layers=auto as fit resolves it): {_choice_text(batch['choice'])}"
                      f"{_ran_text(ours.get('update', {}), label)}"]
    return lines


def _probe_text(probe: str, entry: dict) -> str:
    if "error" in entry or "skipped" in entry:
        return str(entry.get("error", entry.get("skipped")))
    if probe == "autotune":
        return (f"new length ({entry.get('tokens')} tokens): actor micro-step {_f(entry.get('actor_micro_step_s'), 3)} s, "
                f"{entry.get('new_tuned_entries')} new autotune entries ({entry.get('tuned_entries_before')} before)")
    rows = [f"device time {_f(entry.get('device_s'), 3)} s of an actor micro-step:", "",
            "| category | s | share |", "|---|---|---|"]
    for name, cat in entry.get("categories", {}).items():
        rows.append(f"| {name} | {_f(cat.get('s'), 3)} | {_f(cat.get('share'), 1, 100)}% |")
    return "\n".join(rows)
