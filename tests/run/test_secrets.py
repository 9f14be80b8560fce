"""No credential a user passes reaches a file the run writes: distinctive fake secrets are planted
in every place a user could pass one (the environment W&B and the Hub read, the logins ``hf auth
login`` and ``wandb login`` save, a URL with a password, a scorer's and a callback's own keys and
headers, another service's key in the environment), then a real fit (W&B offline, the run export,
logs, records, checkpoints, the Hub checkpoint uploads failing against an endpoint with a password)
and a publish to a local fake Hub run, and every byte written is searched."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SECRETS = {
    "HF_TOKEN": "hf_PLANTEDhfTOKEN0a1b2c3d4e5f6a7b8c9d0",
    "HUGGING_FACE_HUB_TOKEN": "hf_PLANTEDlegacyHUBtoken9f8e7d6c5b4a",
    "WANDB_API_KEY": "PLANTEDwandbKEY0123456789abcdef01234567",
}
#: Read by no library here, but a credential by its name: masked wherever it would be written.
OTHER_SERVICE = {"OPENAI_API_KEY": "PLANTEDotherSERVICEkey31337"}
#: The logins ``hf auth login`` and ``wandb login`` save under $HOME.
SAVED_HF_LOGIN = "hf_PLANTEDsavedLOGINtoken0123456789abcd"
SAVED_WANDB_LOGIN = "PLANTEDwandbNETRCkey0123456789abcdef0123"
URL_PASSWORD = "PLANTEDurlPASSWORD4242"
HUB_URL_PASSWORD = "PLANTEDhubENDPOINTpass5150"
SCORER_KEY = "PLANTEDscorerAPIkey777"
#: A scorer's own settings whose names are no credential word's ending: a header, a bare ``key``.
SCORER_HEADER = "PLANTEDbearerHEADER8080"
SCORER_PLAIN_KEY = "PLANTEDplainKEY9090"
CALLBACK_SECRET = "PLANTEDcallbackAUTH6060"
PLUGIN = '''
from lightning.pytorch import Callback

from atlas_lightning.reward import CostReward


class KeyedReward(CostReward):
    """The package's reward, built with an API key a user's scorer might need."""

    def __init__(self, cost_per_usd, no_submit_reward=0.0, api_key=None, headers=None, key=None, endpoint=None):
        super().__init__(cost_per_usd, no_submit_reward)
        assert api_key and key and headers["Authorization"].startswith("Bearer "), "the keys reach the scorer"


class KeyedCallback(Callback):
    """A user's callback built with a credential in an argument of its own."""

    def __init__(self, auth_header=None):
        assert auth_header, "the key reaches the callback"
'''


def _every_file(root: Path):
    for path in root.rglob("*"):
        if path.is_file() and not path.is_symlink():
            yield path


PLANTED = [*SECRETS.values(), *OTHER_SERVICE.values(), SAVED_HF_LOGIN, SAVED_WANDB_LOGIN, URL_PASSWORD,
           HUB_URL_PASSWORD, SCORER_KEY, SCORER_HEADER, SCORER_PLAIN_KEY, CALLBACK_SECRET]


def _home(tmp_path: Path) -> Path:
    """A $HOME holding the logins ``hf auth login`` and ``wandb login`` save."""
    home = tmp_path / "home"
    (home / ".cache" / "huggingface").mkdir(parents=True)
    (home / ".cache" / "huggingface" / "token").write_text(SAVED_HF_LOGIN)
    (home / ".netrc").write_text(f"machine api.wandb.ai\n  login user\n  password {SAVED_WANDB_LOGIN}\n")
    (home / ".netrc").chmod(0o600)
    return home


def _leaks(root: Path) -> list[str]:
    planted = PLANTED
    found = []
    for path in _every_file(root):
        data = path.read_bytes()
        found += [f"{path.relative_to(root)}: {secret}" for secret in planted if secret.encode() in data]
    return found


@pytest.mark.slow
def test_no_planted_secret_reaches_any_file_a_fit_or_a_publish_writes(tiny_model_dir, sample_data_dir, tmp_path):
    plugin = tmp_path / "plugin"
    plugin.mkdir()
    (plugin / "keyed_reward_plugin.py").write_text(PLUGIN)
    root = tmp_path / "root"
    env = dict(os.environ, **SECRETS, **OTHER_SERVICE, HOME=str(_home(tmp_path)),
               PYTHONPATH=os.pathsep.join([str(plugin), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="2", WANDB_MODE="offline")
    env.pop("HF_HOME", None)  # the saved login under $HOME is the Hub's
    env.pop("HF_HUB_OFFLINE", None)
    fit = [sys.executable, "-m", "atlas_lightning.cli", "fit", "experiment=tiny-cpu", f"model.path={tiny_model_dir}",
           f"data.root={sample_data_dir}", f"paths.root={root}", "name=secrets", "rollout.engine=hf", "rollout.n=2",
           "algorithm.train_batch_size=2", "algorithm.ppo_mini_batch_size=1", "rollout.max_tokens_per_turn=16",
           "rollout.max_turns=2", "trainer.total_steps=1", "trainer.save_every=1", "trainer.val_before_train=false",
           "callbacks.validation.val_on_last_step=false", "logger.mode=offline",
           "reward._target_=keyed_reward_plugin.KeyedReward", f"+reward.api_key={SCORER_KEY}",
           f"+reward.headers={{Authorization:'Bearer {SCORER_HEADER}'}}", f"+reward.key={SCORER_PLAIN_KEY}",
           "+callbacks.mine._target_=keyed_reward_plugin.KeyedCallback",
           f"+callbacks.mine.auth_header={CALLBACK_SECRET}", f"+reward.endpoint=https://bob:{URL_PASSWORD}@h/x",
           # checkpoint uploads to an endpoint with a password, refused: the client's log lines name it
           "hub.publish_checkpoints=true", "hub.repo_id=someone/secrets", "+callbacks.hub.retries=1",
           "+callbacks.hub.backoff_s=0", f"hub.endpoint=http://user:{HUB_URL_PASSWORD}@127.0.0.1:9"]
    result = subprocess.run(fit, capture_output=True, text=True, timeout=900, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    assert (root / "outputs" / "secrets" / "config.yaml").is_file() and any((root / "wandb").rglob("*.wandb"))
    leaks = _leaks(root)
    assert not leaks, "\n".join(leaks)
    assert not any(secret in result.stdout + result.stderr for secret in PLANTED)
    assert "***" in (root / "outputs" / "secrets" / "config.yaml").read_text()  # redacted, not dropped
    config = json.loads(next((root / "runs" / "secrets").glob("*/config.json")).read_text())
    assert config["reward"]["api_key"] == config["reward"]["key"] == "***"
    assert config["reward"]["headers"]["Authorization"] == "***"
    assert "Hub upload of global_step_1 failed" in (root / "outputs" / "secrets" / "main_ppo.log").read_text()

    # publish, with weights, to a local Hub that takes only the planted HF_TOKEN
    with _fake_hub().FakeHub(tmp_path / "hub-storage", token=SECRETS["HF_TOKEN"]) as hub:
        publish = [sys.executable, "-m", "atlas_lightning.cli", "publish", "--weights", f"paths.root={root}",
                   "name=secrets", "hub.repo_id=someone/secrets", f"hub.endpoint={hub.endpoint}"]
        result = subprocess.run(publish, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
        assert result.returncode == 0, result.stderr[-4000:]
        assert "README.md" in hub.files("someone/secrets")
    leaks = _leaks(root) + _leaks(tmp_path / "hub-storage")
    assert not leaks, "\n".join(leaks)
    assert not any(secret in result.stdout + result.stderr for secret in SECRETS.values())


@pytest.mark.parametrize("text, environ, shown", [
    ("https://user:pw0rd@host/x", {}, "https://user:***@host/x"),
    ("header Authorization: Bearer abc.def-ghi", {}, "header Authorization: Bearer ***"),
    ("a token hf_abcdefghijklmnopqrstuvwxyz0123 there", {}, "a token *** there"),
    ("the key otherServiceKey77 in a message", {"OPENAI_API_KEY": "otherServiceKey77"}, "the key *** in a message"),
    ("the key otherServiceKey77 in a message", {"SOME_PATH": "otherServiceKey77"}, "the key otherServiceKey77 in a message"),
    ("step 3 reward 0.5 tokens 4096", {"HF_TOKEN": "x"}, "step 3 reward 0.5 tokens 4096"),
])
def test_credentials_in_any_text_are_masked_by_their_form_or_the_environment(text, environ, shown):
    from atlas_lightning.config import redacted_text

    assert redacted_text(text, environ) == shown


@pytest.mark.parametrize("key, credential", [
    ("reward.api_key", True), ("hf_token", True), ("Authorization", True), ("auth_header", True), ("apiKey", True),
    ("reward.key", True), ("client_secret_path", True), ("cookie", True), ("password", True),
    ("algorithm.ppo_max_token_len_per_gpu", False), ("rollout.max_tokens_per_turn", False), ("monkey", False),
    ("reward.cost_per_usd", False), ("logger.project", False), ("hub.endpoint", False),
])
def test_credential_keys_are_told_by_their_words(key, credential):
    from atlas_lightning.config import is_credential_key

    assert is_credential_key(key) is credential


def test_no_key_of_the_schema_reads_as_a_credential():
    from omegaconf import OmegaConf

    from atlas_lightning.config import RootConfig, is_credential_key

    def keys(node, prefix=""):
        for name, value in node.items():
            yield f"{prefix}{name}"
            if isinstance(value, dict):
                yield from keys(value, f"{prefix}{name}.")

    schema = OmegaConf.to_container(OmegaConf.structured(RootConfig))
    assert [key for key in keys(schema) if is_credential_key(key)] == []


def test_the_run_logs_mask_what_any_library_logs(cfg_of, monkeypatch, tmp_path):
    """A library's line (here the Hub client's, naming its endpoint) written to ``main_ppo.log``
    and the launch's log passes through the same masking as the written config."""
    import logging

    from atlas_lightning.run.wiring import RUN_LOG, prepare_run

    monkeypatch.setenv("OPENAI_API_KEY", "otherServiceKey77")
    names = ("atlas_lightning", "lightning", "lightning.pytorch")
    before = {name: list(logging.getLogger(name).handlers) for name in names}
    prepare_run(cfg_of(), "fit")
    try:
        logging.getLogger("atlas_lightning.hub.client").warning(
            "creating repo at http://user:hubPassw0rd@127.0.0.1:9 with otherServiceKey77 failed")
    finally:
        for name in names:
            for handler in [h for h in logging.getLogger(name).handlers if h not in before[name]]:
                logging.getLogger(name).removeHandler(handler)
                handler.close()
    for log_file in [tmp_path / "outputs" / "run" / RUN_LOG, *(tmp_path / "logs").glob("*.log")]:
        text = log_file.read_text()
        assert "creating repo at http://user:***@127.0.0.1:9 with *** failed" in text, text
        assert "hubPassw0rd" not in text and "otherServiceKey77" not in text


def test_a_refusal_that_quotes_a_value_masks_its_credential(tmp_path, capsys):
    """A launcher tees stderr into ``logs/``: the refusal line is masked as the run's files are."""
    from atlas_lightning.cli import main

    code = main(["fit", "experiment=tiny-cpu", f"paths.root={tmp_path / 'root'}",
                 "rollout.server_url=http://user:refusedPassw0rd@127.0.0.1:8000"])
    err = capsys.readouterr().err
    assert code == 2 and "rollout.server_url=http://user:***@127.0.0.1:8000: attaching" in err, err
    assert "refusedPassw0rd" not in err


def _fake_hub():
    """tests/hub/fake_hub.py (a local Hub that checks the token), loaded by path."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("atlas_tests_fake_hub_secrets",
                                                  Path(__file__).parents[1] / "hub" / "fake_hub.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
