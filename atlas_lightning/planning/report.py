"""The plan, for people and for files: a per-card table, the refusals, ``plan.json``.

Who calls it: the ``plan`` verb (``verbs.plan``), ``python -m atlas_lightning.planning``, the
pre-flight.
"""

from __future__ import annotations

import json
from pathlib import Path

from atlas_lightning.store.atomic import atomic_write_text

from .estimate import GIB, Plan


def format_plan(plan: Plan) -> str:
    """A table of every phase's peak (tensors, card) per kind of card, its largest terms, the
    engine's KV capacity, notes and the verdict."""
    m = plan.model
    card = f"{plan.card_bytes / GIB:.0f} GiB cards" if plan.device == "gpu" else "CPU"
    lines = [
        f"plan for {plan.name}: {m['model_type']}, {m['base_params'] / 1e9:.2f}B parameters "
        f"({m['layers']} layers, {m['linear_attention_layers']} linear-attention; {m['layout']} layout), "
        f"FSDP2 world {m['world_size']}, {card}",
        *(f"  {role} LoRA {m['lora'][role]}: {m['lora_params'][role] / 1e6:.1f}M parameters" for role in m["lora"]),
        "",
        f"{'phase':<16}{'cards':<16}{'tokens':>8}{'tensors GiB':>13}{'card GiB':>10}  largest terms (GiB)",
    ]
    for phase in plan.phases:
        tokens = f"{phase.tokens:,}" if phase.tokens else "-"
        top = ", ".join(f"{k} {v / GIB:.1f}" for k, v in phase.largest(3))
        lines.append(f"{phase.name:<16}{phase.cards:<16}{tokens:>8}{phase.tensors / GIB:>13.1f}"
                     f"{phase.card / GIB:>10.1f}  {top}")
    e = plan.engine
    if e and plan.device == "cpu":
        lines += ["", f"engine: CPU KV cache {e['kv_cache_gib']:.1f} GiB (rollout.cpu_kvcache_gib), "
                      f"{e['full_length_sequences']:.1f} sequences of max_model_len"]
    elif e:
        lines += ["", f"engine per serving card: budget {e['budget_gib']:.1f} GiB = weights {e['weights_gib']:.1f} + "
                      f"reserve {e['reserve_gib']:.1f} + KV cache {e['kv_cache_gib']:.1f} "
                      f"({e['full_length_sequences']:.1f} sequences of max_model_len)"]
    if plan.max_update_tokens:
        lines.append(f"largest ppo_max_token_len_per_gpu that fits: about {plan.max_update_tokens:,} tokens")
    lines += [f"note: {note}" for note in plan.notes]
    lines.append("")
    if plan.ok:
        lines.append("PLAN OK")
    else:
        lines.append(f"PLAN REFUSED ({len(plan.refusals)} reason{'s' if len(plan.refusals) > 1 else ''}):")
        lines += [f"  - {reason}" for reason in plan.refusals]
    return "\n".join(lines)


def write_plan_json(plan: Plan, path: str | Path) -> Path:
    """``plan.to_dict()`` as JSON, atomically."""
    return atomic_write_text(Path(path), json.dumps(plan.to_dict(), indent=1) + "\n")
