"""The benchmark's inputs: a realistic length mix of ATLAS trajectories, and PPO loss inputs.

Length mix (documented in ``bench/README.md``; all numbers scale with ``scale`` for tiny runs):

* prompt: normal(1536, 256) tokens, clipped to [1024, 2048] (system prompt, question,
  candidate list);
* response: 1-6 agent turns (uniform); each turn is a generated part of 64-1024 tokens
  (uniform) followed, except the last, by a tool response of 256-3072 tokens (uniform:
  revealed candidate answers); cut at 16,384 tokens (the response length limit). Tool-response
  tokens are in the sequence (they are attended to and cost compute) but not in the loss mask.
* a micro-batch: trajectories drawn until the next would overflow the token budget
  (49,152), so one packed micro-batch is nearly full (what the token-budget packer produces
  when a mini-batch has many trajectories);
* a batch (``sample_batch``): a fixed number of trajectories (32 in the batch benchmark),
  which the update splits into micro-batches itself.

Token ids are uniform over the vocabulary (random weights make their values irrelevant to
speed; zeros would not be: METHOD.md). PPO inputs (old log-probs, advantages, values,
returns) are random in verl's ``(bs, response_length)`` layout, so the real loss functions run.

``recorded_ppo_inputs``: instead of the mix, the token ids and loss masks of a batch ``fit``
trained on (``recorded_batch.py``), the PPO numbers random as above.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Trajectory:
    prompt_len: int
    response_len: int
    #: ``(start, end)`` response positions of tool responses (not in the loss mask)
    tool_spans: tuple[tuple[int, int], ...]

    @property
    def length(self) -> int:
        return self.prompt_len + self.response_len


def sample_trajectory(rng: random.Random, scale: float = 1.0) -> Trajectory:
    def n(x: float) -> int:
        return max(1, int(round(x * scale)))

    prompt = min(max(int(rng.gauss(1536, 256)), 1024), 2048)
    prompt = n(prompt)
    limit = n(16384)
    turns = rng.randint(1, 6)
    spans, length = [], 0
    for turn in range(turns):
        length += n(rng.randint(64, 1024))
        if turn < turns - 1 and length < limit:
            tool = n(rng.randint(256, 3072))
            spans.append((length, min(length + tool, limit)))
            length += tool
        if length >= limit:
            break
    return Trajectory(prompt, min(length, limit), tuple(spans))


def sample_micro_batch(seed: int, budget_tokens: int, scale: float = 1.0) -> list[Trajectory]:
    """Trajectories drawn until the next one would overflow ``budget_tokens`` (at least one)."""
    rng = random.Random(seed)
    out: list[Trajectory] = []
    total = 0
    while True:
        t = sample_trajectory(rng, scale)
        if out and total + t.length > budget_tokens:
            return out
        if t.length > budget_tokens:
            continue
        out.append(t)
        total += t.length


def sample_batch(seed: int, sequences: int, scale: float = 1.0) -> list[Trajectory]:
    """``sequences`` trajectories of the mix (a whole PPO mini-batch, for the batch benchmark)."""
    rng = random.Random(seed)
    return [sample_trajectory(rng, scale) for _ in range(sequences)]


@dataclass
class PPOInputs:
    """Everything one micro-batch's PPO losses need, on one device."""

    sequences: list[Tensor]  # 1-D token ids, prompt + response
    prompt_lengths: list[int]
    response_mask: Tensor  # (bs, width) float: 1 on generated tokens, 0 on tool responses and padding
    old_log_prob: Tensor
    advantages: Tensor
    values: Tensor
    returns: Tensor

    @property
    def width(self) -> int:
        return int(self.response_mask.shape[1])

    @property
    def num_tokens(self) -> int:
        return sum(int(s.numel()) for s in self.sequences)

    def rows(self, indices: list[int]) -> "PPOInputs":
        """The trajectories ``indices`` alone (a mini-batch), in that order."""
        at = torch.as_tensor(indices, device=self.response_mask.device)
        return PPOInputs(sequences=[self.sequences[i] for i in indices],
                         prompt_lengths=[self.prompt_lengths[i] for i in indices],
                         **{name: getattr(self, name)[at] for name in
                            ("response_mask", "old_log_prob", "advantages", "values", "returns")})


def ppo_inputs(trajectories: list[Trajectory], vocab_size: int, device: torch.device, seed: int = 0) -> PPOInputs:
    gen = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, vocab_size, (t.length,), generator=gen) for t in trajectories]
    width = max(t.response_len for t in trajectories)
    mask = torch.zeros(len(trajectories), width)
    for i, t in enumerate(trajectories):
        mask[i, : t.response_len] = 1.0
        for start, end in t.tool_spans:
            mask[i, start:end] = 0.0
    return _with_ppo_numbers(seqs, [t.prompt_len for t in trajectories], mask, device, gen)


def recorded_ppo_inputs(batch, device: torch.device, seed: int = 0) -> PPOInputs:
    """PPO inputs of a batch ``fit`` trained on (``recorded_batch.RecordedBatch``): its own token
    ids and loss masks, the PPO numbers random as above."""
    width = max(len(m) for m in batch.response_masks)
    mask = torch.zeros(len(batch.response_masks), width)
    for i, row in enumerate(batch.response_masks):
        mask[i, : len(row)] = torch.from_numpy(row)
    seqs = [torch.from_numpy(s) for s in batch.sequences]
    return _with_ppo_numbers(seqs, list(batch.prompt_lengths), mask, device, torch.Generator().manual_seed(seed))


def _with_ppo_numbers(seqs: list[Tensor], prompt_lengths: list[int], mask: Tensor, device: torch.device,
                      gen: torch.Generator) -> PPOInputs:
    """The sequences and loss mask with random old log-probs, advantages, values and returns."""
    shape = tuple(mask.shape)
    old = -torch.rand(shape, generator=gen) * 3.0
    adv = torch.randn(shape, generator=gen)
    values = torch.randn(shape, generator=gen)
    returns = values + torch.randn(shape, generator=gen) * 0.5
    return PPOInputs(
        sequences=seqs,
        prompt_lengths=prompt_lengths,
        response_mask=mask.to(device),
        old_log_prob=(old * mask).to(device),
        advantages=(adv * mask).to(device),
        values=(values * mask).to(device),
        returns=(returns * mask).to(device),
    )
