"""Memory-check mode (README, "Scale"): synthetic RL steps with the real model at the full token budget,
and each card's peak memory for generation, forward-only and backward passes.

    atlas-lightning memory-check experiment=r28-continued-cost-8gpu-t49152-memory

What runs: the real ``PPOModule.training_step`` under a real ``lightning.Trainer`` (one process
a card; FSDP2 through the same strategy as ``fit``), measured through the step's own phase
hook (``PPOModule.phase_hook``: the same step, nothing overridden), on ``trainer.memory_check_steps``
synthetic ``RolloutBatch``es (``synthetic_batch``): every mini-batch of every rank is one
micro-batch filling ``algorithm.ppo_max_token_len_per_gpu`` exactly, with sequences of a
~1.5K-token prompt and a response (generated spans and tool-response spans), random token ids,
a terminal reward. No engine, no data, no runtime is needed for the update phases.

What is measured, per rank and step, phase by phase (``old_log_prob``, ``values``, ``ref`` when
a KL is on, ``update_critic``, ``update_actor``; the peak counters are reset when each phase
starts):

* on GPUs: ``torch.cuda.max_memory_allocated`` (torch tensors) and ``max_memory_reserved``
  (the caching allocator's hold), less what PyTorch counts for the colocated engine (its weights
  and KV cache, counted even while it sleeps), and the card's used memory (``mem_get_info``) at
  the end;
* on CPU: the process's peak resident set (``VmHWM``, reset through ``/proc/self/clear_refs``)
  in GiB: all the process's memory (Python, libraries, tensors), not a GPU figure.

Generation: when vLLM is importable and ``generation`` is on (``trainer.memory_check_generation``,
default true), each rank builds its engine (``rollout.factory.build_engine``), generates a
burst of requests (``max_in_flight / engines`` prompts of the synthetic prompt length, up to
256, ``max_tokens_per_turn`` tokens each) and reports the
card's used memory (GPU) or the peak resident set (CPU), then puts the engine to sleep where it
can, so the update phases see what a colocated step sees. Otherwise the report says "not
measured" and why; nothing is ever estimated in its place.

Separate layout (``layout.mode=separate``; ``memory_check_separate.py``): the training cards
never generate; instead the layout's server is started as ``fit`` starts it, the weights move
to it after every step through ``fit``'s own weight sync (merged weights in buckets of
``rollout.bucket_mb`` through vLLM's weight-transfer API: ``gloo`` on CPU, ``nccl`` on GPUs),
verified, and a generation burst runs on it. The training ranks add the ``update_weights``
phase (the send side); the report's ``serving`` section gives the serving side's memory during
generation and during each receive, and each transfer's buckets. With ``generation`` off
(``trainer.memory_check_generation=false``) no server is started and only the update phases run.

Steady state: before the first step, both optimizers take one step at learning rate 0 with zero
gradients, so Adam's moments and both adapters' gradients are allocated as they are from the
second RL step on, and the parameters are unchanged. The first synthetic step therefore
already shows steady-state peaks.

Output: ``outputs/<name>/memory_check.json`` (rank 0; every rank's phases, the plan's
prediction for the same config beside each measured peak) and a table on stdout.

Who calls it: ``verbs.memory_check`` (the ``memory-check`` verb; ``fit`` with
``trainer.memory_check=true`` should dispatch here), ``tests/scale`` (CPU), the device
script ``tests/scale/device_memory_check.py`` (H200).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import lightning as L
import numpy as np
import torch
from omegaconf import DictConfig
from torch.utils.data import DataLoader, IterableDataset

from atlas_lightning import distributed as dist_utils
from atlas_lightning.ppo.module import PPOModule
from atlas_lightning.store.lora_shapes import LoraShape
from atlas_lightning.store.records import TrajectoryRecord
from atlas_lightning.rollout.agent_loop import LoopStats
from atlas_lightning.rollout.batch import RolloutBatch
from atlas_lightning.run.serving_memory import status_kib

GIB = 2**30
PROMPT_TOKENS = 1536
TOOL_SPAN = 512
GENERATED_SPAN = 2048
PHASE_NAMES = {"actor": "old_log_prob", "critic": "values", "base": "ref"}
#: The step's phases that are measured (``adv``, a few element-wise ops, is not).
MEASURED_PHASES = (*PHASE_NAMES.values(), "update_critic", "update_actor")
PROBE_TEXT = ("Which of the following is closest to the boiling point of water at sea level? (A) 50 C (B) 100 C "
              "(C) 150 C (D) 200 C. Explore a candidate answer, then submit the letter you trust most.")


# ----------------------------------------------------------------------------- synthetic data


def sequence_lengths(budget: int, longest: int) -> list[int]:
    """The fewest equal lengths, none longer than ``longest``, whose sum is ``budget`` less at
    most one token per sequence: one micro-batch that fills the budget, packed (sum) or padded
    (``n x max``) alike."""
    if budget <= 1 or longest <= 1:
        raise ValueError(f"budget={budget} and longest={longest} must exceed one token")
    count = math.ceil(budget / longest)
    return [budget // count] * count


def synthetic_batch(cfg: DictConfig, vocab_size: int, *, step: int, rank: int = 0,
                    sequence_tokens: Optional[int] = None) -> RolloutBatch:
    """This rank's synthetic rollout for RL step ``step`` (module doc): ``train_batch_size /
    ppo_mini_batch_size`` mini-batches, each one micro-batch of ``ppo_max_token_len_per_gpu``
    tokens. ``sequence_tokens`` caps a sequence's length (default: the longest the rollout
    config allows, ``max_prompt_length + max_response_length``)."""
    a, r = cfg.algorithm, cfg.rollout
    longest = sequence_tokens or (r.max_prompt_length + r.max_response_length)
    lengths = sequence_lengths(a.ppo_max_token_len_per_gpu, min(longest, a.ppo_max_token_len_per_gpu))
    mini_batches = a.train_batch_size // a.ppo_mini_batch_size
    rng = np.random.default_rng([int(cfg.seed), step, rank])
    records, rewards, invariants = [], [], []
    for index in range(mini_batches * len(lengths)):
        length = lengths[index % len(lengths)]
        prompt = max(1, min(PROMPT_TOKENS, r.max_prompt_length, length // 4))
        response = length - prompt
        mask = np.ones(response, dtype=np.int8)
        for start in range(GENERATED_SPAN, response - 1, GENERATED_SPAN + TOOL_SPAN):
            mask[start:start + TOOL_SPAN] = 0  # a tool response inside the trajectory
        mask[-1] = 1
        reward = float(rng.choice([-0.1, 1.0]))
        dense = np.zeros(response, dtype=np.float32)
        dense[-1] = reward
        records.append(TrajectoryRecord(
            run_id=f"memory-check-{cfg.name}", partition="train", global_steps=step,
            uid=f"synthetic-r{rank}-q{index:04d}", session_id="n000", attempt_id=0, data_source="synthetic",
            benchmark="synthetic", question_id=f"q{index:04d}", permutation_id=0, candidate_fingerprint="",
            ground_truth="", reward_score=reward, num_turns=1, episode={"synthetic": True},
            reward={"training_reward": reward, "final_reward": reward, "acc": float(reward > 0)},
            reward_trace={"offsets": [response - 1], "values": [reward]},
            prompt_ids=rng.integers(0, vocab_size, prompt, dtype=np.int64),
            response_ids=rng.integers(0, vocab_size, response, dtype=np.int64),
            response_mask=mask,
            response_logprobs=-rng.random(response, dtype=np.float32),
        ))
        rewards.append(dense)
        invariants.append({"mapping_sum_error": 0.0, "mapped_slots_minus_events": 0})
    stats = LoopStats(trajectories=len(records), generated_tokens=int(sum(r.response_mask.sum() for r in records)),
                      seconds=1.0)
    return RolloutBatch(step=step, partition="train", records=records, token_rewards=rewards,
                        invariants=invariants, stats=stats, weights_version=step - 1)


# ----------------------------------------------------------------------------- measuring


class PhaseProbe:
    """Peak memory of a phase on this process's device (module doc for what each backend measures)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.records: list[dict] = []
        #: What PyTorch counts as allocated for a colocated engine (its weights and KV cache,
        #: counted even while it sleeps: vLLM's pool keeps its addresses); left out of the peaks.
        self.engine_bytes = 0
        self.cpu_reset = _reset_cpu_peak() if not self.cuda else True

    @property
    def measures(self) -> str:
        if self.cuda:
            return "torch.cuda.max_memory_allocated / max_memory_reserved, reset at each phase"
        reset = "reset at each phase" if self.cpu_reset else "NOT reset between phases (clear_refs refused)"
        return f"process peak resident set (VmHWM), {reset}; includes Python and libraries"

    @contextmanager
    def phase(self, name: str, step: int):
        started = time.monotonic()
        if self.cuda:
            torch.cuda.synchronize(self.device)
            start = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self.cpu_reset = _reset_cpu_peak() and self.cpu_reset
            start = _rss_bytes()
        yield
        record = {"phase": name, "step": step, "seconds": time.monotonic() - started, "start_gib": start / GIB}
        if self.cuda:
            torch.cuda.synchronize(self.device)
            free, total = torch.cuda.mem_get_info(self.device)
            engine = self.engine_bytes
            record.update(peak_allocated_gib=(torch.cuda.max_memory_allocated(self.device) - engine) / GIB,
                          peak_reserved_gib=(torch.cuda.max_memory_reserved(self.device) - engine) / GIB,
                          card_used_gib=(total - free) / GIB, engine_allocated_gib=engine / GIB)
        else:
            record.update(peak_rss_gib=_peak_rss_bytes() / GIB)
        self.records.append(record)


def _reset_cpu_peak() -> bool:
    """Reset this process's VmHWM (Linux: ``5`` to ``/proc/self/clear_refs``); False if refused."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


def _rss_bytes() -> int:
    return status_kib(os.getpid(), "VmRSS") * 1024


def _peak_rss_bytes() -> int:
    return status_kib(os.getpid(), "VmHWM") * 1024


# ----------------------------------------------------------------------------- the module


class MemoryCheckModule(PPOModule):
    """``PPOModule`` in memory-check mode: its phase hook puts each measured phase (forward-only
    passes, updates) in a ``PhaseProbe`` phase; the step is the same. At train start it makes
    the probe, measures an engine first when ``generation`` (module doc) and primes the
    optimizers; in the separate layout it then runs the serving side (server, weight syncs,
    generation burst: module doc); at train end it closes the engines. ``model.checkpoint_layers=auto``
    resolves as in ``fit``, the room of the engine it builds later kept (``run/recompute.py``)."""

    def __init__(self, cfg: DictConfig, generation: bool = True, actor_lora: Optional[LoraShape] = None) -> None:
        """``actor_lora``: the actor's LoRA shape as the run's start-up resolved it
        (``run.facts.RunFacts.lora``), the one shape every engine is built for (None: resolved
        from ``cfg`` by the engine's arguments, for a module built on its own)."""
        import importlib.util

        from atlas_lightning.run.recompute import CheckpointLayersFor

        # model.checkpoint_layers=auto: the engine comes after the model here, its room is kept for it
        engine_to_come = generation and importlib.util.find_spec("vllm") is not None
        super().__init__(cfg, phase_hook=self.measure_phase, checkpoint_layers_for=CheckpointLayersFor(
            cfg, engine_to_come=engine_to_come, verb="memory-check"))
        self.measure_generation = generation
        self.actor_lora = actor_lora
        self.probe: Optional[PhaseProbe] = None
        self.generation: dict = {"measured": False, "why": "not requested"}
        self._engine_box: dict = {}  # the engine stays out of the module's submodules

    def on_train_start(self) -> None:
        super().on_train_start()
        self.probe = PhaseProbe(self.device)
        self.generation = self._measure_generation() if self.measure_generation else {
            "measured": False, "why": "not measured (generation=False)"}
        _prime_optimizers(self.optimizers())
        if self.cfg.layout.mode == "separate" and self.measure_generation:
            from atlas_lightning.run.memory_check_separate import ServingSide

            self._engine_box["serving"] = ServingSide(self.cfg, actor_lora=self.actor_lora)
            self._engine_box["serving"].start(self.trainer, self)

    @property
    def serving(self):
        """The separate layout's ``ServingSide`` (None elsewhere)."""
        return self._engine_box.get("serving")

    def measure_phase(self, name: str, step: int):
        """The phase hook: the probe's context for a measured phase, the serving side's around a
        weight sync (separate layout: the step's own ``update_weights``), else nothing."""
        if name == "update_weights" and self.serving is not None:
            return self.serving.measuring_sync(self.trainer, self, step)
        if name not in MEASURED_PHASES:
            return contextlib.nullcontext()
        return self.probe.phase(name, step)

    def _measure_generation(self) -> dict:
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            return {"measured": False, "why": "not measured (vllm not installed)"}
        if self.cfg.layout.mode == "separate":
            return {"measured": False, "why": "not run on the training cards: in the separate layout the engine "
                                              "runs on the serving cards (the report's serving section measures "
                                              "it there)"}
        from atlas_lightning.rollout.engine import GenerationRequest, SamplingSpec
        from atlas_lightning.rollout.factory import build_engine

        cfg = self.cfg
        started = time.monotonic()
        probe = PhaseProbe(self.device)
        with probe.phase("generation", 0):
            allocated = torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0
            engine = build_engine(cfg, rank=self.global_rank, local_rank=self.local_rank,
                                  world_size=self.trainer.world_size, actor_lora=self.actor_lora)
            if self.device.type == "cuda":
                self.probe.engine_bytes = torch.cuda.memory_allocated(self.device) - allocated
            engines = max(1, self.trainer.world_size // cfg.layout.engine_tp)
            count = max(1, min(cfg.rollout.max_in_flight // engines, 256))
            prompt = min(PROMPT_TOKENS, cfg.rollout.max_prompt_length)
            vocab = int(self.model.hf_model.get_output_embeddings().weight.shape[0])
            rng = np.random.default_rng([int(cfg.seed), self.global_rank])
            requests = [GenerationRequest(f"memory-check-{i}", tuple(int(t) for t in rng.integers(0, vocab, prompt)),
                                          SamplingSpec(max_tokens=cfg.rollout.max_tokens_per_turn, temperature=1.0))
                        for i in range(count)]
            results = engine.generate(requests)
        record = probe.records[-1]
        if self.device.type == "cuda":
            record["measures"] = "card used memory (mem_get_info) after the burst, trainer included"
        else:
            record["measures"] = probe.measures
        engine.sleep()
        self._engine_box["engine"] = engine
        return {"measured": True, "requests": count, "prompt_tokens": prompt,
                "generated_tokens": int(sum(len(r.token_ids) for r in results)),
                "seconds": time.monotonic() - started, **record}

    def on_train_end(self) -> None:
        engine = self._engine_box.pop("engine", None)
        if engine is not None:
            engine.close()
        # the serving side: _Collect (a callback, so it runs first) gathered its report and closed
        # it; closing again is a no-op, and stops the server where no _Collect ran
        serving = self._engine_box.pop("serving", None)
        if serving is not None:
            serving.close()


def _prime_optimizers(optimizers) -> None:
    """One step at learning rate 0 on zero gradients: Adam's moments and the gradients of every
    parameter exist afterwards, as from the second RL step on; the parameters do not change."""
    if not isinstance(optimizers, (list, tuple)):
        optimizers = [optimizers]
    for wrapped in optimizers:
        optimizer = getattr(wrapped, "optimizer", wrapped)
        saved = [group["lr"] for group in optimizer.param_groups]
        for group in optimizer.param_groups:
            group["lr"] = 0.0
            for param in group["params"]:
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
        optimizer.step()
        for group, lr in zip(optimizer.param_groups, saved):
            group["lr"] = lr


class _SyntheticSteps(IterableDataset):
    def __init__(self, data: "SyntheticData") -> None:
        self.data = data

    def __len__(self) -> int:
        return self.data.steps

    def __iter__(self):
        for step in range(1, self.data.steps + 1):
            yield self.data.batch(step)


class SyntheticData(L.LightningDataModule):
    """``steps`` synthetic batches, each rank its own (``synthetic_batch``)."""

    def __init__(self, cfg: DictConfig, steps: int, vocab_size: int, sequence_tokens: Optional[int] = None) -> None:
        super().__init__()
        self.cfg, self.steps, self.vocab_size, self.sequence_tokens = cfg, steps, vocab_size, sequence_tokens
        #: The separate layout's engine (``memory_check_separate``) and the version it serves, as
        #: the weight sync reads and writes them on ``RolloutDataModule``.
        self.engine = None
        self.weights_version: Optional[int] = None

    def probe_token_ids(self) -> list[int]:
        """The weight sync's probe sequence (identical on every rank): a fixed text in the base's
        tokenizer, or fixed ids where the folder has none."""
        try:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(self.cfg.model.path)
            return list(tokenizer.encode(PROBE_TEXT, add_special_tokens=False))[:96]
        except (OSError, ValueError):
            return [int(t) for t in np.random.default_rng(0).integers(0, self.vocab_size, 64)]

    def batch(self, step: int) -> RolloutBatch:
        rank = self.trainer.global_rank if self.trainer is not None else 0
        return synthetic_batch(self.cfg, self.vocab_size, step=step, rank=rank, sequence_tokens=self.sequence_tokens)

    def train_dataloader(self):
        return DataLoader(_SyntheticSteps(self), batch_size=None, collate_fn=lambda batch: batch)


class _Collect(L.Callback):
    """Gathers every rank's phase records after the last step (collective), for rank 0."""

    def __init__(self) -> None:
        self.gathered: Optional[list] = None

    def on_train_end(self, trainer, pl_module) -> None:
        serving = getattr(pl_module, "serving", None)
        mine = {"rank": trainer.global_rank, "device": str(pl_module.device), "phases": pl_module.probe.records,
                "measures": pl_module.probe.measures, "generation": pl_module.generation,
                "serving": serving.report() if serving is not None and trainer.global_rank == 0 else None}
        self.gathered = dist_utils.gather_objects(mine)
        if serving is not None:
            serving.close()  # stops the server rank 0 started


# ----------------------------------------------------------------------------- the verb


def vocab_size_of(cfg: DictConfig) -> int:
    from atlas_lightning.planning import read_model_shape

    return read_model_shape(cfg.model.path).vocab_size


def run_memory_check(cfg: DictConfig, *, generation: bool = True, module: Optional[MemoryCheckModule] = None,
                     vocab_size: Optional[int] = None, sequence_tokens: Optional[int] = None,
                     write: bool = True, plan: Any = None, lora: Optional[Mapping[str, LoraShape]] = None
                     ) -> Optional[dict]:
    """Run the synthetic steps (module doc); on rank 0 return the report (also written to
    ``outputs/<name>/memory_check.json`` and printed), elsewhere None. ``module`` replaces the
    default ``MemoryCheckModule(cfg)`` (the device script builds its base in place); ``plan``
    replaces the plan made from ``cfg.model.path`` for the comparison; ``lora``: the LoRA shapes
    the run's start-up resolved (``run/facts.py``; None: the plan's)."""
    from atlas_lightning.run.wiring import build_trainer

    collect = _Collect()
    # fit's trainer, with no loggers, no progress bar, no checkpoint, only the collecting callback
    trainer = build_trainer(cfg, callbacks=[collect], loggers=[], progress_bar=False, checkpointing=False)
    module = module or MemoryCheckModule(cfg, generation=generation, actor_lora=lora["actor"] if lora else None)
    data = SyntheticData(cfg, int(cfg.trainer.memory_check_steps), vocab_size or vocab_size_of(cfg), sequence_tokens)
    started = time.monotonic()
    trainer.fit(module, datamodule=data)
    if trainer.global_rank != 0:
        return None
    choice = getattr(module.checkpoint_layers_for, "choice", None)  # auto's policies on the card, planned as such
    report = build_report(cfg, collect.gathered or [], seconds=time.monotonic() - started, plan=plan, lora=lora,
                          layer_recompute=choice.plan if choice is not None else None)
    print(format_report(report))
    if write:
        from atlas_lightning.store.atomic import atomic_write_text

        path = Path(cfg.paths.outputs) / "memory_check.json"
        atomic_write_text(path, json.dumps(report, indent=1) + "\n")
        print(f"written: {path}")
    return report


def _peak_key(record: dict) -> str:
    return "peak_allocated_gib" if "peak_allocated_gib" in record else "peak_rss_gib"


def build_report(cfg: DictConfig, ranks: list[dict], *, seconds: float = 0.0, plan: Any = None,
                 lora: Optional[Mapping[str, LoraShape]] = None,
                 layer_recompute: Optional[Sequence[str]] = None) -> dict:
    """The report: per rank and phase the largest peak over the steps, with the plan's
    prediction (tensors, GiB) and its error against the measured allocation where the measure
    is the GPU allocator's (the CPU's resident set is not comparable); the LoRA shapes ``lora``
    (None: as the plan sized them). ``layer_recompute``: the policies ``model.checkpoint_layers=auto``
    took on the card, which the plan is made at (None: the config's)."""
    if plan is None:
        plan = _plan_for(cfg, layer_recompute)
    if lora is not None:
        described = {role: f"{shape.describe()} ({shape.source})" for role, shape in lora.items()}
    else:
        described = dict(plan.model["lora"]) if plan is not None else {}
    predicted = {p.name: p for p in plan.phases if p.cards != "serving cards"} if plan is not None else {}
    summary = []
    for rank in ranks:
        by_phase: dict[str, dict] = {}
        for record in rank["phases"]:
            key = _peak_key(record)
            best = by_phase.get(record["phase"])
            if best is None or record[key] > best[key]:
                by_phase[record["phase"]] = record
        for name, record in by_phase.items():
            row = {"rank": rank["rank"], "phase": name, "peak_gib": record[_peak_key(record)],
                   "reserved_gib": record.get("peak_reserved_gib"), "step": record["step"]}
            if name in predicted:
                row["plan_tensors_gib"] = predicted[name].tensors / GIB
                if "peak_allocated_gib" in record:
                    row["plan_error"] = row["plan_tensors_gib"] / record["peak_allocated_gib"] - 1.0
            summary.append(row)
    from atlas_lightning.run.memory_check_separate import serving_rows

    serving = next((r["serving"] for r in ranks if r.get("serving")), None)
    return {
        "name": cfg.name, "steps": int(cfg.trainer.memory_check_steps), "seconds": seconds,
        "lora": described,
        "serving": ({**serving, "summary": serving_rows(serving, plan)} if serving else None),
        "budgets": {"ppo_max_token_len_per_gpu": int(cfg.algorithm.ppo_max_token_len_per_gpu),
                    "forward_max_token_len_per_gpu": int(cfg.algorithm.forward_max_token_len_per_gpu)},
        "measures": ranks[0]["measures"] if ranks else "",
        "summary": summary, "generation": [r["generation"] for r in ranks], "ranks": ranks,
        "plan": plan.to_dict() if plan is not None else None,
    }


def _plan_for(cfg: DictConfig, layer_recompute: Optional[Sequence[str]] = None):
    """The plan of ``cfg`` on this machine's card, at ``layer_recompute``'s policies (None: the
    config's); None when the model folder has no readable shape."""
    from atlas_lightning.planning import ShapeError, make_plan

    card = None
    if torch.cuda.is_available():
        card = torch.cuda.get_device_properties(0).total_memory / GIB
    try:
        return make_plan(cfg, card_gib=card, layer_recompute=layer_recompute)
    except (ShapeError, ValueError, OSError):
        return None


def format_report(report: dict) -> str:
    lines = [f"memory check {report['name']}: {report['steps']} synthetic step(s) at "
             f"{report['budgets']['ppo_max_token_len_per_gpu']:,} tokens a micro-batch "
             f"(forward-only {report['budgets']['forward_max_token_len_per_gpu']:,}), {report['seconds']:.0f} s",
             *(f"{role} LoRA: {text}" for role, text in report.get("lora", {}).items()),
             f"measured: {report['measures']}", "",
             f"{'rank':>4}  {'phase':<14}{'peak GiB':>10}{'reserved':>10}{'plan GiB':>10}{'plan err':>10}"]
    for row in report["summary"]:
        reserved = f"{row['reserved_gib']:.2f}" if row.get("reserved_gib") is not None else "-"
        planned = f"{row['plan_tensors_gib']:.2f}" if "plan_tensors_gib" in row else "-"
        error = f"{row['plan_error']:+.1%}" if "plan_error" in row else "-"
        lines.append(f"{row['rank']:>4}  {row['phase']:<14}{row['peak_gib']:>10.2f}{reserved:>10}{planned:>10}{error:>10}")
    serving = report.get("serving")
    if serving:
        lines += ["", f"serving side: {serving['measures']}",
                  f"{'phase':<16}{'step':>5}{'peak GiB':>10}{'end GiB':>10}{'plan card':>11}"]
        for row in serving["summary"]:
            if not row["measured"]:
                lines.append(f"{row['phase']:<16}{row['step']:>5}  not measured: {row.get('why')}")
                continue
            planned = f"{row['plan_card_gib']:.2f}" if "plan_card_gib" in row else "-"
            lines.append(f"{row['phase']:<16}{row['step']:>5}{row['peak_gib']:>10.2f}{row['end_gib']:>10.2f}{planned:>11}")
        for t in serving["transfers"]:
            buckets = f"{t['buckets']} bucket(s), largest {t['largest_bucket_mib']:.1f} MiB of {t['bucket_mb']:g}" \
                if t.get("buckets") is not None else "adapter folder"
            lines.append(f"weight sync v{t['version']} ({t['weight_sync']}, {t.get('backend') or 'http'}): "
                         f"{t['tensors']} tensors, {buckets}, log-prob gap {t['logprob_gap']:.2g}, {t['seconds']:.1f} s")
        gen = serving["generation"]
        if gen.get("measured"):
            lines.append(f"generation on the server: {gen['ranks']} rank(s) x {gen['requests_per_rank']} requests, "
                         f"{gen['generated_tokens']} tokens in {gen['seconds']:.1f} s")
    for rank, gen in enumerate(report["generation"]):
        if gen.get("measured"):
            peak = gen.get("card_used_gib", gen.get("peak_rss_gib", float("nan")))
            lines.append(f"{rank:>4}  generation: {peak:.2f} GiB ({gen.get('measures', '')}), "
                         f"{gen['requests']} requests, {gen['generated_tokens']} tokens")
        else:
            lines.append(f"{rank:>4}  generation: {gen.get('why')}")
    return "\n".join(lines)


def main_verb(cfg: DictConfig) -> int:
    """``atlas-lightning memory-check``: prepare the run folders, run, exit 0."""
    from atlas_lightning.run.facts import check_inputs
    from atlas_lightning.run.faults import stops_cleanly
    from atlas_lightning.run.wiring import prepare_run

    facts = check_inputs(cfg, data=False, training=False)  # before anything is written: a bad model folder exits 2
    # a card that runs out of memory (or a disk that is full) ends in the clean stop's line (exit 5, 7)
    with stops_cleanly(facts.folders["checkpoints"], last_step=lambda: 0):
        prepare_run(cfg, "memory-check")
        run_memory_check(cfg, generation=cfg.trainer.memory_check_generation, lora=facts.lora)
    return 0


if __name__ == "__main__":  # pragma: no cover - the CLI is atlas-lightning memory-check
    sys.exit("use: atlas-lightning memory-check experiment=<run>")
