"""What a server says is quoted on one short line: an error reply's message, a malformed answer,
a page of HTML where JSON was due. A running server named by ``rollout.server_url`` whose
``/v1/models`` is no vLLM server's answer is refused at start, exit 2, before the run writes."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from atlas_lightning.rollout.engine import EngineError
from atlas_lightning.rollout.engines.server_engine import base_card, model_cards
from atlas_lightning.rollout.engines.server_http import QUOTED_CHARS, error_message, quoted


def test_a_long_text_is_folded_onto_one_line_and_cut_saying_how_much_was_left_out():
    text = "internal error\n  File x.py, line 3\n" + "w" * 3000
    shown = quoted(text)
    assert "\n" not in shown and shown.startswith("internal error File x.py, line 3 www")
    left_out = len(" ".join(text.split())) - QUOTED_CHARS
    assert shown.endswith(f"... ({left_out} more characters)") and len(shown) < QUOTED_CHARS + 40
    assert quoted("short  reply\n") == "short reply"


@pytest.mark.parametrize("body", [
    {"error": {"message": "boom " + "w" * 3000}},  # vLLM's error reply
    {"detail": "x" * 5000},                         # another JSON reply
    "<html>" + "y" * 2000,                          # a page where JSON was due
])
def test_an_error_reply_is_quoted_short(body):
    message = error_message(body)
    assert "\n" not in message and len(message) < QUOTED_CHARS + 40


def test_a_models_answer_that_is_no_list_of_models_names_the_server_and_stays_short():
    with pytest.raises(EngineError, match=r"^vllm server http://h:1: /v1/models answered 200, not a list of "
                                          r"models: <html>y+\.\.\. \(\d+ more characters\)$") as refused:
        model_cards("vllm server http://h:1", 200, "<html>" + "y" * 2000)
    assert len(str(refused.value)) < 300
    with pytest.raises(EngineError, match="serves no base model"):
        base_card("s", model_cards("s", 200, {"data": [{"id": "a", "parent": "base"}]}))
    cards = model_cards("s", 200, {"data": [{"id": "a", "parent": "b"}, {"id": "b", "parent": None}]})
    assert base_card("s", cards)["id"] == "b"


def _server(models_body: bytes):
    """A server that is healthy and answers ``/v1/models`` with ``models_body``."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            data = b"{}" if self.path == "/health" else models_body
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd, f"http://127.0.0.1:{httpd.server_address[1]}"


@pytest.mark.parametrize("models_body, said", [
    (b"<html>" + b"y" * 2000, "rollout.server_url={url}: /v1/models answered 200, not a list of models: <html>y"),
    (json.dumps({"data": []}).encode(), "rollout.server_url={url}: serves no base model (/v1/models lists [])"),
])
def test_a_running_server_whose_models_are_no_vllm_answer_is_refused_before_anything_is_written(
        models_body, said, tmp_path, capsys):
    from atlas_lightning.cli import main
    from tests.conftest import write_fake_model_folder

    httpd, url = _server(models_body)
    root = tmp_path / "root"
    try:
        code = main(["fit", "experiment=tiny-cpu", "rollout=vllm_server_cpu", f"rollout.server_url={url}",
                     f"paths.root={root}", f"model.path={write_fake_model_folder(tmp_path / 'model')}"])
    finally:
        httpd.shutdown()
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [line for line in err.splitlines() if f"rollout.server_url={url}" in line]
    assert len(lines) == 1 and said.format(url=url) in lines[0] and len(lines[0]) < 320, err
    assert lines[0].endswith("is it a vLLM server?")
    assert "Traceback" not in err and not root.exists()
