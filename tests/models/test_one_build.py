"""One model build for ``fit``, memory-check and the benchmarks (``models/build.py``): the base is
placed on the device the strategy trains on, the kernel choices are made for that device, and
the benchmarks build through the same function from ``fit``'s own model config."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from atlas_lightning.config import ModelConfig, compose
from atlas_lightning.models import actor_critic as actor_critic_module
from atlas_lightning.models import build

CPU = torch.device("cpu")
CARD = torch.device("cuda", 3)


def _spy(monkeypatch, module, name, result=None):
    """Record each call of ``module.name`` (args, kwargs); answer ``result`` or call through."""
    calls, real = [], getattr(module, name)

    def spy(*args, **kwargs):
        calls.append((args, kwargs))
        return result(*args, **kwargs) if callable(result) else real(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    return calls


def test_configure_model_builds_on_the_strategy_root_device(monkeypatch, tiny_model_dir, tmp_path):
    """Under ModelParallelStrategy ``configure_model`` runs with no device context: the builder
    must be handed the card (the strategy's root device), not left to build on the host."""
    from atlas_lightning.ppo.module import PPOModule
    from atlas_lightning.run.memory_check import MemoryCheckModule

    calls = _spy(monkeypatch, build, "build_actor_critic", result=lambda *a, **k: torch.nn.Linear(1, 1))
    cfg = compose(["experiment=tiny-cpu", f"model.path={tiny_model_dir}", f"paths.root={tmp_path}", "name=placed"])
    module = PPOModule(cfg)
    module._trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=CARD))
    module.configure_model()
    (args, kwargs), = calls
    assert args[0] is cfg.model and kwargs["device"] == CARD and kwargs["random_base"] is None
    # memory-check measures the model fit builds: it does not build its own
    assert MemoryCheckModule.configure_model is PPOModule.configure_model


def test_a_colocated_engine_sleeps_while_the_base_is_read_onto_the_card(monkeypatch, tiny_model_dir, tmp_path):
    """The whole base lands on the card before sharding: an engine that sleeps for updates sleeps
    first (the first weight sync wakes it); on the CPU nothing is read onto a card."""
    from atlas_lightning.ppo.module import PPOModule

    order = []
    monkeypatch.setattr(build, "build_actor_critic", lambda *a, **k: order.append("build") or torch.nn.Linear(1, 1))
    cfg = compose(["experiment=tiny-cpu", f"model.path={tiny_model_dir}", f"paths.root={tmp_path}", "name=asleep"])
    for device, sleeps, expected in ((CARD, True, ["sleep", "build"]), (CARD, False, ["build"]), (CPU, True, ["build"])):
        order.clear()
        module = PPOModule(cfg)
        datamodule = SimpleNamespace(sleeps_for_update=sleeps, engine=SimpleNamespace(sleep=lambda: order.append("sleep")))
        module._trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=device), datamodule=datamodule)
        module.configure_model()
        assert order == expected, (device, sleeps)


def test_a_folder_base_is_read_straight_onto_the_device(monkeypatch, tiny_model_dir):
    """``load_base`` reads the checkpoint onto the training device (device map), and on the CPU
    exactly as before (no device map)."""
    from transformers import AutoModelForCausalLM

    config = ModelConfig(path=str(tiny_model_dir), dtype="float32")
    calls = _spy(monkeypatch, AutoModelForCausalLM, "from_pretrained",
                 result=lambda *a, **k: (SimpleNamespace(config=SimpleNamespace(use_cache=True)),
                                         {"missing_keys": set()}))
    build.load_base(config, CARD)
    build.load_base(config, "cpu")
    (_, on_card), (_, on_host) = calls
    assert on_card["device_map"] == {"": CARD} and "device_map" not in on_host
    assert on_card["dtype"] == torch.float32 and on_card["attn_implementation"] == config.attn_implementation
    assert on_card["output_loading_info"] and on_host["output_loading_info"]  # a missing weight is refused


def test_kernels_are_chosen_for_the_device_the_base_was_built_on(monkeypatch, qwen3_5_base):
    """Every ``auto`` kernel choice gets the device the builder placed the base on."""
    elementwise = _spy(monkeypatch, actor_critic_module, "resolve_elementwise_kernels")
    linear = _spy(monkeypatch, actor_critic_module, "resolve_linear_kernel")
    placed = _spy(monkeypatch, build, "load_base")
    config = ModelConfig(path=qwen3_5_base, dtype="float32", gradient_checkpointing=False,
                         lora={"rank": 2, "alpha": 4})
    model = build.build_actor_critic(config, device=CPU)
    assert placed[0][0][1] == CPU
    assert model.built_on == CPU == next(model.hf_model.parameters()).device
    assert elementwise[0][0] == ("auto", "cpu") and linear[0][0] == ("auto", "cpu")
    assert (model.elementwise_kernels, model.linear_attention_kernel, model.attention_length_bucket) == ("torch", "torch", 0)


def test_auto_takes_the_card_kernels_on_a_card(monkeypatch):
    """What the same keys resolve to when the device is a card (both packages usable there)."""
    from atlas_lightning.models import fused_kernels, linear_kernels

    monkeypatch.setattr(fused_kernels, "liger_problem", lambda *a: None)
    monkeypatch.setattr(linear_kernels, "fla_problem", lambda *a: None)
    assert fused_kernels.resolve("auto", CARD.type) == "liger" and linear_kernels.resolve("auto", CARD.type) == "fla"
    assert fused_kernels.resolve("auto", "cpu") == "torch" and linear_kernels.resolve("auto", "cpu") == "torch"
    with pytest.raises(ValueError, match="model.linear_attention_kernel=fla cannot run here"):
        linear_kernels.resolve("fla", "cpu")


def test_the_benchmark_builds_fits_model_through_fits_builder(monkeypatch, tmp_path):
    """The update benchmark's model: the same builder, and every ``model.*`` key as ``fit``'s
    composed config has it for the report's model, but the LoRA rank, chunk and the keys the
    benchmark varies."""
    from atlas_lightning.bench.shapes import shape_by_name, transformers_config
    from atlas_lightning.bench.update import FIT_MODEL, OursRunner, fit_model_config

    calls = _spy(monkeypatch, build, "build_actor_critic")
    bench_cfg = fit_model_config(4, 64, dtype="float32")
    runner = OursRunner(bench_cfg, transformers_config(shape_by_name("tiny")), 1000, device=CPU)
    (args, kwargs), = calls
    assert args[0] is bench_cfg and kwargs["device"] == CPU and kwargs["random_base"] is not None
    assert runner.model.built_on == CPU

    fit_cfg = compose([f"model={FIT_MODEL}", f"paths.root={tmp_path}", "model.lora.rank=4", "model.lora.alpha=8",
                       "model.logprob_chunk_tokens=64", "model.dtype=float32"]).model
    ours, fits = OmegaConf.to_container(bench_cfg, resolve=False), OmegaConf.to_container(fit_cfg, resolve=True)
    assert {k: v for k, v in ours.items() if k != "path"} == {k: v for k, v in fits.items() if k != "path"}


@pytest.fixture
def foreign_qwen3_5_config():
    """``AutoConfig`` answering ``qwen3_5`` with another library's classes of the same names, as an
    in-process vLLM 0.26 registers them (``vllm.transformers_utils.configs.qwen3_5``); put back after."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.qwen3_5 import configuration_qwen3_5 as ours

    text = type("Qwen3_5TextConfig", (ours.Qwen3_5TextConfig,), {})
    full = type("Qwen3_5Config", (ours.Qwen3_5Config,), {"sub_configs": {**ours.Qwen3_5Config.sub_configs,
                                                                          "text_config": text}})
    kept = CONFIG_MAPPING["qwen3_5"]
    AutoConfig.register("qwen3_5", full, exist_ok=True)
    try:
        yield full
    finally:
        AutoConfig.register("qwen3_5", kept, exist_ok=True)


def test_the_hybrid_base_loads_after_another_library_registered_its_config(qwen3_5_base, foreign_qwen3_5_config):
    """``fit`` starts a colocated vLLM engine before the trainer reads the base; vLLM registers its
    own Qwen3.5 config classes. The base, the weight check and the FLOP count still read the text
    model with transformers' own classes (AutoModelForCausalLM alone fails: no ``vocab_size``)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    assert type(AutoConfig.from_pretrained(qwen3_5_base)) is foreign_qwen3_5_config
    with pytest.raises(AttributeError, match="vocab_size"):
        AutoModelForCausalLM.from_pretrained(qwen3_5_base)
    model_cfg = OmegaConf.structured(ModelConfig(path=qwen3_5_base, dtype="float32", attn_implementation="sdpa"))
    base = build.load_base(model_cfg)
    assert type(base).__name__ == "Qwen3_5ForCausalLM" and base.config.vocab_size > 0
    build.check_base_weights(qwen3_5_base)
    assert type(build.causal_lm_config(qwen3_5_base)).__name__ == "Qwen3_5TextConfig"


# -- a base folder whose weights, config or chat template are not the model's: refused at the start


def _edit_tensors(folder, edit):
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def _edit_json(path, **fields):
    import json

    data = json.loads(path.read_text())
    data.update(fields)
    path.write_text(json.dumps(data))


_DOWN = "model.layers.0.mlp.down_proj.weight"
_TEMPLATE_WITHOUT_TOOLS = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                           "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
#: damage -> what the message must say. Each would otherwise train a model other than the folder's
#: (a weight cast from integers, a layer dropped, another family) or fail late with a traceback.
_BASE_DAMAGE = {
    "tensor_of_another_shape": (lambda f: _edit_tensors(f, lambda t: t.__setitem__(_DOWN, t[_DOWN][:, :-1].clone())),
                                f"have another shape than its config.json gives them ({_DOWN} is [128, 383]"),
    "integer_tensor": (lambda f: _edit_tensors(f, lambda t: t.__setitem__(_DOWN, t[_DOWN].to(torch.int32))),
                       f"model.safetensors holds 1 tensor(s) of integer or boolean type ({_DOWN}: I32)"),
    "tensor_with_no_place": (lambda f: _edit_tensors(f, lambda t: t.__setitem__("model.layers.7.mlp.down_proj.weight",
                                                                               torch.zeros(4, 4))),
                             "hold 1 tensor(s) the model its config.json describes has no place for "
                             "(model.layers.7.mlp.down_proj.weight)"),
    "config_of_another_family": (lambda f: _edit_json(f / "config.json", model_type="llama",
                                                      architectures=["LlamaForCausalLM"]),
                                 "has no place for (model.layers.0.self_attn.k_norm.weight"),
    "config_fewer_layers": (lambda f: _edit_json(f / "config.json", num_hidden_layers=2),
                            "config.json is not a model config transformers can read"),
    "config_field_of_wrong_type": (lambda f: _edit_json(f / "config.json", hidden_size="128"),
                                   "config.json is not a model config transformers can read"),
    "config_unknown_model_type": (lambda f: _edit_json(f / "config.json", model_type="nosuchmodel"),
                                  "config.json is not a model config transformers can read"),
    "config_vocabulary_too_small": (lambda f: _edit_json(f / "config.json", vocab_size=1000),
                                    "transformers cannot build the model its config.json describes"),
    "chat_template_that_does_not_parse": (lambda f: (f / "chat_template.jinja").write_text("{{ unclosed "),
                                          "its chat template cannot render a conversation (TemplateSyntaxError"),
    "chat_template_without_tools": (lambda f: (f / "chat_template.jinja").write_text(_TEMPLATE_WITHOUT_TOOLS),
                                    "its chat template does not render the tools passed as tools="),
}


@pytest.mark.parametrize("damage", sorted(_BASE_DAMAGE))
def test_a_base_folder_that_is_not_the_model_it_claims_is_refused_before_anything_is_written(
        damage, tiny_model_dir, sample_data_dir, tmp_path, capsys):
    """The class: whatever makes the weights, ``config.json`` and chat template disagree is named
    with ``model.path`` (exit 2, no traceback, the run folder untouched), not loaded as another model."""
    import shutil

    from atlas_lightning.cli import main

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    damage_folder, message = _BASE_DAMAGE[damage]
    damage_folder(model)
    root = tmp_path / "root"
    code = main(["fit", "experiment=tiny-cpu", f"paths.root={root}", f"model.path={model}", f"data.root={sample_data_dir}"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"model.path={model}: " in err and message in err and "Traceback" not in err, err
    assert not root.exists()
