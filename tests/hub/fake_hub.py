"""A local HTTP endpoint that speaks the part of the Hugging Face Hub API ``huggingface_hub`` uses
to create a repository, commit files to it and download them back. Standard library only.

Served (``<t>`` is ``models``/``datasets``/``spaces``, ``<p>`` the URL prefix ``""``/``datasets/``/
``spaces/``; only the revision ``main`` or a commit id of the repo):

- ``GET  /api/whoami-v2``                            the token's account, its role ``token_role``
- ``POST /api/repos/create``                         create (409 when it exists)
- ``POST /api/validate-yaml``                        README metadata check (always fine)
- ``GET  /api/<t>/<ns>/<name>[/revision/<rev>]``     repo info with ``sha`` and ``siblings``
- ``GET  /api/<t>/<ns>/<name>/tree/<rev>[/<path>]``  listing (``recursive``)
- ``POST /api/<t>/<ns>/<name>/preupload/<rev>``      upload mode per file (``regular``/``lfs``)
- ``POST /api/<t>/<ns>/<name>/commit/<rev>``         the ndjson commit (checked strictly)
- ``POST /<p><ns>/<name>.git/info/lfs/objects/batch`` LFS batch API, ``basic`` transfer only
- ``PUT  /_lfs/<oid>?sig=..``, ``POST /_lfs/<oid>/verify``  the LFS object store
- ``HEAD|GET /<p><ns>/<name>/resolve/<rev>/<path>``  file content with ``X-Repo-Commit``/``ETag``
- ``GET  /<p><ns>/<name>/raw/<rev>/<path>``          as resolve, but an LFS file gives its pointer

There is no Xet: ``/xet-write-token`` is an unknown route (404), as on an endpoint without Xet.

Honesty: a commit is refused (400) unless its body is ``application/x-ndjson`` whose first line is
a ``header`` with a non-empty ``summary``, every later line a known operation with valid fields, a
regular file is small text (binary or large content must come as ``lfsFile``) and every ``lfsFile``
names an object uploaded through the LFS API with its size. Uploads must hash to the oid announced.

Knobs: ``token`` (every request but the presigned LFS PUT needs ``Authorization: Bearer <token>``),
``token_role`` (what whoami says the token may do: ``write``, or ``read``, which this fake does not
enforce beyond saying it),
``lfs_threshold`` (bytes from which preupload answers ``lfs``), ``fail_next(count, status,
path_contains)`` (fault injection), ``echo_auth_in_errors`` (error bodies quote the Authorization
header, as a careless server might: the client must not repeat it). ``requests`` logs
``(method, path)`` of every request.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
import secrets
import tempfile
import threading
from dataclasses import dataclass, field
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Optional
from urllib.parse import parse_qs, quote, unquote, urlsplit

_TYPES = {"models": "model", "datasets": "dataset", "spaces": "space"}
_PREFIX = {"model": "", "dataset": "datasets/", "space": "spaces/"}
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_OPERATION_KEYS = ("file", "lfsFile", "deletedFile", "deletedFolder")


class HubError(Exception):
    """An HTTP error answer: status, message, and the Hub's ``X-Error-Code`` when it has one."""

    def __init__(self, status: int, message: str, code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(sha256: str, size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


@dataclass(frozen=True)
class StoredFile:
    sha256: str
    size: int
    lfs: bool

    def blob_id(self, data: bytes) -> str:
        return git_blob_id(lfs_pointer(self.sha256, self.size) if self.lfs else data)


@dataclass
class Repo:
    repo_type: str
    repo_id: str
    private: bool
    #: commit id -> {path: StoredFile}; ``head`` is the latest.
    snapshots: dict = field(default_factory=dict)
    head: str = ""
    commit_messages: list = field(default_factory=list)


def _check_path(path) -> str:
    if not isinstance(path, str) or not path or path.startswith("/") or path.endswith("/"):
        raise HubError(400, f"invalid path {path!r}")
    if any(part in ("", ".", "..") for part in path.split("/")):
        raise HubError(400, f"invalid path {path!r}")
    return path


class FakeHub:
    """Start with ``with FakeHub(tmp_path) as hub:``; ``hub.endpoint`` is its base URL."""

    def __init__(self, storage: Optional[Path] = None, *, token: Optional[str] = None,
                 lfs_threshold: int = 10 * 1024 * 1024, echo_auth_in_errors: bool = False,
                 token_role: str = "write"):
        self._tmp = None if storage else tempfile.TemporaryDirectory()
        self.storage = Path(storage or self._tmp.name) / "objects"
        self.storage.mkdir(parents=True, exist_ok=True)
        self.token = token
        self.lfs_threshold = lfs_threshold
        self.echo_auth_in_errors = echo_auth_in_errors
        self.token_role = token_role
        self.repos: dict[tuple[str, str], Repo] = {}
        self.requests: list[tuple[str, str]] = []
        self._faults: list[list] = []
        self._upload_sigs: dict[str, str] = {}
        self._lock = threading.RLock()
        self._server: Optional[ThreadingHTTPServer] = None

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> "FakeHub":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        hub = self

        class Handler(_Handler):
            pass

        Handler.hub = hub
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._tmp is not None:
            self._tmp.cleanup()

    @property
    def endpoint(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    # ------------------------------------------------------------------ test helpers

    def fail_next(self, count: int, status: int = 503, path_contains: Optional[str] = None) -> None:
        """The next ``count`` requests (whose path contains ``path_contains``, if given) answer
        ``status`` without doing anything."""
        with self._lock:
            self._faults.append([count, status, path_contains])

    def files(self, repo_id: str, repo_type: str = "dataset") -> dict[str, bytes]:
        """The repo's files at its head: path -> content."""
        repo = self.repos[(repo_type, repo_id)]
        return {path: self.object_bytes(entry.sha256) for path, entry in repo.snapshots[repo.head].items()}

    def is_lfs(self, repo_id: str, path: str, repo_type: str = "dataset") -> bool:
        repo = self.repos[(repo_type, repo_id)]
        return repo.snapshots[repo.head][path].lfs

    def object_bytes(self, sha256: str) -> bytes:
        return (self.storage / sha256).read_bytes()

    # ------------------------------------------------------------------ internals used by the handler

    def take_fault(self, path: str) -> Optional[int]:
        with self._lock:
            for fault in self._faults:
                count, status, needle = fault
                if count > 0 and (needle is None or needle in path):
                    fault[0] -= 1
                    return status
        return None

    def store_object(self, data: bytes) -> str:
        sha = hashlib.sha256(data).hexdigest()
        target = self.storage / sha
        if not target.exists():
            temp = self.storage / f".{sha}.{secrets.token_hex(4)}"
            temp.write_bytes(data)
            temp.replace(target)
        return sha

    def has_object(self, sha256: str) -> bool:
        return (self.storage / sha256).exists()

    def repo(self, repo_type: str, repo_id: str) -> Repo:
        repo = self.repos.get((repo_type, repo_id))
        if repo is None:
            raise HubError(404, f"Repository {repo_id} not found", "RepoNotFound")
        return repo

    def snapshot(self, repo: Repo, revision: str) -> tuple[str, dict]:
        revision = unquote(revision)
        commit = repo.head if revision == "main" else revision
        if commit not in repo.snapshots:
            raise HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")
        return commit, repo.snapshots[commit]


def _new_commit_id() -> str:
    return secrets.token_hex(20)


class _Handler(BaseHTTPRequestHandler):
    hub: FakeHub
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # keep test output quiet
        pass

    # ------------------------------------------------------------------ plumbing

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _send(self, status: int, body: bytes = b"", content_type: str = "application/json",
              headers: Optional[dict] = None, head_only: bool = False) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if not head_only:
            self.wfile.write(body)

    def _json(self, status: int, data, headers: Optional[dict] = None) -> None:
        self._send(status, json.dumps(data).encode(), headers=headers)

    def _error(self, err: HubError, head_only: bool = False) -> None:
        message = err.message
        if self.hub.echo_auth_in_errors:
            message += f" (request had Authorization: {self.headers.get('Authorization')})"
        headers = {"X-Error-Message": message.replace("\n", " ")}
        if err.code:
            headers["X-Error-Code"] = err.code
        self._send(err.status, json.dumps({"error": message}).encode(), headers=headers, head_only=head_only)

    def _dispatch(self, method: str) -> None:
        url = urlsplit(self.path)
        path = unquote(url.path)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        self.hub.requests.append((method, path))
        body = b"" if method in ("GET", "HEAD") else self._body()
        try:
            status = self.hub.take_fault(path)
            if status is not None:
                raise HubError(status, f"injected fault {status}")
            if not path.startswith("/_lfs/"):
                self._check_auth()
            self._route(method, path, query, body)
        except HubError as err:
            self._error(err, head_only=method == "HEAD")
        except Exception as err:  # a bug in the fake: say so loudly in the client's error
            self._error(HubError(500, f"fake hub crashed: {type(err).__name__}: {err}"))

    def do_GET(self):
        self._dispatch("GET")

    def do_HEAD(self):
        self._dispatch("HEAD")

    def do_POST(self):
        self._dispatch("POST")

    def do_PUT(self):
        self._dispatch("PUT")

    def _check_auth(self) -> None:
        if self.hub.token is None:
            return
        if self.headers.get("Authorization") != f"Bearer {self.hub.token}":
            raise HubError(401, "Invalid credentials in Authorization header")

    def _json_body(self, body: bytes):
        try:
            return json.loads(body or b"null")
        except ValueError:
            raise HubError(400, "request body is not JSON") from None

    # ------------------------------------------------------------------ routes

    def _route(self, method: str, path: str, query: dict, body: bytes) -> None:
        hub = self.hub
        if method == "GET" and path == "/api/whoami-v2":
            return self._json(200, {"type": "user", "name": "fake-user", "auth": {
                "type": "access_token", "accessToken": {"displayName": "fake", "role": hub.token_role}}})
        if method == "POST" and path == "/api/repos/create":
            return self._create(self._json_body(body))
        if method == "POST" and path == "/api/validate-yaml":
            return self._json(200, {"errors": [], "warnings": []})
        if path.startswith("/_lfs/"):
            return self._lfs_object(method, path, query, body)
        match = re.fullmatch(r"/api/(models|datasets|spaces)/([^/]+/[^/]+)(?:/(.*))?", path)
        if match:
            repo = hub.repo(_TYPES[match.group(1)], match.group(2))
            rest = match.group(3) or ""
            return self._api(method, repo, rest, query, body)
        match = re.fullmatch(r"/(?:(datasets|spaces)/)?([^/]+/[^/]+)\.git/info/lfs/objects/batch", path)
        if match and method == "POST":
            repo = hub.repo(_TYPES.get(match.group(1) or "models"), match.group(2))
            return self._lfs_batch(repo, body)
        match = re.fullmatch(r"/(?:(datasets|spaces)/)?([^/]+/[^/]+)/(resolve|raw)/([^/]+)/(.+)", path)
        if match and method in ("GET", "HEAD"):
            repo = hub.repo(_TYPES.get(match.group(1) or "models"), match.group(2))
            return self._download(method, repo, match.group(3), match.group(4), match.group(5))
        raise HubError(404, f"no route for {method} {path}")

    def _create(self, payload) -> None:
        if not isinstance(payload, dict) or not isinstance(payload.get("name"), str) or not payload["name"]:
            raise HubError(400, "create: 'name' is required")
        repo_type = payload.get("type") or "model"
        if repo_type not in _PREFIX:
            raise HubError(400, f"create: unknown type {repo_type!r}")
        if not payload.get("organization"):
            raise HubError(400, "create: this fake needs an explicit namespace (organization)")
        repo_id = f"{payload['organization']}/{payload['name']}"
        url = f"{self.hub.endpoint}/{_PREFIX[repo_type]}{repo_id}"
        with self.hub._lock:
            if (repo_type, repo_id) in self.hub.repos:
                # The Hub's answer names the existing repo's URL (the client reads it).
                return self._json(409, {"error": "You already created this repo", "url": url},
                                  headers={"X-Error-Message": "You already created this repo"})
            repo = Repo(repo_type, repo_id, private=payload.get("visibility", "public") != "public")
            repo.head = _new_commit_id()
            repo.snapshots[repo.head] = {}
            repo.commit_messages.append("initial commit")
            self.hub.repos[(repo_type, repo_id)] = repo
        self._json(200, {"url": url, "name": repo_id})

    def _api(self, method: str, repo: Repo, rest: str, query: dict, body: bytes) -> None:
        if method == "GET" and (rest == "" or rest.startswith("revision/")):
            commit, files = self.hub.snapshot(repo, rest[len("revision/"):] if rest else "main")
            siblings = [{"rfilename": p} for p in sorted(files)]
            return self._json(200, {"id": repo.repo_id, "sha": commit, "private": repo.private,
                                    "siblings": siblings, "tags": [], "downloads": 0, "likes": 0,
                                    "lastModified": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.000Z")})
        if method == "GET" and rest.startswith("tree/"):
            revision, _, sub = rest[len("tree/"):].partition("/")
            return self._tree(repo, revision, sub, query)
        if method == "POST" and rest.startswith("preupload/"):
            return self._preupload(repo, rest[len("preupload/"):], self._json_body(body))
        if method == "POST" and rest.startswith("commit/"):
            return self._commit(repo, rest[len("commit/"):], body)
        raise HubError(404, f"no route for {method} /api/.../{rest}")

    def _tree(self, repo: Repo, revision: str, sub: str, query: dict) -> None:
        commit, files = self.hub.snapshot(repo, revision)
        recursive = query.get("recursive", "false").lower() == "true"
        prefix = f"{sub}/" if sub else ""
        if sub and not any(p.startswith(prefix) for p in files):
            raise HubError(404, f"{sub} does not exist on {revision}", "EntryNotFound")
        entries, folders = [], set()
        for path in sorted(files):
            if not path.startswith(prefix):
                continue
            tail = path[len(prefix):]
            parts = tail.split("/")
            for depth in range(1, len(parts)):
                if recursive or depth == 1:
                    folders.add(prefix + "/".join(parts[:depth]))
            if recursive or len(parts) == 1:
                entry = files[path]
                data = self.hub.object_bytes(entry.sha256)
                item = {"type": "file", "path": path, "size": entry.size, "oid": entry.blob_id(data)}
                if entry.lfs:
                    item["lfs"] = {"oid": entry.sha256, "size": entry.size,
                                   "pointerSize": len(lfs_pointer(entry.sha256, entry.size))}
                entries.append(item)
        for folder in sorted(folders):
            entries.append({"type": "directory", "path": folder, "size": 0, "oid": git_blob_id(folder.encode())})
        self._json(200, entries)

    def _preupload(self, repo: Repo, revision: str, payload) -> None:
        _, files = self.hub.snapshot(repo, revision)
        if not isinstance(payload, dict) or not isinstance(payload.get("files"), list):
            raise HubError(400, "preupload: 'files' must be a list")
        answers = []
        for item in payload["files"]:
            if not isinstance(item, dict) or not isinstance(item.get("size"), int) or "sample" not in item:
                raise HubError(400, "preupload: each file needs path, size and sample")
            path = _check_path(item.get("path"))
            try:
                sample = base64.b64decode(item["sample"], validate=True)
            except (binascii.Error, ValueError):
                raise HubError(400, f"preupload: sample of {path} is not base64") from None
            lfs = item["size"] >= self.hub.lfs_threshold or b"\0" in sample
            existing = files.get(path)
            oid = None
            if existing is not None:
                oid = existing.sha256 if existing.lfs else existing.blob_id(self.hub.object_bytes(existing.sha256))
            answers.append({"path": path, "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False, "oid": oid})
        self._json(200, {"files": answers})

    def _commit(self, repo: Repo, revision: str, body: bytes) -> None:
        if self.headers.get("Content-Type", "").split(";")[0].strip() != "application/x-ndjson":
            raise HubError(400, "commit: Content-Type must be application/x-ndjson")
        try:
            lines = [json.loads(line) for line in body.decode("utf-8").splitlines() if line.strip()]
        except (UnicodeDecodeError, ValueError):
            raise HubError(400, "commit: body is not ndjson") from None
        if not lines or not isinstance(lines[0], dict) or lines[0].get("key") != "header":
            raise HubError(400, "commit: the first line must be the header")
        header = lines[0].get("value")
        if not isinstance(header, dict) or not isinstance(header.get("summary"), str) or not header["summary"].strip():
            raise HubError(400, "commit: header needs a non-empty summary")
        operations = lines[1:]
        if not operations:
            raise HubError(400, "commit: no operations")
        with self.hub._lock:
            parent, files = self.hub.snapshot(repo, revision)
            if parent != repo.head:
                raise HubError(400, "commit: can only commit on top of main")
            if header.get("parentCommit") not in (None, repo.head):
                raise HubError(412, "commit: parentCommit is not the head of main")
            new_files = dict(files)
            for number, line in enumerate(operations, start=2):
                self._apply(new_files, line, number)
            commit = _new_commit_id()
            repo.snapshots[commit] = new_files
            repo.head = commit
            repo.commit_messages.append(header["summary"])
        url = f"{self.hub.endpoint}/{_PREFIX[repo.repo_type]}{repo.repo_id}/commit/{commit}"
        self._json(200, {"commitUrl": url, "commitOid": commit, "success": True})

    def _apply(self, files: dict, line, number: int) -> None:
        if not isinstance(line, dict) or line.get("key") not in _OPERATION_KEYS or not isinstance(line.get("value"), dict):
            raise HubError(400, f"commit line {number}: unknown operation {str(line)[:80]}")
        key, value = line["key"], line["value"]
        path = _check_path(value.get("path"))
        if key == "file":
            if value.get("encoding") != "base64" or not isinstance(value.get("content"), str):
                raise HubError(400, f"commit line {number}: {path}: content must be base64 with encoding 'base64'")
            try:
                data = base64.b64decode(value["content"], validate=True)
            except (binascii.Error, ValueError):
                raise HubError(400, f"commit line {number}: {path}: content is not valid base64") from None
            if b"\0" in data[:512] or len(data) >= self.hub.lfs_threshold:
                raise HubError(400, f"commit line {number}: {path} is binary or large: it must be an lfsFile")
            files[path] = StoredFile(self.hub.store_object(data), len(data), lfs=False)
        elif key == "lfsFile":
            oid, size = value.get("oid"), value.get("size")
            if value.get("algo") != "sha256" or not isinstance(oid, str) or not _SHA256.match(oid):
                raise HubError(400, f"commit line {number}: {path}: lfsFile needs algo sha256 and a sha256 oid")
            if not self.hub.has_object(oid):
                raise HubError(400, f"commit line {number}: {path}: LFS object {oid} was never uploaded")
            actual = (self.hub.storage / oid).stat().st_size
            if size is not None and size != actual:
                raise HubError(400, f"commit line {number}: {path}: size {size} != uploaded {actual}")
            files[path] = StoredFile(oid, actual, lfs=True)
        elif key == "deletedFile":
            if path not in files:
                raise HubError(404, f"commit line {number}: A file with this name doesn't exist: {path}", "EntryNotFound")
            del files[path]
        else:
            doomed = [p for p in files if p.startswith(path + "/")]
            if not doomed:
                raise HubError(404, f"commit line {number}: no folder {path}", "EntryNotFound")
            for p in doomed:
                del files[p]

    def _lfs_batch(self, repo: Repo, body: bytes) -> None:
        if "git-lfs+json" not in self.headers.get("Content-Type", ""):
            raise HubError(400, "LFS batch: Content-Type must be application/vnd.git-lfs+json")
        payload = self._json_body(body)
        if not isinstance(payload, dict) or payload.get("operation") != "upload":
            raise HubError(400, "LFS batch: only operation 'upload' is served")
        if "basic" not in (payload.get("transfers") or ["basic"]):
            raise HubError(400, "LFS batch: only the 'basic' transfer is served")
        objects = payload.get("objects")
        if not isinstance(objects, list) or not objects:
            raise HubError(400, "LFS batch: 'objects' must be a non-empty list")
        answers = []
        for obj in objects:
            oid, size = obj.get("oid") if isinstance(obj, dict) else None, obj.get("size") if isinstance(obj, dict) else None
            if not isinstance(oid, str) or not _SHA256.match(oid) or not isinstance(size, int) or size < 0:
                raise HubError(400, f"LFS batch: bad object {obj!r}")
            answer = {"oid": oid, "size": size, "authenticated": True}
            if not self.hub.has_object(oid):
                with self.hub._lock:  # one signature an object: two files of the same bytes share it
                    sig = self.hub._upload_sigs.setdefault(oid, secrets.token_hex(8))
                base = f"{self.hub.endpoint}/_lfs/{oid}"
                answer["actions"] = {"upload": {"href": f"{base}?sig={sig}"}, "verify": {"href": f"{base}/verify"}}
            answers.append(answer)
        self._send(200, json.dumps({"transfer": "basic", "objects": answers}).encode(),
                   content_type="application/vnd.git-lfs+json")

    def _lfs_object(self, method: str, path: str, query: dict, body: bytes) -> None:
        match = re.fullmatch(r"/_lfs/([0-9a-f]{64})(/verify)?", path)
        if not match:
            raise HubError(404, f"no LFS object route {path}")
        oid = match.group(1)
        if method == "PUT" and not match.group(2):
            if query.get("sig") is None or self.hub._upload_sigs.get(oid) != query.get("sig"):
                raise HubError(403, "LFS upload: bad or missing signature")
            if hashlib.sha256(body).hexdigest() != oid:
                raise HubError(400, f"LFS upload: content does not hash to {oid}")
            self.hub.store_object(body)
            return self._send(200)
        if method == "POST" and match.group(2):
            self._check_auth()
            payload = self._json_body(body)
            if not self.hub.has_object(oid) or payload.get("oid") != oid:
                raise HubError(404, f"LFS verify: {oid} not stored")
            if payload.get("size") != (self.hub.storage / oid).stat().st_size:
                raise HubError(400, f"LFS verify: size of {oid} differs")
            return self._json(200, {"success": True})
        raise HubError(405, f"{method} not allowed on {path}")

    def _download(self, method: str, repo: Repo, kind: str, revision: str, path: str) -> None:
        commit, files = self.hub.snapshot(repo, revision)
        entry = files.get(path)
        headers = {"X-Repo-Commit": commit}
        if entry is None:
            err = HubError(404, f"Entry not found: {path}", "EntryNotFound")
            self.send_response(404)
            message = err.message
            body = json.dumps({"error": message}).encode()
            for key, value in {**headers, "X-Error-Code": err.code, "X-Error-Message": message,
                               "Content-Type": "application/json", "Content-Length": str(len(body))}.items():
                self.send_header(key, value)
            self.end_headers()
            if method != "HEAD":
                self.wfile.write(body)
            return
        data = self.hub.object_bytes(entry.sha256)
        if kind == "raw" and entry.lfs:
            data = lfs_pointer(entry.sha256, entry.size)
        etag = entry.sha256 if entry.lfs and kind == "resolve" else entry.blob_id(data)
        headers["ETag"] = f'"{etag}"'
        self._send(200, data, content_type="application/octet-stream", headers=headers, head_only=method == "HEAD")


def repo_file_url(endpoint: str, repo_id: str, path: str, repo_type: str = "dataset", kind: str = "resolve") -> str:
    return f"{endpoint}/{_PREFIX[repo_type]}{repo_id}/{kind}/main/{quote(path)}"
