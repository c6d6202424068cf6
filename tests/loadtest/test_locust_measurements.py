"""The Locust suite times streams from the body: against a server whose first chunk comes at 1 s and last at 3 s."""
import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from loadtest.prompts import KINDS, load_prompts

ROOT = Path(__file__).resolve().parents[2]


class DelayedSSE(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # chunked, as uvicorn sends a stream

    models: list[str | None] = []  # each request's `model`

    def do_POST(self):
        self.models.append(json.loads(self.rfile.read(int(self.headers.get("content-length", 0)))).get("model"))
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        time.sleep(1.0)
        self._chunk({"choices": [{"index": 0, "delta": {"content": "hello"}, "finish_reason": None}]})
        time.sleep(2.0)
        self._chunk({"choices": [{"index": 0, "delta": {"content": " world"}, "finish_reason": "stop"}]})
        self._chunk({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}})
        self._write(b"data: [DONE]\n\n")
        self.wfile.write(b"0\r\n\r\n")

    def _chunk(self, payload: dict) -> None:
        self._write(f"data: {json.dumps(payload)}\n\n".encode())

    def _write(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def log_message(self, *args):
        pass


@pytest.fixture
def delayed_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), DelayedSSE)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_prompt_mix_is_large_seeded_and_mixed():
    prompts = load_prompts()
    assert len(prompts) >= 1500 and len({p.text for p in prompts}) > 1400
    assert {p.kind for p in prompts} == set(KINDS)
    assert [p.text for p in load_prompts()[:50]] == [p.text for p in prompts[:50]]


@pytest.mark.slow
def test_ttft_and_e2e_come_from_the_streamed_body(delayed_server, tmp_path):
    cmd = [sys.executable, "-m", "loadtest.run", "--url", delayed_server, "--users", "2", "--duration", "10",
           "--warmup", "0", "--stream-share", "1", "--target-rph", "0", "--p95-e2e-slo", "10", "--prometheus", "",
           "--out-dir", str(tmp_path), "--model", "small,big"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.loads(next(tmp_path.glob("*/summary.json")).read_text())
    assert summary["requests_ok"] >= 4 and summary["requests_failed"] == 0
    assert summary["ttft"]["p50"] == pytest.approx(1.0, abs=0.2)
    assert summary["e2e"]["p50"] == pytest.approx(3.0, abs=0.25)
    assert summary["itl"]["p50"] == pytest.approx(1.0, abs=0.2)  # 2 s between first and last of 3 tokens
    locust_stats = (next(tmp_path.glob("*/engine_stats.csv"))).read_text()
    assert "TTFT" in locust_stats and "E2E" in locust_stats  # the custom events reach Locust's own stats
    # each user sends the models in turn (an app serving several), and Locust's stats name them
    assert set(DelayedSSE.models) == {"small", "big"}, DelayedSSE.models
    assert "stream small" in locust_stats and "stream big" in locust_stats, locust_stats
