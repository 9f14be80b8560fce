"""Packed micro-batches: variable-length sequences laid end to end in one row, no padding.

A trajectory is ``prompt + response`` (the response holds generated tokens and tool
responses alike; which of them are trained on is the loss mask's business, not ours).
Packing ``n`` of them gives ``input_ids (1, T)`` with ``T = sum(len_i)`` and
``position_ids (1, T)`` restarting at 0 for each sequence. Transformers reads the restarts
as sequence boundaries (``masking_utils.find_packed_sequence_indices``) when no attention
mask and no cache is given, so attention stays inside each sequence (see
``actor_critic.py`` for which attention path that takes where).

The scored tokens are the response tokens: response token ``j`` of sequence ``i`` sits at
packed position ``t = start_i + P_i + j`` and is predicted by the hidden state at ``t - 1``,
which is inside the same sequence because every prompt has at least one token. Per-token
outputs come out in packed order, ``(N,)`` with ``N = sum(R_i)``, and ``scatter_responses``
puts them into verl's right-padded ``(bs, response_length)`` layout; ``gather_responses``
is its inverse for inputs given in that layout.

Who calls it: the PPO module (micro-batch construction after token-budget packing) and
``ActorCritic`` (reads the index maps). Pure torch; no model code.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional, Sequence

import torch
from torch import Tensor


@dataclass(frozen=True)
class PackedBatch:
    """``n`` sequences packed into one row of ``T`` tokens; ``N`` of them are response tokens.

    Shapes: ``input_ids``, ``position_ids``: ``(1, T)`` int64. ``cu_seqlens``: ``(n + 1,)``
    int32, sequence ``i`` occupies ``[cu_seqlens[i], cu_seqlens[i + 1])``.
    ``prompt_lengths``, ``response_lengths``: ``(n,)`` int64 (``P_i >= 1``, ``R_i >= 0``).
    ``target_index``: ``(N,)`` packed positions of the response tokens, sequence by sequence;
    ``logit_index = target_index - 1`` are the positions whose hidden states score them.
    ``response_row``, ``response_col``: ``(N,)`` where each lands in ``(bs, response_length)``
    (``bs = n``; row ``i`` is sequence ``i``). ``lengths``: each sequence's length on the host
    (``seq_lens`` without reading ``cu_seqlens`` back from a card; empty: read it back).
    """

    input_ids: Tensor
    position_ids: Tensor
    cu_seqlens: Tensor
    prompt_lengths: Tensor
    response_lengths: Tensor
    target_index: Tensor
    response_row: Tensor
    response_col: Tensor
    response_length: int
    lengths: tuple[int, ...] = ()

    # ------------------------------------------------------------------ sizes
    @property
    def num_sequences(self) -> int:
        return int(self.prompt_lengths.numel())

    @property
    def num_tokens(self) -> int:
        """``T``: tokens in the packed row (what a token budget counts)."""
        return int(self.input_ids.shape[1])

    @property
    def num_response_tokens(self) -> int:
        """``N``: tokens that get a log-prob / value."""
        return int(self.target_index.numel())

    @property
    def seq_lens(self) -> list[int]:
        if self.lengths:  # no wait on the card for what the host packed
            return list(self.lengths)
        return (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).tolist()

    @property
    def max_seqlen(self) -> int:
        return max(self.seq_lens)

    # ------------------------------------------------------------------ derived indices
    @property
    def logit_index(self) -> Tensor:
        """``(N,)`` packed positions whose hidden states predict the response tokens."""
        return self.target_index - 1

    @property
    def target_ids(self) -> Tensor:
        """``(N,)`` the response token ids, in packed order."""
        return self.input_ids[0, self.target_index]

    def response_attention_mask(self) -> Tensor:
        """``(bs, response_length)`` bool: True where a real response token lies."""
        mask = torch.zeros(self.num_sequences, self.response_length, dtype=torch.bool, device=self.input_ids.device)
        mask[self.response_row, self.response_col] = True
        return mask

    def padded_layout(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The same sequences right-padded: ``(input_ids, attention_mask, position_ids)`` each
        ``(n, max_seqlen)``, and ``flat_index (T,)`` mapping packed position ``t`` to its slot in
        the flattened ``(n * max_seqlen)`` grid. Used for models whose recurrent layers cannot
        see packed boundaries (``ActorCritic``'s ``padded`` layout)."""
        n, width = self.num_sequences, self.max_seqlen
        device = self.input_ids.device
        lengths = self.cu_seqlens[1:] - self.cu_seqlens[:-1]
        seq_of_token = torch.repeat_interleave(torch.arange(n, device=device), lengths.to(device))
        flat_index = seq_of_token * width + self.position_ids[0]
        ids = torch.zeros(n * width, dtype=self.input_ids.dtype, device=device)
        ids[flat_index] = self.input_ids[0]
        mask = torch.zeros(n * width, dtype=torch.long, device=device)
        mask[flat_index] = 1
        positions = torch.arange(width, device=device).expand(n, width).contiguous()
        return ids.view(n, width), mask.view(n, width), positions, flat_index

    # ------------------------------------------------------------------ layout conversion
    def scatter_responses(self, values: Tensor, pad_value: float = 0.0) -> Tensor:
        """Packed per-token ``values (N, ...)`` -> ``(bs, response_length, ...)``, ``pad_value``
        where no response token lies. Differentiable in ``values``."""
        if values.shape[0] != self.num_response_tokens:
            raise ValueError(
                f"scatter_responses: values has {values.shape[0]} rows, the batch has "
                f"{self.num_response_tokens} response tokens"
            )
        out = values.new_full((self.num_sequences, self.response_length, *values.shape[1:]), pad_value)
        return out.index_put((self.response_row, self.response_col), values)

    def gather_responses(self, padded: Tensor) -> Tensor:
        """``(bs, response_length, ...)`` in verl's layout -> ``(N, ...)`` in packed order."""
        if tuple(padded.shape[:2]) != (self.num_sequences, self.response_length):
            raise ValueError(
                f"gather_responses: expected shape ({self.num_sequences}, {self.response_length}, ...), "
                f"got {tuple(padded.shape)}"
            )
        return padded[self.response_row, self.response_col]

    def to(self, device: torch.device | str) -> "PackedBatch":
        """On ``device``. From the host to a card the copies are queued without waiting for the
        card's earlier work (a pageable source is staged before the call returns, so it may go):
        the next micro-batch moves while the last one's backward still runs."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        to_card = torch.device(device).type == "cuda"
        return PackedBatch(**{k: v.to(device, non_blocking=to_card and v.device.type == "cpu")
                              if isinstance(v, Tensor) else v for k, v in values.items()})


def pack_sequences(
    sequences: Sequence[Tensor],
    prompt_lengths: Sequence[int],
    response_length: Optional[int] = None,
) -> PackedBatch:
    """Pack 1-D token sequences; positions ``>= prompt_lengths[i]`` of ``sequences[i]`` are its
    response tokens. ``response_length`` is the width of the ``(bs, response_length)`` layout
    (default: the longest response). Raises ``ValueError`` naming the sequence at fault."""
    if len(sequences) == 0:
        raise ValueError("pack_sequences: no sequences given")
    if len(prompt_lengths) != len(sequences):
        raise ValueError(
            f"pack_sequences: {len(sequences)} sequences but {len(prompt_lengths)} prompt lengths"
        )
    device = sequences[0].device
    lengths, prompts, responses = [], [], []
    for i, (seq, prompt_len) in enumerate(zip(sequences, prompt_lengths)):
        if not isinstance(seq, Tensor) or seq.dim() != 1:
            found = getattr(seq, "shape", type(seq))
            raise ValueError(f"pack_sequences: sequence {i} must be a 1-D tensor, got {found}")
        if seq.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
            raise ValueError(f"pack_sequences: sequence {i} has dtype {seq.dtype}, token ids must be integers")
        prompt_len = int(prompt_len)
        if not 1 <= prompt_len <= seq.numel():
            raise ValueError(
                f"pack_sequences: sequence {i} has prompt length {prompt_len} outside 1..{seq.numel()} "
                f"(a response token needs at least one token before it)"
            )
        lengths.append(seq.numel())
        prompts.append(prompt_len)
        responses.append(seq.numel() - prompt_len)
    width = max(responses) if response_length is None else int(response_length)
    for i, r in enumerate(responses):
        if r > width:
            raise ValueError(f"pack_sequences: sequence {i} has {r} response tokens, more than response_length={width}")

    lengths_t = torch.tensor(lengths, dtype=torch.long, device=device)
    prompts_t = torch.tensor(prompts, dtype=torch.long, device=device)
    responses_t = torch.tensor(responses, dtype=torch.long, device=device)
    starts = torch.cumsum(lengths_t, 0) - lengths_t
    zero = torch.zeros(1, dtype=torch.long, device=device)
    cu_seqlens = torch.cat([zero, torch.cumsum(lengths_t, 0)]).to(torch.int32)

    input_ids = torch.cat([s.to(device=device, dtype=torch.long) for s in sequences]).unsqueeze(0)
    position_ids = torch.cat([torch.arange(n, device=device) for n in lengths]).unsqueeze(0)

    response_row = torch.repeat_interleave(torch.arange(len(sequences), device=device), responses_t)
    # column j of row i: j = running index inside that sequence's response
    response_col = torch.arange(int(responses_t.sum()), device=device) - torch.repeat_interleave(
        torch.cumsum(responses_t, 0) - responses_t, responses_t
    )
    target_index = (starts + prompts_t)[response_row] + response_col
    return PackedBatch(
        input_ids=input_ids,
        position_ids=position_ids,
        cu_seqlens=cu_seqlens,
        prompt_lengths=prompts_t,
        response_lengths=responses_t,
        target_index=target_index,
        response_row=response_row,
        response_col=response_col,
        response_length=width,
        lengths=tuple(lengths),
    )


def pack_padded(input_ids: Tensor, attention_mask: Tensor, response_length: int) -> PackedBatch:
    """Pack verl's padded layout: ``input_ids``/``attention_mask`` ``(bs, L)`` whose first
    ``L - response_length`` columns are left-padded prompts and last ``response_length``
    columns right-padded responses; ``attention_mask`` marks real tokens (tool-response tokens
    included: it is not the loss mask). Row ``i`` of the result's layout is row ``i`` here."""
    if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"pack_padded: input_ids {tuple(input_ids.shape)} and attention_mask "
            f"{tuple(attention_mask.shape)} must be the same (bs, L) shape"
        )
    prompt_width = input_ids.shape[1] - int(response_length)
    if prompt_width < 1 or response_length < 0:
        raise ValueError(
            f"pack_padded: response_length={response_length} leaves no prompt columns in L={input_ids.shape[1]}"
        )
    mask = attention_mask.bool()
    sequences, prompt_lengths = [], []
    for i in range(input_ids.shape[0]):
        prompt_mask, response_mask = mask[i, :prompt_width], mask[i, prompt_width:]
        p, r = int(prompt_mask.sum()), int(response_mask.sum())
        if not prompt_mask[prompt_width - p :].all():
            raise ValueError(f"pack_padded: row {i}'s prompt is not left-padded (real tokens must end its columns)")
        if not response_mask[:r].all():
            raise ValueError(f"pack_padded: row {i}'s response is not right-padded (real tokens must start them)")
        prompt, response = input_ids[i, prompt_width - p : prompt_width], input_ids[i, prompt_width : prompt_width + r]
        sequences.append(torch.cat([prompt, response]))
        prompt_lengths.append(p)
    return pack_sequences(sequences, prompt_lengths, response_length=response_length)
