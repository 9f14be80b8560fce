"""What the Hub refuses, and a Hub that cannot be reached, as one line each: ``publish`` exits 2 for
a refusal (the token, the repo, an endpoint that is no Hub) and 1 for a Hub it could not reach,
with nothing written into the data root; ``HubUploader.check_token`` (the start-up check of a run
that uploads) says the same of the token."""

from __future__ import annotations

import json

import httpx2
import pytest
from huggingface_hub.errors import HfHubHTTPError
from huggingface_hub.utils import hf_raise_for_status

from atlas_lightning.cli import main
from atlas_lightning.hub import client
from atlas_lightning.hub.client import (
    HubCredentialsError,
    HubPublishError,
    HubRefusedError,
    HubUploader,
    hub_said,
    not_a_hub,
)
from tests.fixed_answer import answering, closed_port_url

REPO = "atlas/r-test-refusals"
FORBIDDEN = json.dumps({"error": 'You don\'t have the rights to create a dataset under the namespace "atlas"'})


def _files(root):
    return {p: p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()}


def _publish(root, name, endpoint, capsys):
    code = main(["publish", f"paths.root={root}", f"name={name}", f"hub.repo_id={REPO}", f"hub.endpoint={endpoint}"])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("status, body, content_type, code, words", [
    (401, json.dumps({"error": "Invalid credentials in Authorization header"}), "application/json", 2,
     ["the Hub refused the credentials (401 Unauthorized: Invalid credentials in Authorization header)", "HF_TOKEN",
      "hf auth login"]),
    (403, FORBIDDEN, "application/json", 2,
     ["the Hub refused the credentials (403 Forbidden: You don't have the rights", "HF_TOKEN", "hub.repo_id"]),
    (200, "<html>not json", "application/json", 2,
     ["hub.endpoint=http://127.0.0.1:", "did not answer as a Hugging Face Hub (a reply that is not JSON)"]),
    (404, "<html>" + "x" * 3000, "text/html", 2,
     ["did not answer as a Hugging Face Hub (404 Not Found, a text/html page)", "set hub.endpoint"]),
    (503, json.dumps({"error": "down for maintenance"}), "application/json", 1,
     ["failed after 4 attempts (transient error: 503 Service Unavailable: down for maintenance)",
      "run the same publish again"]),
])
def test_what_the_hub_refuses_is_one_line_and_writes_nothing(status, body, content_type, code, words, hf_env,
                                                             fake_run, capsys, monkeypatch):
    monkeypatch.setattr(client.time, "sleep", lambda seconds: None)  # the retries' waits
    before = _files(fake_run.root)
    with answering(status, body.encode(), content_type) as endpoint:
        got, err = _publish(fake_run.root, fake_run.name, endpoint, capsys)
    lines = err.strip().splitlines()
    assert got == code and len(lines) == 1 and len(lines[0]) < 300, err
    assert all(word in lines[0] for word in words), err
    assert "Traceback" not in err and hf_env not in err and "developer.mozilla.org" not in err
    assert _files(fake_run.root) == before  # no README.md, no FILES.txt


def test_a_hub_that_cannot_be_reached_exits_1_with_one_line(hf_env, fake_run, capsys, monkeypatch):
    """Not the user's input: a transient fault (exit 1), the retries (INFO in a run's log) not on
    the console, the root as it was."""
    monkeypatch.setattr(client.time, "sleep", lambda seconds: None)
    before = _files(fake_run.root)
    code, err = _publish(fake_run.root, fake_run.name, closed_port_url(), capsys)
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1 and len(lines[0]) < 300, err
    assert "failed after 4 attempts (transient error: ConnectError" in err and "publish again" in err
    assert _files(fake_run.root) == before


def test_a_refused_commit_later_is_exit_2_quoting_the_hub(hub, hf_env, fake_run, capsys):
    hub.fail_next(1, 422, path_contains="/commit/")
    code, err = _publish(fake_run.root, fake_run.name, hub.endpoint, capsys)
    last = err.strip().splitlines()[-1]  # after the library's progress bars of the transfer
    assert code == 2 and "the Hub refused it (422 Unprocessable Entity: injected fault 422)" in last, err
    assert len(last) < 300 and "Traceback" not in err


def test_the_token_check_says_who_or_why_not(make_hub, hf_env, monkeypatch):
    hub = make_hub()
    assert HubUploader(REPO, endpoint=hub.endpoint).check_token() == "fake-user"
    assert ("GET", "/api/whoami-v2") in hub.requests

    monkeypatch.setenv("HF_TOKEN", "hf_notTheRightOne0000000000000000")
    with pytest.raises(HubCredentialsError, match=r"checking the token at http://127\.0\.0\.1:\d+: the Hub refused "
                                                  r"the credentials \(401 Unauthorized"):
        HubUploader(REPO, endpoint=hub.endpoint).check_token()

    monkeypatch.setenv("HF_TOKEN", hf_env)
    reader = make_hub(token_role="read")
    with pytest.raises(HubCredentialsError, match="a read token, with which no upload can succeed"):
        HubUploader(REPO, endpoint=reader.endpoint).check_token()

    with answering(200, b"<html>welcome</html>", "text/html") as page:
        with pytest.raises(HubRefusedError, match="did not answer as a Hugging Face Hub"):
            HubUploader(REPO, endpoint=page).check_token()
    with answering(404, json.dumps({"error": "Not Found"}).encode()) as mirror:  # a Hub without the route
        assert HubUploader(REPO, endpoint=mirror).check_token() == ""
    with pytest.raises(HubPublishError) as unreachable:
        HubUploader(REPO, endpoint=closed_port_url()).check_token()
    assert unreachable.value.transient and not isinstance(unreachable.value, HubRefusedError)


def _answer(status: int, body: str, content_type: str = "application/json") -> HfHubHTTPError:
    """The error ``huggingface_hub`` raises for this answer (its own ``hf_raise_for_status``)."""
    request = httpx2.Request("POST", "http://hub/api/repos/create")
    response = httpx2.Response(status, request=request, content=body.encode(), headers={"content-type": content_type})
    with pytest.raises(HfHubHTTPError) as raised:
        hf_raise_for_status(response)
    return raised.value


def test_the_hubs_words_are_quoted_short_and_a_web_page_is_no_hub():
    assert hub_said(_answer(403, FORBIDDEN)).startswith("403 Forbidden: You don't have the rights")
    long = hub_said(_answer(400, json.dumps({"error": "y" * 500})))
    assert long.endswith("... (380 more characters)") and len(long) < 200
    assert hub_said(_answer(502, "<html>bad gateway</html>", "text/html")) == "502 Bad Gateway"
    assert not_a_hub(_answer(404, "<html></html>", "text/html")) == "404 Not Found, a text/html page"
    assert not_a_hub(_answer(404, json.dumps({"error": "Repository not found"}))) is None
    assert not_a_hub(_answer(502, "<html>bad gateway</html>", "text/html")) is None, "a proxy's 5xx stays transient"
    try:
        json.loads("<html>")
    except json.JSONDecodeError as err:
        assert not_a_hub(err) == "a reply that is not JSON"
        assert hub_said(err).startswith("JSONDecodeError: Expecting value"), "the decoder's StopIteration is no cause"
