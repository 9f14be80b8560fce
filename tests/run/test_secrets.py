"""No credential a user passes reaches a file the run writes: distinctive fake secrets are planted
in every place a user could pass one (the environment W&B and the Hub read, a URL with a password,
a scorer's own key), then a real fit (W&B offline, the run export, logs, records, checkpoints) and
a publish to a local fake Hub run, and every byte written is searched."""

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
URL_PASSWORD = "PLANTEDurlPASSWORD4242"
SCORER_KEY = "PLANTEDscorerAPIkey777"
PLUGIN = '''
from atlas_lightning.reward import CostReward


class KeyedReward(CostReward):
    """The package's reward, built with an API key a user's scorer might need."""

    def __init__(self, cost_per_usd, no_submit_reward=0.0, api_key=None):
        super().__init__(cost_per_usd, no_submit_reward)
        assert api_key, "the key reaches the scorer"
'''


def _every_file(root: Path):
    for path in root.rglob("*"):
        if path.is_file() and not path.is_symlink():
            yield path


def _leaks(root: Path) -> list[str]:
    planted = [*SECRETS.values(), URL_PASSWORD, SCORER_KEY]
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
    env = dict(os.environ, **SECRETS, PYTHONPATH=os.pathsep.join([str(plugin), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="2", WANDB_MODE="offline", HF_HOME=str(tmp_path / "hf-home"))
    fit = [sys.executable, "-m", "atlas_lightning.cli", "fit", "experiment=tiny-cpu", f"model.path={tiny_model_dir}",
           f"data.root={sample_data_dir}", f"paths.root={root}", "name=secrets", "rollout.engine=hf", "rollout.n=2",
           "algorithm.train_batch_size=2", "algorithm.ppo_mini_batch_size=1", "rollout.max_tokens_per_turn=16",
           "rollout.max_turns=2", "trainer.total_steps=1", "trainer.save_every=1", "trainer.val_before_train=false",
           "callbacks.validation.val_on_last_step=false", "logger.mode=offline",
           "reward._target_=keyed_reward_plugin.KeyedReward", f"+reward.api_key={SCORER_KEY}",
           f"hub.endpoint=http://user:{URL_PASSWORD}@127.0.0.1:9"]
    result = subprocess.run(fit, capture_output=True, text=True, timeout=900, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    assert (root / "outputs" / "secrets" / "config.yaml").is_file() and any((root / "wandb").rglob("*.wandb"))
    leaks = _leaks(root)
    assert not leaks, "\n".join(leaks)
    assert not any(secret in result.stdout + result.stderr for secret in [*SECRETS.values(), URL_PASSWORD, SCORER_KEY])
    assert "***" in (root / "outputs" / "secrets" / "config.yaml").read_text()  # redacted, not dropped
    config = json.loads(next((root / "runs" / "secrets").glob("*/config.json")).read_text())
    assert config["reward"]["api_key"] == "***"

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


def _fake_hub():
    """tests/hub/fake_hub.py (a local Hub that checks the token), loaded by path."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("atlas_tests_fake_hub_secrets",
                                                  Path(__file__).parents[1] / "hub" / "fake_hub.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
