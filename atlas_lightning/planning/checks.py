"""Layouts the planner refuses before anything starts, whatever the memory says.

Each check returns sentences naming the keys involved and what to change. Some repeat
``config.validate`` on purpose: a config changed after composition (a test's, a user's
``OmegaConf.create``) must still never pass a layout the trainer cannot run. The config read is
a composed one (every key present: the schema holds the defaults).

Who calls it: ``planning.make_plan``; ``token_budget_refusals`` also ``run/facts.check_inputs`` (fit).
"""

from __future__ import annotations

from typing import Any

from atlas_lightning.rollout.layout_checks import separate_refusals

from .shapes import LINEAR, ModelShape

#: The test proving merged weights exact at uneven FSDP2 world sizes.
MERGED_WEIGHTS_TEST = "tests/scale/test_merged_weights_world_sizes.py"
#: The end-to-end test of the separate layout (CPU: one trainer, one vLLM server).
SEPARATE_LAYOUT_TEST = "tests/e2e/test_separate_layout.py"


def layout_refusals(cfg: Any, shape: ModelShape) -> list[str]:
    """Every reason ``cfg``'s layout cannot run on ``shape`` (empty: none)."""
    out: list[str] = []
    layout, rollout = cfg.layout, cfg.rollout
    mode = str(layout.mode)
    gpus, train, serve = int(layout.gpus), int(layout.train_gpus), int(layout.serve_gpus)
    tp = int(layout.engine_tp)
    processes = int(cfg.trainer.devices) * int(cfg.trainer.num_nodes)

    if mode == "separate":
        out.extend(separate_refusals(cfg))
        if processes != train:
            out.append(f"trainer.devices x trainer.num_nodes = {processes} but layout.train_gpus={train}")
        if train + serve != gpus and not layout.get("share_cards", False):
            out.append(f"layout.train_gpus ({train}) + layout.serve_gpus ({serve}) != layout.gpus ({gpus})")
        engine_cards = serve
    else:
        if processes != gpus or train != gpus:
            out.append(f"colocated layout: layout.gpus={gpus}, layout.train_gpus={train} and trainer.devices x "
                       f"trainer.num_nodes={processes} must all be equal (every card trains)")
        engine_cards = gpus
        if layout.get("partial_rollouts"):
            out.append("layout.partial_rollouts=true interrupts the separate layout's server requests at a weight "
                       "sync; a colocated layout never samples during an update: set layout.partial_rollouts=false "
                       "or layout.mode=separate")
    if tp <= 0 or engine_cards <= 0 or engine_cards % tp:
        out.append(f"engine TP {tp} does not divide the {engine_cards} cards that serve "
                   f"({'layout.serve_gpus' if mode == 'separate' else 'layout.gpus'})")
    if tp > 0:
        out.extend(_tp_divides_heads(shape, tp))

    out.extend(token_budget_refusals(cfg))
    utilization = float(rollout.gpu_memory_utilization)
    if not 0.0 < utilization <= 1.0:
        out.append(f"rollout.gpu_memory_utilization={utilization} must be within (0, 1]")
    return out


def token_budget_refusals(cfg: Any) -> list[str]:
    """Each per-card token budget (``algorithm.ppo_max_token_len_per_gpu``, ``forward_max_token_len_per_gpu``)
    below the longest sequence a rollout can make (``rollout.max_prompt_length +
    max_response_length``): the update puts such a sequence alone in a micro-batch over the budget
    (``ppo/micro_batches.py``), which the plan, the memory check and the card never sized. Asked by
    ``plan`` (``layout_refusals``) and by ``fit`` before anything is written (``run/facts.py``)."""
    rollout, algorithm = cfg.rollout, cfg.algorithm
    longest = int(rollout.max_prompt_length) + int(rollout.max_response_length)
    out = []
    for key in ("ppo_max_token_len_per_gpu", "forward_max_token_len_per_gpu"):
        budget = int(algorithm[key])
        if longest > budget:
            out.append(f"a single sequence can be rollout.max_prompt_length + rollout.max_response_length = {longest:,} "
                       f"tokens, longer than algorithm.{key}={budget:,}: such a micro-batch would exceed the budget "
                       f"(set algorithm.{key} to at least {longest}, or shorten the rollout's lengths)")
    return out


def _tp_divides_heads(shape: ModelShape, tp: int) -> list[str]:
    """vLLM splits attention heads over TP ranks (KV heads may be replicated when fewer)."""
    out = []
    if shape.num_heads % tp:
        out.append(f"engine TP {tp} does not divide the model's {shape.num_heads} attention heads (vLLM needs it)")
    kv = shape.num_kv_heads
    if kv % tp and tp % kv:
        out.append(f"engine TP {tp} and the model's {kv} KV heads: one must divide the other (vLLM)")
    if LINEAR in shape.layer_types:
        for name, heads in (("linear_num_key_heads", shape.linear_num_key_heads),
                            ("linear_num_value_heads", shape.linear_num_value_heads)):
            if heads % tp:
                out.append(f"engine TP {tp} does not divide the model's {name}={heads} (vLLM)")
    return out
