"""The fake Hub refuses what the real Hub refuses, so a broken client usage cannot pass the tests."""

from __future__ import annotations

import base64
import hashlib
import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from atlas_lightning.hub.client import HubPublishError, HubUploader

REPO = "atlas/honesty"


def _request(hub, method, path, body=b"", headers=None, token=True):
    headers = dict(headers or {})
    if token:
        headers["Authorization"] = f"Bearer {hub.token}"
    request = urllib.request.Request(hub.endpoint + path, data=body or None, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def _ndjson(*lines):
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


@pytest.fixture
def repo_hub(hub):
    status, _ = _request(hub, "POST", "/api/repos/create", json.dumps(
        {"name": "honesty", "organization": "atlas", "type": "dataset"}).encode(),
        {"Content-Type": "application/json"})
    assert status == 200
    return hub


NDJSON = {"Content-Type": "application/x-ndjson"}
TEXT = {"key": "file", "value": {"path": "a.txt", "encoding": "base64", "content": base64.b64encode(b"hi\n").decode()}}
HEADER = {"key": "header", "value": {"summary": "add a.txt", "description": ""}}


def test_a_well_formed_commit_is_accepted(repo_hub):
    status, body = _request(repo_hub, "POST", f"/api/datasets/{REPO}/commit/main", _ndjson(HEADER, TEXT), NDJSON)
    assert status == 200 and json.loads(body)["commitOid"]
    assert repo_hub.files(REPO) == {"a.txt": b"hi\n"}


@pytest.mark.parametrize(
    "lines, headers, message",
    [
        ((TEXT,), NDJSON, "first line must be the header"),
        (({"key": "header", "value": {"summary": ""}}, TEXT), NDJSON, "non-empty summary"),
        ((HEADER, TEXT), {"Content-Type": "application/json"}, "x-ndjson"),
        ((HEADER,), NDJSON, "no operations"),
        ((HEADER, {"key": "file", "value": {"path": "b.bin", "encoding": "base64",
                                            "content": base64.b64encode(b"\0\1\2").decode()}}), NDJSON, "lfsFile"),
        ((HEADER, {"key": "file", "value": {"path": "c.txt", "content": "aGk="}}), NDJSON, "encoding"),
        ((HEADER, {"key": "lfsFile", "value": {"path": "d.bin", "algo": "sha256", "oid": "0" * 64, "size": 3}}),
         NDJSON, "never uploaded"),
        ((HEADER, {"key": "file", "value": {"path": "../escape.txt", "encoding": "base64", "content": "aGk="}}),
         NDJSON, "invalid path"),
        ((HEADER, {"key": "rename", "value": {"path": "x"}}), NDJSON, "unknown operation"),
    ],
)
def test_malformed_commits_are_refused(repo_hub, lines, headers, message):
    status, body = _request(repo_hub, "POST", f"/api/datasets/{REPO}/commit/main", _ndjson(*lines), headers)
    assert status == 400 and message in json.loads(body)["error"]
    assert repo_hub.files(REPO) == {}


def test_lfs_objects_must_be_announced_signed_and_match_their_oid(repo_hub):
    data = b"\0payload"
    oid = hashlib.sha256(data).hexdigest()
    lfs_headers = {"Content-Type": "application/vnd.git-lfs+json", "Accept": "application/vnd.git-lfs+json"}
    batch = {"operation": "upload", "transfers": ["basic"], "objects": [{"oid": oid, "size": len(data)}]}
    status, body = _request(repo_hub, "POST", f"/datasets/{REPO}.git/info/lfs/objects/batch",
                            json.dumps(batch).encode(), lfs_headers)
    assert status == 200
    href = json.loads(body)["objects"][0]["actions"]["upload"]["href"]
    assert _request(repo_hub, "PUT", f"/_lfs/{oid}?sig=forged", data, token=False)[0] == 403
    assert _request(repo_hub, "PUT", href[len(repo_hub.endpoint):], b"other bytes", token=False)[0] == 400
    assert _request(repo_hub, "PUT", href[len(repo_hub.endpoint):], data, token=False)[0] == 200
    line = {"key": "lfsFile", "value": {"path": "w.bin", "algo": "sha256", "oid": oid, "size": len(data) + 1}}
    status, body = _request(repo_hub, "POST", f"/api/datasets/{REPO}/commit/main", _ndjson(HEADER, line), NDJSON)
    assert status == 400 and "size" in json.loads(body)["error"]


def test_requests_without_the_token_are_refused(repo_hub):
    status, _ = _request(repo_hub, "GET", f"/api/datasets/{REPO}", token=False)
    assert status == 401


def test_xet_is_used_only_when_the_endpoint_offers_it(repo_hub, tmp_path, hf_env):
    binary = tmp_path / "w.bin"
    binary.write_bytes(b"\0" * 5000)
    forced = HubUploader(REPO, endpoint=repo_hub.endpoint, use_xet=True, retries=0)
    with pytest.raises(HubPublishError, match="404 Not Found"):
        forced.upload([("w.bin", binary)], "through Xet")
    assert any(path.endswith("/xet-write-token/main") for _, path in repo_hub.requests)  # Xet it was
    detected = HubUploader(REPO, endpoint=repo_hub.endpoint, retries=0)
    assert detected.offers_xet() is False
    detected.upload([("w.bin", Path(binary))], "through the LFS batch API")
    assert repo_hub.files(REPO)["w.bin"] == b"\0" * 5000 and repo_hub.is_lfs(REPO, "w.bin")
