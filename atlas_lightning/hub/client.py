"""Sending files to a Hugging Face Hub repository: retries, commit batches, Xet or plain LFS, and
a token that never appears in a message.

What ``huggingface_hub`` (2.4) does underneath, and what an endpoint must serve for it
(``tests/hub/fake_hub.py`` serves exactly this):

- ``create_repo``: ``POST /api/repos/create`` (409 = exists, accepted with ``exist_ok``).
- ``create_commit``: ``POST /api/validate-yaml`` when README.md is in the commit;
  ``POST /api/<type>s/<repo>/preupload/<rev>`` (each file ``regular`` or ``lfs``); for ``lfs``
  files either Xet (``GET /api/<type>s/<repo>/xet-write-token/<rev>``, then the Xet CAS) or the
  LFS batch API (``POST /<prefix><repo>.git/info/lfs/objects/batch``, a ``PUT`` per object to the
  URL it returns, then its ``verify``); finally ``POST /api/<type>s/<repo>/commit/<rev>`` with an
  ndjson body: a ``header`` line, then one line per file (regular files inline, base64; LFS files
  by sha256 and size).

Xet: with ``hf_xet`` installed the library sends every LFS file through Xet, which fails on an
endpoint without Xet. ``use_xet=None`` (default) asks the endpoint once (the ``xet-write-token``
route must answer 200 with an ``X-Xet-Cas-Url`` header) and otherwise uses the LFS batch API,
which every Hub serves. The switch is ``huggingface_hub.constants.HF_HUB_DISABLE_XET``, flipped
only for the duration of our calls and under a lock.

Retries: ``retries`` more attempts after the first on transient errors (HTTP 408/425/429/5xx,
connection errors, timeouts), waiting ``backoff_s * 2**attempt`` seconds. A commit that is
retried is rebuilt from the files and is idempotent: files already on the Hub with the same
content are skipped by the library, so a publish can also simply be run again after a failure.
A permanent error (401/403/404, a refused commit) raises ``HubPublishError`` at once.

Token: from the caller, else ``HF_TOKEN``, else the login saved by ``hf auth login``. It is sent
only in the ``Authorization`` header; every message this module logs or raises has it replaced
by ``***``, errors are raised ``from None`` so a server's echo of it cannot surface through the
exception chain, and while a Hub call runs every log record of the process is redacted too
(``redacted_logs``: the HTTP libraries' debug traces print response headers verbatim).

Who calls it: ``atlas_lightning.hub.publish`` (the closing publish) and
``atlas_lightning.callbacks.hub.HubCheckpointCallback`` (checkpoint uploads during training).
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import re
import threading
import time
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence, TypeVar

from atlas_lightning.errors import InputError

log = logging.getLogger(__name__)

REPO_TYPES = ("dataset", "model", "space")
TRANSIENT_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})
#: A commit carries at most this many files (the Hub's own limit is 25,000 LFS files)...
MAX_FILES_PER_COMMIT = 2000
#: ... and at most this many bytes of small files (sent inline, base64; the Hub caps a commit's
#: inline payload at 1 GB).
MAX_INLINE_BYTES_PER_COMMIT = 256 * 1024 * 1024
#: Files from this size on are LFS on the Hub whatever their content.
INLINE_SIZE_LIMIT = 10 * 1024 * 1024
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
_XET_LOCK = threading.RLock()

T = TypeVar("T")


class HubPublishError(RuntimeError):
    """A Hub operation that failed for good; the message names the repo and never the token.
    ``transient`` tells whether the last error was of the kind worth trying again later."""

    def __init__(self, message: str, transient: bool = False):
        super().__init__(message)
        self.transient = transient




def _status(err: BaseException) -> Optional[int]:
    """The HTTP status along ``err``'s chain, if any."""
    for link in _error_chain(err):
        status = getattr(getattr(link, "response", None), "status_code", None)
        if isinstance(status, int):
            return status
    return None


class HubCredentialsError(HubPublishError, InputError):
    """The Hub refused the credentials (401): no token, or one it does not accept; the message
    says where a token comes from, never the token. An ``InputError`` too: the CLI exits 2."""


def resolve_token(token: Optional[str]) -> Optional[str]:
    """``token``, else ``HF_TOKEN``, else the saved login (None when there is none)."""
    if token:
        return token
    if os.environ.get("HF_TOKEN"):
        return os.environ["HF_TOKEN"]
    try:
        from huggingface_hub import get_token

        return get_token()
    except Exception:  # no saved login, or an unreadable one: publish without a token
        return None


def check_repo_id(repo_id: str, repo_type: str) -> None:
    if not isinstance(repo_id, str) or not _REPO_ID.match(repo_id):
        raise ValueError(f"repo_id={repo_id!r} must be '<owner>/<name>' (letters, digits, '.', '_', '-')")
    if repo_type not in REPO_TYPES:
        raise ValueError(f"repo_type={repo_type!r} must be one of {', '.join(REPO_TYPES)}")


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
    ``secret`` replaced by ``***``: an HTTP library's debug trace of a server that echoes the
    Authorization header must not reveal the token either."""
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


def _error_chain(err: BaseException) -> Iterator[BaseException]:
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or err.__context__


def is_transient(err: BaseException) -> bool:
    """True for errors worth retrying: 408/425/429/5xx answers, connection errors, timeouts."""
    import httpx2

    for link in _error_chain(err):
        response = getattr(link, "response", None)
        status = getattr(response, "status_code", None)
        if isinstance(status, int):
            return status in TRANSIENT_STATUS or status >= 500
        if isinstance(link, (httpx2.TransportError, ConnectionError, TimeoutError)):
            return True
    return False


def describe(err: BaseException) -> str:
    """One line per distinct message along the exception chain (the root cause included)."""
    lines: list[str] = []
    for link in _error_chain(err):
        text = " ".join(str(link).split()) or type(link).__name__
        line = f"{type(link).__name__}: {text}"
        if line not in lines:
            lines.append(line)
    return " <- ".join(lines)


class HubUploader:
    """One repository on one endpoint. Construct, ``ensure_repo()``, then ``upload(files, message)``.

    Args:
        repo_id: ``<owner>/<name>``.
        repo_type: ``dataset`` (default), ``model`` or ``space``.
        endpoint: the Hub's base URL (None: ``HF_ENDPOINT`` or https://huggingface.co).
        token: see ``resolve_token``.
        private: visibility when the repo is created (an existing repo is left as it is).
        retries: extra attempts on transient errors; backoff_s: the first wait, doubled each time.
        use_xet: None asks the endpoint, True/False force it.
    """

    def __init__(self, repo_id: str, *, repo_type: str = "dataset", endpoint: Optional[str] = None,
                 token: Optional[str] = None, private: bool = True, retries: int = 3, backoff_s: float = 2.0,
                 use_xet: Optional[bool] = None):
        from huggingface_hub import HfApi, constants

        check_repo_id(repo_id, repo_type)
        if not isinstance(retries, int) or retries < 0:
            raise ValueError(f"retries={retries!r} must be an int >= 0")
        self.repo_id = repo_id
        self.repo_type = repo_type
        self.endpoint = (endpoint or constants.ENDPOINT).rstrip("/")
        self.private = private
        self.retries = retries
        self.backoff_s = backoff_s
        self._token = resolve_token(token)
        self._api = HfApi(endpoint=self.endpoint, token=self._token if self._token else False)
        self._use_xet = use_xet

    def __repr__(self) -> str:  # never the token
        return f"HubUploader({self.repo_type} {self.repo_id} at {self.endpoint})"

    @property
    def where(self) -> str:
        return f"{self.repo_type} repo {self.repo_id} at {self.endpoint}"

    def redact(self, text: str) -> str:
        return text.replace(self._token, "***") if self._token else text

    # ------------------------------------------------------------------ operations

    def ensure_repo(self) -> str:
        """Create the repo if needed; returns its URL."""
        url = self._retrying("creating", lambda: self._api.create_repo(
            self.repo_id, repo_type=self.repo_type, private=self.private, exist_ok=True))
        return str(url)

    def upload(self, files: Sequence[tuple[str, Path]], message: str) -> list[str]:
        """Commit ``files`` (``(path in repo, local path)``) in order, in as few commits as the
        limits allow; returns the commit ids. The repo must exist (``ensure_repo``)."""
        from huggingface_hub import CommitOperationAdd

        batches = plan_batches([(path, Path(local), Path(local).stat().st_size) for path, local in files])
        commits = []
        with self._xet_switch():
            for number, batch in enumerate(batches, start=1):
                summary = message if len(batches) == 1 else f"{message} ({number}/{len(batches)})"

                def commit(batch=batch, summary=summary):
                    # Fresh operations each attempt: the library mutates them.
                    operations = [CommitOperationAdd(path_in_repo=path, path_or_fileobj=str(local))
                                  for path, local, _ in batch]
                    return self._api.create_commit(self.repo_id, operations, commit_message=summary,
                                                   repo_type=self.repo_type)

                info = self._retrying(f"committing {len(batch)} files ({summary!r}) to", commit)
                commits.append(info.oid)
        return commits

    # ------------------------------------------------------------------ internals

    def _retrying(self, what: str, call: Callable[[], T]) -> T:
        for attempt in range(self.retries + 1):
            try:
                with redacted_logs(self._token):
                    return call()
            except Exception as err:  # classify, redact, and either wait or give up
                if _status(err) == 401:
                    found = "a token" if self._token else "no token (HF_TOKEN unset, no saved login)"
                    raise HubCredentialsError(
                        f"{what} {self.where}: the Hub refused the credentials (401 Unauthorized) with {found}: set "
                        f"HF_TOKEN to a token with write access, or run `hf auth login` "
                        f"(the Hub said: {self.redact(describe(err))})") from None
                transient = is_transient(err)
                detail = self.redact(describe(err))
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


def plan_batches(files: Sequence[tuple[str, Path, int]], max_files: int = MAX_FILES_PER_COMMIT,
                 max_inline_bytes: int = MAX_INLINE_BYTES_PER_COMMIT) -> list[list[tuple[str, Path, int]]]:
    """Split ``(path, local, size)`` entries, in order, into commits of at most ``max_files`` files
    and ``max_inline_bytes`` of small (possibly inline) files."""
    batches: list[list] = []
    current: list = []
    inline = 0
    for entry in files:
        small = entry[2] if entry[2] < INLINE_SIZE_LIMIT else 0
        if current and (len(current) >= max_files or inline + small > max_inline_bytes):
            batches.append(current)
            current, inline = [], 0
        current.append(entry)
        inline += small
    if current:
        batches.append(current)
    return batches
