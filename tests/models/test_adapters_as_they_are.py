"""Starting adapters as other trainers wrote them: ATLAS report 28's critic folder on a Qwen3.6-shaped
base held a LoRA on the attention-style module list only, its tensors in the VLM checkpoint's
naming (``model.language_model.layers``) and its value head inside ``adapter_model.safetensors``
as a peft ``modules_to_save`` module (bf16 weight and bias). The builder takes that shape from
the folder, and the loader renames and finds the head; a head of the wrong shape is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from atlas_lightning.models.adapters import AdapterMismatchError, save_adapter
from atlas_lightning.models.build import build_actor_critic
from atlas_lightning.models.weights import adapter_state
from tests.model_builds import actor_critic

#: The report's critic targets on the hybrid base: the full-attention layers' q/k/v/o and every MLP.
CRITIC = {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                    "down_proj"]}


def _as_report_folder(ours: Path, theirs: Path, hidden: int, head_name: str = "score") -> dict:
    """Rewrite our critic folder the way the report's was written; returns its tensors by our names."""
    tensors = load_file(str(ours / "adapter_model.safetensors"))
    renamed = {k.replace("base_model.model.model.layers.", "base_model.model.model.language_model.layers."): v
               for k, v in tensors.items()}
    assert renamed.keys() != tensors.keys()
    g = torch.Generator().manual_seed(7)
    head = {"weight": torch.randn(1, hidden, generator=g).to(torch.bfloat16), "bias": torch.tensor([0.25]).to(torch.bfloat16)}
    renamed.update({f"base_model.model.{head_name}.{k}": v for k, v in head.items()})
    theirs.mkdir(parents=True)
    save_file(renamed, str(theirs / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = json.loads((ours / "adapter_config.json").read_text())
    config.update(modules_to_save=[head_name], task_type="TOKEN_CLS")
    (theirs / "adapter_config.json").write_text(json.dumps(config))
    return {"lora": tensors, "head": head}


def _model_cfg(base: str, **adapters):
    """The schema's model group (``config.ModelConfig``) on ``base``, LoRA r8 for fresh adapters."""
    from atlas_lightning.config import LoraConfig, ModelConfig

    return ModelConfig(path=base, dtype="float32", lora=LoraConfig(rank=8, alpha=16), gradient_checkpointing=False,
                       logprob_chunk_tokens=64, attn_implementation="sdpa", **adapters)


def test_the_reports_critic_folder_loads_as_it_is(qwen3_5_base, tmp_path, randomize):
    source = actor_critic(qwen3_5_base, {"rank": 2, "alpha": 4}, critic_lora=CRITIC)
    randomize(source)
    save_adapter(source, "critic", tmp_path / "ours")
    hidden = int(source.value_head.weight.shape[1])
    expected = _as_report_folder(tmp_path / "ours", tmp_path / "theirs", hidden)
    # linear-attention layers carry no critic LoRA: the module list adapts only what it names
    assert not any("linear_attn" in k for k in expected["lora"])
    assert any("linear_attn.in_proj_qkv" in k for k in adapter_state(source, "actor"))

    model = build_actor_critic(_model_cfg(qwen3_5_base, critic_adapter=str(tmp_path / "theirs")))
    live = model.peft_model.peft_config["critic"]
    assert (live.r, live.lora_alpha, set(live.target_modules)) == (4, 8, set(CRITIC["target_modules"]))
    assert live.modules_to_save is None and model.peft_model.peft_config["actor"].r == 8
    state = adapter_state(model, "critic")
    assert state.keys() == expected["lora"].keys()
    assert all(torch.equal(state[k], expected["lora"][k]) for k in state)
    assert torch.equal(model.value_head.weight.detach(), expected["head"]["weight"].float())
    assert model.value_head.bias.detach().tolist() == [0.25]


def test_a_head_among_modules_to_save_of_another_shape_is_refused(qwen3_5_base, tmp_path):
    source = actor_critic(qwen3_5_base, {"rank": 2, "alpha": 4}, critic_lora=CRITIC)
    save_adapter(source, "critic", tmp_path / "ours")
    _as_report_folder(tmp_path / "ours", tmp_path / "theirs", hidden=8)
    with pytest.raises(AdapterMismatchError, match=r"score \(modules_to_save\) holds .*'weight': \(1, 8\).*a value head is a weight \(1, 64\)"):
        build_actor_critic(_model_cfg(qwen3_5_base, critic_adapter=str(tmp_path / "theirs")))


def test_a_critic_without_any_head_is_refused(qwen3_5_base, tmp_path):
    source = actor_critic(qwen3_5_base, {"rank": 2, "alpha": 4}, critic_lora=CRITIC)
    folder = save_adapter(source, "critic", tmp_path / "critic")
    (folder / "value_head.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no value head among adapter_config.json's modules_to_save"):
        build_actor_critic(_model_cfg(qwen3_5_base, critic_adapter=str(folder)))
