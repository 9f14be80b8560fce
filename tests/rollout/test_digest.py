"""The weight digests are exact: any bit, any swap, any missing tensor shows and is named; the
engine-side form is computed without touching the trainer's tensors; the weight-sync check
compares what came back with what was sent (CPU, no engine)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from atlas_lightning.rollout.digest import (
    WeightDigest,
    bucket_digest,
    canonical_module,
    digest_named,
    held_form,
    lora_digest,
    lora_modules,
    tensor_digest,
)
from atlas_lightning.errors import NonFiniteError
from atlas_lightning.rollout.engine import SyncReport
from atlas_lightning.rollout.sync import WeightSyncError, check_held, check_probe_logprobs


def _modules(seed=0, layers=3):
    g = torch.Generator().manual_seed(seed)
    return {f"base_model.model.model.layers.{i}.self_attn.q_proj": (torch.randn(4, 16, generator=g),
                                                                   torch.randn(16, 4, generator=g) * 1e-6, 2.0)
            for i in range(layers)}


def _reference_digest(t: torch.Tensor) -> str:
    """tensor_digest's definition, written out in plain Python over the tensor's bytes."""
    raw = bytes(t.contiguous().reshape(-1).view(torch.uint8).tolist())
    if len(raw) % 2:
        words = list(raw)
    else:
        words = [int.from_bytes(raw[i:i + 2], "little") for i in range(0, len(raw), 2)]

    def w(k):
        return (40503 * k) % 65536 + 1

    sums = (sum(words), sum(x * w(i) for i, x in enumerate(words)), sum(x * w(i >> 16) for i, x in enumerate(words)))
    return f"{str(t.dtype).removeprefix('torch.')}{tuple(t.shape)}:" + ".".join(f"{v:x}" for v in sums)


@pytest.mark.parametrize("tensor", [
    torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
    torch.randn(3, 70_000, generator=torch.Generator().manual_seed(0)),  # rows past the first 2^16 words
    torch.tensor([1, 2, 3], dtype=torch.uint8),  # an odd byte count: bytes, not words
    torch.tensor([True, False]),
    torch.zeros(0, 4),
    torch.tensor(-2.5, dtype=torch.float64),
])
def test_tensor_digest_is_its_definition_over_the_raw_bytes(tensor):
    assert tensor_digest(tensor) == _reference_digest(tensor)


def test_tensor_digest_sees_dtype_shape_any_swap_and_reads_views_in_row_major_order():
    t = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    assert tensor_digest(t) != tensor_digest(t.reshape(3, 2)) != tensor_digest(t.float())
    assert tensor_digest(t.t()) == tensor_digest(t.t().contiguous())
    big = torch.randn(3 * 2**16 + 5, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    for i, j in [(0, 1), (3, 2**16 + 3), (7, 2 * 2**16 + 7)]:  # same low 16 bits of position: s3 sees it
        swapped = big.clone()
        swapped[i], swapped[j] = big[j], big[i]
        assert tensor_digest(swapped) != tensor_digest(big), (i, j)
    odd_offset = torch.arange(9, dtype=torch.uint8)[1:]  # a byte view at an odd offset, read as words
    assert tensor_digest(odd_offset) == tensor_digest(odd_offset.clone())


def test_tensor_digest_is_the_same_in_chunks_and_segments(monkeypatch):
    from atlas_lightning.rollout import digest

    t = torch.randn(5 * 2**16 + 3, generator=torch.Generator().manual_seed(2))
    whole = digest.tensor_digest(t)
    monkeypatch.setattr(digest, "_CHUNK_ROWS", 1)
    monkeypatch.setattr(digest, "_SEGMENT_ROWS", 2)
    assert digest.tensor_digest(t) == whole == _reference_digest(t)


def test_named_digests_in_batches_are_each_tensors_own(monkeypatch):
    """Small tensors digested together (several batches: a cap of 3 rows) give each its own
    tensor_digest, its definition: a word's weight is its place in its own tensor."""
    from atlas_lightning.rollout import digest

    monkeypatch.setitem(digest._BATCH_ROWS, "cpu", 3)
    g = torch.Generator().manual_seed(3)
    named = [(f"t{i}", torch.randn(n, generator=g).to(dtype)) for i, (n, dtype) in
             enumerate([(5, torch.bfloat16), (2**16, torch.bfloat16), (2**16 + 1, torch.bfloat16),
                        (70_000, torch.float32), (3, torch.float32), (4 * 2**16, torch.bfloat16)])]
    named += [("bytes", torch.tensor([1, 2, 3], dtype=torch.uint8)), ("empty", torch.zeros(0, 2))]
    got = digest_named(iter(named)).entries
    assert got == {name: _reference_digest(t) for name, t in named}
    with pytest.raises(ValueError, match="names given twice: 't0'"):
        digest_named([("t0", named[0][1]), ("t0", named[0][1])])


def test_one_bit_anywhere_changes_the_digest_and_is_named():
    modules = _modules()
    sent = lora_digest(modules)
    name = "base_model.model.model.layers.2.self_attn.q_proj"
    a, b, s = modules[name]
    flipped = b.clone()
    flipped.view(torch.int32).view(-1)[7] ^= 1  # the last bit of one element of a 1e-6-sized factor
    held = lora_digest({**modules, name: (a, flipped, s)})
    assert held.total != sent.total
    assert sent.differences(held) == ["layers.2.self_attn.q_proj.lora_B differs"]


def test_swapped_layers_and_missing_tensors_are_named():
    modules = _modules()
    names = list(modules)
    swapped = dict(modules)
    swapped[names[0]], swapped[names[1]] = modules[names[1]], modules[names[0]]
    sent, held = lora_digest(modules), lora_digest(swapped)
    assert sum(map(float, [t.double().sum() for p in modules.values() for t in p[:2]])) == pytest.approx(
        sum(map(float, [t.double().sum() for p in swapped.values() for t in p[:2]])))  # a sum cannot see it
    assert sent.differences(held) == [f"layers.{i}.self_attn.q_proj.lora_{f} differs" for i in (0, 1) for f in "AB"]
    dropped = WeightDigest({k: v for k, v in sent.entries.items() if not k.endswith("layers.1.self_attn.q_proj.lora_B")})
    assert sent.differences(dropped) == ["layers.1.self_attn.q_proj.lora_B is missing"]


def test_held_form_is_vllms_and_leaves_the_trainers_tensors_alone():
    a, b = torch.randn(4, 16), torch.randn(16, 4)
    before = b.clone()
    a_held, b_held = held_form(a, b, 2.0, torch.float32)
    assert torch.equal(b, before)  # no in-place change of the trainer's tensor
    assert torch.equal(b_held, before * 2.0) and torch.equal(a_held, a)
    a16, b16 = held_form(a, b, 2.0, torch.bfloat16)
    reference = b.to(torch.bfloat16)
    reference *= 2.0
    assert torch.equal(b16, reference) and a16.dtype == torch.bfloat16


def test_names_agree_between_peft_and_vllm():
    assert canonical_module("base_model.model.model.layers.3.mlp.down_proj") == "layers.3.mlp.down_proj"
    assert canonical_module("model.layers.3.mlp.down_proj") == "layers.3.mlp.down_proj"
    assert canonical_module("language_model.model.layers.3.mlp.down_proj") == "layers.3.mlp.down_proj"
    assert canonical_module("base_model.model.lm_head") == "lm_head"


def test_lora_modules_refuses_a_factor_without_its_partner():
    state = {"m.layers.0.q.lora_A.weight": torch.zeros(1), "m.layers.0.q.lora_B.weight": torch.zeros(1),
             "m.layers.1.q.lora_A.weight": torch.zeros(1)}
    with pytest.raises(ValueError, match=r"m\.layers\.1\.q\.lora_B\.weight is missing"):
        lora_modules(state, 2.0)


# -- the weight sync's comparison -------------------------------------------------------------------


def _buckets(seed):
    g = torch.Generator().manual_seed(seed)
    return [[(f"w{i}.{j}", torch.randn(8, generator=g)) for j in range(3)] for i in range(2)]


def test_buckets_received_as_sent_pass_and_a_changed_one_is_named():
    buckets = _buckets(0)
    sent = WeightDigest({f"bucket{i}": bucket_digest(b) for i, b in enumerate(buckets)})
    report = SyncReport(tensor_count=6, digest=WeightDigest(dict(sent.entries)), form={"kind": "buckets"},
                        held="received by the server's workers")
    check_held(sent, report, 3, sent_tensors=6)
    buckets[1][2][1][0] += 1e-7
    report.digest = WeightDigest({f"bucket{i}": bucket_digest(b) for i, b in enumerate(buckets)})
    with pytest.raises(WeightSyncError, match=r"v3: what the engine holds \(received by the server's workers\) is "
                                              r"not what the trainer sent: bucket1 differs"):
        check_held(sent, report, 3, sent_tensors=6)
    with pytest.raises(WeightSyncError, match="the engine took 5 tensors"):
        check_held(sent, SyncReport(tensor_count=5, digest=sent, form={"kind": "buckets"}), 3,
                                       sent_tensors=6)


def test_an_engine_in_another_dtype_is_compared_in_its_dtype():
    modules = _modules()
    held = lora_digest(modules, dtype=torch.bfloat16, scale_b=True)
    report = SyncReport(tensor_count=len(held), digest=held, form={"kind": "lora", "dtype": "bfloat16", "scale_b": True})
    check_held(modules, report, 1)
    unscaled = lora_digest(modules, dtype=torch.bfloat16, scale_b=False)
    report.digest = unscaled  # an engine that did not apply the scaling it says it did
    with pytest.raises(WeightSyncError, match="lora_B differs"):
        check_held(modules, report, 1)


def test_a_held_form_made_on_the_card_that_differs_is_judged_by_the_hosts(monkeypatch):
    """The trainer computes the engine's form where its tensors are; should that ever round
    otherwise than vLLM's host computation, the host's form decides: a faithful engine passes,
    an unfaithful one is still named. (A device other than the host, simulated: ``cpu:0``.)"""
    from atlas_lightning.rollout import digest

    modules = _modules()
    held = lora_digest(modules, dtype=torch.bfloat16, scale_b=True)
    form = {"kind": "lora", "dtype": "bfloat16", "scale_b": True}
    computed = []
    host_form = digest.held_form

    def card_form(a, b, scaling, dtype, device="cpu"):
        computed.append(str(device))
        a_held, b_held = host_form(a, b, scaling, dtype, "cpu")
        return (a_held, b_held + 1) if str(device) != "cpu" else (a_held, b_held)  # one rounding off

    monkeypatch.setattr(digest, "held_form", card_form)
    check_held(modules, SyncReport(tensor_count=len(held), digest=held, form=form), 1, device=torch.device("cpu", 0))
    assert {"cpu:0", "cpu"} <= set(computed)
    wrong = lora_digest(modules, dtype=torch.bfloat16, scale_b=False)
    with pytest.raises(WeightSyncError, match="lora_B differs"):
        check_held(modules, SyncReport(tensor_count=len(wrong), digest=wrong, form=form), 1,
                   device=torch.device("cpu", 0))


def test_merged_tensors_digest_by_name():
    named = [("a", torch.ones(2)), ("b", torch.zeros(3))]
    assert digest_named(named).entries == {"a": tensor_digest(torch.ones(2)), "b": tensor_digest(torch.zeros(3))}
    with pytest.raises(ValueError, match="names given twice"):
        digest_named(named + [("a", torch.ones(2))])


def test_probe_logprobs_must_be_finite():
    check_probe_logprobs([-0.1, -2.5, -30.0], step=4)
    check_probe_logprobs(torch.tensor([-0.5, -1.0], dtype=torch.bfloat16), step=4)
    with pytest.raises(NonFiniteError, match=r"step 7: the engine's probe log-probs hold 1 non-finite value\(s\) of 3 "
                                             r"\(position: value 1: nan\)") as caught:
        check_probe_logprobs(np.array([-0.1, np.nan, -0.2]), step=7)
    assert caught.value.step == 7 and caught.value.what == ["probe_logprobs"]
    with pytest.raises(NonFiniteError, match="2 non-finite"):
        check_probe_logprobs(torch.tensor([[-0.1, float("-inf")], [float("inf"), -1.0]]), step=2)
    with pytest.raises(ValueError, match="step 3: the engine's probe has no log-probs"):
        check_probe_logprobs([], step=3)
