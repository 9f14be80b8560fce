"""Sending files to a Hugging Face Hub repository: ``huggingface_hub`` does the work, this module
adds only what it lacks.

What the library does (``huggingface_hub`` 2.4, ``HfApi``): ``create_repo`` (409 "exists" taken
with ``exist_ok``); ``upload_folder``: the preupload (regular or LFS), the transfer of LFS files,
files already on the Hub with the same content skipped, the commit; with ``hf_xet`` installed a
streamed Xet upload in as many commits as the Hub's limits need, its commits retried, resumable by
running it again; without Xet one commit through the LFS batch API; its own retries of the
preupload and LFS requests (429/5xx, network errors); the token (``HF_TOKEN``, then the login saved
by ``hf auth login``); the ``Authorization`` header hidden in its own debug logs.

What this module adds, because the library lacks it:

- Xet only where the endpoint offers it. With ``hf_xet`` installed the library sends every LFS
  file through Xet and fails on an endpoint without it (a mirror, ``tests/hub/fake_hub.py``).
  ``use_xet=None`` asks the endpoint once (``xet-write-token`` must answer 200 with an
  ``X-Xet-Cas-Url`` header) and otherwise takes the LFS path, which every Hub serves. The switch
  is ``huggingface_hub.constants.HF_HUB_DISABLE_XET``, flipped only during our calls, under a lock.
- Retries of the calls the library does not retry (``create_repo``, the commit of the LFS path):
  the whole call is tried ``retries`` more times on transient errors (408/425/429/5xx, connection
  errors, timeouts), waiting ``backoff_s * 2**attempt`` seconds. Running an upload again is
  idempotent (unchanged files are skipped). A permanent error raises ``HubPublishError`` at once.
- Refused credentials (401) raise ``HubCredentialsError``: an ``InputError`` (the CLI exits 2)
  whose message says to set ``HF_TOKEN`` or run ``hf auth login``.
- A token that never appears in a message: a careless server may quote the ``Authorization``
  header in its error text, which the library copies into its exceptions and which the HTTP
  libraries' debug traces print with the response headers. Every message raised here has the
  token replaced by ``***`` and is raised ``from None``; while a Hub call runs every log record
  of the process is redacted too (``redacted_logs``).
- ``upload(files, message)`` takes ``(path in repo, local path)`` pairs from anywhere on disk:
  ``upload_folder`` sends one folder, so they are laid out as links in a temporary folder.

Who calls it: ``atlas_lightning.hub.publish`` (the closing publish) and
``atlas_lightning.callbacks.hub.HubCheckpointCallback`` (checkpoint uploads during training).
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
import re
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence, TypeVar

from atlas_lightning.config import redacted_text
from atlas_lightning.errors import InputError

log = logging.getLogger(__name__)

REPO_TYPES = ("dataset", "model", "space")
TRANSIENT_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
_XET_LOCK = threading.RLock()

T = TypeVar("T")


class HubPublishError(RuntimeError):
    """A Hub operation that failed for good; the message names the repo and never the token.
    ``transient`` tells whether the last error was of the kind worth trying again later."""

    def __init__(self, message: str, transient: bool = False):
        super().__init__(message)
        self.transient = transient


class HubCredentialsError(HubPublishError, InputError):
    """The Hub refused the credentials (401): no token, or one it does not accept; the message
    says where a token comes from, never the token. An ``InputError`` too: the CLI exits 2."""


def _saved_token() -> Optional[str]:
    """``HF_TOKEN``, else the login ``hf auth login`` saved (``huggingface_hub.get_token``); None when
    there is none or it cannot be read (an unreadable token file): the upload then goes without a
    token, and a Hub that wants one answers 401, which ``HubCredentialsError`` explains."""
    from huggingface_hub import get_token

    try:
        return get_token()
    except Exception:  # an unreadable saved login is no token, as a missing one is
        return None


def check_repo_id(repo_id: str, repo_type: str) -> None:
    if not isinstance(repo_id, str) or not _REPO_ID.match(repo_id):
        raise ValueError(f"repo_id={repo_id!r} must be '<owner>/<name>' (letters, digits, '.', '_', '-')")
    if repo_type not in REPO_TYPES:
        raise ValueError(f"repo_type={repo_type!r} must be one of {', '.join(REPO_TYPES)}")


def check_retries(retries: Any, backoff_s: Any) -> None:
    """``retries`` an int >= 0 and ``backoff_s`` a finite number of seconds >= 0 (the uploader's
    and the hub callback's, checked where each is built: the callback's before the run writes
    anything); ``ValueError`` naming the argument otherwise."""
    if not isinstance(retries, int) or isinstance(retries, bool) or retries < 0:
        raise ValueError(f"retries={retries!r} must be an int >= 0")
    if (not isinstance(backoff_s, (int, float)) or isinstance(backoff_s, bool) or not math.isfinite(backoff_s)
            or backoff_s < 0):
        raise ValueError(f"backoff_s={backoff_s!r} must be a finite number of seconds >= 0")


# ----------------------------------------------------------------------------- redaction

_FACTORY_LOCK = threading.Lock()
_SECRETS: dict[str, int] = {}
_PLAIN_FACTORY: Optional[Callable[..., logging.LogRecord]] = None


def _redacting_factory(*args, **kwargs) -> logging.LogRecord:
    record = _PLAIN_FACTORY(*args, **kwargs)
    secrets_now = list(_SECRETS)
    if secrets_now:
        try:
            text = record.getMessage()
        except Exception:  # a malformed record is not ours to fix
            return record
        if any(secret in text for secret in secrets_now):
            for secret in secrets_now:
                text = text.replace(secret, "***")
            record.msg, record.args = text, None
    return record


@contextlib.contextmanager
def redacted_logs(secret: Optional[str]) -> Iterator[None]:
    """While active, every log record created in this process (any logger, any thread) has
    ``secret`` replaced by ``***``."""
    global _PLAIN_FACTORY
    if not secret:
        yield
        return
    with _FACTORY_LOCK:
        if not _SECRETS:
            _PLAIN_FACTORY = logging.getLogRecordFactory()
            logging.setLogRecordFactory(_redacting_factory)
        _SECRETS[secret] = _SECRETS.get(secret, 0) + 1
    try:
        yield
    finally:
        with _FACTORY_LOCK:
            _SECRETS[secret] -= 1
            if not _SECRETS[secret]:
                del _SECRETS[secret]
            if not _SECRETS and logging.getLogRecordFactory() is _redacting_factory:
                logging.setLogRecordFactory(_PLAIN_FACTORY)


# ----------------------------------------------------------------------------- errors


def _error_chain(err: BaseException) -> Iterator[BaseException]:
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or err.__context__


def _status(err: BaseException) -> Optional[int]:
    """The HTTP status along ``err``'s chain, if any."""
    for link in _error_chain(err):
        status = getattr(getattr(link, "response", None), "status_code", None)
        if isinstance(status, int):
            return status
    return None


def is_transient(err: BaseException) -> bool:
    """True for errors worth retrying: 408/425/429/5xx answers, connection errors, timeouts."""
    import httpx2

    from huggingface_hub.errors import OfflineModeIsEnabled

    status = _status(err)
    if status is not None:
        return status in TRANSIENT_STATUS or status >= 500
    if any(isinstance(link, OfflineModeIsEnabled) for link in _error_chain(err)):  # a ConnectionError that stays
        return False
    return any(isinstance(link, (httpx2.TransportError, ConnectionError, TimeoutError)) for link in _error_chain(err))


def describe(err: BaseException) -> str:
    """One line per distinct message along the exception chain (the root cause included)."""
    lines: list[str] = []
    for link in _error_chain(err):
        text = " ".join(str(link).split()) or type(link).__name__
        line = f"{type(link).__name__}: {text}"
        if line not in lines:
            lines.append(line)
    return " <- ".join(lines)


# ----------------------------------------------------------------------------- the uploader


class HubUploader:
    """One repository on one endpoint. Construct, ``ensure_repo()``, then ``upload(files, message)``.

    Args:
        repo_id: ``<owner>/<name>``.
        repo_type: ``dataset`` (default), ``model`` or ``space``.
        endpoint: the Hub's base URL (None: ``HF_ENDPOINT`` or https://huggingface.co).
        token: None: ``HF_TOKEN``, else the saved login (``huggingface_hub.get_token``).
        private: visibility when the repo is created (an existing repo is left as it is).
        retries: extra attempts on transient errors; backoff_s: the first wait, doubled each time.
        use_xet: None asks the endpoint, True/False force it.
    """

    def __init__(self, repo_id: str, *, repo_type: str = "dataset", endpoint: Optional[str] = None,
                 token: Optional[str] = None, private: bool = True, retries: int = 3, backoff_s: float = 2.0,
                 use_xet: Optional[bool] = None):
        from huggingface_hub import HfApi, constants

        check_repo_id(repo_id, repo_type)
        check_retries(retries, backoff_s)
        self.repo_id = repo_id
        self.repo_type = repo_type
        self.endpoint = (endpoint or constants.ENDPOINT).rstrip("/")
        self.private = private
        self.retries = retries
        self.backoff_s = backoff_s
        self._token = token or _saved_token()
        self._api = HfApi(endpoint=self.endpoint, token=self._token or False)
        self._use_xet = use_xet

    def __repr__(self) -> str:  # never the token, nor the endpoint's password
        return f"HubUploader({self.repo_type} {self.repo_id} at {redacted_text(self.endpoint)})"

    @property
    def where(self) -> str:
        return f"{self.repo_type} repo {self.repo_id} at {redacted_text(self.endpoint)}"

    def redact(self, text: str) -> str:
        """``text`` without the token, nor any credential ``config.redacted_text`` masks (the
        endpoint's password, which the Hub library's messages repeat in its URLs)."""
        return redacted_text(text.replace(self._token, "***") if self._token else text)

    def ensure_repo(self) -> str:
        """Create the repo if needed; returns its URL."""
        url = self._retrying("creating", lambda: self._api.create_repo(
            self.repo_id, repo_type=self.repo_type, private=self.private, exist_ok=True))
        return str(url)

    def upload(self, files: Sequence[tuple[str, Path]], message: str) -> list[str]:
        """Send ``files`` (``(path in repo, local path)``) with ``upload_folder``; returns the id
        of the (last) commit. The repo must exist (``ensure_repo``)."""
        with tempfile.TemporaryDirectory(prefix="atlas-hub-upload-") as folder:
            for path, local in files:
                link = Path(folder, path)
                link.parent.mkdir(parents=True, exist_ok=True)
                link.symlink_to(Path(local).resolve())
            with self._xet_switch():
                info = self._retrying(f"uploading {len(files)} files ({message!r}) to", lambda: self._api.upload_folder(
                    repo_id=self.repo_id, repo_type=self.repo_type, folder_path=folder, commit_message=message))
        return [info.oid]

    def _retrying(self, what: str, call: Callable[[], T]) -> T:
        for attempt in range(self.retries + 1):
            try:
                with redacted_logs(self._token):
                    return call()
            except Exception as err:  # classify, redact, and either wait or give up
                detail = self.redact(describe(err))
                if _status(err) == 401:
                    found = "a token" if self._token else "no token (HF_TOKEN unset, no saved login)"
                    raise HubCredentialsError(
                        f"{what} {self.where}: the Hub refused the credentials (401 Unauthorized) with {found}: set "
                        f"HF_TOKEN to a token with write access, or run `hf auth login` (the Hub said: {detail})"
                    ) from None
                transient = is_transient(err)
                if not transient or attempt == self.retries:
                    tries = f" after {attempt + 1} attempts" if attempt else ""
                    kind = "transient error" if transient else "error"
                    raise HubPublishError(f"{what} {self.where} failed{tries} ({kind}): {detail}", transient) from None
                delay = self.backoff_s * (2 ** attempt) * (1 + 0.1 * random.random())
                log.warning("%s %s: transient error, retry %d/%d in %.1f s: %s",
                            what, self.where, attempt + 1, self.retries, delay, detail)
                time.sleep(delay)
        raise AssertionError("unreachable")

    def offers_xet(self) -> bool:
        """Whether the endpoint hands out Xet write tokens for this repo (one GET)."""
        import importlib.util

        from huggingface_hub import constants
        from huggingface_hub.utils import build_hf_headers, get_session

        # The library's own test (utils/_runtime.py): hf_xet installed and not disabled.
        if constants.HF_HUB_DISABLE_XET or importlib.util.find_spec("hf_xet") is None:
            return False
        url = f"{self.endpoint}/api/{self.repo_type}s/{self.repo_id}/xet-write-token/main"
        try:
            response = get_session().get(url, headers=build_hf_headers(token=self._token or False), timeout=30)
        except Exception:  # an endpoint that cannot answer this cannot do Xet either
            return False
        return response.status_code == 200 and "X-Xet-Cas-Url" in response.headers

    @contextlib.contextmanager
    def _xet_switch(self) -> Iterator[None]:
        from huggingface_hub import constants

        with redacted_logs(self._token):
            use_xet = self.offers_xet() if self._use_xet is None else self._use_xet
        with _XET_LOCK:
            before = constants.HF_HUB_DISABLE_XET
            constants.HF_HUB_DISABLE_XET = before or not use_xet
            try:
                yield
            finally:
                constants.HF_HUB_DISABLE_XET = before
