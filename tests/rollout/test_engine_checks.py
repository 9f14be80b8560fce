"""The in-process engine's refusals (``rollout/engine_checks.py``): LoRA sync with CUDA graphs on a
Gated DeltaNet hybrid under vLLM 0.26 is refused at the start, before anything is written, with
the keys that make it run; every neighbouring combination that ran on the card is not."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from atlas_lightning.config import ConfigError
from atlas_lightning.rollout.engine_checks import in_process_refusals, linear_attention_layers

FAULTING = dict(engine="vllm", enable_sleep_mode=True, weight_sync="lora", enforce_eager=False)


def _cfg(**rollout):
    return OmegaConf.create({"model": {"path": "/models/qwen3.6-27b"}, "rollout": {**FAULTING, **rollout}})


def test_lora_sync_with_graphs_on_a_hybrid_is_refused_with_the_keys_that_run():
    problems = in_process_refusals(_cfg(), linear_layers=48, on_cards=True, vllm_version="0.26.0")
    assert len(problems) == 1
    message = problems[0]
    assert message.startswith("rollout.weight_sync=lora with CUDA graphs (rollout.enforce_eager=false) on a hybrid")
    assert "model.path=/models/qwen3.6-27b has 48 Gated DeltaNet layers" in message
    assert "vLLM 0.26.0" in message
    assert "rollout.weight_sync=merged" in message and "rollout.enforce_eager=true" in message


@pytest.mark.parametrize("change", [
    dict(rollout={"weight_sync": "merged"}),  # ran with graphs on the 16-layer hybrid
    dict(rollout={"enforce_eager": True}),  # ran with LoRA sync on it
    dict(linear_layers=0),  # the dense 8B ran LoRA sync with graphs
    dict(on_cards=False),  # the CPU engine captures no CUDA graphs
    dict(rollout={"engine": "vllm-server"}),  # another process: no allocator shared with the trainer
    dict(rollout={"enable_sleep_mode": False}),  # nothing released under a sleeping engine
    dict(vllm_version="0.27.0"),  # not measured: not refused
    dict(vllm_version=None),  # no GPU vLLM installed
], ids=lambda change: ",".join(f"{k}={v}" for k, v in change.items()))
def test_what_ran_or_was_never_measured_is_not_refused(change):
    given = dict(linear_layers=48, on_cards=True, vllm_version="0.26.0")
    given.update({k: v for k, v in change.items() if k != "rollout"})
    assert in_process_refusals(_cfg(**change.get("rollout", {})), **given) == []


def test_linear_layers_are_counted_from_the_base_config(qwen3_5_base, tiny_model_dir):
    """The count comes from the config ``check_inputs`` reads (the text part of an image-text
    checkpoint), not from the folder's name or model type."""
    from atlas_lightning.models.build import causal_lm_config

    hybrid = causal_lm_config(qwen3_5_base)
    assert linear_attention_layers(hybrid) == sum(kind == "linear_attention" for kind in hybrid.layer_types) == 1
    assert linear_attention_layers(causal_lm_config(tiny_model_dir)) == 0


def test_the_run_is_refused_before_anything_is_written(tmp_path_factory, cfg_of, tmp_path, monkeypatch):
    """Through ``check_inputs``, as ``fit`` calls it, on a hybrid base with a tokenizer: the
    config error (the CLI's exit 2) comes before the run's folder exists; the same run with
    merged sync passes the check."""
    from atlas_lightning.demo.tiny_hybrid_orchestrator import build_tiny_hybrid_base
    from atlas_lightning.rollout import engine_checks
    from atlas_lightning.run import environment
    from atlas_lightning.run.facts import check_inputs

    hybrid = build_tiny_hybrid_base(tmp_path_factory.mktemp("hybrid") / "base")
    monkeypatch.setattr(environment, "trains_on_gpu", lambda accelerator: True)  # this machine has no card
    monkeypatch.setattr(engine_checks, "installed_vllm", lambda: "0.26.0")
    before = sorted(p.name for p in tmp_path.iterdir())
    overrides = (f"model.path={hybrid}", "rollout.engine=vllm", "rollout.enforce_eager=false",
                 "rollout.enable_sleep_mode=true")
    with pytest.raises(ConfigError, match=r"rollout\.weight_sync=lora with CUDA graphs .* 3 Gated DeltaNet layers"):
        check_inputs(cfg_of(*overrides, "rollout.weight_sync=lora"))
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    check_inputs(cfg_of(*overrides, "rollout.weight_sync=merged"))


def test_no_shipped_run_of_the_report_is_refused_on_its_model():
    """Every ``r28-*`` experiment (the report's Qwen3.6-27B: 48 Gated DeltaNet layers of 64) passes
    the check as shipped, on the cards, under vLLM 0.26: the training of record launches."""
    from pathlib import Path

    from transformers.models.qwen3_5 import Qwen3_5TextConfig

    from atlas_lightning.config import compose
    from atlas_lightning.planning.named_shapes import NAMED_CONFIGS

    runs = sorted(p.stem for p in (Path(__file__).parents[2] / "conf" / "experiment").glob("r28-*.yaml"))
    assert len(runs) >= 6
    linear = linear_attention_layers(Qwen3_5TextConfig(**NAMED_CONFIGS["qwen3_6_27b"][1]))
    assert linear == 48
    for run in runs:
        cfg = compose([f"experiment={run}"])
        assert cfg.model.shape == "qwen3_6_27b", run
        assert in_process_refusals(cfg, linear_layers=linear, on_cards=True, vllm_version="0.26.0") == [], run
