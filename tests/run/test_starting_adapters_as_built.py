"""A starting adapter folder is refused at the start, before anything is written, for whatever
the build would refuse when it loads it (``models.build.check_starting_adapters``: the same
check, against the peft model built on the meta device) and for the LoRA variants neither the
trainer nor the engines take (``store.lora_shapes``): tensors of other names or kinds, a
config whose targets or fields the tensors do not match, DoRA, trained biases, an init that
rewrites the base, quantized tensors, a value head with more or less than a weight and a bias."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from atlas_lightning.config import ConfigError
from atlas_lightning.errors import InputError

_DOWN_A = "base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"


def _config(change):
    def damage(folder):
        data = json.loads((folder / "adapter_config.json").read_text())
        change(data)
        (folder / "adapter_config.json").write_text(json.dumps(data))
    return damage


def _tensors(change, name="adapter_model.safetensors"):
    def damage(folder):
        tensors = load_file(folder / name)
        change(tensors)
        save_file(tensors, folder / name, metadata={"format": "pt"})
    return damage


#: case -> (role, damage, what the refusal says)
DAMAGED = {
    "dora": ("actor", _config(lambda d: d.update(use_dora=True)), "the adapter uses DoRA"),
    "trained_biases": ("actor", _config(lambda d: d.update(bias="all")), "trained biases (bias='all')"),
    "init_rewriting_the_base": ("critic", _config(lambda d: d.update(init_lora_weights="pissa")),
                                "init_lora_weights='pissa', which rewrites the base weights"),
    "target_of_no_module": ("actor", _config(lambda d: d.update(target_modules=d["target_modules"] + ["nope_proj"])),
                            "target_modules name nope_proj, which is no module of the base"),
    # a string is peft's regex over full module names: one that matches nothing, one that is no regex
    "regex_of_no_module": ("actor", _config(lambda d: d.update(target_modules=r".*\.nope_proj")),
                           "adapter_config.json does not fit this base model: Target modules .*\\.nope_proj not found"),
    "target_that_is_no_regex": ("critic", _config(lambda d: d.update(target_modules="([")),
                                "field target_modules='([' is not a regular expression"),
    "layers_the_tensors_exceed": ("actor", _config(lambda d: d.update(layers_to_transform=[0])),
                                  "in the folder but not here"),
    "fan_in_fan_out": ("actor", _config(lambda d: d.update(fan_in_fan_out=True)),
                       "fan_in_fan_out=True in adapter_config.json"),
    "tensor_of_no_lora_factor": ("actor", _tensors(lambda t: t.update({_DOWN_A.replace("lora_A", "lora_C"):
                                                                        torch.zeros(2)})),
                                 "keys differ from this adapter's, e.g. ['base_model.model.model.layers.0.mlp."
                                 "down_proj.lora_C.weight']"),
    "tensors_without_the_peft_prefix": ("actor", _tensors(lambda t: [t.update({k.removeprefix("base_model.model."):
                                                                               t.pop(k)}) for k in list(t)]),
                                        "target_modules differ"),
    "quantized_tensor": ("actor", _tensors(lambda t: t.update({_DOWN_A: t[_DOWN_A].to(torch.float8_e4m3fn)})),
                         "is torch.float8_e4m3fn, a quantized type"),
    "value_head_extra_tensor": ("critic", _tensors(lambda t: t.update(extra=torch.zeros(1)), "value_head.safetensors"),
                                "value_head.safetensors holds ['extra']"),
    "value_head_without_bias": ("critic", _tensors(lambda t: t.pop("bias"), "value_head.safetensors"),
                                "value_head.safetensors field bias is missing"),
}


@pytest.fixture(scope="module")
def saved(tiny_model_dir, tmp_path_factory):
    """Real adapters of the tiny model's LoRA (r8, alpha 16), as a run saves them."""
    from atlas_lightning.models.adapters import save_adapter
    from tests.model_builds import actor_critic

    model = actor_critic(tiny_model_dir, {"rank": 8, "alpha": 16})
    root = tmp_path_factory.mktemp("adapters")
    return {role: save_adapter(model, role, root / role) for role in ("actor", "critic")}


def _copy(saved, role, tmp_path):
    import shutil

    folder = tmp_path / "elsewhere" / role
    shutil.copytree(saved[role], folder)
    return folder


def _start_checks(cfg):
    """What ``check_inputs`` checks of the starting adapters: read and checked from the header,
    then against the model the build makes."""
    from atlas_lightning.run.facts import _check_adapters_fit, _check_starting_adapters

    _check_adapters_fit(cfg, _check_starting_adapters(cfg))


def test_intact_adapters_pass(saved, cfg_of):
    _start_checks(cfg_of(f"model.actor_adapter={saved['actor']}", f"model.critic_adapter={saved['critic']}"))


@pytest.mark.parametrize("case", sorted(DAMAGED))
def test_a_damaged_or_unsupported_adapter_is_refused_at_the_start(saved, cfg_of, tmp_path, case):
    role, damage, message = DAMAGED[case]
    folder = _copy(saved, role, tmp_path)
    damage(folder)
    with pytest.raises(InputError) as refused:
        _start_checks(cfg_of(f"model.{role}_adapter={folder}"))
    assert message in str(refused.value) and str(folder) in str(refused.value), str(refused.value)
    assert str(refused.value).startswith(f"model.{role}_adapter={folder}"), str(refused.value)


def test_what_the_build_refuses_is_refused_by_check_inputs_before_anything_is_written(saved, cfg_of, tmp_path):
    """Before, an extra tensor passed the start-up's header check and the build refused it after
    the run's config and logs were written."""
    from atlas_lightning.run.facts import check_inputs

    folder = _copy(saved, "actor", tmp_path)
    DAMAGED["tensor_of_no_lora_factor"][1](folder)
    with pytest.raises(ConfigError, match=r"^model.actor_adapter=.*lora_C"):
        check_inputs(cfg_of(f"model.actor_adapter={folder}"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere"]
