"""``RolloutDataModule``: questions in, one ``RolloutBatch`` per RL step out.

Contract:

- RL steps are 1-based, as verl's: step ``N`` is the N-th rollout batch, sampled with the
  weights after ``N - 1`` updates; validation "before training" is step 0.
- Step ``N`` samples the questions ``QuestionSampler.step_indices(N - 1)`` (a pure function
  of the seed and the step), ``rollout.n`` samples each (``step_questions.py``, which the
  run's start-up reads too). With several engines (``world_size / TP``),
  engine ``g`` serves the ``g``-th share of the questions; the ranks of one TP group feed it
  identical requests and then keep their own share of its trajectories.
- Synchronous mode is strictly on-policy: the train dataloader has a length (``total_steps``),
  which stops Lightning from fetching a batch ahead, and a step's rollout runs only when the
  loop asks for that step, i.e. after the previous step's update and weight sync. Each batch
  carries ``weights_version``, the adapter version the engine served while sampling.
- Asynchronous mode (``layout.mode=separate``): a producer thread samples step ``k + 1`` while
  update ``k`` runs, within ``layout.max_staleness`` versions of the trainer (``asynchronous.py``:
  its contract, the staleness policy, the hand-over, a rollback and a resume). The dataloader
  stays sized: Lightning itself never fetches ahead, the producer does, within the bound.
- Every use of the engine (a rollout, a weight sync, validation) holds ``engine_lock``. With
  ``layout.partial_rollouts`` a weight sync does not wait for a training rollout: it interrupts
  it (``engine_for_sync``, ``rollout/interruption.py``), and the rollout continues under the new
  weights, so one batch (even one turn) may span versions; its ``weights_version`` is the one
  it started with, which its oldest tokens carry. The producer then schedules by trajectory
  (``trajectory_producer.py``), validation and a step sampled again ask it to give way
  (``SyncPause.hold``) and a step checkpoint keeps what it has in flight (``inflight.py``), which
  a resumed run (``resume_from``) continues.
- A validation may ride with the next training rollout (``carry_validation``, synchronous mode
  only): its trajectories go through the same agent loop run in a lane of their own (own
  sampling, seeds and records, ``agent_loop.Lane``), with the global RNGs left as they were;
  ``take_validation`` hands the assembled validation batch over.
- ``state_dict`` holds the next step to TRAIN (not the next sampled): a resumed run samples
  exactly what an uninterrupted one would (the sampler and every request seed are functions
  of the step), and a batch sampled ahead but not trained on is sampled again, never lost or
  counted twice (with partial rollouts: continued from the checkpoint's ``inflight/``).
- The engine is built in ``setup`` (after the process group exists; ``rollout.engine``,
  ``factory.py``) and closed in ``teardown``, or attached by a caller, who closes it. The reward scorer (``reward._target_``) is built
  at construction and scores every ended episode (``batch.assemble_batch``).
"""

from __future__ import annotations

import threading
import time
from contextlib import nullcontext
from dataclasses import replace
from typing import Callable, Optional, Union

import lightning as L
import torch
from omegaconf import DictConfig
from torch.utils.data import DataLoader, IterableDataset

from atlas_lightning.config import LoopLimits
from atlas_lightning.questions.loader import QuestionSplits, load_splits
from atlas_lightning.rollout.asynchronous import AsynchronousSteps
from atlas_lightning.rollout.prefetch import RolloutProducer, WeightsClock
from atlas_lightning.rollout.trajectory_producer import TrajectoryProducer
from atlas_lightning.questions.sampler import shard
from atlas_lightning.questions.schema import Question
from atlas_lightning.env.episode import Episode
from atlas_lightning.rollout.agent_loop import AgentLoop, Lane, LoopStats, Sampling, Trajectory
from atlas_lightning.rollout.batch import RolloutBatch, assemble_batch
from atlas_lightning.rollout.chat import ChatFormat
from atlas_lightning.reward.scorer import build_scorer
from atlas_lightning.rollout.engine import Engine
from atlas_lightning.rollout.engines import trainer_allocator
from atlas_lightning.rollout.engines.args import client_in_flight
from atlas_lightning.rollout.interruption import SyncPause
from atlas_lightning.rollout.rng import preserved_rng
from atlas_lightning.rollout.step_questions import (StepQuestions, chat_format, fitted_splits, prompt_ids, runtime,
                                                    trajectory_key)
from atlas_lightning.store.lora_shapes import LoraShape


class _RolloutSteps(IterableDataset):
    """Yields the datamodule's rollouts for steps ``next_step .. total_steps``: sampled when
    asked for (synchronous), or by the producer thread ahead of time (asynchronous,
    ``asynchronous.py``). Sized, so Lightning does not prefetch."""

    def __init__(self, datamodule: "RolloutDataModule") -> None:
        self.dm = datamodule

    def __len__(self) -> int:
        return self.dm.total_steps

    def __iter__(self):
        if self.dm.asynchronous:
            yield from self.dm.async_steps
            return
        while self.dm.next_step <= self.dm.total_steps:
            step = self.dm.next_step
            batch = self.dm.handed_over(self.dm.rollout(step))
            self.dm.next_step = step + 1
            yield batch


#: ``sink(label, done, total, tokens_per_second)``: told of a rollout's progress (the progress bar).
ProgressSink = Callable[[str, int, int, float], None]


class RolloutProgress:
    """A rollout's progress (trajectories done out of the total, tokens a second), passed to
    ``sink`` at most every ``every_s`` seconds and once at the end; nothing without a sink."""

    def __init__(self, label: str, sink: Optional[ProgressSink], every_s: float = 1.0) -> None:
        self.label, self.sink, self.every_s = label, sink, every_s
        self._last = 0.0

    def __call__(self, done: int, total: int, stats: LoopStats) -> None:
        now = time.monotonic()
        if self.sink is None or (done < total and now - self._last < self.every_s):
            return
        self._last = now
        self.sink(self.label, done, total, stats.tokens_per_second)


class RolloutDataModule(L.LightningDataModule):
    def __init__(self, cfg: DictConfig, engine: Optional[Engine] = None,
                 questions: Optional[QuestionSplits] = None, resume_from: Optional[str] = None,
                 actor_lora: Optional[LoraShape] = None) -> None:
        """``engine``: see the module doc. ``questions``: the splits the run's start-up loaded,
        checked and fitted to ``rollout.max_prompt_length`` (``run.facts.check_inputs``,
        ``step_questions.fitted_splits``), used as they are; None: ``setup`` loads and fits them
        (a datamodule built on its own, as tests do). ``resume_from``: the verified checkpoint a
        resumed run continues, whose trajectories in flight (partial rollouts, ``inflight.py``)
        the producer continues. ``actor_lora``: the LoRA shape the actor trains, as the run's
        start-up resolved it (``RunFacts.lora``), which sizes the engine's LoRA slot; None: the
        engine resolves it from ``cfg``."""
        super().__init__()
        self.cfg = cfg
        self.resume_from = resume_from
        self.engine = engine
        self.questions = questions
        self.actor_lora = actor_lora
        #: Told of each rollout's progress on rank 0 (``RolloutProgress``); the progress bar sets it.
        self.progress_sink: Optional[ProgressSink] = None
        #: The engine ``setup`` built, which ``teardown`` closes (None for one passed in).
        self._built_engine: Optional[Engine] = None
        self.next_step = 1
        self.total_steps = cfg.trainer.total_steps
        #: The weights version the engine serves (``weights_version``); the weight sync bumps it.
        self.clock = WeightsClock()
        #: Held by every use of the engine: a rollout, a weight sync, validation.
        self.engine_lock = threading.RLock()
        #: Partial rollouts: how a weight sync interrupts a training rollout (``engine_for_sync``).
        self.pause = SyncPause(self.engine_lock)
        #: Asynchronous mode: the producer thread and the hand-over within the bound.
        self.async_steps = AsynchronousSteps(self)
        #: A validation step to ride with the next training rollout, and those that rode, by step.
        self._rider: Optional[int] = None
        self._ridden: dict[int, RolloutBatch] = {}
        self.train_questions: list[Question] = []
        self.val_questions: list[Question] = []
        self.chat: Optional[ChatFormat] = None
        self.rank, self.local_rank, self.world_size = 0, 0, 1
        #: The run's reward (``reward._target_``), applied to every ended episode.
        self.scorer = build_scorer(cfg.reward)
        #: Bytes PyTorch counts as allocated for the engine this module built (CUDA): its weights
        #: and KV cache, counted even while it sleeps (vLLM's memory pool keeps its addresses), so
        #: the trainer's own peaks are PyTorch's minus these (``memory/engine_allocated_gib``).
        self.engine_allocated_bytes = 0

    @property
    def weights_version(self) -> Optional[int]:
        """The weights version the engine serves (updates applied; None before the first sync)."""
        return self.clock.version

    @weights_version.setter
    def weights_version(self, version: Optional[int]) -> None:
        self.clock.publish(version)

    @property
    def asynchronous(self) -> bool:
        """Rollouts sampled ahead by a producer thread (``layout.mode=separate``)."""
        return self.cfg.layout.mode == "separate"

    @property
    def partial_rollouts(self) -> bool:
        """A weight sync interrupts the training rollout in flight, which continues under the new
        weights (``layout.partial_rollouts``, separate layout; ``rollout/interruption.py``)."""
        return self.asynchronous and bool(self.cfg.layout.get("partial_rollouts", False))

    @property
    def producer(self) -> Optional[Union[RolloutProducer, TrajectoryProducer]]:
        """The producer thread sampling ahead (asynchronous mode; None before the first batch)."""
        return self.async_steps.producer

    def engine_for_sync(self):
        """What the weight sync holds while the weights move: the engine, a running training
        rollout interrupted to get it (partial rollouts) or waited for (otherwise)."""
        return self.pause.hold() if self.partial_rollouts else self.engine_lock

    # -- set-up ---------------------------------------------------------------------------

    def setup(self, stage: Optional[str] = None) -> None:
        if self.trainer is not None:
            self.rank = self.trainer.global_rank
            self.local_rank = self.trainer.local_rank
            self.world_size = self.trainer.world_size
        if self.chat is None:
            self.chat = chat_format(self.cfg)
        if not self.train_questions:
            splits = self.questions or fitted_splits(self.cfg, load_splits(self.cfg.data), self.chat)
            self.train_questions, self.val_questions = splits.train, splits.val
        #: What each step samples (``step_questions.py``), as the run's start-up compared a
        #: checkpoint's kept steps in flight with it (``run/facts.py``).
        self.steps = StepQuestions(self.train_questions, self.cfg)
        if self.partial_rollouts and self.resume_from is not None:
            self.async_steps.restore(self.resume_from)
        if self.engine is None:
            from atlas_lightning.rollout.factory import build_engine

            self._check_accelerator()

            allocated = _allocated_bytes()
            self.engine = self._built_engine = build_engine(self.cfg, self.rank, self.local_rank, self.world_size,
                                                            actor_lora=self.actor_lora)
            self.engine_allocated_bytes = _allocated_bytes() - allocated
            if self.cfg.layout.mode == "separate" and torch.cuda.is_available():
                trainer_allocator.for_training()  # no engine in this process: the update's allocator throughout

    def _check_accelerator(self) -> None:
        """The engine is not started beside an accelerator its CUDA graphs cannot live with
        (``rollout/engine_checks.py``): a ``ConfigError`` before anything of it exists."""
        from atlas_lightning.config import ConfigError
        from atlas_lightning.rollout.engine_checks import accelerator_refusal

        problem = accelerator_refusal(self.cfg, getattr(self.trainer, "accelerator", None))
        if problem:
            raise ConfigError(problem)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_RolloutSteps(self), batch_size=None, num_workers=0, collate_fn=_identity)

    def val_dataloader(self) -> DataLoader:
        """One placeholder batch: the ``validate`` verb runs its rollout from a callback, with the
        engine and weights Lightning has set up (fit never runs Lightning's validation loop)."""
        return DataLoader([0], batch_size=None)

    # -- rollouts -------------------------------------------------------------------------

    def _limits(self) -> LoopLimits:
        """``rollout``'s loop limits, with this rank's share of the requests in flight."""
        return replace(LoopLimits.of(self.cfg.rollout), max_in_flight=client_in_flight(self.cfg, self.world_size))

    def _engine_world(self) -> tuple[int, int, int]:
        """(engine index, engines, rank in the engine's TP group) of this rank's requests. In the
        separate layout each training rank is its own client of the serving engine(s)."""
        from atlas_lightning.rollout.factory import engine_world

        if self.asynchronous:
            return self.rank, self.world_size, 0
        return engine_world(self.rank, self.world_size, self.cfg.layout.engine_tp)

    def _trajectories(self, questions: list[Question], samples: int) -> list[Trajectory]:
        """This rank's trajectories of ``questions``: its engine's share of the questions, then,
        within a TP group, its own share of the group's trajectories."""
        engine_index, engines, _ = self._engine_world()
        trajectories = []
        for question in shard(questions, engine_index, engines):
            for sample in range(samples):
                episode = Episode(question, sample, runtime(self.cfg), seed=self.cfg.seed)
                prompt = prompt_ids(self.chat, episode)
                episode.on_prompt_tokens(len(prompt))
                uid, session = trajectory_key(question, sample)
                trajectories.append(Trajectory(uid=uid, session_id=session, episode=episode, prompt_ids=prompt))
        return trajectories

    def agent_loop(self, pause: Optional[SyncPause]) -> AgentLoop:
        """An agent loop on this rank's engine, stamping the served version on every token;
        ``pause``: interruptible by a weight sync (partial rollouts)."""
        return AgentLoop(self.engine, self.chat, self._limits(), policy_version=lambda: self.weights_version,
                         pause=pause)

    def _engine_held(self, interruptible: bool):
        """The engine for one rollout: ``engine_lock``; with partial rollouts a rollout that no sync
        interrupts (validation, a step sampled again) asks the producer to give way instead."""
        if self.partial_rollouts and not interruptible:
            return self.pause.hold()
        return self.engine_lock

    def _run(self, trajectories: list[Trajectory], sampling: Sampling, step: int, partition: str,
             seed_parts: tuple, interruptible: bool = False, rider: Optional[int] = None) -> RolloutBatch:
        """One rollout of ``trajectories`` on the engine, assembled as ``partition`` of ``step``.
        ``interruptible``: a weight sync may interrupt it (partial rollouts). ``rider``: the
        validation of the weights after step ``rider`` goes through the same agent loop run, in a
        lane of its own (``take_validation`` hands it over)."""
        if self.engine is None:
            raise RuntimeError("RolloutDataModule has no engine: call setup() or pass one")
        timing: dict[str, float] = {}
        memory: dict[str, float] = {}
        with self._engine_held(interruptible):  # one version per batch, unless a sync interrupts it
            started = time.monotonic()
            version = self.weights_version
            self.engine.wake_up()  # a no-op after a weight sync, which wakes the engine itself
            timing["wake_rollout"] = time.monotonic() - started
            progress = RolloutProgress(f"{partition} step {step}", self.progress_sink if self.rank == 0 else None)
            looped = time.monotonic()
            loop = self.agent_loop(self.pause if interruptible else None)
            lanes = [Lane(trajectories, sampling, seed_parts, progress)]
            if rider is not None:
                lanes.append(Lane(*self._validation_part(), tag="val:"))
            # a rider leaves the global RNGs as the training rollout alone does (which draws
            # nothing from them: every request has its own seed; tests/rollout/test_validation_rides.py)
            with preserved_rng() if rider is not None else nullcontext():
                stats = loop.run_lanes(lanes)[0]
            timing["gen"] = time.monotonic() - looped
            if interruptible:
                timing["reprefill"] = loop.reprefill.seconds
                stats.reprefill_tokens = loop.reprefill.tokens
            _card_used(memory, "gen", self.engine_allocated_bytes or 0)
            if self.engine_allocated_bytes:
                memory["engine_allocated_gib"] = self.engine_allocated_bytes / 2**30
            if partition == "train" and self.sleeps_for_update:
                slept = time.monotonic()
                self.engine.sleep()  # the update gets the engine's memory; the weight sync wakes it
                timing["sleep"] = time.monotonic() - slept
                _card_used(memory, "asleep", self.engine_allocated_bytes or 0)
        if rider is not None:
            self._ridden[rider] = self._rider_batch(lanes, rider, version)
        assembled = time.monotonic()
        batch = assemble_batch(
            self._own_share(trajectories), step=step, partition=partition, run_id=self.cfg.name,
            scorer=self.scorer, stats=stats, weights_version=version)
        timing["assemble"] = time.monotonic() - assembled
        timing["rollout"] = time.monotonic() - started
        batch.timing.update(timing)
        batch.memory.update(memory)
        return batch

    @property
    def sleeps_for_update(self) -> bool:
        """A colocated engine with sleep mode sleeps after each training rollout (its weights and
        KV cache give way to the update) and is woken by the weight sync; validation rollouts and
        the separate layout's server never sleep."""
        return (not self.asynchronous and bool(self.cfg.rollout.enable_sleep_mode)
                and bool(getattr(self.engine, "sleeps", False)))

    def _own_share(self, trajectories: list[Trajectory]) -> list[Trajectory]:
        _, _, tp_rank = self._engine_world()
        tp = 1 if self.asynchronous else self.cfg.layout.engine_tp
        return shard(trajectories, tp_rank, tp)

    # -- hand-over ------------------------------------------------------------------------

    def handed_over(self, batch: RolloutBatch, waited_s: Optional[float] = None) -> RolloutBatch:
        """``batch`` as the trainer gets it: its ``staleness`` (the trainer's version, i.e. the
        version the engine serves now, since every update is synced before the next step, minus
        the batch's; asynchronous mode then holds its trajectories to the bound,
        ``asynchronous.within_bound``) and the time the trainer waited for it."""
        if batch.weights_version is not None and self.weights_version is not None:
            batch.staleness = self.weights_version - batch.weights_version
        if waited_s is not None:
            batch.timing["wait_rollout"] = waited_s
        return batch

    def rollout(self, step: int, interruptible: Optional[bool] = None) -> RolloutBatch:
        """RL step ``step``'s training rollout on this rank (sampled now, with the weights the
        engine serves now); a validation deferred to it (``carry_validation``) rides along.
        ``interruptible`` (default: with partial rollouts): a weight sync interrupts it rather
        than waiting for it."""
        interruptible = self.partial_rollouts if interruptible is None else interruptible
        rider, self._rider = self._rider, None
        return self._run(self.train_trajectories(step), self.sampling, step, "train",
                         seed_parts=(self.cfg.seed, "train", step), interruptible=interruptible, rider=rider)

    @property
    def sampling(self) -> Sampling:
        """The training rollouts' sampling settings (``rollout.temperature``, ``top_p``, ``top_k``)."""
        r = self.cfg.rollout
        return Sampling(r.temperature, r.top_p, r.top_k)

    def train_trajectories(self, step: int) -> list[Trajectory]:
        """This rank's fresh trajectories of step ``step``, each carrying its requests' seed parts."""
        trajectories = self._trajectories(self.steps.questions(step), self.cfg.rollout.n)
        for traj in trajectories:
            traj.seed_parts = (self.cfg.seed, "train", step)
        return trajectories

    def assemble_step(self, step: int, trajectories: list[Trajectory], stats: LoopStats, version: Optional[int],
                      timing: dict) -> RolloutBatch:
        """Step ``step``'s batch from its finished trajectories (scheduling by trajectory)."""
        assembled = time.monotonic()
        batch = assemble_batch(trajectories, step=step, partition="train", run_id=self.cfg.name, scorer=self.scorer,
                               stats=stats, weights_version=version)
        batch.timing.update(timing, assemble=time.monotonic() - assembled, rollout=timing.get("gen", 0.0))
        return batch

    def validation_rollout(self, step: int) -> RolloutBatch:
        """The validation sets through the same agent loop (``rollout.val_temperature``, greedy
        by default), labelled with the RL step it validates.

        Sampled validation uses the same request seeds at every step (they depend on the run seed,
        the trajectory and its turn, not on ``step``): common random numbers, so that the change
        between two validations measures the policy, not a fresh draw of sampling noise."""
        trajectories, sampling, seed_parts = self._validation_part()
        return self._run(trajectories, sampling, step, "val", seed_parts=seed_parts)

    def _validation_part(self) -> tuple[list[Trajectory], Sampling, tuple]:
        """This rank's validation trajectories, their sampling and their seed parts, wherever
        they run (alone or riding with a training rollout)."""
        r = self.cfg.rollout
        sampling = Sampling(r.val_temperature, 1.0 if r.val_temperature == 0 else r.top_p,
                            -1 if r.val_temperature == 0 else r.top_k)
        return self._trajectories(self.val_questions, r.val_n), sampling, (self.cfg.seed, "val")

    # -- validation riding with the next training rollout -------------------------------------

    @property
    def carries_validation(self) -> bool:
        """Whether a validation can ride with the next training rollout (``carry_validation``):
        in the synchronous layout only, where that rollout samples exactly the weights just
        synced. The separate layout's producer samples ahead, on older weights: there
        validation runs alone."""
        return not self.asynchronous

    def carry_validation(self, step: int) -> None:
        """The validation of the weights after step ``step`` (which the engine serves now) goes
        through the next training rollout's agent loop run, in a lane of its own (its own
        sampling, seeds and records); ``take_validation(step)`` hands it over once that rollout
        is sampled. Not kept across a restart: the caller checkpoints what it deferred."""
        if not self.carries_validation:
            raise RuntimeError("RolloutDataModule.carry_validation: the separate layout samples ahead on older "
                               "weights; run validation_rollout instead")
        self._rider = step

    def take_validation(self, step: int) -> Optional[RolloutBatch]:
        """The validation of step ``step`` that rode with the last training rollout; None when
        no training rollout has run since it was deferred (then it is deferred no more)."""
        if self._rider == step:
            self._rider = None
        return self._ridden.pop(step, None)

    def _rider_batch(self, lanes: list[Lane], step: int, version: Optional[int]) -> RolloutBatch:
        """The validation lane of a shared run (``lanes[1]``), assembled as validation of
        ``step``; its timing: ``gen`` (its own seconds in the run), ``tail`` (the run's seconds
        after the training lane was done: what validation added to the step) and
        ``overlapped`` (its seconds under the training lane's)."""
        train_s, val_s = lanes[0].stats.seconds, lanes[1].stats.seconds
        batch = assemble_batch(self._own_share(lanes[1].trajectories), step=step, partition="val",
                               run_id=self.cfg.name, scorer=self.scorer, stats=lanes[1].stats,
                               weights_version=version)
        batch.timing.update({"gen": val_s, "tail": max(0.0, val_s - train_s), "overlapped": min(val_s, train_s)})
        return batch

    def probe_token_ids(self) -> list[int]:
        """The fixed probe sequence of the weight-sync check: the first validation question's
        prompt (identical on every rank)."""
        question = (self.val_questions or self.train_questions)[0]
        return prompt_ids(self.chat, Episode(question, 0, runtime(self.cfg)))

    # -- resumable state ------------------------------------------------------------------

    def state_dict(self) -> dict:
        steps = getattr(self, "steps", None)  # the sampling's digest: a resume on other data is refused
        return {"next_step": self.next_step, **({"sampling": steps.digest} if steps is not None else {})}

    def load_state_dict(self, state: dict) -> None:
        self.next_step = int(state["next_step"])

    def teardown(self, stage: Optional[str] = None) -> None:
        """Stop the producer (what it sampled ahead is dropped) and close the engine ``setup``
        built (one passed in belongs to its maker). Lightning calls this while the process group
        still exists, which an in-process engine's shutdown needs."""
        self.async_steps.stop()
        if self._built_engine is not None:
            engine, self._built_engine = self._built_engine, None
            if self.engine is engine:
                self.engine = None
            engine.close()


def _identity(batch):
    return batch


def _allocated_bytes() -> int:
    """PyTorch's allocated bytes on this process's card (0 off CUDA)."""
    import torch

    return torch.cuda.memory_allocated() if torch.cuda.is_available() else 0


def _card_used(memory: dict, key: str, engine_bytes: int = 0) -> None:
    """``memory["card_used_gib/<key>"]``: this card's used memory (the driver's count: the
    trainer, vLLM's own mappings, every process on the card), beside what this process's PyTorch
    allocator holds of it less the in-process engine's pool (``engine_bytes``, which PyTorch counts
    whether the engine sleeps or not): ``torch_reserved_gib/<key>`` reserved, of which
    ``torch_allocated_gib/<key>`` handed out; the difference is cached blocks that any later
    allocation of the process reuses (the 27B-shaped hybrid's card held 13.6 GiB more at
    generation than the plan predicts, which this split explains or not). Nothing off CUDA."""
    import torch

    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        memory[f"card_used_gib/{key}"] = (total - free) / 2**30
        memory[f"torch_reserved_gib/{key}"] = max(torch.cuda.memory_reserved() - engine_bytes, 0) / 2**30
        memory[f"torch_allocated_gib/{key}"] = max(torch.cuda.memory_allocated() - engine_bytes, 0) / 2**30
