"""Fixtures of the scale tests: base-model folders holding only a ``config.json`` (the planner
never loads weights), shaped like the report's models."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

# device_memory_check.py (the H200 script) is imported by the test that replays its cases
sys.path.insert(0, str(Path(__file__).resolve().parent))

DENSE_8B = dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=151936, hidden_size=4096,
                intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                head_dim=128, tie_word_embeddings=False)
QWEN3_6_27B_TEXT = dict(model_type="qwen3_5_text", vocab_size=248320, hidden_size=5120, intermediate_size=17408,
                        num_hidden_layers=64, num_attention_heads=24, num_key_value_heads=4, head_dim=256,
                        linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
                        linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=4,
                        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(64)])
#: Qwen3.6-27B's checkpoint config: the VLM wrapper with the text model under text_config.
QWEN3_6_27B = dict(model_type="qwen3_5", architectures=["Qwen3_5ForConditionalGeneration"],
                   text_config=QWEN3_6_27B_TEXT, tie_word_embeddings=False)


@pytest.fixture(scope="session")
def qwen27b_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3_6_27b")
    (folder / "config.json").write_text(json.dumps(QWEN3_6_27B))
    return folder


@pytest.fixture(scope="session")
def dense8b_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dense8b")
    (folder / "config.json").write_text(json.dumps(DENSE_8B))
    return folder
