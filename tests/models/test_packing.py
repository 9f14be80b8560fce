"""PackedBatch: index maps, layout round trips, verl's padded layout, bad input."""

from __future__ import annotations

import pytest
import torch

from atlas_lightning.models.packing import pack_padded, pack_sequences


def _seqs():
    return [torch.tensor([10, 11, 12, 13, 14]), torch.tensor([20, 21]), torch.tensor([30, 31, 32, 33])]


def test_positions_restart_and_cu_seqlens():
    packed = pack_sequences(_seqs(), [2, 1, 4])
    assert packed.input_ids.tolist() == [[10, 11, 12, 13, 14, 20, 21, 30, 31, 32, 33]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 0, 1, 2, 3]]
    assert packed.cu_seqlens.tolist() == [0, 5, 7, 11]
    assert packed.cu_seqlens.dtype == torch.int32
    assert (packed.num_sequences, packed.num_tokens, packed.max_seqlen) == (3, 11, 5)


def test_targets_are_response_tokens_scored_from_the_previous_position_of_the_same_sequence():
    packed = pack_sequences(_seqs(), [2, 1, 4])  # third sequence: no response token
    assert packed.target_ids.tolist() == [12, 13, 14, 21]
    assert packed.target_index.tolist() == [2, 3, 4, 6]
    assert packed.logit_index.tolist() == [1, 2, 3, 5]
    # the scoring position always lies in the scored token's own sequence
    seq_of = torch.bucketize(torch.arange(packed.num_tokens), packed.cu_seqlens[1:].long(), right=True)
    assert torch.equal(seq_of[packed.logit_index], seq_of[packed.target_index])
    assert packed.response_row.tolist() == [0, 0, 0, 1]
    assert packed.response_col.tolist() == [0, 1, 2, 0]
    assert packed.response_length == 3


def test_scatter_then_gather_round_trip_and_padding():
    packed = pack_sequences(_seqs(), [2, 1, 4], response_length=5)
    values = torch.tensor([1.0, 2.0, 3.0, 4.0], requires_grad=True)
    padded = packed.scatter_responses(values, pad_value=-7.0)
    assert padded.tolist() == [[1, 2, 3, -7, -7], [4, -7, -7, -7, -7], [-7] * 5]
    assert torch.equal(packed.gather_responses(padded), values)
    padded.sum().backward()  # differentiable into the packed values
    assert values.grad.tolist() == [1, 1, 1, 1]
    assert packed.response_attention_mask().sum().item() == 4


def test_pack_padded_matches_pack_sequences():
    # verl layout: prompts left-padded to 4 columns, responses right-padded to 3 columns
    input_ids = torch.tensor([[0, 0, 10, 11, 12, 13, 14], [0, 0, 0, 20, 21, 0, 0]])
    attention = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [0, 0, 0, 1, 1, 0, 0]])
    packed = pack_padded(input_ids, attention, response_length=3)
    expected = pack_sequences(_seqs()[:2], [2, 1], response_length=3)
    for field in ("input_ids", "position_ids", "cu_seqlens", "target_index", "response_row", "response_col"):
        assert torch.equal(getattr(packed, field), getattr(expected, field)), field


def test_padded_layout_maps_every_token_to_its_slot():
    packed = pack_sequences(_seqs(), [2, 1, 4])
    ids, mask, positions, flat = packed.padded_layout()
    assert ids.shape == (3, 5)
    assert mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0]]
    assert torch.equal(ids.reshape(-1)[flat], packed.input_ids[0])
    assert torch.equal(positions.reshape(-1)[flat], packed.position_ids[0])


@pytest.mark.parametrize(
    "sequences, prompts, width, message",
    [
        ([], [], None, "no sequences"),
        ([torch.tensor([1, 2])], [1, 1], None, "2 prompt lengths"),
        ([torch.tensor([[1, 2]])], [1], None, "sequence 0 must be a 1-D"),
        ([torch.tensor([1.0, 2.0])], [1], None, "must be integers"),
        ([torch.tensor([1, 2]), torch.tensor([3, 4])], [1, 0], None, "sequence 1 has prompt length 0"),
        ([torch.tensor([1, 2])], [3], None, "prompt length 3 outside 1..2"),
        ([torch.tensor([1, 2, 3, 4])], [1], 2, "sequence 0 has 3 response tokens"),
    ],
)
def test_bad_input_is_named(sequences, prompts, width, message):
    with pytest.raises(ValueError, match=message):
        pack_sequences(sequences, prompts, response_length=width)


def test_pack_padded_rejects_wrong_padding_side():
    input_ids = torch.tensor([[10, 11, 0, 12, 13]])
    with pytest.raises(ValueError, match="row 0's prompt is not left-padded"):
        pack_padded(input_ids, torch.tensor([[1, 1, 0, 1, 1]]), response_length=2)
    with pytest.raises(ValueError, match="row 0's response is not right-padded"):
        pack_padded(input_ids, torch.tensor([[0, 1, 1, 0, 1]]), response_length=2)


def test_scatter_rejects_wrong_count():
    packed = pack_sequences(_seqs(), [2, 1, 4])
    with pytest.raises(ValueError, match="values has 3 rows, the batch has 4 response tokens"):
        packed.scatter_responses(torch.zeros(3))


def test_the_hosts_lengths_travel_with_the_batch_and_agree_with_cu_seqlens():
    """``seq_lens`` (what attention and the Gated DeltaNet take) comes from the lengths the host
    packed, kept through ``to``, not from reading ``cu_seqlens`` back from a card."""
    packed = pack_sequences([torch.arange(5), torch.arange(3), torch.arange(7)], [2, 1, 4]).to("cpu")
    assert packed.lengths == (5, 3, 7)
    assert packed.seq_lens == (packed.cu_seqlens[1:] - packed.cu_seqlens[:-1]).tolist() == [5, 3, 7]
    assert packed.max_seqlen == 7
