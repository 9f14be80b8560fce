"""Fixtures for the Hub tests: a running fake Hub and a small data root shaped like a real run's."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

# fake_hub.py is a helper beside the tests; with --import-mode=importlib it is loaded by path.
_spec = importlib.util.spec_from_file_location("atlas_tests_fake_hub", Path(__file__).with_name("fake_hub.py"))
fake_hub = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = fake_hub
_spec.loader.exec_module(fake_hub)

TOKEN = "hf_testTOKENdoNotPrint0123456789"
RUN = "r-test"


def _record(uid: str, score: float) -> str:
    """A step record in the trainer's JSON layout, with its four per-token arrays."""
    from atlas_lightning.store.records import record_json_text

    return record_json_text({"uid": uid, "reward_score": score, "prompt_ids": [5, 6, 7], "response_ids": [8, 9, 2],
                             "response_mask": [1, 0, 1], "response_logprobs": [-0.25, 0.0, -1.5]})


def _manifest(files: dict) -> str:
    """``records.write_manifest``'s format over ``{name: bytes}``."""
    import hashlib

    entries = [{"path": n, "bytes": len(d), "sha256": hashlib.sha256(d).hexdigest()} for n, d in sorted(files.items())]
    return json.dumps({"file_version": 1, "counts": {"files": len(entries), "records": 1,
                                                      "bytes": sum(e["bytes"] for e in entries)},
                       "files": entries, "step": 1}, indent=1)


@pytest.fixture
def hub(tmp_path):
    """A fake Hub that requires ``TOKEN`` and makes every file from 4 KiB on (or binary) LFS."""
    with fake_hub.FakeHub(tmp_path / "hub-storage", token=TOKEN, lfs_threshold=4096) as server:
        yield server


@pytest.fixture
def hf_env(monkeypatch, tmp_path):
    """The token through HF_TOKEN, and a private HF cache (nothing of the user's is read)."""
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.delenv("HF_HUB_DISABLE_XET", raising=False)
    return TOKEN


def _npz_bytes() -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, values=np.arange(10, dtype=np.float32), values__offsets=np.array([0, 4, 10]))
    return buffer.getvalue()


def _write(root: Path, rel: str, data) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data if isinstance(data, bytes) else data.encode())


#: Files of the fake run that a publish without weights must send, relative to the root.
PUBLISHED = {
    f"artifacts/{RUN}/run.json": json.dumps({"config": {"name": RUN, "model": {"path": "/models/tiny"},
                                                        "logger": {"project": "p", "entity": None}},
                                             "code_revision": {"git_commit": "abc123", "git_dirty": False},
                                             "start_time": "2026-09-12T07:47:00Z",
                                             "hosts": {"world_size": 8, "hostnames": ["node-1"]},
                                             "packages": {"torch": "2.13.0", "vllm": "0.32.0"}}),
    f"artifacts/{RUN}/train/step_1/u1_s0.json": _record("u1", 0.9),
    f"artifacts/{RUN}/train/step_1/manifest.json": _manifest({"u1_s0.json": _record("u1", 0.9).encode(),
                                                              "tensors.npz": _npz_bytes()}),
    f"artifacts/{RUN}/train/step_2/u1_s0.json": json.dumps({"uid": "u1", "reward_score": 0.1}),
    f"artifacts/{RUN}/train/step_2/manifest.json": json.dumps({"files": {}}),
    f"artifacts/{RUN}/train_figures/reward.png": b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4,
    f"artifacts/{RUN}/val/step_2/big.json": json.dumps({"text": "x" * 6000}),  # text, but LFS by size
    f"checkpoints/{RUN}/global_step_2/val_dumps/2.jsonl": '{"input": "q", "output": "a", "score": 1.0}\n',
    f"checkpoints/{RUN}/global_step_2/meta.json": json.dumps({"step": 2}),
    f"outputs/{RUN}/config.yaml": "name: r-test\n",
    f"outputs/{RUN}/main_ppo.log": "step 1\nstep 2\n",
    "logs/launch-1.log": "launched\n",
    "wandb/offline-run-20260912_074700-abcd1234/run-abcd1234.wandb": b":W&B\xe1\xbe\x00" + b"\x00" * 64,
    "wandb/offline-run-20260912_074700-abcd1234/files/config.yaml": "a: 1\n",
    f"runs/{RUN}/abcd1234/history.csv": "_step,_runtime,_timestamp,gpqa/overall/acc\n0,0.1,1.8e9,0.25\n",
    f"runs/{RUN}/abcd1234/summary.json": json.dumps({"gpqa/overall/acc": 0.25, "_step": 0}),
    f"runs/{RUN}/abcd1234/config.json": json.dumps({"name": RUN, "model": {"path": "/models/tiny"},
                                                    "algorithm": {"ppo_epochs": 2}}),
}
#: Files only a publish with weights sends.
WEIGHTS = {
    f"artifacts/{RUN}/train/step_1/tensors.npz": _npz_bytes(),
    f"checkpoints/{RUN}/global_step_2/actor/lora_adapter/adapter_config.json": json.dumps({"r": 8}),
    f"checkpoints/{RUN}/global_step_2/actor/lora_adapter/adapter_model.safetensors": os.urandom(9000),
    f"checkpoints/{RUN}/global_step_2/critic/lora_adapter/adapter_config.json": json.dumps({"r": 8}),
    f"checkpoints/{RUN}/global_step_2/critic/lora_adapter/adapter_model.safetensors": os.urandom(5000),
    f"checkpoints/{RUN}/global_step_2/trainer_state/optimizer.distcp": os.urandom(3000),
    f"checkpoints/{RUN}/global_step_2/trainer_state/meta.json": "{}",
    f"checkpoints/{RUN}/global_step_2/extra.pt": os.urandom(100),
}
#: Files never sent: outside the published folders, hidden, half-written.
NEVER = {
    "scratch.txt": "not part of the data root contract\n",
    ".cache/x.bin": b"\x00",
    f"artifacts/{RUN}/.tmp-step_3-abcd/u1_s0.json": "{}",
    f"artifacts/{RUN}/train/step_2/.u2_s0.json.x1.tmp": "{",
}


@pytest.fixture
def fake_run(tmp_path):
    """A data root on disk: ``.root``, and the relative paths ``.published`` (sent without
    weights), ``.weights`` (sent only with weights), ``.never`` (never sent); ``.name`` the run."""
    root = tmp_path / "root"
    for rel, data in {**PUBLISHED, **WEIGHTS, **NEVER}.items():
        _write(root, rel, data)
    # W&B's own links: never followed, never sent.
    os.symlink(root / "wandb" / "offline-run-20260912_074700-abcd1234", root / "wandb" / "latest-run")
    os.symlink(root / "logs" / "launch-1.log", root / "wandb" / "debug.log")
    return SimpleNamespace(root=root, name=RUN, published=set(PUBLISHED), weights=set(WEIGHTS), never=set(NEVER))


@pytest.fixture
def make_hub(tmp_path):
    """Start extra fake Hubs with other settings: ``make_hub(echo_auth_in_errors=True)``."""
    servers = []

    def start(**kwargs):
        kwargs.setdefault("token", TOKEN)
        kwargs.setdefault("lfs_threshold", 4096)
        server = fake_hub.FakeHub(tmp_path / f"hub-storage-{len(servers)}", **kwargs)
        server.start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()
