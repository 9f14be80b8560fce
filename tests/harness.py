"""The callback tests' harness (``tests/callbacks/cb_harness.py``: scripted questions and turns,
the tiny tokenizer's chat) for tests outside that folder, loaded once as the module
``cb_harness``, the name the callback tests know it by (one module, one set of classes)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path


def callbacks_harness():
    if "cb_harness" not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            "cb_harness", Path(__file__).resolve().parent / "callbacks" / "cb_harness.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["cb_harness"] = module
        spec.loader.exec_module(module)
    return sys.modules["cb_harness"]
