"""The uploader's own parts (what huggingface_hub lacks): error classification, log redaction.
Splitting a large upload into commits is the library's (``upload_folder``)."""

from __future__ import annotations

import logging

import httpx2
import pytest
from huggingface_hub.errors import HfHubHTTPError

from atlas_lightning.hub.client import HubUploader, is_transient, redacted_logs


def _http_error(status: int) -> HfHubHTTPError:
    request = httpx2.Request("POST", "http://hub/api/x")
    return HfHubHTTPError(f"{status}", response=httpx2.Response(status, request=request))


@pytest.mark.parametrize("status, transient", [(500, True), (503, True), (429, True), (408, True),
                                               (401, False), (403, False), (404, False), (400, False)])
def test_http_errors_are_classified_by_status(status, transient):
    assert is_transient(_http_error(status)) is transient


def test_connection_errors_are_transient_even_when_wrapped():
    try:
        try:
            raise httpx2.ConnectError("refused")
        except httpx2.ConnectError as inner:
            raise RuntimeError("Error while uploading 'x' to the Hub.") from inner
    except RuntimeError as outer:
        assert is_transient(outer)
    assert not is_transient(ValueError("LFS batch API returned errors"))
    from huggingface_hub.errors import OfflineModeIsEnabled

    assert not is_transient(OfflineModeIsEnabled("offline mode is enabled")), "HF_HUB_OFFLINE stays on: no retry"


def test_redacted_logs_hide_the_secret_from_every_logger_and_restore_the_factory(caplog):
    factory = logging.getLogRecordFactory()
    with caplog.at_level(logging.DEBUG):
        with redacted_logs("s3cr3t-token"):
            with redacted_logs("s3cr3t-token"):  # nested use keeps it on
                logging.getLogger("some.http.lib").debug("header Authorization: Bearer %s", "s3cr3t-token")
            logging.getLogger("other").warning("again s3cr3t-token")
        logging.getLogger("after").warning("plain s3cr3t-token")
    messages = [record.getMessage() for record in caplog.records]
    assert messages[:2] == ["header Authorization: Bearer ***", "again ***"]
    assert messages[2] == "plain s3cr3t-token", "redaction must stop when the publish ends"
    assert logging.getLogRecordFactory() is factory


def test_the_uploader_does_not_show_its_token():
    uploader = HubUploader("a/b", endpoint="http://localhost:1", token="hf_shouldNotShow")
    assert "hf_shouldNotShow" not in repr(uploader) and "hf_shouldNotShow" not in uploader.where
    assert uploader.redact("x hf_shouldNotShow y") == "x *** y"
    # nor the password of its endpoint, which its messages (the run's log) and the Hub library's repeat
    uploader = HubUploader("a/b", endpoint="http://user:endpointPassw0rd@localhost:1", token="hf_shouldNotShow")
    assert "endpointPassw0rd" not in repr(uploader) + uploader.where
    assert uploader.where == "dataset repo a/b at http://user:***@localhost:1"
    assert "endpointPassw0rd" not in uploader.redact("Cannot reach http://user:endpointPassw0rd@localhost:1/api")
    with pytest.raises(ValueError, match="retries=-1"):
        HubUploader("a/b", retries=-1)


def test_an_unreadable_saved_login_is_no_token(monkeypatch, tmp_path):
    """A token file the process cannot read (here: a folder where the file should be) is taken as
    no login, as a missing one is: the upload goes without a token and a Hub that wants one
    answers 401, which names HF_TOKEN and `hf auth login`."""
    from huggingface_hub import constants

    monkeypatch.delenv("HF_TOKEN", raising=False)
    unreadable = tmp_path / "token"
    unreadable.mkdir()
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(unreadable))
    uploader = HubUploader("a/b", endpoint="http://localhost:1")
    assert uploader._token is None
