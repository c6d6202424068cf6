"""request_timeout_s holds: a non-streamed request past it gets a 504 envelope, a stream gets one error chunk and
[DONE], and the engine frees the request's blocks (the autouse fixture checks)."""
import json

import httpx
import pytest

from tests.serve.conftest import ingress_only_app

pytestmark = pytest.mark.slow
LONG = {"prompt": "Write a long story.", "max_tokens": 256, "ignore_eos": True}


@pytest.fixture(scope="module")
def impatient(serve_app, replica_handle):
    with ingress_only_app(serve_app, replica_handle, "impatient", request_timeout_s=1.0) as base:
        yield base


def test_a_request_past_its_timeout_gets_a_504_envelope(impatient, auth):
    r = httpx.post(impatient + "/v1/completions", json=LONG, headers=auth, timeout=60)
    assert r.status_code == 504, r.text
    error = r.json()["error"]
    assert error["code"] == "timeout" and error["type"] == "timeout_error" and "1 s" in error["message"]


def test_a_stream_past_its_timeout_ends_with_one_error_chunk_and_done(impatient, auth):
    with httpx.stream("POST", impatient + "/v1/completions", json={**LONG, "stream": True}, headers=auth, timeout=60) as r:
        assert r.status_code == 200
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) > 1 and all("error" not in c for c in chunks[:-1]), "tokens streamed before the deadline"
    assert chunks[-1] == {"error": {"message": "request timed out", "type": "timeout_error", "param": None, "code": "timeout"}}
