"""The HTTP side of a vLLM OpenAI-compatible server: exchanges over kept-alive pooled
connections, their replies decoded, an error reply's message, a free local port.

The pool is urllib3's (a dependency of ``requests``, which vLLM and W&B require): one pool per
server address, connections reused across requests and threads, a dropped one replaced when
taken. urllib3 never retries here: a failed exchange raises at once, so the caller tells a
server that is gone from a request that failed (``is_gone``). What urllib3 lacks is a way for
one thread to cut the connection another thread waits on (vLLM aborts a request whose client
disconnects): an ``Exchange`` passed to ``http_call`` does that (``Exchange.cut``).

Who calls it: ``server_process.VLLMServer`` (health), ``server_engine.ServerEngine`` (requests,
adapters), ``weight_transfer.ServerWeightTransfer`` (the RL routes).
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
from typing import Iterator, Optional

import urllib3
from urllib3.connection import HTTPConnection

from atlas_lightning.errors import QUOTED_CHARS
from atlas_lightning.errors import quoted as quoted_text

#: What an exchange raises when it fails: urllib3's errors (they wrap the OS's) and the OS's.
HTTP_ERRORS = (urllib3.exceptions.HTTPError, OSError, http.client.HTTPException)
#: Connection failures that mean nobody answers at the server's address (as opposed to one
#: request failing): they lead to a liveness check and, if the server is gone, ``EngineError``.
_GONE = (ConnectionRefusedError, ConnectionResetError, BrokenPipeError, http.client.RemoteDisconnected)
#: Idle connections kept per server: above the most requests one process holds in flight
#: (``rollout.max_in_flight``, 640 by default), so that none is closed and reopened between
#: requests (urllib3 opens connections only as needed; beyond this it warns and drops them).
_KEPT_PER_SERVER = 4096
_LOCK = threading.Lock()  # an exchange's connection, and who uses that connection now
_current = threading.local()  # the exchange the calling thread sends


def is_gone(err: BaseException) -> bool:
    """Whether ``err`` (from ``http_call``) says nobody answers at the server's address: the
    connection refused, reset, or closed without a reply (urllib3 wraps these)."""
    seen: list[BaseException] = []
    pending = [err]
    while pending:
        link = pending.pop()
        if link is None or any(link is s for s in seen):
            continue
        seen.append(link)
        if isinstance(link, _GONE):
            return True
        pending += [link.__cause__, link.__context__] + [a for a in link.args if isinstance(a, BaseException)]
    return False


class Exchange:
    """One request that another thread may ``cut``: its connection is shut down, the server
    sees its client go (vLLM aborts the request) and ``http_call`` raises."""

    def __init__(self) -> None:
        self.is_cut = False
        self._conn: Optional[HTTPConnection] = None

    def cut(self) -> None:
        with _LOCK:
            self.is_cut = True
            conn = self._conn
            # only while the connection is still ours: it returns to the pool after the reply
            if conn is not None and getattr(conn, "exchange", None) is self and conn.sock is not None:
                try:
                    conn.sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def _attach(self, conn: HTTPConnection) -> None:
        with _LOCK:
            if self.is_cut:
                raise ConnectionAbortedError("the request was cut before it was sent")
            self._conn, conn.exchange = conn, self


class _CuttableConnection(HTTPConnection):
    """urllib3's connection, made known to the exchange the sending thread carries."""

    def request(self, *args, **kwargs):
        exchange = getattr(_current, "exchange", None)
        if exchange is not None:
            exchange._attach(self)
        return super().request(*args, **kwargs)


class _CuttablePool(urllib3.HTTPConnectionPool):
    ConnectionCls = _CuttableConnection


_POOLS = urllib3.PoolManager(num_pools=16, maxsize=_KEPT_PER_SERVER, block=False, retries=False)
_POOLS.pool_classes_by_scheme = {"http": _CuttablePool}


def http_call(url: str, method: str, path: str, payload: Optional[dict] = None, timeout: Optional[float] = 60.0,
              *, body: Optional[bytes] = None, exchange: Optional[Exchange] = None,
              request_id: Optional[str] = None) -> tuple[int, dict | str]:
    """One HTTP exchange on a pooled connection to the server at ``url``: (status, JSON body or
    text). ``payload`` is sent as JSON (or ``body``, already encoded); ``exchange`` lets another
    thread cut it; ``request_id`` is sent as ``X-Request-Id`` (vLLM names its reply after it).
    Failures raise one of ``HTTP_ERRORS`` (``is_gone`` tells which kind)."""
    if payload is not None:
        body = json.dumps(payload).encode()
    _current.exchange = exchange
    try:
        response = _POOLS.request(method, url.rstrip("/") + path, body=body, timeout=timeout,
                                  headers=_headers({"Content-Type": "application/json"}, request_id))
    finally:
        _current.exchange = None
    return response.status, decode_body(response.data)


def http_stream(url: str, path: str, body: bytes, timeout: Optional[float] = 60.0, *,
                exchange: Optional[Exchange] = None, request_id: Optional[str] = None) -> Iterator[dict | str]:
    """A POST whose reply is a server-sent event stream (vLLM's ``stream: true``): yields each
    event's ``data`` decoded (JSON, else text), up to ``[DONE]``; a non-200 reply is yielded
    once, decoded, as ``{"status": N, "body": ...}``. ``timeout`` bounds each read; ``exchange``
    lets another thread cut it (then the next read raises one of ``HTTP_ERRORS``);
    ``request_id``: as ``http_call``'s."""
    _current.exchange = exchange
    try:
        response = _POOLS.request("POST", url.rstrip("/") + path, body=body, timeout=timeout, preload_content=False,
                                  headers=_headers({"Content-Type": "application/json", "Accept": "text/event-stream"},
                                                   request_id))
    finally:
        _current.exchange = None
    read_to_end = False
    try:
        if response.status != 200:
            yield {"status": response.status, "body": decode_body(response.read())}
            read_to_end = True
            return
        pending = b""
        for chunk in response.stream(64 * 1024):
            pending = (pending + chunk).replace(b"\r\n", b"\n")  # SSE lines may end in CRLF too
            *events, pending = pending.split(b"\n\n")
            for event in events:
                data = b"".join(line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:"))
                if data == b"[DONE]":
                    response.drain_conn()  # the stream's end marker: the connection can be reused
                    read_to_end = True
                    return
                if data:
                    yield decode_body(data)
    finally:
        if not read_to_end:  # cut, failed or left early: never reuse a connection with a reply in it
            response.close()
        response.release_conn()


def _headers(headers: dict[str, str], request_id: Optional[str]) -> dict[str, str]:
    return headers if request_id is None else {**headers, "X-Request-Id": request_id}


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (another process may still take it before the server)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def decode_body(raw: bytes) -> dict | str:
    text = raw.decode("utf-8", errors="replace")
    try:
        return json.loads(text)
    except ValueError:
        return text


def quoted(text: object, limit: int = QUOTED_CHARS) -> str:
    """``text`` (a reply's body, decoded or not: JSON is quoted as JSON) as ``errors.quoted``
    quotes it: one line, cut at ``limit`` characters, the number left out said."""
    return quoted_text(text if isinstance(text, str) else json.dumps(text, default=str), limit)


def error_message(body: dict | str) -> str:
    """The error message of a vLLM error reply (``{"error": {"message": ...}}``), or its text;
    ``quoted``: one line, cut."""
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and error.get("message"):
            return quoted(str(error["message"]))
    return quoted(body)
