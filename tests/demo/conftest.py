"""Fixtures of the SFT warm-start tests: the tiny model's chat format and sample questions. The
warm-started model itself (``orchestrator_dir``) is built beside the other tests by
``tests/orchestrator_build.py``; its fixture and hooks are in ``tests/conftest.py``.
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def chat(tiny_tokenizer):
    from atlas_lightning.rollout.chat import ChatFormat

    return ChatFormat(tiny_tokenizer)


@pytest.fixture(scope="session")
def train_questions():
    from atlas_lightning.demo.tiny_orchestrator import sample_questions

    return sample_questions("train")
