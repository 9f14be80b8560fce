"""Memory-check mode in the separate layout: the serving side and the weight transfer, measured.

In the separate layout the training cards never generate; what can run out of memory there is
the serving side (the engine's budget, generation, and the buckets of a weight transfer
arriving beside it) and the sender's buckets. So, besides the synthetic PPO steps
(``memory_check.py``), the check runs what ``fit`` runs on both sides, through the same code:

1. at train start, on every training rank (collective): the engine as ``fit`` builds it
   (``rollout.factory.build_engine`` -> ``rollout/separate.py``: rank 0 starts ONE vLLM server
   on the serving cards, a CPU server on CPU, with vLLM's weight-transfer API when
   ``rollout.weight_sync=merged``); then the first weight sync; then a generation burst: every
   training rank sends its share, ``min(rollout.max_in_flight, 256)`` requests of a
   ``min(1536, rollout.max_prompt_length)``-token synthetic prompt, ``rollout.max_tokens_per_turn``
   tokens each at temperature 1, as its producer would;
2. after every synthetic step: that step's weight sync.

Every weight sync is ``fit``'s own, the module's ``PPOModule.sync_weights`` (the step's last
phase, ``rollout/sync.py``): merged weights gathered, merged and packed in buckets of at most
``rollout.bucket_mb`` and sent through ``rollout/engines/weight_transfer.py`` (``gloo`` on CPU,
vLLM's ``nccl`` on GPUs), or the LoRA adapter loaded by name; then verified as in ``fit``
(tensor count and digest, the log-prob gap on a probe sequence), so a transfer that delivers
wrong weights fails the check. The module measures each sync through its phase hook
(``measuring_sync``).

Measured:

* training ranks: the ``update_weights`` phase (the send side: gather, merge, pack, send),
  with the ``PhaseProbe`` of the other phases;
* serving side (training rank 0 reads it, ``serving_memory.ServingMemory``): ``generation``
  (while the burst runs; its end value is the server after generation) and ``receive_weights``
  (while each sync runs);
* each sync's transfer as the engine reported it: tensors, buckets, the largest bucket, backend.

Who calls it: ``memory_check.MemoryCheckModule`` when ``layout.mode=separate``.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Iterator, Optional

import numpy as np

from atlas_lightning import distributed as dist_utils
from atlas_lightning.run.serving_memory import GIB, ServingMemory, server_pid, serving_cards_of

PROMPT_TOKENS = 1536
MAX_BURST = 256


class _RecordingEngine:
    """The layout's engine, unchanged, keeping the ``SyncReport`` of every merged transfer
    (``load_merged``) and LoRA load (``set_adapter``) for the report."""

    def __init__(self, engine) -> None:
        self._engine = engine
        self.reports: list[Any] = []

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    def load_merged(self, weights, version: int):
        report = self._engine.load_merged(weights, version=version)
        self.reports.append(report)
        return report

    def set_adapter(self, adapter):
        report = self._engine.set_adapter(adapter)
        self.reports.append(report)
        return report


class ServingSide:
    """The separate layout's engine, weight syncs and serving-side memory for one memory check
    (module doc). Every method is collective over the training ranks."""

    def __init__(self, cfg, actor_lora=None) -> None:
        """``actor_lora``: the actor's LoRA shape the run resolved (``MemoryCheckModule.actor_lora``)."""
        self.cfg = cfg
        self.actor_lora = actor_lora
        self.engine: Optional[_RecordingEngine] = None
        self.memory: Optional[ServingMemory] = None
        self.generation: dict = {"measured": False, "why": "not run"}
        self.transfers: list[dict] = []

    def start(self, trainer, module) -> None:
        """Build the engine (rank 0 starts the server), sync the initial weights, generate."""
        from atlas_lightning.rollout.factory import build_engine

        engine = build_engine(self.cfg, rank=trainer.global_rank, local_rank=trainer.local_rank,
                              world_size=trainer.world_size, actor_lora=self.actor_lora)
        self.engine = _RecordingEngine(engine)
        trainer.datamodule.engine = self.engine
        if trainer.global_rank == 0:
            self.memory = ServingMemory(pid=server_pid(engine), cards=serving_cards_of(self.cfg))
        module.sync_weights(0)  # measured through the module's phase hook (measuring_sync)
        self.generate(trainer, module)

    def _window(self, phase: str, step: int):
        from contextlib import nullcontext

        return self.memory.window(phase, step) if self.memory is not None else nullcontext()

    @contextmanager
    def measuring_sync(self, trainer, module, version: int) -> Iterator[None]:
        """Around ``fit``'s weight sync of ``version`` (module doc): the send side measured on
        every training rank, the receive side on the serving side, the transfer recorded."""
        dist_utils.barrier()
        before = len(self.engine.reports)
        started = time.monotonic()
        with module.probe.phase("update_weights", version), self._window("receive_weights", version):
            yield
        if trainer.global_rank == 0:
            report = self.engine.reports[before] if len(self.engine.reports) > before else None
            extra = dict(getattr(report, "extra", {}) or {})
            self.transfers.append({
                "version": version, "weight_sync": self.cfg.rollout.weight_sync, "seconds": time.monotonic() - started,
                "tensors": getattr(report, "tensor_count", None), "buckets": extra.get("buckets"),
                "largest_bucket_mib": extra["largest_bucket_bytes"] / 2**20 if "largest_bucket_bytes" in extra else None,
                "bucket_mb": float(self.cfg.rollout.bucket_mb), "backend": extra.get("backend"),
                "logprob_gap": module.weight_sync.last_gap,
            })

    def generate(self, trainer, module) -> None:
        """Every training rank's burst to the shared server (module doc); the serving side measured."""
        from atlas_lightning.rollout.engine import GenerationRequest, SamplingSpec

        cfg, rank = self.cfg, trainer.global_rank
        count = max(1, min(cfg.rollout.max_in_flight, MAX_BURST))
        prompt = min(PROMPT_TOKENS, cfg.rollout.max_prompt_length)
        vocab = int(module.model.hf_model.get_output_embeddings().weight.shape[0])
        rng = np.random.default_rng([int(cfg.seed), rank, 7])
        requests = [GenerationRequest(f"memory-check-r{rank}-{i}", tuple(int(t) for t in rng.integers(0, vocab, prompt)),
                                      SamplingSpec(max_tokens=cfg.rollout.max_tokens_per_turn, temperature=1.0,
                                                   seed=int(rng.integers(1 << 31))))
                    for i in range(count)]
        dist_utils.barrier()
        started = time.monotonic()
        with self._window("generation", 0):
            results = self.engine.generate(requests)
            dist_utils.barrier()  # the window covers every rank's requests
        tokens = dist_utils.all_reduce_sum([float(sum(len(r.token_ids) for r in results))])[0]
        self.generation = {"measured": True, "requests_per_rank": count, "ranks": trainer.world_size,
                           "prompt_tokens": prompt, "generated_tokens": int(tokens),
                           "seconds": time.monotonic() - started}

    def report(self) -> dict:
        """Rank 0's view: the serving side's windows, the transfers and the generation burst."""
        return {"measures": self.memory.measures if self.memory is not None else "measured on rank 0",
                "server_pid": self.memory.pid if self.memory is not None else None,
                "windows": list(self.memory.records) if self.memory is not None else [],
                "transfers": list(self.transfers), "generation": dict(self.generation)}

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None


def serving_rows(serving: Optional[dict], plan: Any) -> list[dict]:
    """The report's serving-side rows: per phase the window of largest peak, with the plan's
    card figure for that phase of the serving cards beside it where the measure is a card's
    (GPU; a CPU server's resident set holds Python and libraries, not comparable)."""
    if not serving:
        return []
    predicted = {p.name: p for p in plan.phases if p.cards == "serving cards"} if plan is not None else {}
    best: dict[str, dict] = {}
    for record in serving.get("windows", []):
        if not record.get("measured"):
            best.setdefault(record["phase"], record)
            continue
        current = best.get(record["phase"])
        if current is None or not current.get("measured") or record["peak_gib"] > current["peak_gib"]:
            best[record["phase"]] = record
    rows = []
    for phase, record in best.items():
        row = {"phase": phase, "step": record["step"], "measured": record.get("measured", False)}
        if record.get("measured"):
            row.update(peak_gib=record["peak_gib"], end_gib=record["end_gib"], start_gib=record["start_gib"])
            if "sampled_peak_gib" in record:
                row["sampled_peak_gib"] = record["sampled_peak_gib"]
        else:
            row["why"] = record.get("why")
        if phase in predicted and "cards_gib" in record:  # a card's used memory: comparable to the plan's card
            row["plan_card_gib"] = predicted[phase].card / GIB
        rows.append(row)
    return rows
