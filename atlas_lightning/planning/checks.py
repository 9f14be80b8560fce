"""Layouts the planner refuses before anything starts, whatever the memory says.

Each check returns sentences naming the keys involved and what to change. Some repeat
``config.validate`` on purpose: the planner also reads configs that did not come through
``compose`` (a user's dict, a test), and must never pass a layout the trainer cannot run.

Who calls it: ``planning.make_plan``.
"""

from __future__ import annotations

from typing import Any

from .estimate import _select
from .shapes import LINEAR, ModelShape

#: The test proving merged weights exact at uneven FSDP2 world sizes.
MERGED_WEIGHTS_TEST = "tests/scale/test_merged_weights_world_sizes.py"
#: The end-to-end test of the separate layout (CPU: one trainer, one vLLM server).
SEPARATE_LAYOUT_TEST = "tests/e2e/test_separate_layout.py"


def layout_refusals(cfg: Any, shape: ModelShape) -> list[str]:
    """Every reason ``cfg``'s layout cannot run on ``shape`` (empty: none)."""
    out: list[str] = []
    mode = str(_select(cfg, "layout.mode", "colocated"))
    gpus, train, serve = (int(_select(cfg, f"layout.{k}", 0)) for k in ("gpus", "train_gpus", "serve_gpus"))
    tp = int(_select(cfg, "rollout.tensor_parallel_size", 1))
    layout_tp = int(_select(cfg, "layout.engine_tp", tp))
    processes = int(_select(cfg, "trainer.devices", 1)) * int(_select(cfg, "trainer.num_nodes", 1))

    if mode == "separate":
        out.extend(separate_refusals(cfg))
        if processes != train:
            out.append(f"trainer.devices x trainer.num_nodes = {processes} but layout.train_gpus={train}")
        if train + serve != gpus:
            out.append(f"layout.train_gpus ({train}) + layout.serve_gpus ({serve}) != layout.gpus ({gpus})")
        engine_cards = serve
    else:
        if processes != gpus or train != gpus:
            out.append(f"colocated layout: layout.gpus={gpus}, layout.train_gpus={train} and trainer.devices x "
                       f"trainer.num_nodes={processes} must all be equal (every card trains)")
        engine_cards = gpus
    if tp != layout_tp:
        out.append(f"rollout.tensor_parallel_size={tp} differs from layout.engine_tp={layout_tp}")
    if tp <= 0 or engine_cards <= 0 or engine_cards % tp:
        out.append(f"engine TP {tp} does not divide the {engine_cards} cards that serve "
                   f"({'layout.serve_gpus' if mode == 'separate' else 'layout.gpus'})")
    if tp > 0:
        out.extend(_tp_divides_heads(shape, tp))

    longest = int(_select(cfg, "rollout.max_prompt_length", 0)) + int(_select(cfg, "rollout.max_response_length", 0))
    for key in ("algorithm.ppo_max_token_len_per_gpu", "algorithm.forward_max_token_len_per_gpu"):
        budget = int(_select(cfg, key, 0))
        if longest > budget:
            out.append(f"a single sequence can be rollout.max_prompt_length + rollout.max_response_length = {longest:,} "
                       f"tokens, longer than {key}={budget:,}: such a micro-batch would exceed the budget")
    utilization = float(_select(cfg, "rollout.gpu_memory_utilization", 0.5))
    if not 0.0 < utilization <= 1.0:
        out.append(f"rollout.gpu_memory_utilization={utilization} must be within (0, 1]")
    return out


def separate_refusals(cfg: Any) -> list[str]:
    """What the separate layout (``rollout/separate.py``) cannot run (it runs one vLLM server
    on the serving cards, fed by every training rank; merged weights through vLLM's
    weight-transfer API, exact at any FSDP2 world size, uneven shards included:
    ``MERGED_WEIGHTS_TEST``). Also what ``separate.build_separate_engine`` refuses."""
    out = []
    serve = int(_select(cfg, "layout.serve_gpus", 0))
    tp = int(_select(cfg, "layout.engine_tp", _select(cfg, "rollout.tensor_parallel_size", 1)))
    engine = str(_select(cfg, "rollout.engine", "vllm"))
    if engine != "vllm-server":
        out.append(f"layout.mode=separate serves from a vLLM server on the serving cards: set rollout.engine=vllm-server "
                   f"(got {engine!r})")
    if serve != tp:
        out.append(f"layout.serve_gpus={serve} with engine TP {tp} would make {serve // max(tp, 1)} servers; the "
                   f"separate layout runs one server over all serving cards: set layout.engine_tp="
                   f"rollout.tensor_parallel_size={serve}")
    if bool(_select(cfg, "rollout.enable_sleep_mode", False)):
        out.append("layout.mode=separate: the serving cards never train, nothing needs to sleep: "
                   "set rollout.enable_sleep_mode=false")
    if int(_select(cfg, "layout.max_staleness", 1)) < 0:
        out.append("layout.max_staleness must be >= 0")
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
