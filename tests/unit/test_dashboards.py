"""The shipped dashboards are current and load through the SDK's model; Prometheus accepts the config and rules."""
import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from grafana_foundation_sdk.models.dashboard import Dashboard

from dashboards.build import OUT, panel_queries, render

ROOT = Path(__file__).resolve().parents[2]
PANELS_ASKED_FOR = ["Requests/s by HTTP status", "End-to-end latency", "Time to first token", "Inter-token latency",
                    "Tokens/s", "Running and waiting requests", "KV cache usage", "Preemptions/s",
                    "Prefix-cache hit rate", "Replicas", "Ingress queue", "Error ratio (5xx)",
                    "Speculative tokens/s", "Speculative acceptance rate"]


def test_committed_dashboards_match_the_generator():
    for name, text in render().items():
        assert (OUT / name).read_text() == text, f"{name} is stale: run python -m dashboards.build"


@pytest.mark.parametrize("name", ["overview.json", "replica.json"])
def test_dashboards_load_through_the_sdk_model_with_variables(name):
    data = json.loads((OUT / name).read_text())
    model = Dashboard.from_json(data)
    assert model.uid == data["uid"] and len(model.panels) == len(data["panels"])
    names = {v["name"] for v in data["templating"]["list"]}
    assert {"datasource", "model_name"} <= names
    for _, expr in panel_queries((OUT / name).read_text()):
        assert expr.count("(") == expr.count(")"), expr


def test_overview_has_every_panel_asked_for():
    titles = {title for title, _ in panel_queries((OUT / "overview.json").read_text())}
    assert set(PANELS_ASKED_FOR) <= titles, set(PANELS_ASKED_FOR) - titles


@pytest.mark.parametrize("args", [["check", "config", "dashboards/prometheus.yml"], ["check", "rules", "dashboards/alerts.yml"]])
def test_promtool_accepts_config_and_rules(args):
    r = subprocess.run(["promtool", *args], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_every_alert_fires_on_synthetic_series_and_clears():
    r = subprocess.run(["promtool", "test", "rules", "dashboards/alerts.test.yml"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    tested = set(re.findall(r"alertname: (\w+)", (ROOT / "dashboards/alerts.test.yml").read_text()))
    rules = yaml.safe_load((ROOT / "dashboards/alerts.yml").read_text())["groups"][0]["rules"]
    assert tested == {rule["alert"] for rule in rules}, "every alert rule needs its fire-and-clear test"


def test_a_broken_alert_expression_fails_the_rule_tests(tmp_path):
    rules = (ROOT / "dashboards/alerts.yml").read_text().replace("rate(ray_engine_steps_total[2m])) == 0",
                                                                 "rate(ray_engine_steps_total[2m])) < 0")
    (tmp_path / "alerts.yml").write_text(rules)
    (tmp_path / "alerts.test.yml").write_text((ROOT / "dashboards/alerts.test.yml").read_text())
    r = subprocess.run(["promtool", "test", "rules", "alerts.test.yml"], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode != 0 and "LLMServeEngineStalled" in r.stdout + r.stderr
