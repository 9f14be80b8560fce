"""Fixtures of the callback tests: the harness module (``h``), the tiny tokenizer's ChatFormat."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_HARNESS = Path(__file__).with_name("cb_harness.py")


def _load_harness():
    name = "cb_harness"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, _HARNESS)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.fixture(scope="session")
def h():
    return _load_harness()


@pytest.fixture(scope="session")
def chat(h):
    return h.make_chat()
