"""The HTTP side of a vLLM OpenAI-compatible server: one exchange on a fresh connection, its
reply decoded, an error reply's message, a free local port.

Who calls it: ``server_process.VLLMServer`` (health), ``server_engine.ServerEngine`` (requests,
adapters), ``weight_transfer.ServerWeightTransfer`` (the RL routes).
"""

from __future__ import annotations

import http.client
import json
import socket
from typing import Optional
from urllib.parse import urlsplit

#: Connection failures that mean nobody answers at the server's address (as opposed to one
#: request failing): they lead to a liveness check and, if the server is gone, ``EngineError``.
GONE = (ConnectionRefusedError, ConnectionResetError, BrokenPipeError, http.client.RemoteDisconnected)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (another process may still take it before the server)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def http_call(url: str, method: str, path: str, payload: Optional[dict] = None,
          timeout: Optional[float] = 60.0) -> tuple[int, dict | str]:
    """One HTTP exchange on a fresh connection: (status, JSON body or text). Connection errors
    propagate (``OSError``, ``http.client.HTTPException``)."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    try:
        body = None if payload is None else json.dumps(payload)
        conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, decode_body(response.read())
    finally:
        conn.close()


def decode_body(raw: bytes) -> dict | str:
    text = raw.decode("utf-8", errors="replace")
    try:
        return json.loads(text)
    except ValueError:
        return text


def error_message(body: dict | str) -> str:
    """The error message of a vLLM error reply (``{"error": {"message": ...}}``), or its text."""
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        return json.dumps(body)[:1000]
    return body[:1000]
