"""The step benchmark's model folders are written as the shape's real checkpoints are
(``bench/step.build_model_folder``, ``bench/shapes.checkpoint_config``): a Qwen3.5/3.6 shape as
``Qwen3_5ForConditionalGeneration`` (``Qwen3_5Config`` with ``text_config`` and ``vision_config``,
the text model under ``model.language_model.*``, a vision tower under ``model.visual.*``, the full
vocabulary), which the trainer's loader reads with every base tensor supplied (the tower left
aside) and vLLM serves as that architecture."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from atlas_lightning.bench.shapes import ModelShape, build_checkpoint_model, checkpoint_config, shape_by_name
from atlas_lightning.bench.step import build_model_folder, main
from atlas_lightning.models.checkpoint_names import checkpoint_keys


@pytest.fixture(scope="module")
def hybrid_folder(tmp_path_factory) -> Path:
    """``tiny_hybrid`` written by the step benchmark's builder (no tokenizer: the loaders' business)."""
    return build_model_folder("tiny_hybrid", tmp_path_factory.mktemp("ckpt") / "tiny_hybrid", None)


def test_the_27b_shape_is_written_as_its_checkpoints_are():
    """Qwen3.6-27B at 16 layers: the image-text config vLLM requires, its 3:1 layer pattern, the
    full vocabulary, a vision tower into the text width; built on the meta device (no memory)."""
    config = checkpoint_config(shape_by_name("qwen3_6_27b"), 16)
    assert type(config).__name__ == "Qwen3_5Config" and config.architectures == ["Qwen3_5ForConditionalGeneration"]
    text, vision = config.text_config, config.vision_config
    assert type(text).__name__ == "Qwen3_5TextConfig" and text.num_hidden_layers == 16 and text.vocab_size == 248320
    assert text.layer_types == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + [
        "full_attention"] + ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"]
    assert text.rope_parameters["mrope_section"] == [11, 11, 10] and text.rope_parameters["partial_rotary_factor"] == 0.25
    assert (vision.depth, vision.hidden_size, vision.out_hidden_size) == (27, 1152, text.hidden_size)
    model = build_checkpoint_model(shape_by_name("qwen3_6_27b"), device=torch.device("meta"), dtype=torch.bfloat16,
                                   layers=16)
    names = dict(model.named_parameters())
    assert names["lm_head.weight"].shape == (248320, 5120)
    assert names["model.language_model.embed_tokens.weight"].shape == (248320, 5120)
    assert any(name.startswith("model.visual.") for name in names)
    assert {name.split(".")[4] for name in names if name.startswith("model.language_model.layers.")} >= {
        "linear_attn", "self_attn", "mlp"}


def test_the_folder_is_the_image_text_checkpoint_format(hybrid_folder):
    config = json.loads((hybrid_folder / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5ForConditionalGeneration"] and config["model_type"] == "qwen3_5"
    assert config["text_config"]["model_type"] == "qwen3_5_text" and config["vision_config"]["model_type"] == (
        "qwen3_5_vision")
    assert config["text_config"]["vocab_size"] == shape_by_name("tiny_hybrid").vocab_size
    assert config["text_config"]["use_cache"] is True
    keys = checkpoint_keys(hybrid_folder)
    assert all(k.startswith(("model.language_model.", "model.visual.")) or k == "lm_head.weight" for k in keys)
    assert any(k.startswith("model.visual.") for k in keys)
    assert any(".linear_attn.in_proj_qkv." in k for k in keys) and any(".self_attn.q_proj." in k for k in keys)


def test_the_trainer_loads_every_base_tensor_and_leaves_the_vision_tower(hybrid_folder):
    """``check_base_weights`` finds every tensor of the text model; ``load_base`` reads them
    (``Qwen3_5ForCausalLM``: the text model alone; transformers skips the tower's tensors by the
    class's own ``_keys_to_ignore_on_load_unexpected``, ``^model.visual.*``: never read, never
    reported) equal to the files; every parameter has its checkpoint name (what merged weights
    are sent to the engine under)."""
    from types import SimpleNamespace

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from atlas_lightning.models.build import check_base_weights, load_base
    from atlas_lightning.models.checkpoint_names import name_map

    check_base_weights(hybrid_folder)
    model = load_base(SimpleNamespace(path=str(hybrid_folder), dtype="bfloat16", attn_implementation="sdpa"))
    assert type(model).__name__ == "Qwen3_5ForCausalLM"
    assert not any("visual" in name for name, _ in model.named_parameters())
    _, info = AutoModelForCausalLM.from_pretrained(str(hybrid_folder), device_map="meta", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert any(p.startswith("^model.visual") for p in model._keys_to_ignore_on_load_unexpected)
    stored = load_file(str(hybrid_folder / "model.safetensors"))
    mapping, problem = name_map(model, hybrid_folder)
    assert mapping is not None, problem
    params = dict(model.named_parameters())
    assert set(mapping.values()) == {k for k in stored if not k.startswith("model.visual.")}
    for name, stored_name in mapping.items():
        assert torch.equal(params[name], stored[stored_name]), name


def test_a_bad_build_request_exits_2_before_anything_is_written(tmp_path, tiny_model_dir, capsys):
    """An unknown shape, a layer count outside the decoder, a folder without a tokenizer, or a
    tokenizer larger than the shape's vocabulary: exit 2 naming the option, nothing written, no fit."""
    model_dir = tmp_path / "model"
    common = ["--out", str(tmp_path / "out"), "--model-dir", str(model_dir)]
    cases = [(["--build", "qwen9", "--tokenizer-from", str(tiny_model_dir)], "--build qwen9"),
             (["--build", "qwen3_6_27b", "--layers", "65", "--tokenizer-from", str(tiny_model_dir)], "--layers 65"),
             (["--build", "tiny_hybrid", "--tokenizer-from", str(tmp_path)], "no tokenizer.json"),
             (["--build", "tiny_hybrid", "--tokenizer-from", str(tiny_model_dir)], "do not fit tiny_hybrid's vocabulary")]
    for argv, named in cases:
        assert main([*common, *argv]) == 2
        assert named in capsys.readouterr().err
    assert not model_dir.exists() and not (tmp_path / "out").exists()


def _engine_shape() -> ModelShape:
    """``tiny_hybrid`` with the Gated DeltaNet heads vLLM's CPU kernel takes (head size 128)."""
    fields = dict(shape_by_name("tiny_hybrid").config, vocab_size=2048, linear_num_key_heads=1,
                  linear_num_value_heads=2, linear_key_head_dim=128, linear_value_head_dim=128)
    return ModelShape("tiny_hybrid", "qwen3_5", fields)


def _vllm_can_load_qwen3_5() -> str:
    """Why vLLM cannot run the architecture here ('' when it can): its Qwen3.5 module imports
    transformers' Qwen2-VL image processor, which needs torchvision."""
    pytest.importorskip("vllm")
    try:
        import vllm.model_executor.models.qwen3_5  # noqa: F401
    except Exception as err:  # noqa: BLE001 - vLLM's own words are the reason
        return f"vLLM cannot import its Qwen3.5 model here: {type(err).__name__}: {err}"
    return ""


@pytest.mark.vllm
def test_vllm_serves_the_folder_as_its_architecture(tmp_path, tiny_model_dir):
    """vLLM starts an engine on the folder with the engine arguments the rollout passes
    (``language_model_only``: no vision tower) and generates. vLLM's CPU Gated DeltaNet kernel
    takes bf16 only and prefix caching of a hybrid needs chunked prefill, which the CPU engine
    turns off for seeded sampling: prefix caching is off here."""
    reason = _vllm_can_load_qwen3_5()
    if reason:
        pytest.skip(reason)
    import shutil

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from atlas_lightning.config import compose
    from atlas_lightning.rollout.engines.args import EngineArgs
    from atlas_lightning.rollout.engines.vllm_engine import prepare_cpu_environment
    from atlas_lightning.rollout.engines.vllm_lifetime import shut_down_llm, start_llm

    folder = tmp_path / "model"
    folder.mkdir()
    build_checkpoint_model(_engine_shape(), device=torch.device("cpu"), dtype=torch.bfloat16).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tiny_model_dir / name, folder / name)
    args = EngineArgs.from_config(compose(["experiment=tiny-cpu", f"model.path={folder}", "model.dtype=bfloat16",
                                           "rollout.max_logprob_gap=0.3", "rollout.weight_sync=merged"]))
    prepare_cpu_environment(args.cpu_kvcache_gib)
    llm = start_llm(**{**args.vllm_kwargs(on_cpu=True), "enable_prefix_caching": False})
    try:
        out = llm.generate([TokensPrompt(prompt_token_ids=list(range(5, 30)))],
                           SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4
    finally:
        shut_down_llm(llm)
