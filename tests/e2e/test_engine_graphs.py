"""The engine-fault locator (``bench/engine_graphs.py``) on CPU: the engine ``fit`` builds, driven
through an order of calls, names each call before and after it runs and exits 0 when all
returned; an unknown order is refused by its arguments (exit 2). The card runs it on the hybrid
with CUDA graphs (``bench/card/engine_graphs.sh``); here the tiny model on the vLLM CPU engine."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.e2e]


def _run(*args: str, tmp_path) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="2")
    return subprocess.run([sys.executable, "-m", "atlas_lightning.bench.engine_graphs", *args],
                          capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)


def test_each_call_is_named_before_and_after_it_runs(tiny_model_dir, tmp_path):
    result = _run("--order", "probe-sleep", "--probe-tokens", "100", "--requests", "4", "--max-tokens", "8", "--",
                  "experiment=tiny-cpu", f"model.path={tiny_model_dir}", f"paths.root={tmp_path}", tmp_path=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line.split("] ", 1)[1] for line in result.stdout.splitlines() if line.startswith("[engine_graphs")]
    calls = [line.split(":")[0] for line in lines if line.endswith("start")]
    assert calls == ["probe", "sleep", "wake", "probe", "generate"]
    assert "probe: done in" in lines[2] and "99 log-probs, finite True" in lines[2]
    assert "32 tokens" in lines[-2] and lines[-1] == "order probe-sleep: every call returned"


def test_an_unknown_order_is_refused(tmp_path):
    result = _run("--order", "sideways", tmp_path=tmp_path)
    assert result.returncode == 2 and "invalid choice: 'sideways'" in result.stderr


def test_the_trainer_is_built_and_trained_while_the_engine_sleeps(tiny_model_dir, tmp_path):
    """``train-between``: what fit does between the engine's sleep and wake (the trainer's build
    on the card, a forward and backward), then the probe and a generation."""
    result = _run("--order", "train-between", "--probe-tokens", "50", "--requests", "2", "--max-tokens", "4", "--",
                  "experiment=tiny-cpu", f"model.path={tiny_model_dir}", f"paths.root={tmp_path}", tmp_path=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line.split("] ", 1)[1] for line in result.stdout.splitlines() if line.startswith("[engine_graphs")]
    assert [line.split(":")[0] for line in lines if line.endswith("start")] == \
        ["sleep", "build", "train", "wake", "probe", "generate"]
    trained = next(line for line in lines if line.startswith("train: done"))
    assert float(trained.rsplit("loss ", 1)[1]) > 0  # a mean negative log-prob: positive and finite
    assert lines[-1] == "order train-between: every call returned"
