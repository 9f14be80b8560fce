"""``build_loggers``: modes, ids, and a real offline W&B run written under ``<root>/wandb/``."""

from __future__ import annotations

import csv
import json
import struct
import time
import zlib

import pytest
from lightning.pytorch import Trainer

from atlas_lightning.loggers.run_export import RunExportLogger
from atlas_lightning.config import ConfigError, compose
from atlas_lightning.loggers.wandb_logger import RLStepWandbLogger, build_loggers, log_image, resolve_wandb_mode


@pytest.mark.parametrize(
    "mode, env, expected",
    [
        ("auto", {}, "offline"),
        ("auto", {"WANDB_API_KEY": "k"}, "online"),
        ("auto", {"WANDB_API_KEY": "k", "WANDB_MODE": "offline"}, "offline"),
        ("auto", {"WANDB_MODE": "dryrun"}, "offline"),
        ("auto", {"WANDB_MODE": "disabled"}, "disabled"),
        ("disabled", {"WANDB_API_KEY": "k"}, "disabled"),
        ("online", {}, "online"),
    ],
)
def test_mode_resolution(mode, env, expected):
    assert resolve_wandb_mode(mode, env) == expected


def test_unknown_mode_is_a_config_error():
    with pytest.raises(ConfigError, match="logger.mode='sometimes'"):
        resolve_wandb_mode("sometimes", {})


def test_disabled_wandb_leaves_only_the_export_with_an_offline_id(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_RUN_ID", raising=False)
    cfg = compose([f"paths.root={tmp_path}", "name=quiet", "logger.mode=disabled"])
    loggers = build_loggers(cfg)
    assert len(loggers) == 1 and isinstance(loggers[0], RunExportLogger)
    assert loggers[0].version.startswith("offline-")
    assert loggers[0].log_dir == tmp_path / "runs" / "quiet" / loggers[0].version
    assert not any(tmp_path.iterdir()), "building loggers must not write anything"


def _tiny_png(path):
    """A valid 1x1 PNG written by hand (no image library needed)."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    raw = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 1, 1, 8, 2, 0, 0, 0))
    raw += chunk(b"IDAT", zlib.compress(b"\x00\xff\x00\x00")) + chunk(b"IEND", b"")
    path.write_bytes(raw)
    return path


def _wandb_records(path):
    """Records of a ``.wandb`` file, parsed with W&B's own protobuf schema: the file is a
    LevelDB-style log (7-byte file header, 32 KiB blocks, chunks of crc32/length/type + data)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, block, payload, records = path.read_bytes(), 7, 32768, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if pos + 7 + length > len(data):  # a chunk W&B's service is still writing: read it next time
            break
        payload += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: a whole record
            record = pb.Record()
            record.ParseFromString(payload)
            payload = b""
            records.append(record)
    return records


def _wandb_history(path, timeout_s=20.0):
    """History rows of a finished run; W&B's service flushes the file after ``finish`` returns,
    so wait for its ``exit`` record."""
    deadline = time.monotonic() + timeout_s
    while True:
        records = _wandb_records(path)
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    return [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
            for r in records if r.WhichOneof("record_type") == "history"]


def test_offline_wandb_and_export_share_the_rl_step(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_RUN_ID", raising=False)
    monkeypatch.delenv("WANDB_DIR", raising=False)
    cfg = compose([f"paths.root={tmp_path}", "name=r-offline", "logger.mode=auto", "logger.tags=[a,b]"])
    loggers = build_loggers(cfg)
    wandb_logger, export = loggers
    assert isinstance(wandb_logger, RLStepWandbLogger) and isinstance(export, RunExportLogger)
    run_id = export.version
    assert wandb_logger.version == run_id and len(run_id) == 8

    trainer = Trainer(logger=loggers, accelerator="cpu", devices=1, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False)
    try:
        for logger in loggers:
            logger.log_metrics({"gpqa/overall/acc": 0.25}, step=0)
            logger.log_metrics({"actor/pg_loss": 0.5, "reward/mapping_sum_error_max": 0.0}, step=1)
            logger.log_metrics({"actor/pg_loss": 0.25, "reward/mapping_sum_error_max": 0.0}, step=5)
            logger.log_metrics({"gpqa/overall/acc": 0.75}, step=5)
        assert log_image(trainer, "train_figures/reward", _tiny_png(tmp_path / "f.png"), step=5) is True
        with pytest.raises(FileNotFoundError, match="missing.png"):
            log_image(trainer, "k", tmp_path / "missing.png", step=5)
        run_dir = wandb_logger.experiment.dir
    finally:
        wandb_logger.experiment.finish()

    # W&B's run folder sits under <root>/wandb/ and its summary is indexed by the RL step.
    runs = list((tmp_path / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(runs) == 1 and (runs[0] / f"run-{run_id}.wandb").is_file()
    assert str(run_dir).startswith(str(runs[0]))
    history = _wandb_history(runs[0] / f"run-{run_id}.wandb")
    assert [row["_step"] for row in history] == [0, 1, 5]
    assert history[0]["gpqa/overall/acc"] == 0.25 and history[1]["actor/pg_loss"] == 0.5
    assert history[2]["gpqa/overall/acc"] == 0.75 and history[2]["actor/pg_loss"] == 0.25
    assert history[2]["train_figures/reward/_type"] == "image-file"  # the PNG, at RL step 5
    assert all("trainer/global_step" not in row for row in history)

    folder = tmp_path / "runs" / "r-offline" / run_id
    with open(folder / "history.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [int(r["_step"]) for r in rows] == [0, 1, 5]
    assert [r["gpqa/overall/acc"] for r in rows] == ["0.25", "", "0.75"]
    assert json.loads((folder / "summary.json").read_text())["gpqa/overall/acc"] == 0.75
    assert json.loads((folder / "config.json").read_text())["name"] == "r-offline"
    assert json.loads((folder / "config.json").read_text())["logger"]["tags"] == ["a", "b"]


def test_log_image_without_wandb_is_a_no_op(tmp_path):
    cfg = compose([f"paths.root={tmp_path}", "name=x", "logger.mode=disabled"])
    trainer = Trainer(logger=build_loggers(cfg), accelerator="cpu", devices=1, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False)
    assert log_image(trainer, "k", tmp_path / "not-needed.png", step=1) is False


def test_auto_goes_online_after_wandb_login(tmp_path):
    from atlas_lightning.loggers.wandb_logger import wandb_credentials

    netrc = tmp_path / ".netrc"
    netrc.write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    netrc.chmod(0o600)
    env = {"HOME": str(tmp_path)}
    assert resolve_wandb_mode("auto", env) == "online" and wandb_credentials(env).endswith("(wandb login)")
    assert resolve_wandb_mode("auto", {"HOME": str(tmp_path), "WANDB_BASE_URL": "https://wandb.example.org"}) == "offline"
    assert resolve_wandb_mode("auto", {"HOME": str(tmp_path / "elsewhere")}) == "offline"
