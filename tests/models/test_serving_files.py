"""A base folder whose files parse but lie is refused before any work, naming the file and the
field (``models/serving_files.py``, ``models/build.check_base_weights``, ``rollout/chat.py``):
an ``architectures`` the engine would build another model from, tokenizer ids beyond the
vocabulary, stop ids that are no special token (a turn would end at a word), a generation config
transformers cannot read, a context longer than the folder allows, a chat template that does not
render ChatML, an output head stored apart from the embeddings it is tied to, quantized weights.
The pristine tiny model passes every check."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from atlas_lightning.errors import InputError


def _json(file, change):
    data = json.loads(file.read_text())
    change(data)
    file.write_text(json.dumps(data))


def _weights(folder, change):
    tensors = load_file(folder / "model.safetensors")
    change(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def _template(folder, template):
    (folder / "chat_template.jinja").write_text(template)
    _json(folder / "tokenizer_config.json", lambda d: d.update(chat_template=template))


_NO_CHATML = ("{% for m in messages %}[{{ m.role }}]: {{ m.content }}\n{% endfor %}{{ tools | tojson }}"
              "{% if add_generation_prompt %}[assistant]: {% endif %}")

#: case -> (damage, what the refusal says)
SERVING = {
    "architectures_of_another_family": (
        lambda f: _json(f / "config.json", lambda d: d.update(architectures=["LlamaForCausalLM"])),
        "architectures names LlamaForCausalLM, which is a llama model"),
    "architectures_of_a_classifier": (
        lambda f: _json(f / "config.json", lambda d: d.update(architectures=["Qwen3ForSequenceClassification"])),
        "which does not generate text"),
    "architectures_unknown": (
        lambda f: _json(f / "config.json", lambda d: d.update(architectures=["NoSuchModelForCausalLM"])),
        "which is no transformers model class"),
    "architectures_missing": (lambda f: _json(f / "config.json", lambda d: d.pop("architectures")),
                              "architectures=None is not a list of class names"),
    "tokenizer_ids_beyond_the_vocabulary": (
        lambda f: _json(f / "tokenizer.json", lambda d: [t.update(id=t["id"] + 3000) for t in d["added_tokens"]]),
        "config.json's vocab_size is 2048"),
    "tokenizer_eos_a_word": (lambda f: _json(f / "tokenizer_config.json", lambda d: d.update(eos_token="the")),
                             "tokenizer's eos_token 'the' holds"),
    "tokenizer_eos_unknown": (lambda f: _json(f / "tokenizer_config.json", lambda d: d.update(eos_token="<|no|>")),
                              "the tokenizer has token id 2048 ('<|no|>')"),
    "config_eos_out_of_vocabulary": (lambda f: _json(f / "config.json", lambda d: d.update(eos_token_id=99999)),
                                     "config.json's eos_token_id holds 99999, not a token id"),
    "generation_eos_a_word": (
        lambda f: _json(f / "generation_config.json", lambda d: d.update(eos_token_id=[2041, 30])),
        "generation_config.json's eos_token_id holds 30, which is not a special token"),
    "generation_eos_not_an_id": (
        lambda f: _json(f / "generation_config.json", lambda d: d.update(eos_token_id="x")),
        "generation_config.json's eos_token_id holds 'x'"),
    "positions_shorter_than_the_context": (
        lambda f: _json(f / "config.json", lambda d: d.update(max_position_embeddings=512)),
        "rollout.max_model_len=2048: model.path="),
}


@pytest.fixture
def folder(tmp_path, tiny_model_dir):
    copied = tmp_path / "model"
    shutil.copytree(tiny_model_dir, copied)
    return copied


def test_the_tiny_model_passes(folder):
    from atlas_lightning.models.build import check_base_config, check_base_weights
    from atlas_lightning.models.serving_files import check_serving_files

    check_serving_files(folder, check_base_config(folder), 2048)
    check_base_weights(folder)


def test_a_tokenizer_limit_below_the_context_is_no_limit(folder):
    """vLLM reads ``tokenizer_config.json``'s ``model_max_length`` for pooling models only: a
    generating model serves past it (the benchmarks' folders: the tiny tokenizer's 4,096 under
    a 32,768-token context)."""
    from atlas_lightning.models.build import check_base_config
    from atlas_lightning.models.serving_files import check_serving_files

    _json(folder / "config.json", lambda d: d.update(max_position_embeddings=32768))
    _json(folder / "tokenizer_config.json", lambda d: d.update(model_max_length=4096))
    check_serving_files(folder, check_base_config(folder), 32768)


@pytest.mark.parametrize("case", sorted(SERVING))
def test_files_that_parse_but_lie_are_refused_naming_the_file_and_field(folder, case):
    from atlas_lightning.models.build import check_base_config
    from atlas_lightning.models.serving_files import check_serving_files

    damage, message = SERVING[case]
    damage(folder)
    with pytest.raises(InputError) as refused:
        check_serving_files(folder, check_base_config(folder), 2048)
    assert message in str(refused.value) and str(folder) in str(refused.value), str(refused.value)


@pytest.mark.parametrize("template", [_NO_CHATML, "no-generation-prompt"])
def test_a_chat_template_that_does_not_render_chatml_is_refused(folder, template):
    """The runtime appends ChatML tool responses and assistant headers: a prompt of another
    format, or one without the assistant header, would train on sequences of two formats."""
    from transformers import AutoTokenizer

    from atlas_lightning.rollout.chat import ChatFormat

    if template == "no-generation-prompt":
        template = (folder / "chat_template.jinja").read_text().replace("'<|im_start|>assistant\\n'", "''")
    _template(folder, template)
    with pytest.raises(ValueError, match="does not render ChatML turns"):
        ChatFormat(AutoTokenizer.from_pretrained(folder)).check_template()


def test_an_output_head_stored_apart_from_the_embeddings_it_is_tied_to_is_refused(folder):
    """transformers unties them and trains the stored head; vLLM keeps them tied."""
    from atlas_lightning.models.build import BaseWeightsError, check_base_weights

    _weights(folder, lambda t: t.update({"lm_head.weight": torch.zeros_like(t["model.embed_tokens.weight"])}))
    with pytest.raises(BaseWeightsError, match="ties the output head to the embeddings"):
        check_base_weights(folder)
    _weights(folder, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].clone()}))
    check_base_weights(folder)  # the same values stored twice: tied on both sides


def test_a_quantized_base_tensor_is_refused_from_the_header(folder):
    from atlas_lightning.config import ConfigError
    from atlas_lightning.planning.model_folder import check_model_folder

    _weights(folder, lambda t: t.update({"model.norm.weight": t["model.norm.weight"].to(torch.float8_e4m3fn)}))
    with pytest.raises(ConfigError, match=r"model.norm.weight: F8_E4M3"):
        check_model_folder(folder)
