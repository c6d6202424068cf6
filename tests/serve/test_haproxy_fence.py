"""serve_app/haproxy_fence.py on the config Ray 2.60 renders itself, run by the HAProxy that ray[serve] ships."""
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
from ray.serve._private.haproxy import BackendConfig, HAProxyApi, HAProxyConfig, ServerConfig
from ray.serve.config import HTTPOptions

from serve_app.haproxy_fence import ERRORS, bundled_haproxy, fence
from serve_app.ray_env import HAPROXY_FENCE
from loadtest.loopback import free_port
from tests.serve.test_hostile_input import seconds_until_the_server_hangs_up

HEADER_TIMEOUT_S = 2.0


@pytest.fixture
def ray_config(tmp_path) -> dict:
    """haproxy.cfg as Ray's HAProxyManager writes it: its template, its defaults, one app whose replica is gone."""
    ports = {"http": free_port(), "stats": free_port(), "metrics": free_port(), "replica": free_port()}
    cfg = HAProxyConfig(http_options=HTTPOptions(host="127.0.0.1", port=ports["http"]), stats_port=ports["stats"],
                        metrics_port=ports["metrics"], socket_path=str(tmp_path / "admin.sock"),
                        enable_hap_optimization=False, metrics_enabled=False)
    replica = ServerConfig(name="replica", host="127.0.0.1", port=ports["replica"])
    api = HAProxyApi(cfg, {"llm": BackendConfig(name="llm", path_prefix="/v1", servers=[replica], app_name="llm")},
                     config_file_path=str(tmp_path / "haproxy.cfg"))
    api._generate_config_file_internal()  # what HAProxyApi.start() writes before it starts the binary
    return {"path": tmp_path / "haproxy.cfg", "ports": ports}


def test_the_fence_closes_what_rays_config_leaves_open_and_haproxy_accepts_it(ray_config, tmp_path):
    text = ray_config["path"].read_text()
    assert "timeout http-request" not in text and "bind *:%d" % ray_config["ports"]["stats"] in text  # still so in Ray
    assert "option splice-request" in text  # still so in Ray: HAProxy then misses a client's close (module docstring)
    fenced = fence(text, HEADER_TIMEOUT_S, tmp_path)
    defaults = fenced.split("\ndefaults\n", 1)[1].split("\nfrontend ", 1)[0]
    assert "timeout http-request 2000ms" in defaults
    for status in ERRORS:
        assert f"errorfile {status} {tmp_path / f'{status}.http'}" in defaults
    assert "500.http" not in fenced
    assert "option splice-request" not in fenced and "option splice-response" in defaults
    assert f"bind 127.0.0.1:{ray_config['ports']['stats']}" in fenced
    assert f"bind 127.0.0.1:{ray_config['ports']['metrics']}" in fenced
    assert fence(fenced, HEADER_TIMEOUT_S, tmp_path) == fenced
    ray_config["path"].write_text(fenced)
    for status in ERRORS:
        (tmp_path / f"{status}.http").write_bytes(b"HTTP/1.1 %d x\r\nContent-Length: 0\r\n\r\n" % status)
    checked = subprocess.run([bundled_haproxy(), "-c", "-f", str(ray_config["path"])], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr


@pytest.fixture
def fenced_haproxy(ray_config):
    """Started the way Ray starts it, with this project's console script as RAY_SERVE_HAPROXY_BINARY_PATH."""
    assert HAPROXY_FENCE.parent == Path(sys.executable).parent, "the console script sits beside this python"
    proc = subprocess.Popen([str(HAPROXY_FENCE), "-db", "-f", str(ray_config["path"])],
                            env={"PATH": "/usr/bin:/bin", "LLM_SERVE_HEADER_TIMEOUT_S": str(HEADER_TIMEOUT_S)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{ray_config['ports']['http']}"
    deadline = time.monotonic() + 20
    while True:
        try:
            socket.create_connection(("127.0.0.1", ray_config["ports"]["http"]), timeout=1).close()
            break
        except OSError:
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline, "HAProxy did not start listening"
            time.sleep(0.1)
    yield {"url": url, "proc": proc, **ray_config}
    proc.terminate()
    proc.wait(10)


def test_haproxy_runs_as_ray_started_it_with_its_admin_ports_on_loopback(fenced_haproxy):
    haproxy = psutil.Process(fenced_haproxy["proc"].pid)  # exec'd: Ray's pid is HAProxy's
    assert haproxy.cmdline()[1:] == ["-db", "-f", str(fenced_haproxy["path"])]  # what Ray's /proc checks look for
    assert Path(haproxy.exe()).name == "haproxy"
    listening = {c.laddr.port: c.laddr.ip for c in haproxy.net_connections("tcp") if c.status == psutil.CONN_LISTEN}
    ports = fenced_haproxy["ports"]
    assert listening == {ports["http"]: "127.0.0.1", ports["stats"]: "127.0.0.1", ports["metrics"]: "127.0.0.1"}


def test_no_replica_to_forward_to_is_a_503_openai_envelope(fenced_haproxy):
    response = httpx.post(f"{fenced_haproxy['url']}/v1/chat/completions", json={"messages": []}, timeout=30)
    assert response.status_code == 503, response.text
    assert response.json()["error"]["type"] == "service_unavailable"


def test_a_path_no_app_serves_is_a_404_openai_envelope_naming_it(fenced_haproxy):
    response = httpx.get(f'{fenced_haproxy["url"]}/v2/"odd"\\path', timeout=10)
    assert response.status_code == 404, response.text
    error = response.json()["error"]  # valid JSON whatever the path holds
    sent = response.request.url.raw_path.decode()  # as it went on the wire: quotes percent-encoded, a backslash not
    assert error["type"] == "not_found_error" and error["message"].endswith(f" {sent}") and "\\" in sent, error


@pytest.mark.parametrize("drip", [b"X-Slow: 1\r\n", None], ids=["headers-a-line-at-a-time", "nothing-at-all"])
async def test_a_client_slow_with_its_headers_is_cut_off_at_the_header_deadline(fenced_haproxy, drip):
    """In Ray's own config this connection stays open for `timeout client`, 3,600 s."""
    waited, answer = await seconds_until_the_server_hangs_up(fenced_haproxy["url"], drip, limit_s=15)
    assert HEADER_TIMEOUT_S - 0.5 <= waited < HEADER_TIMEOUT_S + 3, waited
    assert answer.startswith(b"HTTP/1.1 408 "), answer  # HAProxy's own HTML: no errorfile reaches that stage
