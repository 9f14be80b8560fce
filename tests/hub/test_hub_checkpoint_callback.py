"""``HubCheckpointCallback``: a saved step's adapters and val_dumps reach the repo; failures never
stop training and are tried again."""

from __future__ import annotations

import logging
import os
from types import SimpleNamespace

import pytest
from lightning.pytorch import Trainer

from atlas_lightning.callbacks.hub import HubCheckpointCallback, step_files
from atlas_lightning.config import ConfigError, compose
from atlas_lightning.store.checkpoints import checkpoint_step

REPO = "atlas/r-test-ckpt"


def _step_dir(root, step):
    step_dir = root / "checkpoints" / "r-test" / f"global_step_{step}"
    files = {
        "actor/lora_adapter/adapter_config.json": b'{"r": 8}',
        "actor/lora_adapter/adapter_model.safetensors": os.urandom(6000),
        "critic/lora_adapter/adapter_config.json": b'{"r": 8}',
        "critic/lora_adapter/adapter_model.safetensors": os.urandom(5000),
        f"val_dumps/{step}.jsonl": b'{"score": 1.0}\n',
        "trainer_state/optimizer.distcp": os.urandom(100),  # not this callback's to send
        "actor/optimizer.pt": os.urandom(100),
    }
    for rel, data in files.items():
        (step_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        (step_dir / rel).write_bytes(data)
    return step_dir


def _expected(step_dir):
    prefix = f"checkpoints/r-test/{step_dir.name}"
    parts = ("actor/lora_adapter/adapter_config.json", "actor/lora_adapter/adapter_model.safetensors",
             "critic/lora_adapter/adapter_config.json", "critic/lora_adapter/adapter_model.safetensors",
             f"val_dumps/{checkpoint_step(step_dir)}.jsonl")
    return {f"{prefix}/{part}": (step_dir / part).read_bytes() for part in parts}


@pytest.fixture
def trainer():
    return Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False)


def test_a_saved_step_is_uploaded_to_the_same_paths(hub, hf_env, tmp_path, trainer):
    step_dir = _step_dir(tmp_path, 5)
    callback = HubCheckpointCallback(REPO, endpoint=hub.endpoint, background=False, backoff_s=0.01)
    callback.on_checkpoint_saved(trainer, step_dir, 5)
    assert hub.files(REPO) == _expected(step_dir)
    assert callback.state_dict() == {"uploaded_steps": [5], "pending": {}}
    assert hub.is_lfs(REPO, "checkpoints/r-test/global_step_5/actor/lora_adapter/adapter_model.safetensors")


def test_background_uploads_finish_by_fit_end(hub, hf_env, tmp_path, trainer):
    callback = HubCheckpointCallback(REPO, endpoint=hub.endpoint, backoff_s=0.01)
    dirs = [_step_dir(tmp_path, step) for step in (5, 10)]
    for step, step_dir in zip((5, 10), dirs):
        callback.on_checkpoint_saved(trainer, step_dir, step)
    callback.on_fit_end(trainer, None)
    assert hub.files(REPO) == {**_expected(dirs[0]), **_expected(dirs[1])}
    assert callback.uploaded_steps == [5, 10]


def test_a_failed_step_is_tried_again_after_the_next_checkpoint(hub, hf_env, tmp_path, trainer, caplog):
    callback = HubCheckpointCallback(REPO, endpoint=hub.endpoint, retries=1, backoff_s=0.01, background=False)
    first, second = _step_dir(tmp_path, 5), _step_dir(tmp_path, 10)
    hub.fail_next(2, 503, path_contains="/commit/")
    with caplog.at_level(logging.WARNING):
        callback.on_checkpoint_saved(trainer, first, 5)  # must not raise
    assert "global_step_5" in caplog.text and REPO in caplog.text
    assert callback.pending == {5: str(first)} and callback.uploaded_steps == []
    callback.on_checkpoint_saved(trainer, second, 10)
    assert hub.files(REPO) == {**_expected(first), **_expected(second)}
    assert callback.state_dict() == {"uploaded_steps": [5, 10], "pending": {}}


def test_a_permanent_error_turns_uploads_off_without_the_token(make_hub, hf_env, tmp_path, trainer, caplog):
    refusing = make_hub(token="hf_someoneElsesToken0000000000", echo_auth_in_errors=True)
    callback = HubCheckpointCallback(REPO, endpoint=refusing.endpoint, backoff_s=0.01, background=False)
    with caplog.at_level(logging.DEBUG):
        callback.on_checkpoint_saved(trainer, _step_dir(tmp_path, 5), 5)
    assert callback.disabled_reason and REPO in callback.disabled_reason
    assert "turned off" in caplog.text and hf_env not in caplog.text and hf_env not in callback.disabled_reason
    seen = len(refusing.requests)
    callback.on_checkpoint_saved(trainer, _step_dir(tmp_path, 10), 10)
    assert len(refusing.requests) == seen, "a disabled callback must not call the Hub again"


def test_failed_uploads_are_said_on_the_console_and_in_the_closing_line(hub, hf_env, tmp_path, trainer, capsys):
    """Not only in the run's log: each failure is a console line when it happens (from the upload
    thread), and the end of fit says what was not sent, why, and how to send it."""
    callback = HubCheckpointCallback(REPO, endpoint=hub.endpoint, retries=0, backoff_s=0.01)
    hub.fail_next(4, 503, path_contains="/commit/")  # step 5, then at step 10 it and step 10, and 5 at the end
    callback.on_checkpoint_saved(trainer, _step_dir(tmp_path, 5), 5)
    callback.wait()
    warned = _warnings(capsys)
    assert len(warned) == 1, warned
    assert warned[0].startswith("atlas-lightning: warning: Hub upload of global_step_5 failed; it will be tried "
                                "again after the next checkpoint: uploading "), warned
    assert "503 Service Unavailable" in warned[0] and hf_env not in warned[0]
    callback.on_checkpoint_saved(trainer, _step_dir(tmp_path, 10), 10)
    callback.wait()
    assert len(_warnings(capsys)) == 2  # step 5 again, step 10
    callback.on_fit_end(trainer, None)
    at_end = _warnings(capsys)
    assert len(at_end) == 1  # 10 went at the end, 5 did not: the closing line says so, once
    closing = at_end[-1]
    assert closing.startswith("atlas-lightning: warning: Hub checkpoint uploads: global_step_5 not sent "
                              "(uploading ")
    assert closing.endswith("`atlas-lightning publish --weights` sends the checkpoints later")
    assert callback.uploaded_steps == [10]


def test_uploads_turned_off_are_said_in_the_closing_line(make_hub, hf_env, tmp_path, trainer, capsys):
    refusing = make_hub(token="hf_someoneElsesToken0000000000")
    callback = HubCheckpointCallback(REPO, endpoint=refusing.endpoint, backoff_s=0.01, background=False)
    callback.on_checkpoint_saved(trainer, _step_dir(tmp_path, 5), 5)
    callback.on_fit_end(trainer, None)
    lines = _warnings(capsys)
    assert len(lines) == 2 and lines[0].startswith("atlas-lightning: warning: Hub uploads turned off for the rest of "
                                                   "this run (global_step_5): creating ")
    assert lines[-1].startswith("atlas-lightning: warning: Hub checkpoint uploads were turned off (steps sent: 0): "
                                "creating dataset repo")
    assert "refused the credentials (401 Unauthorized" in lines[-1] and hf_env not in "".join(lines)


def test_a_run_whose_uploads_all_went_says_nothing_more(hub, hf_env, tmp_path, trainer, capsys):
    callback = HubCheckpointCallback(REPO, endpoint=hub.endpoint, background=False)
    callback.on_checkpoint_saved(trainer, _step_dir(tmp_path, 5), 5)
    callback.on_fit_end(trainer, None)
    assert _warnings(capsys) == [] and callback.closing_line() is None


def _warnings(capsys) -> list[str]:
    """The callback's console lines (among the library's progress bars of the transfer)."""
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("atlas-lightning: warning: ")]


def test_every_n_steps_and_other_ranks_send_nothing(hub, hf_env, tmp_path):
    callback = HubCheckpointCallback(REPO, endpoint=hub.endpoint, every_n_steps=10, background=False)
    callback.on_checkpoint_saved(SimpleNamespace(is_global_zero=True), _step_dir(tmp_path, 5), 5)
    callback.on_checkpoint_saved(SimpleNamespace(is_global_zero=False), _step_dir(tmp_path, 10), 10)
    assert hub.requests == []
    callback.on_checkpoint_saved(SimpleNamespace(is_global_zero=True), tmp_path / "checkpoints/r-test/global_step_10", 10)
    assert set(hub.files(REPO)) == set(_expected(tmp_path / "checkpoints/r-test/global_step_10"))


def test_state_round_trips_and_bad_arguments_are_refused(tmp_path):
    callback = HubCheckpointCallback(REPO)
    callback.load_state_dict({"uploaded_steps": [5], "pending": {"10": "/x/global_step_10"}})
    assert callback.state_dict() == {"uploaded_steps": [5], "pending": {10: "/x/global_step_10"}}
    with pytest.raises(ValueError, match="every_n_steps=0"):
        HubCheckpointCallback(REPO, every_n_steps=0)
    with pytest.raises(ValueError, match="repo_id"):
        HubCheckpointCallback("")
    for retries in (-1, 1.5, True, "3"):
        with pytest.raises(ValueError, match=r"HubCheckpointCallback: retries=.* must be an int >= 0"):
            HubCheckpointCallback(REPO, retries=retries)
    for backoff_s in (-0.5, float("nan"), float("inf"), "2", None):
        with pytest.raises(ValueError, match=r"HubCheckpointCallback: backoff_s=.* must be a finite number"):
            HubCheckpointCallback(REPO, backoff_s=backoff_s, enabled=False)
    assert HubCheckpointCallback(REPO, retries=0, backoff_s=0).backoff_s == 0
    with pytest.raises(ValueError, match="repo_id='bad id'"):
        HubCheckpointCallback("bad id")
    assert step_files(tmp_path / "checkpoints" / "r-test" / "global_step_1") == []


def test_the_callback_from_config():
    from atlas_lightning.run.wiring import build_callbacks

    def hub_callback(cfg):
        return next(c for c in build_callbacks(cfg) if isinstance(c, HubCheckpointCallback))

    assert not hub_callback(compose([])).enabled
    with pytest.raises(ConfigError, match="hub.repo_id"):
        compose(["hub.publish_checkpoints=true"])
    callback = hub_callback(compose(["hub.publish_checkpoints=true", f"hub.repo_id={REPO}",
                                     "hub.endpoint=http://localhost:9", "hub.private=false"]))
    assert callback.enabled
    assert (callback.repo_id, callback.endpoint, callback.private) == (REPO, "http://localhost:9", False)
