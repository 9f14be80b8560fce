"""The separate layout on the training cards (``layout.share_cards``, ``layout=separate_one_card``):
it composes and validates, the server gets the training cards' ids, the combinations it cannot
run are refused naming the keys, and the server is started by a module the installed vLLM has."""

from __future__ import annotations

import re

import pytest
from omegaconf import OmegaConf

from atlas_lightning.config import ConfigError, compose
from atlas_lightning.rollout import separate
from atlas_lightning.rollout.engines.server_process import server_module
from atlas_lightning.rollout.layout_checks import separate_refusals

ONE_CARD = ["experiment=tiny-cpu", "layout=separate_one_card", "rollout=vllm_server_cpu"]


def _fake_cards(monkeypatch, count: int, visible: str | None) -> None:
    monkeypatch.setattr(separate.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(separate.torch.cuda, "device_count", lambda: count)
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)


def test_the_one_card_layout_composes_and_its_server_gets_the_training_card(monkeypatch):
    cfg = compose(ONE_CARD)
    assert (cfg.layout.mode, cfg.layout.gpus, cfg.layout.train_gpus, cfg.layout.serve_gpus) == ("separate", 1, 1, 1)
    assert cfg.layout.share_cards and cfg.trainer.devices == 1
    assert separate_refusals(cfg) == []
    assert separate.serving_cards(cfg) is None  # CPU: the server runs on CPU, no card to name
    _fake_cards(monkeypatch, 1, None)
    assert separate.serving_cards(cfg) == "0"
    _fake_cards(monkeypatch, 2, "5,3")
    assert separate.serving_cards(cfg) == "5"
    # the same cards split: the server gets the card after the training one
    split = compose(["experiment=tiny-cpu", "layout=separate_cpu", "rollout=vllm_server_cpu"])
    assert separate.serving_cards(split) == "3"
    # two cards shared by two training ranks and one TP2 server
    two = compose([*ONE_CARD, "layout.gpus=2", "layout.train_gpus=2", "layout.serve_gpus=2", "layout.engine_tp=2"])
    assert separate.serving_cards(two) == "5,3"


def test_the_gpu_server_config_composes_with_the_one_card_layout():
    cfg = compose(["experiment=h200-tiny", "layout=separate_one_card", "rollout=vllm_server_gpu",
                   "layout.partial_rollouts=true", "algorithm.off_policy_loss=decoupled"])
    assert cfg.rollout.engine == "vllm-server" and not cfg.rollout.enable_sleep_mode
    assert cfg.rollout.weight_sync == "lora" and separate_refusals(cfg) == []


@pytest.mark.parametrize("overrides, message", [
    (["layout.gpus=2"], "layout.share_cards=true runs the server on the training cards: layout.gpus (2), "
                        "layout.train_gpus (1) and layout.serve_gpus (1) must be equal"),
    (["layout.gpus=2", "layout.serve_gpus=2", "layout.engine_tp=2"], "must be equal (layout=separate_one_card"),
    (["trainer.num_nodes=2", "layout.gpus=2", "layout.train_gpus=2", "layout.serve_gpus=2", "layout.engine_tp=2"],
     "layout.share_cards=true with trainer.num_nodes=2: the server shares the cards of one machine"),
    (["rollout.weight_sync=merged"], "rollout.weight_sync=merged with layout.share_cards=true and "
                                     "rollout.weight_transfer=None: NCCL (the GPU default) refuses two ranks on one card"),
    (["rollout.weight_sync=merged", "rollout.weight_transfer=nccl"], "vLLM's ipc backend, the one for a shared card, "
                                                                     "is not wired here"),
    (["layout.mode=colocated", "rollout=vllm_cpu", "layout.serve_gpus=0"],
     "layout.share_cards=true puts the separate layout's server on the training cards"),
])
def test_what_a_shared_card_cannot_run_is_refused_naming_the_keys(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        compose([*ONE_CARD, *overrides])


def test_merged_weights_by_gloo_go_through_host_memory_and_are_allowed():
    cfg = compose([*ONE_CARD, "rollout.weight_sync=merged", "rollout.weight_transfer=gloo"])
    assert separate_refusals(cfg) == []
    changed = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    changed.rollout.weight_transfer = "nccl"  # changed after composition: the engine side refuses it again
    cfg = changed
    assert any("NCCL (the GPU default) refuses two ranks on one card" in p for p in separate_refusals(cfg))


def test_the_server_module_is_one_the_installed_vllm_has():
    import importlib.util

    assert importlib.util.find_spec(server_module()) is not None
