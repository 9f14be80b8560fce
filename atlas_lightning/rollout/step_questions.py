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
- A step's trajectories (``algorithm.train_batch_size`` x ``rollout.n``) and a validation's (the
  validation questions x ``rollout.val_n``) are held at once by the node that samples them: a
  ``rollout.n`` or ``rollout.val_n`` whose prompts alone cannot fit this machine's memory is a
  ``ConfigError`` naming the key, the largest value that fits and why (``check_step_memory``).
  No other bound holds ``rollout.n``: the step's time and memory grow with it, and no format,
  dtype or engine limit caps it (session ids, token offsets and request seeds are unbounded; the
  engine takes ``rollout.max_in_flight`` requests at a time, whatever their number).

One path for the two that need it: the run's start-up (``run/facts.py``), which fits the
splits once before anything is written (``fitted_splits``: a bad ``rollout.max_prompt_length``,
``algorithm.train_batch_size`` or tokenizer exits 2 there) and compares a checkpoint's kept
in-flight steps with the steps this run samples, and the data module
(``datamodule.RolloutDataModule``), which samples them from the splits it is given.
"""

from __future__ import annotations

import logging
from functools import cached_property
from pathlib import Path
from typing import Callable, Optional

from omegaconf import DictConfig

from atlas_lightning.config import ConfigError
from atlas_lightning.env.episode import Episode, RuntimeConfig
from atlas_lightning.errors import first_line
from atlas_lightning.questions.loader import QuestionSplits
from atlas_lightning.questions.sampler import QuestionSampler, sampling_digest
from atlas_lightning.questions.schema import Question
from atlas_lightning.questions.uid import trajectory_uid
from atlas_lightning.rollout.batch import session_id
from atlas_lightning.rollout.chat import IM_START, ChatFormat

log = logging.getLogger(__name__)


def chat_format(cfg: DictConfig) -> ChatFormat:
    """The chat format of ``model.path``'s tokenizer (local files); ``ConfigError`` naming the
    key for a tokenizer that does not load, lacks the chat tokens tool calls need, or whose chat
    template cannot render the tools (``ChatFormat.check_template``)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    except Exception as err:  # the library's error for a damaged tokenizer, whatever its type
        present = sorted(p.name for p in Path(str(cfg.model.path)).glob("*") if p.is_file()
                         and (p.name.startswith(("tokenizer", "vocab", "merges", "spiece")) or p.suffix == ".model"))
        raise ConfigError(f"model.path={cfg.model.path}: its tokenizer cannot be loaded from "
                          f"{', '.join(present) or 'no tokenizer file'} ({first_line(err)})") from None
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


def _token_ids(tokenizer, texts: list[str]) -> list[list[int]]:
    """Each of ``texts`` tokenized as the chat template's ``tokenize=True`` tokenizes its text
    (no special tokens added, no padding, no truncation), in one call."""
    if not texts:
        return []
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=False, padding=False,
                                            truncation=False)["input_ids"]]


def _boundary(tokenizer) -> Optional[tuple[str, int, list]]:
    """``(content, id, added tokens)`` of the special token prompts are cut after (ChatML's turn
    opener ``<|im_start|>``, which ``ChatFormat`` requires), or None where no cut is proven: a slow
    tokenizer, an opener that is no special token matched on the raw text, or an added token that
    strips spaces or needs a whole word (a match would then be more than its own text)."""
    if not getattr(tokenizer, "is_fast", False):
        return None
    added = list(getattr(tokenizer, "added_tokens_decoder", {}).values())
    if not added or any(t.lstrip or t.rstrip or t.single_word for t in added):
        return None
    token_id = tokenizer.convert_tokens_to_ids(IM_START)
    if token_id in (None, tokenizer.unk_token_id) or not any(
            t.content == IM_START and t.special and not t.normalized for t in added):
        return None
    return IM_START, token_id, added


def _splits_after(tokenizer, head: str, boundary: tuple[str, int, list]) -> Optional[int]:
    """The number of ids of ``head`` (a text's start ending with the boundary token) where the
    tokenizer provably cuts any text that starts with it there, else None. A fast tokenizer cuts
    a text at each added token it matches (leftmost-longest) and tokenizes the pieces between them
    each on its own (``tokenizers``' added vocabulary: the normalizer, pre-tokenizer and model
    piece by piece), so the head's ids followed by the rest's are the whole text's when no added
    token could start inside the head and end past it (a proper prefix of one that the head ends
    with) and the head alone ends with the boundary token matched whole (its last id, spanning
    its last characters)."""
    content, token_id, added = boundary
    if any(head.endswith(t.content[:j]) for t in added for j in range(1, len(t.content))):
        return None  # an added token could straddle the cut
    encoded = tokenizer(head, add_special_tokens=False, padding=False, truncation=False, return_offsets_mapping=True)
    ids, offsets = encoded["input_ids"], encoded["offset_mapping"]
    if not ids or ids[-1] != token_id or tuple(offsets[-1]) != (len(head) - len(content), len(head)):
        return None
    return len(ids)


def prompt_lengths(chat: ChatFormat, episodes: list[Episode]) -> list[int]:
    """``len(prompt_ids(chat, episode))`` for each of ``episodes``, the same numbers in a fraction
    of the time: the texts rendered as ``prompt_ids`` renders them and tokenized in one call, each
    cut after its last boundary token (``_boundary``) whose start another text shares (the system
    prompt and the tools, most of a prompt, are one of a few): each shared start is tokenized once
    where the tokenizer provably cuts there (``_splits_after``), the rest of each text on its own."""
    from collections import Counter

    tokenizer = chat.tokenizer
    texts = [tokenizer.apply_chat_template(e.messages(), tools=e.tools(), add_generation_prompt=True, tokenize=False)
             for e in episodes]
    boundary = _boundary(tokenizer) if len(texts) > 1 else None
    if boundary is None:
        return [len(ids) for ids in _token_ids(tokenizer, texts)]
    content = boundary[0]

    def heads(text: str) -> list[str]:
        cuts, at = [], text.find(content)
        while at >= 0:
            cuts.append(text[:at + len(content)])
            at = text.find(content, at + 1)
        return cuts

    shared = Counter(hash(head) for text in texts for head in set(heads(text)))  # hashes: a few ints a text
    known: dict[str, Optional[int]] = {}  # by the text itself: a hash shared by chance costs a check, never a number
    cut = []
    for text in texts:
        head = max((h for h in heads(text) if shared[hash(h)] > 1), key=len, default="")
        if head and head not in known:
            known[head] = _splits_after(tokenizer, head, boundary)
        cut.append(head if head and known[head] is not None else "")
    rest = _token_ids(tokenizer, [text[len(head):] for text, head in zip(texts, cut)])
    return [(known[head] if head else 0) + len(ids) for head, ids in zip(cut, rest)]


def fitting(questions: list[Question], split: str, chat: ChatFormat, cfg: DictConfig,
            say: Callable[[str], None] = log.warning) -> tuple[list[Question], list[int]]:
    """``questions`` without those whose prompt exceeds ``rollout.max_prompt_length``, telling
    ``say`` how many were dropped, and the prompt length of each kept (``prompt_lengths``);
    ``ConfigError`` when none is left. (A question's prompt is the same for every sample: its
    candidates are not in it.)"""
    limit = cfg.rollout.max_prompt_length
    limits = runtime(cfg)
    lengths = prompt_lengths(chat, [Episode(q, 0, limits) for q in questions])
    kept = [(q, length) for q, length in zip(questions, lengths) if length <= limit]
    if len(kept) < len(questions):
        say(f"{len(questions) - len(kept)} of {len(questions)} {split} questions have prompts over "
            f"rollout.max_prompt_length={limit} and are skipped")
    if not kept:
        raise ConfigError(f"rollout.max_prompt_length={limit}: no {split} question's prompt fits it "
                          f"({len(questions)} questions of data.{split}_split)")
    return [q for q, _ in kept], [length for _, length in kept]


def fitted_splits(cfg: DictConfig, splits: QuestionSplits, chat: Optional[ChatFormat] = None,
                  say: Callable[[str], None] = log.warning, training: bool = True) -> QuestionSplits:
    """``splits`` without the questions whose prompts do not fit (``fitting``; ``chat``: default
    ``model.path``'s), the training ones checked to fill a batch (``StepQuestions``), and the
    trajectories of a step (``training``: the run trains) and of a validation checked to fit this
    machine's memory (``check_step_memory``): ``ConfigError`` naming the key otherwise."""
    chat = chat if chat is not None else chat_format(cfg)
    train, train_lengths = fitting(splits.train, "train", chat, cfg, say)
    val, val_lengths = fitting(splits.val, "val", chat, cfg, say)
    StepQuestions(train, cfg)
    check_step_memory(cfg, train_lengths if training else None, val_lengths)
    return QuestionSplits(train=train, val=val)


#: Bytes each prompt token of a step holds at the least, in the memory of the node that samples
#: it, once the step's batch is assembled (``batch.assemble_batch``): the agent loop's prompt, a
#: list (a reference of 8 bytes a token), and the record's ``prompt_ids`` (int64: 8 bytes a token),
#: both alive until the batch is handed over. A floor: the token objects, the responses, the
#: episodes and the update's tensors come on top (on the tiny model a trajectory of 576 prompt
#: tokens held 20 KB before its first generated token: 35 bytes a token).
PROMPT_TOKEN_BYTES = 16
_GIB = 2**30


def host_memory_bytes() -> int:
    """This machine's memory and swap in bytes (psutil's totals). A container's own limit may be
    lower: the figure is an upper one, so that what it refuses cannot run anywhere on the machine."""
    import psutil

    return int(psutil.virtual_memory().total + psutil.swap_memory().total)


def check_step_memory(cfg: DictConfig, train_lengths: Optional[list[int]], val_lengths: list[int],
                      memory: Optional[int] = None) -> None:
    """A training step's trajectories (``algorithm.train_batch_size`` questions of the training
    prompts' ``train_lengths`` x ``rollout.n``; None: the run does not train) and a validation's
    (every validation question, ``val_lengths``, x ``rollout.val_n``) are sampled at once, each
    node holding its share (one of them a ``trainer.num_nodes``-th at least) until the batch is
    handed over.
    Their prompts alone take ``PROMPT_TOKEN_BYTES`` a token there; when that floor exceeds
    ``memory`` (default ``host_memory_bytes()``) the run cannot hold one step and would be killed
    by the machine after writing its files: ``ConfigError`` naming the key, the floor and the
    largest value the floor admits. A floor, never an estimate: a value it passes may still not fit."""
    memory = host_memory_bytes() if memory is None else memory
    nodes = max(int(cfg.trainer.num_nodes), 1)
    checks = [("rollout.val_n", "a validation", int(cfg.rollout.val_n), len(val_lengths), sum(val_lengths), "")]
    if train_lengths is not None:  # a step can draw the shortest prompts: its floor is theirs
        batch = int(cfg.algorithm.train_batch_size)
        checks.insert(0, ("rollout.n", "a training step", int(cfg.rollout.n), batch,
                          sum(sorted(train_lengths)[:batch]), " shortest"))
    for key, what, samples, questions, tokens, which in checks:
        floor = samples * tokens * PROMPT_TOKEN_BYTES / nodes
        if floor > memory:
            largest = int(memory * nodes // (tokens * PROMPT_TOKEN_BYTES))
            raise ConfigError(
                f"{key}={samples}: {what} samples {questions * samples:,} trajectories ({questions} questions x "
                f"{samples}) at once; their prompts alone ({tokens:,} tokens for the {questions}{which} questions, "
                f"x {samples}) hold at least {PROMPT_TOKEN_BYTES} bytes a token until the batch is assembled: "
                f"{floor / _GIB:,.1f} GiB on each of {nodes} node(s), more than this machine's {memory / _GIB:,.1f} "
                f"GiB of memory and swap, so the machine would kill the run after it wrote its files; at most "
                f"{key}={largest:,} fits that floor (fewer in practice: responses, episodes and the update's "
                f"tensors come on top)")


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
