"""The machine's credentials checked at a run's start (``run/environment.check_machine``), before
anything is written: a W&B key W&B refuses by its form, a Hub token the Hub refuses or that can only
read, an endpoint that is no Hub: exit 2, one line naming the setting, no traceback, no secret, the
run's root never made. A Hub that cannot be reached is a warning: training goes on."""

from __future__ import annotations

import pytest

from atlas_lightning.cli import main
from atlas_lightning.config import compose
from atlas_lightning.loggers.wandb_logger import refused_wandb_key
from atlas_lightning.run.environment import check_hub_answers
from tests.conftest import write_fake_model_folder
from tests.fixed_answer import answering, closed_port_url

HUB_TOKEN = "hf_testTOKENforTheStartCheck0123456"


def _fit(tmp_path, capsys, *overrides):
    root = tmp_path / "root"
    code = main(["fit", "experiment=tiny-cpu", f"paths.root={root}",
                 f"model.path={write_fake_model_folder(tmp_path / 'model')}", *overrides])
    err = capsys.readouterr().err
    assert "Traceback" not in err and not root.exists(), err  # refused before anything is written
    lines = err.strip().splitlines()
    assert len(lines) == 1 and len(lines[0]) < 300, err
    return code, lines[0]


@pytest.fixture
def make_hub(tmp_path):
    """Fake Hubs (``tests/hub/fake_hub.py``) with the given settings, stopped after the test."""
    from tests.hub.fake_hub import FakeHub

    servers = []

    def start(**kwargs):
        servers.append(FakeHub(tmp_path / f"hub-{len(servers)}", **kwargs))
        servers[-1].start()
        return servers[-1]

    yield start
    for server in servers:
        server.stop()


@pytest.fixture
def hub_token(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_TOKEN", HUB_TOKEN)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return HUB_TOKEN


@pytest.mark.parametrize("mode", ["online", "auto"])
def test_a_wandb_key_of_a_form_wandb_refuses_is_refused_at_the_start(mode, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "bogus")
    monkeypatch.delenv("WANDB_MODE", raising=False)  # auto: online, as a key is there
    code, line = _fit(tmp_path, capsys, f"logger.mode={mode}")
    assert code == 2 and f"logger.mode={mode} logs online, but W&B refuses the key in WANDB_API_KEY: API key " \
                          f"must have 40+ characters, has 5." in line
    assert "logger.mode=offline" in line and "bogus" not in line


def test_wandbs_own_rule_names_where_the_key_is(tmp_path):
    assert refused_wandb_key({"WANDB_API_KEY": "k" * 40}) is None
    assert refused_wandb_key({"WANDB_API_KEY": "bad key with spaces" + "k" * 40}) == \
        "WANDB_API_KEY: API key may only contain the letters A-Z, digits and underscores."
    netrc = tmp_path / ".netrc"
    netrc.write_text("machine api.wandb.ai\n  login user\n  password short\n")
    netrc.chmod(0o600)
    assert refused_wandb_key({"HOME": str(tmp_path)}) == \
        f"{netrc} (wandb login): API key must have 40+ characters, has 5."
    assert refused_wandb_key({"HOME": str(tmp_path / "nobody")}) is None  # no key: another check's refusal


def test_a_hub_token_the_hub_refuses_is_refused_at_the_start(make_hub, hub_token, tmp_path, capsys):
    hub = make_hub(token="hf_theHubWantsAnotherToken000000000")
    code, line = _fit(tmp_path, capsys, "hub.publish_checkpoints=true", "hub.repo_id=a/b",
                      f"hub.endpoint={hub.endpoint}")
    assert code == 2 and line.startswith("atlas-lightning fit: hub.publish_checkpoints=true: checking the token at "
                                         f"{hub.endpoint}: the Hub refused the credentials (401 Unauthorized"), line
    assert "HF_TOKEN" in line and hub_token not in line
    assert hub.requests == [("GET", "/api/whoami-v2")]


def test_a_read_token_and_an_endpoint_that_is_no_hub_are_refused_at_the_start(make_hub, hub_token, tmp_path, capsys):
    reader = make_hub(token=hub_token, token_role="read")
    code, line = _fit(tmp_path, capsys, "hub.publish_checkpoints=true", "hub.repo_id=a/b",
                      f"hub.endpoint={reader.endpoint}")
    assert code == 2 and "a read token, with which no upload can succeed" in line, line
    with answering(200, b"<!doctype html><title>intranet</title>", "text/html") as page:
        code, line = _fit(tmp_path, capsys, "hub.publish_checkpoints=true", "hub.repo_id=a/b", f"hub.endpoint={page}")
    assert code == 2 and f"hub.endpoint={page} did not answer as a Hugging Face Hub" in line, line


def test_a_hub_that_cannot_be_reached_at_the_start_is_a_warning(hub_token, capsys):
    endpoint = closed_port_url()
    cfg = compose(["hub.publish_checkpoints=true", "hub.repo_id=a/b", f"hub.endpoint={endpoint}"])
    notes = check_hub_answers(cfg)
    err = capsys.readouterr().err
    assert len(notes) == 1 and f"checking the token at {endpoint} failed after 1 attempt" in notes[0]
    assert "training goes on" in notes[0]
    assert err == f"atlas-lightning: warning: {notes[0]}\n"


def test_an_accepted_token_is_a_note(make_hub, hub_token):
    hub = make_hub(token=hub_token)
    cfg = compose(["hub.publish_checkpoints=true", "hub.repo_id=a/b", f"hub.endpoint={hub.endpoint}"])
    assert check_hub_answers(cfg) == [f"Hub token accepted by dataset repo a/b at {hub.endpoint} (account fake-user)"]
