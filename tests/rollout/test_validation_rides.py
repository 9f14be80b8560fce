"""Validation riding with the next training rollout (``RolloutDataModule.carry_validation``) on
the real vLLM CPU engine and the tiny model: the ridden validation's records and metrics against
the same validation run alone, and the training rollout it rode with against that rollout alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from atlas_lightning.callbacks.validation import validation_metrics
from atlas_lightning.config import compose
from atlas_lightning.rollout.datamodule import RolloutDataModule

pytestmark = pytest.mark.vllm


def _datamodule(tiny_model_dir, sample_data_dir, tmp_path, vllm_engine, *extra) -> RolloutDataModule:
    vllm_engine.set_adapter(None)
    cfg = compose(["experiment=tiny-cpu", f"model.path={tiny_model_dir}", f"data.root={sample_data_dir}",
                   f"paths.root={tmp_path}", "rollout.n=4", "algorithm.train_batch_size=4",
                   "algorithm.ppo_mini_batch_size=2", "rollout.max_tokens_per_turn=48",
                   "data.val_max_questions=3", *extra])
    dm = RolloutDataModule(cfg, engine=vllm_engine)
    dm.setup("fit")
    return dm


def _arrays(batch) -> list[dict]:
    """Every record's JSON form (episode, reward, ids) and its per-token arrays, exact, but the
    generated tokens' log-probs (``_logprobs``)."""
    out = []
    for record in batch.records:
        data = record.to_json_dict()
        data.update({name: array.tolist() for name, array in record.token_arrays().items()})
        data.pop("response_logprobs")
        out.append(data)
    return out


def _logprobs(batch) -> np.ndarray:
    return np.concatenate([record.response_logprobs for record in batch.records])


def _assert_same_records(batch, expected) -> None:
    """Token for token the same records; the log-probs as vLLM gives them in another batch's
    company: within 1e-5 (float32 sums in another order; ``test_engines.py``)."""
    assert _arrays(batch) == _arrays(expected)
    np.testing.assert_allclose(_logprobs(batch), _logprobs(expected), rtol=0, atol=1e-5)


@pytest.mark.parametrize("val", [["rollout.val_temperature=0", "rollout.val_n=1"], ["rollout.val_n=2"]],
                         ids=["greedy", "sampled"])
def test_validation_riding_with_training_is_the_validation_alone(tiny_model_dir, sample_data_dir, tmp_path,
                                                                 vllm_engine, val):
    dm = _datamodule(tiny_model_dir, sample_data_dir, tmp_path, vllm_engine, *val)
    assert dm.carries_validation
    alone = dm.validation_rollout(3)
    train_alone = dm.rollout(4)

    torch.manual_seed(0)
    seeded = torch.get_rng_state()
    dm.carry_validation(3)
    train = dm.rollout(4)
    # a shared run leaves the global RNGs where they were (vLLM's CPU sampler draws a seed a row
    # a step from them; its GPU sampler only for rows without their own seed: greedy riders)
    assert torch.equal(torch.get_rng_state(), seeded)
    ridden = dm.take_validation(3)
    assert dm.take_validation(3) is None  # handed over once

    assert ridden.step == 3 and ridden.partition == "val" and len(ridden) == len(alone) > 0
    assert ridden.weights_version == alone.weights_version
    _assert_same_records(ridden, alone)
    assert validation_metrics(ridden.records) == validation_metrics(alone.records)  # metrics and rows, exactly
    _assert_same_records(train, train_alone)  # training's rollout is what it is without the rider
    timing = ridden.timing
    assert timing["gen"] == pytest.approx(timing["tail"] + timing["overlapped"])
    assert timing["overlapped"] > 0


def test_the_separate_layout_does_not_carry_validation(tiny_model_dir, sample_data_dir, tmp_path, vllm_engine):
    dm = _datamodule(tiny_model_dir, sample_data_dir, tmp_path, vllm_engine, "layout=separate_cpu")
    assert not dm.carries_validation
    with pytest.raises(RuntimeError, match="separate layout samples ahead"):
        dm.carry_validation(3)
