"""Every dashboard query and alert rule, evaluated by a real Prometheus scraping the real app after mixed traffic."""
import asyncio
import json
import logging
import shutil
import time
from pathlib import Path

import httpx
import pytest
import yaml

from dashboards.build import panel_queries, render
from dashboards.report import substitute
from tests.prometheus_server import query, running_prometheus
from tests.serve.conftest import whole_app

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True, scope="module")
def prometheus_is_installed():
    assert shutil.which("prometheus"), "Prometheus is missing: `make prometheus` installs it (never a silent skip)"
log = logging.getLogger(__name__)
ROOT = Path(__file__).resolve().parents[2]
MODEL = "obs-model"
SHARED_PREFIX = "You are a careful assistant who answers in one short paragraph. " * 4


@pytest.fixture(scope="module")
def obs_app(serve_app):
    """A second app with a tiny KV pool (so preemptions happen), its own model_name (so counts are exact) and NF4
    weights (so a non-default engine setting is shown to reach a served engine)."""
    engine_config = {**serve_app["args"]["engine_config"], "num_kv_blocks": 24, "max_num_seqs": 8, "quantization": "nf4",
              "speculative": {"num_speculative_tokens": 3, "disable_by_batch_size": 8, "weigh_cost": False}}
    # NF4 through bitsandbytes is slow on CPUs without AVX-512 (an AVX2 EPYC ran past the session app's 60 s): this
    # test is about metrics, not deadlines
    with whole_app(serve_app, "obs", served_model_name=MODEL, engine_config=engine_config, request_timeout_s=300) as base:
        yield base


def test_the_second_app_serves_nf4_with_its_own_engine_settings(obs_app):
    from ray import serve

    effective = serve.get_deployment_handle("EngineReplica", app_name="obs").info.remote().result(timeout_s=10)["engine"]
    assert (effective["model_impl"], effective["linear_type"], effective["num_kv_blocks"], effective["max_num_seqs"]) == \
        ("native", "Linear4bit", 24, 8)


@pytest.fixture(scope="module")
def prometheus(serve_app, tmp_path_factory):
    with running_prometheus([f"127.0.0.1:{serve_app['metrics_port']}"], tmp_path_factory.mktemp("prometheus"),
                            [str(ROOT / "dashboards/alerts.yml")]) as url:
        yield url


async def mixed_traffic(base: str, auth: dict) -> dict:
    """Normal, streaming, shared-prefix, preempting, erroring and cancelled requests. Returns what must be counted."""
    sent = {"ok": 0, "completion_tokens": 0, "cancelled": 0, "cancelled_max_tokens": 0}
    async with httpx.AsyncClient(base_url=base, headers=auth, timeout=300) as client:
        async def complete(prompt: str, max_tokens: int) -> None:
            r = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True})
            assert r.status_code == 200, r.text
            sent["ok"] += 1
            sent["completion_tokens"] += r.json()["usage"]["completion_tokens"]

        async def stream_chat(content: str) -> None:
            body = {"messages": [{"role": "user", "content": content}], "max_tokens": 24, "stream": True,
                    "stream_options": {"include_usage": True}}
            async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                lines = [line async for line in r.aiter_lines() if line.startswith("data: {")]
            sent["ok"] += 1
            sent["completion_tokens"] += json.loads(lines[-1][len("data: "):])["usage"]["completion_tokens"]

        for i in range(3):  # one after another, so the later ones hit the cached prefix blocks
            await complete(SHARED_PREFIX + f"Question {i}: why is the sky blue?", 8)
        await asyncio.gather(*(stream_chat(f"Tell me about the number {i}.") for i in range(4)))
        # 8 requests of ~105 tokens (7 blocks) each against a 24-block pool (max_num_seqs 8): any four running at
        # once outgrow it, so some must be preempted and recomputed (at ~55 tokens all eight had to overlap to the
        # end, and on a fast CPU they once did not). Few new tokens: NF4 through bitsandbytes is slow on AVX2-only CPUs
        await asyncio.gather(*(complete(f"Count slowly from {i}: " + "one, two, three, four, five, " * 5, 48)
                               for i in range(8)))
        assert (await client.post("/v1/completions", json={"prompt": "", "max_tokens": 4})).status_code == 400
        assert (await client.post("/v1/completions", json={"prompt": "hi", "model": "nope"})).status_code == 404
        body = {"prompt": "Write a very long story.", "max_tokens": 200, "stream": True, "ignore_eos": True}
        async with client.stream("POST", "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    break  # the client walks away mid-stream
        sent["cancelled"], sent["cancelled_max_tokens"] = 1, 200
    return sent


def wait_for(prom: str, expr: str, want, timeout: float = 60) -> float:
    deadline = time.monotonic() + timeout
    while True:
        result = query(prom, expr)
        value = float(result[0]["value"][1]) if result else None
        if value is not None and want(value):
            return value
        assert time.monotonic() < deadline, f"{expr} = {value}"
        time.sleep(1)


def test_every_panel_and_rule_evaluates_against_live_prometheus(obs_app, prometheus, auth):
    sent = asyncio.run(mixed_traffic(obs_app, auth))
    selector = f'model_name="{MODEL}"'
    finished = wait_for(prometheus, f'sum(ray_engine_request_success_total{{{selector}, finish_reason=~"stop|length"}})',
                        lambda v: v >= sent["ok"])
    assert finished == sent["ok"], "a request was counted twice"
    wait_for(prometheus, f'sum(ray_engine_request_success_total{{{selector}, finish_reason="abort"}})', lambda v: v >= 1)
    generated = wait_for(prometheus, f"sum(ray_engine_generation_tokens_total{{{selector}}})",
                         lambda v: v >= sent["completion_tokens"])
    assert generated <= sent["completion_tokens"] + sent["cancelled_max_tokens"], (generated, sent)
    wait_for(prometheus, f"sum(ray_engine_num_preemptions_total{{{selector}}})", lambda v: v > 0)
    wait_for(prometheus, f"sum(ray_engine_prefix_cache_hits_total{{{selector}}})", lambda v: v > 0)
    wait_for(prometheus, f"sum(ray_engine_spec_decode_num_draft_tokens_total{{{selector}}})", lambda v: v > 0)
    # set once by the core as it attaches its metrics, replayed by the replica like every other update
    wait_for(prometheus, f'max(ray_engine_cache_config_info{{{selector}, kv_cache_dtype!="", block_size!=""}})',
             lambda v: v == 1)
    time.sleep(3)  # one more scrape, so every rate() has two samples after the last event

    empty = []
    for name, text in render().items():
        for title, expr in panel_queries(text):
            if not query(prometheus, substitute(expr, "3m", MODEL)):
                empty.append(f"{name} / {title}: {expr}")
    assert not empty, "panels with no data:\n" + "\n".join(empty)

    labels = httpx.get(prometheus + "/api/v1/label/model_name/values",
                       params={"match[]": "ray_engine_num_requests_running"}, timeout=10).json()["data"]
    assert MODEL in labels  # the $model_name variable's query
    rules = yaml.safe_load((ROOT / "dashboards/alerts.yml").read_text())["groups"][0]["rules"]
    for rule in rules:
        query(prometheus, rule["expr"])  # parses and evaluates
    deadline = time.monotonic() + 40  # rules are evaluated every 15 s; "unknown" only means not yet
    while True:
        loaded = httpx.get(prometheus + "/api/v1/rules", timeout=10).json()["data"]["groups"][0]["rules"]
        if all(r["health"] != "unknown" for r in loaded) or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert {r["name"] for r in loaded} == {r["alert"] for r in rules}
    assert all(r["health"] == "ok" for r in loaded), [(r["name"], r["health"], r.get("lastError")) for r in loaded]
    from ray import serve

    stats = serve.get_deployment_handle("EngineReplica", app_name="obs").stats.remote().result(timeout_s=10)
    assert stats.engine.kv_blocks_free == stats.engine.kv_blocks_total and stats.engine.num_running == 0, stats
    log.warning("dashboards: %d panel queries non-empty; %d alert rules evaluate; sent %s",
                sum(len(panel_queries(t)) for t in render().values()), len(rules), sent)
