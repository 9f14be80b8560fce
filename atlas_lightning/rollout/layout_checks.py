"""What the separate layout's engine side cannot run, in sentences naming the keys to change.

Pure Python (no torch): ``planning.checks`` refuses these before a launch, and
``separate.build_separate_engine`` refuses them again before starting the server.
"""

from __future__ import annotations

from typing import Any

from atlas_lightning.config import shared_card_refusals


def separate_refusals(cfg: Any) -> list[str]:
    """Every reason ``cfg`` (a composed config in the separate layout) cannot run its one vLLM
    server on the serving cards (the training cards with ``layout.share_cards``), fed by every
    training rank (empty: none). Merged weights reach
    it through vLLM's weight-transfer API, exact at any FSDP2 world size, uneven shards included
    (``planning.checks.MERGED_WEIGHTS_TEST``)."""
    out = []
    serve, tp = int(cfg.layout.serve_gpus), int(cfg.layout.engine_tp)
    engine = str(cfg.rollout.engine)
    if engine != "vllm-server":
        out.append(f"layout.mode=separate serves from a vLLM server on the serving cards: set rollout.engine=vllm-server "
                   f"(got {engine!r})")
    if serve != tp:
        out.append(f"layout.serve_gpus={serve} with engine TP {tp} would make {serve // max(tp, 1)} servers; the "
                   f"separate layout runs one server over all serving cards: set layout.engine_tp={serve}")
    if bool(cfg.rollout.enable_sleep_mode):
        out.append("layout.mode=separate: the serving cards never train, nothing needs to sleep: "
                   "set rollout.enable_sleep_mode=false")
    if cfg.layout.get("share_cards", False):
        out.extend(shared_card_refusals(cfg))
    if int(cfg.layout.max_staleness) < 0:
        out.append("layout.max_staleness must be >= 0")
    if cfg.layout.get("staleness_policy", "wait") == "drop" and int(cfg.layout.max_staleness) < 1:
        out.append("layout.staleness_policy=drop samples one step ahead without waiting for weights: with "
                   "layout.max_staleness=0 it would drop all of it; set layout.max_staleness >= 1 or "
                   "layout.staleness_policy=wait")
    return out
