"""What each RL step samples: the questions whose prompts fit, step ``N``'s share of them and
the identity of each of its trajectories.

Contract:

- A question is trained on only when its prompt (the chat template of its first turn, tools
  included) fits ``rollout.max_prompt_length``, as verl's loader filters (``fitting``); none
  fitting is a ``ConfigError`` naming the key.
- Step ``N`` (1-based) samples ``QuestionSampler.step_indices(N - 1)`` of the fitting training
  questions, a pure function of ``data.seed``, ``data.shuffle`` and ``algorithm.train_batch_size``,
  ``rollout.n`` samples each (``StepQuestions``).
- A trajectory is named by ``(uid, session)`` (``trajectory_key``), in records, checkpoints and
  the steps a checkpoint keeps in flight.

One path for the two that need it: the run's start-up (``run/facts.py``), which fits the
splits once before anything is written (``fitted_splits``: a bad ``rollout.max_prompt_length``,
``algorithm.train_batch_size`` or tokenizer exits 2 there) and compares a checkpoint's kept
in-flight steps with the steps this run samples, and the data module
(``datamodule.RolloutDataModule``), which samples them from the splits it is given.
"""

from __future__ import annotations

import logging
from functools import cached_property
from typing import Callable, Optional

from omegaconf import DictConfig

from atlas_lightning.config import ConfigError
from atlas_lightning.env.episode import Episode, RuntimeConfig
from atlas_lightning.questions.loader import QuestionSplits
from atlas_lightning.questions.sampler import QuestionSampler, sampling_digest
from atlas_lightning.questions.schema import Question
from atlas_lightning.questions.uid import trajectory_uid
from atlas_lightning.rollout.batch import session_id
from atlas_lightning.rollout.chat import ChatFormat

log = logging.getLogger(__name__)


def chat_format(cfg: DictConfig) -> ChatFormat:
    """The chat format of ``model.path``'s tokenizer (local files); ``ConfigError`` naming the
    key for a tokenizer that does not load, lacks the chat tokens tool calls need, or whose chat
    template cannot render the tools (``ChatFormat.check_template``)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    except Exception as err:  # the library's error for a damaged tokenizer, whatever its type
        first = str(err).strip().splitlines()[0][:300] if str(err).strip() else type(err).__name__
        raise ConfigError(f"model.path={cfg.model.path}: its tokenizer cannot be loaded ({first})") from None
    try:
        chat = ChatFormat(tokenizer)
        chat.check_template()
    except ValueError as err:
        raise ConfigError(f"model.path={cfg.model.path}: {err}") from None
    return chat


def runtime(cfg: DictConfig) -> RuntimeConfig:
    """The runtime's limits (``rollout.max_explores``, ``rollout.max_turns``)."""
    return RuntimeConfig(max_explores=cfg.rollout.max_explores, max_turns=cfg.rollout.max_turns)


def prompt_ids(chat: ChatFormat, episode: Episode) -> list[int]:
    """The tokens of ``episode``'s prompt: its messages and tools through the chat template."""
    return chat.prompt_ids(episode.messages(), episode.tools())


def fitting(questions: list[Question], split: str, chat: ChatFormat, cfg: DictConfig,
            say: Callable[[str], None] = log.warning) -> list[Question]:
    """``questions`` without those whose prompt exceeds ``rollout.max_prompt_length``, telling
    ``say`` how many were dropped; ``ConfigError`` when none is left."""
    limit = cfg.rollout.max_prompt_length
    limits = runtime(cfg)
    kept = [q for q in questions if len(prompt_ids(chat, Episode(q, 0, limits))) <= limit]
    if len(kept) < len(questions):
        say(f"{len(questions) - len(kept)} of {len(questions)} {split} questions have prompts over "
            f"rollout.max_prompt_length={limit} and are skipped")
    if not kept:
        raise ConfigError(f"rollout.max_prompt_length={limit}: no {split} question's prompt fits it "
                          f"({len(questions)} questions of data.{split}_split)")
    return kept


def fitted_splits(cfg: DictConfig, splits: QuestionSplits, chat: Optional[ChatFormat] = None,
                  say: Callable[[str], None] = log.warning) -> QuestionSplits:
    """``splits`` without the questions whose prompts do not fit (``fitting``; ``chat``: default
    ``model.path``'s), the training ones checked to fill a batch (``StepQuestions``):
    ``ConfigError`` naming the key otherwise."""
    chat = chat if chat is not None else chat_format(cfg)
    fitted = QuestionSplits(train=fitting(splits.train, "train", chat, cfg, say),
                            val=fitting(splits.val, "val", chat, cfg, say))
    StepQuestions(fitted.train, cfg)
    return fitted


class StepQuestions:
    """Which questions and trajectories each RL step samples (module doc), every rank's."""

    def __init__(self, train: list[Question], cfg: DictConfig) -> None:
        """``train``: the fitting training questions (``fitting``). ``ConfigError`` when they
        cannot fill one batch of ``algorithm.train_batch_size``."""
        self.train = train
        self.samples = int(cfg.rollout.n)
        batch = cfg.algorithm.train_batch_size
        if len(train) < batch:
            raise ConfigError(f"algorithm.train_batch_size={batch}: the {len(train)} training questions whose "
                              f"prompts fit rollout.max_prompt_length cannot fill one batch")
        self.sampler = QuestionSampler(len(train), batch, seed=cfg.data.seed, shuffle=cfg.data.shuffle)

    @cached_property
    def digest(self) -> str:
        """What decides every step's trajectories, as a checkpoint keeps it (``sampler.sampling_digest``)."""
        return sampling_digest(self.train, self.sampler, self.samples)

    def questions(self, step: int) -> list[Question]:
        """The questions of RL step ``step`` (the sampler's draw)."""
        return [self.train[i] for i in self.sampler.step_indices(step - 1)]

    def keys(self, step: int) -> set[tuple[str, str]]:
        """The ``(uid, session)`` of every trajectory of RL step ``step``."""
        return {trajectory_key(q, sample) for q in self.questions(step) for sample in range(self.samples)}


def trajectory_key(question: Question, sample: int) -> tuple[str, str]:
    """The ``(uid, session_id)`` of sample ``sample`` of ``question``: a trajectory's identity
    in records, checkpoints and the kept steps in flight."""
    return trajectory_uid(question.benchmark, question.question_id), session_id(sample)
