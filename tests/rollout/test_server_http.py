"""``server_http``: requests to one server share kept-alive connections, a cut exchange ends at
once and its connection is not reused, and failures are told apart (gone vs. one request)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from atlas_lightning.rollout.engines.server_http import HTTP_ERRORS, Exchange, free_port, http_call, is_gone


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive

    def log_message(self, *args) -> None:
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.peers.append(self.client_address)
        time.sleep(body.get("sleep", 0))
        data = json.dumps({"echo": body}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        try:
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client cut or gave up on this request: what the tests do on purpose


@pytest.fixture
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.daemon_threads = True
    httpd.peers = []
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    yield httpd, f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_requests_reuse_one_kept_alive_connection(server):
    httpd, url = server
    for i in range(5):
        assert http_call(url, "POST", "/echo", {"i": i}) == (200, {"echo": {"i": i}})
    assert len(set(httpd.peers)) == 1, httpd.peers  # one client port: one connection


def test_a_cut_exchange_ends_at_once_and_its_connection_is_dropped(server):
    httpd, url = server
    http_call(url, "POST", "/echo", {})  # a pooled connection the cut request will take
    exchange, failure = Exchange(), []

    def send():
        try:
            http_call(url, "POST", "/echo", {"sleep": 5}, exchange=exchange)
        except HTTP_ERRORS as err:
            failure.append(err)

    worker = threading.Thread(target=send)
    started = time.monotonic()
    worker.start()
    while len(httpd.peers) < 2:
        time.sleep(0.01)
    exchange.cut()
    worker.join(timeout=3)
    assert not worker.is_alive() and failure and time.monotonic() - started < 3
    assert http_call(url, "POST", "/echo", {"after": 1}) == (200, {"echo": {"after": 1}})
    assert httpd.peers[-1] != httpd.peers[0], "the cut connection must not go back to the pool"
    with pytest.raises(HTTP_ERRORS):  # cut before it was sent: never sent
        http_call(url, "POST", "/echo", {}, exchange=exchange)


def test_nobody_listening_is_gone_and_a_timeout_is_not(server):
    _, url = server
    with pytest.raises(HTTP_ERRORS) as refused:
        http_call(f"http://127.0.0.1:{free_port()}", "GET", "/health")
    assert is_gone(refused.value)
    with pytest.raises(HTTP_ERRORS) as slow:
        http_call(url, "POST", "/echo", {"sleep": 1}, timeout=0.2)
    assert not is_gone(slow.value)
