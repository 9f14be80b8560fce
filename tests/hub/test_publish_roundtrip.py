"""``publish_data_root`` against the fake Hub: what arrives, byte for byte, and how failures look."""

from __future__ import annotations

import hashlib
import json
import logging

import pytest
from huggingface_hub import constants, hf_hub_download, snapshot_download

from atlas_lightning.hub.client import HubCredentialsError, HubPublishError
from atlas_lightning.config import ConfigError, compose
from atlas_lightning.hub.publish import publish_data_root, publish_from_config

REPO = "atlas/r-test-data"


def _check_files_txt(text: str, files: dict) -> None:
    """FILES.txt lists every file of the repo with its true size, sorted."""
    lines = text.splitlines()
    listed = dict(line.split("\t") for line in lines)
    assert lines == sorted(lines, key=lambda line: line.split("\t")[0])
    assert set(listed) == set(files)
    assert {path: int(size) for path, size in listed.items()} == {path: len(data) for path, data in files.items()}


def test_publish_without_weights_sends_exactly_the_data_root(hub, hf_env, fake_run):
    result = publish_data_root(fake_run.root, REPO, endpoint=hub.endpoint, name=fake_run.name, backoff_s=0.01)

    files = hub.files(REPO)
    assert set(files) == fake_run.published | {"README.md", "FILES.txt"}
    run = fake_run.name
    record, manifest = f"artifacts/{run}/train/step_1/u1_s0.json", f"artifacts/{run}/train/step_1/manifest.json"
    for rel in fake_run.published - {record, manifest}:
        assert files[rel] == (fake_run.root / rel).read_bytes(), rel
    # the reading copy: the record without its per-token arrays, tensors.npz left out, the
    # step's manifest rewritten to what was sent; the root itself unchanged
    local_record = (fake_run.root / record).read_text()
    assert '"response_logprobs"' in local_record
    assert json.loads(files[record]) == {"uid": "u1", "reward_score": 0.9}
    sent = json.loads(files[manifest])
    assert [e["path"] for e in sent["files"]] == ["u1_s0.json"]
    assert sent["files"][0]["bytes"] == len(files[record])
    assert sent["files"][0]["sha256"] == hashlib.sha256(files[record]).hexdigest()
    assert sent["counts"]["files"] == 1 and sent["reading_copy"]["left_out"] == ["tensors.npz"]
    assert [e["path"] for e in json.loads((fake_run.root / manifest).read_text())["files"]] == ["tensors.npz", "u1_s0.json"]
    assert files["README.md"] == (fake_run.root / "README.md").read_bytes()
    _check_files_txt(files["FILES.txt"].decode(), files)
    # Binary or large files went through the LFS batch API (no Xet here), small text inline.
    assert hub.is_lfs(REPO, f"artifacts/{run}/train_figures/reward.png")
    assert hub.is_lfs(REPO, f"artifacts/{run}/val/step_2/big.json")
    assert not hub.is_lfs(REPO, f"artifacts/{run}/train/step_1/u1_s0.json")
    assert any(path.endswith("/info/lfs/objects/batch") for _, path in hub.requests)
    assert constants.HF_HUB_DISABLE_XET is False, "the Xet switch must be put back"
    assert hub.repos[("dataset", REPO)].private is True

    assert result["files"] == len(fake_run.published) + 2 and result["weights"] is False
    assert result["left_out"] == len(fake_run.weights) and result["readme"] == "generated"

    readme = files["README.md"].decode()
    for heading in ("## 1. Question and links", "## 2. Directory tree", "## 3. How to read each kind of file",
                    "## 4. Row fields", "## 5. What is left out, and the inputs"):
        assert heading in readme
    assert readme.startswith("---\n") and REPO in readme and f"**{run}**" in readme
    assert f"{hub.endpoint}/datasets/{REPO}/raw/main/<path>" in readme
    assert f"{hub.endpoint}/datasets/{REPO}/resolve/main/<path>" in readme
    assert "checkpoints/*/global_step_N/actor/ (weights or trainer state): 2 files" in readme
    assert "checkpoints/*/global_step_N/trainer_state/ (weights or trainer state): 2 files" in readme
    assert "artifacts/*/*/step_N/tensors.npz (per-token arrays): 1 file," in readme
    assert "stripped from the records of this repository" in readme
    assert "*.pt files (weights): 1 file," in readme
    assert "W&B: offline run abcd1234" in readme and "Saved steps: 2" in readme
    assert "base model `/models/tiny`" in readme and "started 2026-09-12T07:47:00Z; code abc123" in readme
    assert "8 processes on node-1; torch 2.13.0, vllm 0.32.0" in readme


def test_publish_with_weights_adds_the_adapters(hub, hf_env, fake_run):
    publish_data_root(fake_run.root, REPO, endpoint=hub.endpoint, weights=True, backoff_s=0.01)
    files = hub.files(REPO)
    assert set(files) == fake_run.published | fake_run.weights | {"README.md", "FILES.txt"}
    for rel in fake_run.published | fake_run.weights:  # the full copy: every file as written, arrays kept
        assert files[rel] == (fake_run.root / rel).read_bytes(), rel
    _check_files_txt(files["FILES.txt"].decode(), files)
    assert "snapshot_download" in files["README.md"].decode()
    assert "also in the step's tensors.npz" in files["README.md"].decode()


def test_what_was_published_downloads_back_identical(hub, hf_env, fake_run, tmp_path):
    publish_data_root(fake_run.root, REPO, endpoint=hub.endpoint, weights=True, backoff_s=0.01)
    adapter = f"checkpoints/{fake_run.name}/global_step_2/actor/lora_adapter/adapter_model.safetensors"
    one = hf_hub_download(REPO, adapter, repo_type="dataset", endpoint=hub.endpoint, cache_dir=tmp_path / "c1")
    assert open(one, "rb").read() == (fake_run.root / adapter).read_bytes()

    local = tmp_path / "snapshot"
    snapshot_download(REPO, repo_type="dataset", endpoint=hub.endpoint, local_dir=local, cache_dir=tmp_path / "c2")
    got = {p.relative_to(local).as_posix(): p.read_bytes() for p in local.rglob("*")
           if p.is_file() and ".cache" not in p.relative_to(local).parts}
    expected = fake_run.published | fake_run.weights | {"README.md", "FILES.txt"}
    assert set(got) == expected
    for rel in expected:
        assert got[rel] == (fake_run.root / rel).read_bytes(), rel


def test_publishing_again_is_a_no_op_for_unchanged_files(hub, hf_env, fake_run):
    publish_data_root(fake_run.root, REPO, endpoint=hub.endpoint, backoff_s=0.01)
    uploads = sum(1 for method, path in hub.requests if method == "PUT")
    publish_data_root(fake_run.root, REPO, endpoint=hub.endpoint, backoff_s=0.01)
    assert sum(1 for method, path in hub.requests if method == "PUT") == uploads, "LFS objects sent twice"


def test_transient_failures_are_retried(hub, hf_env, fake_run):
    hub.fail_next(1, 503, path_contains="/api/repos/create")
    hub.fail_next(2, 502, path_contains="/commit/")
    publish_data_root(fake_run.root, REPO, endpoint=hub.endpoint, backoff_s=0.01)
    assert set(hub.files(REPO)) == fake_run.published | {"README.md", "FILES.txt"}
    assert sum(1 for _, path in hub.requests if "/commit/" in path) == 3


def test_retries_run_out_with_an_error_naming_the_repo(hub, hf_env, fake_run):
    hub.fail_next(100, 503, path_contains="/commit/")
    with pytest.raises(HubPublishError) as caught:
        publish_data_root(fake_run.root, REPO, endpoint=hub.endpoint, retries=2, backoff_s=0.01)
    assert caught.value.transient
    assert REPO in str(caught.value) and "after 3 attempts" in str(caught.value) and "503" in str(caught.value)
    assert sum(1 for _, path in hub.requests if "/commit/" in path) == 3


def test_the_token_never_appears_in_output_logs_or_errors(make_hub, fake_run, monkeypatch, tmp_path, caplog, capfd):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    caplog.set_level(logging.DEBUG)
    good = make_hub()
    secret = good.token
    publish_data_root(fake_run.root, REPO, endpoint=good.endpoint, token=secret, backoff_s=0.01)
    assert set(good.files(REPO)) == fake_run.published | {"README.md", "FILES.txt"}

    # A careless server that quotes the Authorization header in its errors, refusing our token.
    careless = make_hub(token="hf_theRightOneIsElsewhere000000", echo_auth_in_errors=True)
    with pytest.raises(HubPublishError) as caught:
        publish_data_root(fake_run.root, REPO, endpoint=careless.endpoint, token=secret, backoff_s=0.01)
    message = str(caught.value)
    assert REPO in message and "401" in message and "***" in message
    assert caught.value.__cause__ is None and caught.value.__suppress_context__

    # A transient failure that is logged while retrying, quoting the header too.
    careless_transient = make_hub(echo_auth_in_errors=True)
    careless_transient.fail_next(1, 503, path_contains="/api/repos/create")
    publish_data_root(fake_run.root, REPO, endpoint=careless_transient.endpoint, token=secret, backoff_s=0.01)
    assert any("retry 1/3" in record.getMessage() for record in caplog.records)

    out, err = capfd.readouterr()
    assert secret not in message
    assert secret not in out and secret not in err
    assert all(secret not in record.getMessage() for record in caplog.records)
    assert secret not in caplog.text


def test_a_hand_written_readme_is_kept(hub, hf_env, fake_run):
    (fake_run.root / "README.md").write_text("# My own report\n\nWritten by hand.\n")
    result = publish_data_root(fake_run.root, REPO, endpoint=hub.endpoint, backoff_s=0.01)
    assert result["readme"] == "kept"
    assert hub.files(REPO)["README.md"] == b"# My own report\n\nWritten by hand.\n"


def test_bad_arguments_are_refused_before_any_request(hub, hf_env, fake_run, tmp_path):
    with pytest.raises(ValueError, match="repo_id='no-owner'"):
        publish_data_root(fake_run.root, "no-owner", endpoint=hub.endpoint)
    with pytest.raises(ValueError, match="repo_type='bucket'"):
        publish_data_root(fake_run.root, REPO, repo_type="bucket", endpoint=hub.endpoint)
    with pytest.raises(ValueError, match="is not a folder"):
        publish_data_root(tmp_path / "missing", REPO, endpoint=hub.endpoint)
    assert hub.requests == []


def test_publish_from_config(hub, hf_env, fake_run, capsys):
    base = [f"paths.root={fake_run.root}", f"name={fake_run.name}"]
    with pytest.raises(ConfigError, match="hub.repo_id is not set"):
        publish_from_config(compose(base), weights=False)
    cfg = compose(base + [f"hub.repo_id={REPO}", f"hub.endpoint={hub.endpoint}"])
    assert publish_from_config(cfg, weights=False) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["repo_id"] == REPO and printed["left_out"] == len(fake_run.weights)
    assert set(hub.files(REPO)) == fake_run.published | {"README.md", "FILES.txt"}

    hub.token = "hf_rotated000000000000000000000"
    with pytest.raises(HubCredentialsError) as info:
        publish_from_config(cfg, weights=True)
    assert REPO in str(info.value) and hf_env not in str(info.value)
    assert "set HF_TOKEN to a token with write access, or run `hf auth login`" in str(info.value)


def test_refused_credentials_exit_2_before_anything_is_written(hub, hf_env, fake_run, capsys, monkeypatch):
    from atlas_lightning.cli import main

    (fake_run.root / "README.md").unlink(missing_ok=True)
    before = {p: p.stat().st_mtime_ns for p in fake_run.root.rglob("*") if p.is_file()}
    monkeypatch.setenv("HF_TOKEN", "hf_notTheRightOne0000000000000000")
    code = main(["publish", f"paths.root={fake_run.root}", f"name={fake_run.name}", f"hub.repo_id={REPO}",
                 f"hub.endpoint={hub.endpoint}"])
    err = capsys.readouterr().err
    assert code == 2 and "refused the credentials (401 Unauthorized" in err and "hf auth login" in err, err
    assert "Traceback" not in err and "hf_notTheRightOne" not in err
    assert {p: p.stat().st_mtime_ns for p in fake_run.root.rglob("*") if p.is_file()} == before  # no README, FILES


@pytest.mark.parametrize("case, message", [
    ("no root", "paths.root={root}: no such folder"),
    ("root is a file", "paths.root={root}: not a folder"),
    ("empty root", "paths.root={root}: nothing to publish (none of artifacts, checkpoints"),
    ("hub offline", "publish uploads to the Hub, but HF_HUB_OFFLINE=1 (environment) switches it off"),
    ("endpoint", "hub.endpoint='huggingface.co': must be null or the Hub's http(s):// URL"),
    ("no token", "publish but there is no Hub token here: set HF_TOKEN to a token with write access or run "
                 "`hf auth login`"),
])
def test_a_publish_that_cannot_work_exits_2_before_the_hub_is_asked(case, message, hub, hf_env, fake_run, tmp_path,
                                                                   capsys, monkeypatch):
    from huggingface_hub import constants

    from atlas_lightning.cli import main

    root = {"no root": tmp_path / "nope", "root is a file": tmp_path / "afile", "empty root": tmp_path / "empty"}.get(
        case, fake_run.root)
    (tmp_path / "afile").write_text("x")
    (tmp_path / "empty").mkdir()
    if case == "hub offline":
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # read once, at import
    if case == "no token":  # neither HF_TOKEN nor a saved login
        monkeypatch.delenv("HF_TOKEN", raising=False)
        monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-login" / "token"))
    endpoint = "huggingface.co" if case == "endpoint" else hub.endpoint
    before = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")}
    code = main(["publish", f"paths.root={root}", f"name={fake_run.name}", f"hub.repo_id={REPO}",
                 f"hub.endpoint={endpoint}"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert message.format(root=root) in err and "Traceback" not in err
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")} == before
    assert ("dataset", REPO) not in hub.repos, "the Hub was asked nothing"


@pytest.mark.parametrize("damage", ["flipped_byte", "truncated", "removed"])
def test_publish_with_weights_refuses_a_checkpoint_that_no_longer_matches_its_marker(hub, hf_env, fake_run, damage):
    """A finished checkpoint (one with its ``checkpoint.json``) is verified before its weights are
    sent; a damaged one is refused naming the folder and the file, before the repo is made."""
    from atlas_lightning.store.checkpoints import CheckpointError, verify_checkpoint, write_marker

    step = fake_run.root / "checkpoints" / fake_run.name / "global_step_2"
    (step / "lightning").mkdir()
    (step / "lightning" / "state.ckpt").write_bytes(b"state")
    write_marker(step, 2)
    verify_checkpoint(step)  # whole, it would be sent
    adapter = step / "actor" / "lora_adapter" / "adapter_model.safetensors"
    data = adapter.read_bytes()
    if damage == "flipped_byte":
        adapter.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
    elif damage == "truncated":
        adapter.write_bytes(data[:-100])
    else:
        adapter.unlink()
    with pytest.raises(CheckpointError, match=r"global_step_2: actor/lora_adapter/adapter_model.safetensors"):
        publish_data_root(fake_run.root, REPO, endpoint=hub.endpoint, weights=True, backoff_s=0.01)
    assert ("dataset", REPO) not in hub.repos and not (fake_run.root / "FILES.txt").exists()
