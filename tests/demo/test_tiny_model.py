"""The tiny model folder: deterministic, loadable by transformers, ChatML + Hermes tool calls."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from atlas_lightning.env.tools import tool_schemas
from atlas_lightning.demo.tiny_model import MODEL_FILES, TINY_ARCHITECTURE, build_tiny_model
from atlas_lightning.demo.tiny_tokenizer import SPECIAL_TOKENS, TOOL_TOKENS, VOCAB_SIZE

TOOLS = tool_schemas("gpqa")


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer):
    return tiny_tokenizer


def test_same_seed_gives_identical_files_and_other_seed_differs(tiny_model_dir, tmp_path):
    summary = build_tiny_model(tmp_path / "again", seed=0)
    assert sorted(p.name for p in tiny_model_dir.iterdir()) == sorted(MODEL_FILES)
    for name in MODEL_FILES:
        assert (tmp_path / "again" / name).read_bytes() == (tiny_model_dir / name).read_bytes(), name
    assert summary["vocab_size"] == VOCAB_SIZE and set(summary["files"]) == set(MODEL_FILES)
    build_tiny_model(tmp_path / "other", seed=1)
    for name in ("model.safetensors", "tokenizer.json"):
        assert (tmp_path / "other" / name).read_bytes() != (tiny_model_dir / name).read_bytes(), name
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # staging folders removed


def test_config_is_the_documented_architecture(tiny_model_dir, tokenizer):
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    assert {k: config[k] for k in TINY_ARCHITECTURE} == TINY_ARCHITECTURE
    assert config["head_dim"] in (32, 64, 80, 96, 112, 128)  # vLLM's CPU attention sizes
    assert config["vocab_size"] == len(tokenizer) == VOCAB_SIZE
    assert config["eos_token_id"] == tokenizer.convert_tokens_to_ids("<|im_end|>") == tokenizer.eos_token_id
    assert config["pad_token_id"] == tokenizer.convert_tokens_to_ids("<|endoftext|>") == tokenizer.pad_token_id
    assert tokenizer.bos_token is None
    generation = json.loads((tiny_model_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [config["eos_token_id"], config["pad_token_id"]]


def test_parameter_count_matches_the_architecture(tiny_model_dir):
    a, vocab = TINY_ARCHITECTURE, VOCAB_SIZE
    hidden, heads, kv, dim = a["hidden_size"], a["num_attention_heads"], a["num_key_value_heads"], a["head_dim"]
    per_layer = (
        2 * hidden * heads * dim  # q and o
        + 2 * hidden * kv * dim  # k and v
        + 2 * dim  # q_norm, k_norm
        + 3 * hidden * a["intermediate_size"]  # gate, up, down
        + 2 * hidden  # the two RMSNorms
    )
    expected = vocab * hidden + a["num_hidden_layers"] * per_layer + hidden  # tied lm_head, final norm
    state = load_file(tiny_model_dir / "model.safetensors")
    assert sum(t.numel() for t in state.values()) == expected
    assert "lm_head.weight" not in state and all(t.dtype == torch.float32 for t in state.values())


def test_chat_template_renders_hermes_tool_calls_as_qwen3(tokenizer):
    messages = [
        {"role": "system", "content": "You are the orchestrator."},
        {"role": "user", "content": "Which? A) 1 B) 2"},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "explore", "arguments": {}}}]},
        {"role": "tool", "content": "Candidate #1\nCost: $0.12"},
        {"role": "tool", "content": "Explore budget: 1/8 used, 7 remaining."},
    ]
    rendered = tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    expected = (
        "<|im_start|>system\nYou are the orchestrator.\n\n# Tools\n\nYou may call one or more functions to "
        "assist with the user query.\n\nYou are provided with function signatures within <tools></tools> "
        "XML tags:\n<tools>\n" + json.dumps(TOOLS[0]) + "\n" + json.dumps(TOOLS[1]) + "\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nWhich? A) 1 B) 2<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "explore", "arguments": {}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nCandidate #1\nCost: $0.12\n</tool_response>\n"
        "<tool_response>\nExplore budget: 1/8 used, 7 remaining.\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert rendered == expected
    ids = tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, return_dict=False)
    assert ids == tokenizer.encode(expected)

    plain = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert tokenizer.apply_chat_template(plain, tokenize=False) == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"
    assert tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=True, enable_thinking=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    answered = plain + [{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "submit", "arguments": '{"answer": "B"}'}}]}]
    assert tokenizer.apply_chat_template(answered, tokenize=False).endswith(
        '<|im_start|>assistant\n<think>\n\n</think>\n\n<tool_call>\n{"name": "submit", "arguments": {"answer": "B"}}\n</tool_call><|im_end|>\n'
    )


def test_template_also_loads_from_tokenizer_config_alone(tiny_model_dir, tokenizer, tmp_path):
    for name in MODEL_FILES:
        if name != "chat_template.jinja":
            shutil.copy(tiny_model_dir / name, tmp_path / name)
    older = AutoTokenizer.from_pretrained(tmp_path)
    messages = [{"role": "user", "content": "hi"}]
    assert older.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False) == (
        tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    )


def test_special_and_tool_tokens_are_single_ids(tokenizer):
    ids = {token: tokenizer.encode(token) for token in SPECIAL_TOKENS + TOOL_TOKENS}
    assert all(len(v) == 1 for v in ids.values()), ids
    assert len({v[0] for v in ids.values()}) == len(ids)
    for token in SPECIAL_TOKENS + TOOL_TOKENS:
        assert ids[token][0] in tokenizer.encode(f"x{token}y")  # also inside text
    text = '<|im_start|>assistant\n<tool_call>\n{"name": "explore", "arguments": {}}\n</tool_call><|im_end|>'
    # Decoding as vLLM does drops ChatML but keeps the tool tags the runtime parses.
    assert tokenizer.decode(tokenizer.encode(text), skip_special_tokens=True) == (
        'assistant\n<tool_call>\n{"name": "explore", "arguments": {}}\n</tool_call>'
    )


def test_runtime_strings_tokenize_compactly(tokenizer):
    assert len(tokenizer.encode('{"name": "explore", "arguments": {}}')) <= 10
    assert len(tokenizer.encode('{"name": "submit", "arguments": {"answer": "B"}}')) <= 16
    assert len(tokenizer.encode("Explore budget: 3/8 used, 5 remaining.")) <= 14


@pytest.mark.parametrize(
    "text",
    ["", " ", "héllo wörld", "你好，世界", "emoji 🤖🧪 e\u0301", "tabs\tand\r\nCRLF  ", "\x00\x01\x7f", "def f(x):\n    return x  # ok"],
)
def test_encode_decode_round_trips(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text)) == text


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=60))
def test_any_text_round_trips(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_byte_level_covers_every_byte(tokenizer):
    vocab = tokenizer.get_vocab()
    from tokenizers.pre_tokenizers import ByteLevel

    assert set(ByteLevel.alphabet()) <= set(vocab)  # all 256 byte symbols
    # A lone continuation byte is invalid UTF-8 a model may still generate: it decodes to U+FFFD.
    lone = tokenizer.convert_tokens_to_ids(tokenizer.convert_ids_to_tokens(tokenizer.encode("é"))[0][-1:])
    assert tokenizer.decode([lone]) == "\ufffd"


def test_model_loads_and_runs_a_forward(tiny_model_dir, tokenizer):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "2+2?"}], add_generation_prompt=True, return_dict=False)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
        generated = model.generate(torch.tensor([ids]), max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert logits.shape == (1, len(ids), VOCAB_SIZE) and torch.isfinite(logits).all()
    # Greedy decoding is the argmax of the forward's last logits.
    assert generated[0, len(ids)].item() == logits[0, -1].argmax().item()
    # A random model that merely echoed its last token would make engine-agreement tests vacuous.
    assert len(set(generated[0, len(ids):].tolist())) > 2
