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
  errors, timeouts), waiting ``backoff_s * 2**attempt`` seconds (each retry an INFO line: the run's
  log has it, a console shows only the final error). Running an upload again is idempotent
  (unchanged files are skipped). A permanent error is raised at once.
- One line for each failure, of what matters: the operation, the repo and endpoint, the HTTP
  status and the Hub's own words (``HfHubHTTPError.server_message``, at most 120 characters) or,
  without an answer, the root cause (``ConnectError: [Errno 111] Connection refused``); not the
  library's whole text (its MDN link, the URL again, the exception chain).
- What the Hub refuses for good is a ``HubRefusedError``, an ``InputError`` (the CLI exits 2): a
  4xx answer other than 408/425/429 (the token, the repo, what was sent), and an endpoint that did
  not answer as a Hub at the first call (a reply that is not JSON: ``hub.endpoint`` names a web
  server, not a Hub). Refused credentials (401, 403) are its ``HubCredentialsError``, whose
  message says which token to give. A Hub that cannot be reached, or keeps failing (5xx, 429), is
  a transient ``HubPublishError``: not the user's input; ``publish`` exits 1 (run it again).
- ``check_token``: the token asked about once (``whoami-v2``) before a run that uploads writes
  anything: refused or read-only, the run is refused at its start.
- A token that never appears in a message: a careless server may quote the ``Authorization``
  header in its error text, which the library copies into its exceptions and which the HTTP
  libraries' debug traces print with the response headers. Every message raised here has the
  token replaced by ``***`` and is raised ``from None``; while a Hub call runs every log record
  of the process is redacted too (``redacted_logs``).
- ``upload(files, message)`` takes ``(path in repo, local path)`` pairs from anywhere on disk:
  ``upload_folder`` sends one folder, so they are laid out as links in a temporary folder.

Who calls it: ``atlas_lightning.hub.publish`` (the closing publish),
``atlas_lightning.callbacks.hub.HubCheckpointCallback`` (checkpoint uploads during training) and
``run/environment.check_hub_answers`` (``check_token`` at the start of a run that uploads).
"""

from __future__ import annotations

import contextlib
import json
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
from atlas_lightning.errors import InputError, quoted

log = logging.getLogger(__name__)

REPO_TYPES = ("dataset", "model", "space")
TRANSIENT_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})
#: Seconds the start-up ``check_token`` waits for the Hub (``HfApi.whoami`` itself has no limit).
CHECK_TIMEOUT_S = 15.0
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
_XET_LOCK = threading.RLock()

T = TypeVar("T")


class HubPublishError(RuntimeError):
    """A Hub operation that failed for good; the message names the repo and never the token.
    ``transient`` tells whether the last error was of the kind worth trying again later."""

    def __init__(self, message: str, transient: bool = False):
        super().__init__(message)
        self.transient = transient


class HubRefusedError(HubPublishError, InputError):
    """The Hub refused, for good, what was asked (a 4xx answer other than 408/425/429), or the
    endpoint did not answer as a Hub; the message quotes why. An ``InputError``: the CLI exits 2."""


class HubCredentialsError(HubRefusedError):
    """The Hub refused the credentials (401: no token, or one it does not accept; 403: a token
    without the rights, a read token); the message says which token to give, never the token."""


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
    """``err`` and its causes, as a traceback shows them (a context raised ``from None`` is not one)."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or (None if err.__suppress_context__ else err.__context__)


def _response(err: BaseException) -> Any:
    """The HTTP response along ``err``'s chain, if any."""
    for link in _error_chain(err):
        response = getattr(link, "response", None)
        if isinstance(getattr(response, "status_code", None), int):
            return response
    return None


def _status(err: BaseException) -> Optional[int]:
    """The HTTP status along ``err``'s chain, if any."""
    response = _response(err)
    return None if response is None else response.status_code


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


def hub_said(err: BaseException) -> str:
    """``err`` in a few words: the HTTP status and the Hub's own message (``server_message``),
    else the root cause (``ConnectError: [Errno 111] ...``); what is quoted is one line
    of at most ``errors.QUOTED_CHARS``, saying how much was left out (``errors.quoted``)."""
    response = _response(err)
    if response is None:
        root = list(_error_chain(err))[-1]
        return type(root).__name__ + (f": {quoted(str(root))}" if str(root).strip() else "")
    said = next((link.server_message for link in _error_chain(err) if getattr(link, "server_message", None)), "")
    return f"{response.status_code} {response.reason_phrase}" + (f": {quoted(said)}" if said else "")


def not_a_hub(err: BaseException) -> Optional[str]:
    """How a reply shows that the endpoint is no Hub, or None: a body that does not parse as JSON,
    or an error answer below 500 that is not JSON (the Hub's API answers JSON, its errors too;
    an HTML page comes from a web server). Asked of the first call only: later calls reach
    storage (LFS) whose errors are not the Hub's."""
    if any(isinstance(link, json.JSONDecodeError) for link in _error_chain(err)):
        return "a reply that is not JSON"
    response = _response(err)
    if response is None or is_transient(err):
        return None
    kind = response.headers.get("content-type", "").split(";")[0].strip()
    if "json" in kind:
        return None
    return f"{response.status_code} {response.reason_phrase}, {f'a {kind} page' if kind else 'no content type'}"


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
        """Create the repo if needed; returns its URL. The first call to the endpoint: an answer
        that is not a Hub's is refused here (``not_a_hub``)."""
        url = self._retrying("creating", lambda: self._api.create_repo(
            self.repo_id, repo_type=self.repo_type, private=self.private, exist_ok=True), first_call=True)
        return str(url)

    def check_token(self, timeout: float = CHECK_TIMEOUT_S) -> str:
        """The account the token belongs to ("" where the endpoint has no such route), asked once
        (``/api/whoami-v2``, as ``HfApi.whoami`` asks, through the library's session, headers and
        status check, but within ``timeout`` seconds: ``whoami`` has no limit, and a host that
        drops packets would hold a run's start).
        ``HubCredentialsError`` for a token the Hub refuses or one that can only read (no upload
        could succeed); ``HubRefusedError`` for an endpoint that is no Hub; a transient
        ``HubPublishError`` when it cannot be reached."""
        from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

        def whoami() -> dict:
            response = get_session().get(f"{self.endpoint}/api/whoami-v2", timeout=timeout,
                                         headers=build_hf_headers(token=self._token or False))
            hf_raise_for_status(response)
            return response.json()

        at = f"at {redacted_text(self.endpoint)}"
        try:
            with redacted_logs(self._token):
                account = whoami()
        except Exception as err:
            if _status(err) == 404 and not not_a_hub(err):  # a Hub without the route (a mirror): uploads will tell
                return ""
            raise self._failure("checking the token", err, attempts=1, first_call=True, where=at) from None
        if not isinstance(account, dict):
            raise HubRefusedError(self._not_a_hub_line("checking the token", "a reply that is no account", where=at))
        role = ((account.get("auth") or {}).get("accessToken") or {}).get("role")
        if role == "read":
            raise HubCredentialsError(f"checking the token {at}: a read token, with which no upload can succeed: set "
                                      f"HF_TOKEN to a token with write access, or run `hf auth login` with one")
        return str(account.get("name") or "")

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

    def _retrying(self, what: str, call: Callable[[], T], first_call: bool = False) -> T:
        for attempt in range(self.retries + 1):
            try:
                with redacted_logs(self._token):
                    return call()
            except Exception as err:  # classify, redact, and either wait or give up
                failure = self._failure(what, err, attempts=attempt + 1, first_call=first_call)
                if not failure.transient or attempt == self.retries:
                    raise failure from None
                delay = self.backoff_s * (2 ** attempt) * (1 + 0.1 * random.random())
                log.info("%s %s: transient error, retry %d/%d in %.1f s: %s",
                         what, self.where, attempt + 1, self.retries, delay, self.redact(hub_said(err)))
                time.sleep(delay)
        raise AssertionError("unreachable")

    def _failure(self, what: str, err: BaseException, attempts: int, first_call: bool,
                 where: Optional[str] = None) -> HubPublishError:
        """``err`` of ``what`` (at ``where``: the repo by default) as the error to raise, one line
        (module doc), never the token."""
        said = self.redact(hub_said(err))
        where = where or self.where
        how = not_a_hub(err) if first_call else None
        if how:
            return HubRefusedError(self._not_a_hub_line(what, how, where))
        status = _status(err)
        if status == 401:
            found = "a token" if self._token else "no token (HF_TOKEN unset, no saved login)"
            return HubCredentialsError(f"{what} {where}: the Hub refused the credentials ({said}) with {found}: "
                                       f"set HF_TOKEN to a token with write access, or run `hf auth login`")
        if status == 403:
            return HubCredentialsError(f"{what} {where}: the Hub refused the credentials ({said}): set HF_TOKEN to "
                                       f"a token that can write there, or another hub.repo_id")
        if is_transient(err):
            return HubPublishError(f"{what} {where} failed after {attempts} attempt{'s' * (attempts > 1)} "
                                   f"(transient error: {said})", transient=True)
        if status is not None:
            return HubRefusedError(f"{what} {where}: the Hub refused it ({said})")
        return HubPublishError(f"{what} {where} failed ({said})")

    def _not_a_hub_line(self, what: str, how: str, where: str) -> str:
        from huggingface_hub import constants

        return (f"{what} {where}: hub.endpoint={redacted_text(self.endpoint)} did not answer as a Hugging Face "
                f"Hub ({how}): set hub.endpoint to a Hub's URL (null: {constants.ENDPOINT})")

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
