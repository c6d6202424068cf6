"""A real Prometheus for tests: started on loopback, scraping the given targets every second."""
from __future__ import annotations

import contextlib
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import yaml

from loadtest.loopback import free_port

ROOT = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def running_prometheus(targets: list[str], workdir: Path, rule_files: list[str] = ()):
    """Yields the base URL of a Prometheus using dashboards/prometheus.yml, its scrape pointed at `targets`."""
    assert shutil.which("prometheus"), "Prometheus is missing: `make prometheus` installs it (never a silent skip)"
    config = yaml.safe_load((ROOT / "dashboards/prometheus.yml").read_text())
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    config["rule_files"] = list(rule_files)
    config["scrape_configs"][0]["static_configs"] = [{"targets": targets}]
    (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    proc = subprocess.Popen(["prometheus", f"--config.file={workdir / 'prometheus.yml'}", f"--storage.tsdb.path={workdir / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while not _ready(url):
            assert time.monotonic() < deadline and proc.poll() is None, "prometheus did not start"
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def _ready(url: str) -> bool:
    try:
        return httpx.get(url + "/-/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def query(prom: str, expr: str) -> list:
    r = httpx.get(prom + "/api/v1/query", params={"query": expr}, timeout=10)
    assert r.status_code == 200 and r.json()["status"] == "success", f"{expr}\n{r.text}"
    return r.json()["data"]["result"]
