"""Each starting adapter brings its own LoRA shape: a critic whose rank and target modules differ
from the actor's (and both from ``model.lora``) is trained for one real PPO step on the tiny
model, and both export as PEFT folders that reload, with their own shapes, through
``PeftModel.from_pretrained`` and through our loader."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from atlas_lightning.config import compose
from atlas_lightning.models.adapters import save_adapter
from atlas_lightning.models.build import build_actor_critic
from atlas_lightning.ppo.module import PPOModule
from atlas_lightning.run.memory_check import SyntheticData, vocab_size_of
from atlas_lightning.store.lora_shapes import lora_shapes
from tests.model_builds import actor_critic

ACTOR = {"rank": 4, "alpha": 12, "target_modules": "all-linear"}
CRITIC = {"rank": 2, "alpha": 6, "target_modules": ["q_proj", "v_proj"]}
ALL_LINEAR = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def _lora_shapes_of(tensors: dict) -> dict[str, set]:
    """``{module leaf name: {(A shape rank), ...}}`` from PEFT adapter keys and tensors."""
    out: dict[str, set] = {}
    for key, tensor in tensors.items():
        if ".lora_A." in key:
            out.setdefault(key.split(".lora_A.")[0].split(".")[-1], set()).add(int(tensor.shape[0]))
    return out


class _Capture(L.Callback):
    """After the one step: the adapters as PEFT folders (what checkpoints write)."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.finite = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.finite = outputs["finite"]
        pl_module.save_adapters(self.out)


@pytest.fixture
def start(tiny_model_dir, tmp_path, randomize):
    """``global_step_29``-like folders: actor r4 on every linear, critic r2 on q/v only, random values."""
    step = tmp_path / "start" / "global_step_29"
    model = actor_critic(str(tiny_model_dir), ACTOR, critic_lora=CRITIC)
    randomize(model, scale=0.05)
    for role in ("actor", "critic"):
        save_adapter(model, role, step / role / "lora_adapter")
    return step


def test_a_critic_of_another_shape_trains_a_step_and_exports(start, tiny_model_dir, tmp_path):
    # model.lora says r8 on all linears: both folders say otherwise, and the folders win
    cfg = compose(["experiment=tiny-cpu", f"model.path={tiny_model_dir}", f"paths.root={tmp_path}",
                   f"trainer.init_from={start}", "model.lora.rank=8", "model.lora.alpha=16",
                   "algorithm.train_batch_size=2", "algorithm.ppo_mini_batch_size=1", "algorithm.ppo_epochs=1",
                   "algorithm.ppo_max_token_len_per_gpu=256", "algorithm.forward_max_token_len_per_gpu=512",
                   "algorithm.actor_lr=1e-2", "algorithm.critic_lr=1e-2", "rollout.max_prompt_length=64",
                   "rollout.max_response_length=192", "rollout.max_tokens_per_turn=64", "rollout.max_model_len=512"])
    shapes = lora_shapes(cfg)
    assert (shapes["actor"].rank, shapes["actor"].alpha) == (4, 12.0)
    assert (shapes["critic"].rank, shapes["critic"].alpha, shapes["critic"].target_modules) == (2, 6.0, ("q_proj", "v_proj"))
    assert shapes["critic"].source.endswith("critic/lora_adapter/adapter_config.json")
    from atlas_lightning.rollout.engines.args import EngineArgs

    assert EngineArgs.from_config(cfg).lora_rank == 4  # the engines serve the actor's rank, not model.lora's 8

    out = tmp_path / "after"
    capture = _Capture(out)
    module = PPOModule(cfg)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[capture])
    trainer.fit(module, datamodule=SyntheticData(cfg, 1, vocab_size_of(cfg)))
    assert capture.finite is True

    before = {role: load_file(str(start / role / "lora_adapter" / "adapter_model.safetensors")) for role in ("actor", "critic")}
    after = {role: load_file(str(out / role / "lora_adapter" / "adapter_model.safetensors")) for role in ("actor", "critic")}
    assert _lora_shapes_of(after["actor"]) == {name: {4} for name in ALL_LINEAR}
    assert _lora_shapes_of(after["critic"]) == {"q_proj": {2}, "v_proj": {2}}
    for role in ("actor", "critic"):
        assert after[role].keys() == before[role].keys()
        moved = sum(float((after[role][k] - before[role][k]).abs().max()) > 0 for k in after[role])
        assert moved == len(after[role]), f"{role}: the step trained {moved} of {len(after[role])} tensors"
        saved = json.loads((out / role / "lora_adapter" / "adapter_config.json").read_text())
        expected = ACTOR if role == "actor" else CRITIC
        assert (saved["r"], saved["lora_alpha"]) == (expected["rank"], expected["alpha"])

    # PEFT reloads each folder with its own shape and the trained values
    peft_actor = None
    for role in ("actor", "critic"):
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        peft = PeftModel.from_pretrained(base, str(out / role / "lora_adapter"))
        loaded = {n: p for n, p in peft.named_parameters() if ".lora_" in n}
        assert len(loaded) == len(after[role])
        for name, param in loaded.items():
            key = name.replace(".default", "")
            assert torch.equal(param.detach(), after[role][key]), name
        if role == "actor":
            peft_actor = peft.eval()

    # ...and so does our loader, whatever model.lora says (r8 here), into the trained values
    model = build_actor_critic(cfg.model, actor_adapter=str(out / "actor" / "lora_adapter"),
                               critic_adapter=str(out / "critic" / "lora_adapter"))
    for role in ("actor", "critic"):
        live = model.peft_model.peft_config[role]
        expected = ACTOR if role == "actor" else CRITIC
        assert (live.r, live.lora_alpha) == (expected["rank"], expected["alpha"])
    from atlas_lightning.models.weights import adapter_state

    for role in ("actor", "critic"):
        state = adapter_state(model, role)
        assert state.keys() == after[role].keys()
        assert all(torch.equal(state[k], after[role][k]) for k in state)
    # the actor as our loader rebuilt it scores tokens as PEFT's reload does
    from atlas_lightning.models.packing import pack_sequences

    ids = torch.randint(0, 100, (12,), generator=torch.Generator().manual_seed(3))
    model.eval()
    with torch.no_grad():
        ours, _ = model.actor_forward(pack_sequences([ids], [4]), compute_entropy=False)
        logits = peft_actor(input_ids=ids[None]).logits[0].float()
    theirs = torch.log_softmax(logits[3:11], -1).gather(-1, ids[4:12, None])[:, 0]
    assert torch.allclose(ours, theirs, atol=1e-5), (ours - theirs).abs().max()
    head = load_file(str(out / "critic" / "lora_adapter" / "value_head.safetensors"))
    assert torch.equal(model.value_head.weight.detach(), head["weight"])
    # what the weight sync sends the engines carries the actor's own scaling (12 / 4), not model.lora's (16 / 8)
    from atlas_lightning.rollout.sync import export_actor_adapter

    sent = export_actor_adapter(module.model, tmp_path / "export")
    assert len(sent) == len(after["actor"]) // 2
    assert {scaling for _, _, scaling in sent.values()} == {ACTOR["alpha"] / ACTOR["rank"]}
