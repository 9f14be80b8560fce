"""W&B's start (``wandb.init``, at the trainer's set-up) failing online, with W&B's real service: a
server that refuses is a ``ConfigError`` naming ``logger.mode`` (exit 2, one line); ``auto`` takes
a server it cannot reach as a reason to log offline, with the same run id, and says so; a run that
failed there leaves no run export."""

from __future__ import annotations

import json

import pytest

from atlas_lightning.config import ConfigError, compose
from atlas_lightning.loggers.run_export import RunExportLogger
from atlas_lightning.loggers.wandb_logger import _start_refusal, build_loggers
from tests.fixed_answer import answering, closed_port_url

KEY = "k" * 40  # of a form W&B takes: the server is what refuses it


@pytest.fixture
def wandb_env(monkeypatch, tmp_path):
    """A W&B key, nothing of the user's W&B settings, a short ``init_timeout`` (what a server that
    cannot be reached costs); W&B's service (a process of its own, holding the settings it started
    with) stopped before and after."""
    import wandb

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("WANDB_API_KEY", KEY)
    monkeypatch.setenv("WANDB_INIT_TIMEOUT", "1")
    for name in ("WANDB_MODE", "WANDB_DIR", "WANDB_RUN_ID", "WANDB_ENTITY", "WANDB_PROJECT"):
        monkeypatch.delenv(name, raising=False)
    wandb.teardown()
    yield monkeypatch
    wandb.teardown()


def test_a_server_that_refuses_is_one_line_naming_logger_mode(wandb_env, tmp_path):
    with answering(401, json.dumps({"errors": [{"message": "user is not logged in"}]}).encode()) as server:
        wandb_env.setenv("WANDB_BASE_URL", server)
        wandb_env.setenv("WANDB_INIT_TIMEOUT", "60")  # the refusal comes at once; a loaded machine is slow
        wandb_logger, export = build_loggers(compose([f"paths.root={tmp_path}", "name=r", "logger.mode=online"]))
        with pytest.raises(ConfigError) as refused:
            wandb_logger.experiment
    line = str(refused.value)
    assert line.startswith(f"logger.mode=online: W&B at {server} refused the run: ") and "\n" not in line, line
    assert "returned error 401" in line and line.endswith("check WANDB_API_KEY, logger.entity, logger.project, or use "
                                                          "logger.mode=offline")
    assert KEY not in line and len(line) < 260, line  # the CLI adds "atlas-lightning fit: config error: "
    export.finalize("failed")  # as Lightning does when the set-up failed
    assert not (tmp_path / "runs").exists()


def test_auto_logs_offline_when_wandb_cannot_be_reached(wandb_env, tmp_path, capsys):
    endpoint = closed_port_url()
    wandb_env.setenv("WANDB_BASE_URL", endpoint)
    wandb_logger, export = build_loggers(compose([f"paths.root={tmp_path}", "name=r", "logger.mode=auto"]))
    run = wandb_logger.experiment
    try:
        assert run.id == export.version and run.settings.mode == "offline"
        run.log({"x": 1.0}, step=1)
    finally:
        run.finish()
    assert list((tmp_path / "wandb").glob(f"offline-run-*-{export.version}"))
    warning = [line for line in capsys.readouterr().err.splitlines() if line.startswith("atlas-lightning: warning:")]
    assert len(warning) == 1 and f"logger.mode=auto: W&B at {endpoint} could not be reached" in warning[0]
    assert "logging offline; `wandb sync" in warning[0] and KEY not in warning[0]


def test_each_failure_names_what_to_do():
    from wandb.errors import AuthenticationError, CommError, UsageError

    unreachable = CommError('Timed out while retrying: Post "http://h/graphql": dial tcp: no such host\n'
                            "Consider increasing the init_timeout setting:\n  wandb.init(settings=...)")
    line = _start_refusal("online", "online", unreachable, unreachable=True)
    assert "could not be reached: Timed out while retrying: Post" in line and "wandb.init(" not in line
    assert line.endswith("check the network and WANDB_BASE_URL, or use logger.mode=offline")
    assert "refused the key: API key invalid; check WANDB_API_KEY" in _start_refusal(
        "auto", "online", AuthenticationError("API key invalid"), unreachable=False)
    assert "refused the run: CommError; check" in _start_refusal("online", "online", CommError("<no message>"), False)
    assert _start_refusal("offline", "offline", UsageError("bad dir"), unreachable=False) == \
        "logger.mode=offline: W&B could not start offline: bad dir; logger.mode=disabled runs without W&B"


def test_the_export_of_a_run_that_started_is_kept_when_it_fails(tmp_path):
    export = RunExportLogger(tmp_path, "id1", {"a": 1})
    export.save()  # Lightning's, as fit starts
    export.finalize("failed")
    assert json.loads((tmp_path / "id1" / "config.json").read_text()) == {"a": 1}
