"""Generates the Grafana dashboards (grafana-foundation-sdk) into dashboards/grafana/*.json.

python -m dashboards.build           # write
python -m dashboards.build --check   # exit 1 if the committed JSON is stale

Every expression here is evaluated against a live Prometheus in tests/observability.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from grafana_foundation_sdk.builders.dashboard import Dashboard, DatasourceVariable, QueryVariable, Row
from grafana_foundation_sdk.builders.prometheus import Dataquery
from grafana_foundation_sdk.builders.timeseries import Panel as Timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import DataSourceRef, GridPos, VariableRefresh

OUT = Path(__file__).parent / "grafana"
DS = DataSourceRef(type_val="prometheus", uid="${datasource}")
MODEL = 'model_name=~"$model_name"'
RATE = "$__rate_interval"


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str


def rate(metric: str, by: str = "", labels: str = MODEL) -> str:
    grouping = f" by ({by})" if by else ""
    return f"sum{grouping} (rate({metric}{{{labels}}}[{RATE}]))"


def quantiles(histogram: str, by: str = "", labels: str = MODEL) -> list[Query]:
    keys = f"le, {by}" if by else "le"
    prefix = f"{{{{{by}}}}} " if by else ""
    return [Query(f"histogram_quantile({q}, sum by ({keys}) (rate({histogram}_bucket{{{labels}}}[{RATE}])))", f"{prefix}p{round(q * 100)}")
            for q in (0.5, 0.95, 0.99)]


def panel(title: str, unit: str, queries: list[Query], x: int, y: int, w: int = 12, h: int = 8, description: str = "") -> Timeseries:
    p = Timeseries().title(title).unit(unit).datasource(DS).grid_pos(GridPos(h=h, w=w, x=x, y=y))
    if description:
        p = p.description(description)
    for i, q in enumerate(queries):
        p = p.with_target(Dataquery().expr(q.expr).legend_format(q.legend).ref_id(chr(ord("A") + i)).datasource(DS))
    return p


def variables(dashboard: Dashboard) -> Dashboard:
    return (dashboard
            .with_variable(DatasourceVariable("datasource").label("Data source").type("prometheus"))
            .with_variable(QueryVariable("model_name").label("Model").datasource(DS)
                           .query("label_values(ray_engine_num_requests_running, model_name)")
                           .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED).include_all(True).all_value(".*").multi(True)))


HTTP_RATE = f"sum by (status_code) (rate(ray_serve_num_http_requests_total[{RATE}]))"
ERROR_RATIO = (f'(sum(rate(ray_serve_num_http_requests_total{{status_code=~"5.."}}[{RATE}])) or vector(0))'
               f" / sum(rate(ray_serve_num_http_requests_total[{RATE}]))")


def overview() -> Dashboard:
    d = variables(Dashboard("LLM serving: overview").uid("llm-serve-overview").tags(["llm-serve"])
                  .refresh("10s").time("now-30m", "now"))
    panels = [
        Row("Traffic"),
        panel("Requests/s by HTTP status", "reqps", [Query(HTTP_RATE, "{{status_code}}")], 0, 1),
        panel("Error ratio (5xx)", "percentunit", [Query(ERROR_RATIO, "5xx share")], 12, 1),
        panel("End-to-end latency", "s", quantiles("ray_engine_e2e_request_latency_seconds"), 0, 9, 8),
        panel("Time to first token", "s", quantiles("ray_engine_time_to_first_token_seconds"), 8, 9, 8),
        panel("Inter-token latency", "s", quantiles("ray_engine_inter_token_latency_seconds"), 16, 9, 8),
        Row("Engine"),
        panel("Tokens/s", "short", [Query(rate("ray_engine_prompt_tokens_total"), "prompt"),
                                    Query(rate("ray_engine_generation_tokens_total"), "generation")], 0, 18, 8),
        panel("Running and waiting requests", "short", [
            Query(f"sum(ray_engine_num_requests_running{{{MODEL}}})", "running"),
            Query(f"sum(ray_engine_num_requests_waiting{{{MODEL}}})", "waiting")], 8, 18, 8),
        panel("KV cache usage", "percentunit", [Query(f"max(ray_engine_kv_cache_usage_ratio{{{MODEL}}})", "fullest replica"),
                                                Query(f"avg(ray_engine_kv_cache_usage_ratio{{{MODEL}}})", "mean")], 16, 18, 8),
        panel("Preemptions/s", "short", [Query(rate("ray_engine_num_preemptions_total"), "preemptions")], 0, 26, 8,
              description="Sequences evicted to free KV blocks and recomputed later: a sign the pool is too small"),
        panel("Prefix-cache hit rate", "percentunit", [Query(
            f"{rate('ray_engine_prefix_cache_hits_total')} / {rate('ray_engine_prefix_cache_queries_total')}", "hit rate")],
              8, 26, 8, description="Prompt tokens served from cached KV blocks"),
        panel("Engine steps/s", "short", [Query(rate("ray_engine_steps_total"), "steps")], 16, 26, 8,
              description="Zero while requests are running means the step loop is stalled"),
        panel("Speculative tokens/s", "short", [
            Query(rate("ray_engine_spec_decode_num_draft_tokens_total"), "proposed"),
            Query(rate("ray_engine_spec_decode_num_accepted_tokens_total"), "accepted")], 0, 34, 12,
              description="n-gram drafts verified and accepted; none while the batch is past disable_by_batch_size"),
        panel("Speculative acceptance rate", "percentunit", [Query(
            f"{rate('ray_engine_spec_decode_num_accepted_tokens_total')} / "
            f"{rate('ray_engine_spec_decode_num_draft_tokens_total')}", "accepted / proposed")], 12, 34, 12,
              description="Share of draft tokens the model confirmed; each accepted draft is a token without a step"),
        Row("Ray Serve"),
        panel("Replicas", "short", [
            Query("sum by (deployment) (ray_serve_deployment_replica_healthy)", "{{deployment}} healthy"),
            Query("max by (deployment) (ray_serve_autoscaling_target_replicas)", "{{deployment}} target"),
            Query("max by (deployment) (ray_serve_autoscaling_desired_replicas)", "{{deployment}} policy wants")], 0, 43,
              description="What the autoscaling policy asks for, before Serve's delays; with autoscaling_policy: engine "
                          "its inputs are the KV cache, waiting, preemption and time-to-first-token panels"),
        panel("Ingress queue", "short", [
            Query("sum(ray_serve_num_ongoing_http_requests)", "ongoing at the proxy"),
            Query("sum by (deployment) (ray_serve_deployment_queued_queries)", "{{deployment}} queued in handles")], 12, 43),
    ]
    for p in panels:
        d = d.with_row(p) if isinstance(p, Row) else d.with_panel(p)
    return d


def per_replica() -> Dashboard:
    d = variables(Dashboard("LLM serving: per replica").uid("llm-serve-replica").tags(["llm-serve"])
                  .refresh("10s").time("now-30m", "now"))
    d = d.with_variable(QueryVariable("replica").label("Replica").datasource(DS)
                        .query('label_values(ray_engine_num_requests_running{model_name=~"$model_name"}, replica)')
                        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED).include_all(True).all_value(".*").multi(True))
    labels = f'{MODEL}, replica=~"$replica"'
    panels = [
        panel("Running requests", "short", [Query(f"sum by (replica) (ray_engine_num_requests_running{{{labels}}})", "{{replica}}")], 0, 0),
        panel("Waiting requests", "short", [Query(f"sum by (replica) (ray_engine_num_requests_waiting{{{labels}}})", "{{replica}}")], 12, 0),
        panel("KV cache usage", "percentunit", [Query(f"max by (replica) (ray_engine_kv_cache_usage_ratio{{{labels}}})", "{{replica}}")], 0, 8),
        panel("Generation tokens/s", "short", [Query(rate("ray_engine_generation_tokens_total", "replica", labels), "{{replica}}")], 12, 8),
        panel("Time to first token", "s", quantiles("ray_engine_time_to_first_token_seconds", "replica", labels)[1:2], 0, 16),
        panel("Engine steps/s", "short", [Query(rate("ray_engine_steps_total", "replica", labels), "{{replica}}")], 12, 16),
        panel("Tokens per step", "short", quantiles("ray_engine_iteration_tokens", "replica", labels)[:2], 0, 24),
        panel("Preemptions/s", "short", [Query(rate("ray_engine_num_preemptions_total", "replica", labels), "{{replica}}")], 12, 24),
        panel("Step time by phase", "percentunit", [Query(rate("ray_engine_step_phase_seconds_total", "replica, phase", labels),
                                                          "{{replica}} {{phase}}")], 0, 32,
              description="Share of wall time in each phase of the step loop; a phase that grows while the load holds "
                          "is where a slowdown lives"),
        # the counter exists only after a first collection, and the native engine's core may go minutes without one
        panel("Garbage-collector pauses", "percentunit", [Query(rate("ray_engine_gc_pause_seconds_total", "replica, generation", labels)
                                                                + " or vector(0)", "{{replica}} gen {{generation}}")], 12, 32,
              description="Share of wall time the process spent collecting garbage (0: no collection yet)"),
        panel("Resident memory", "bytes", [Query(f"max by (replica) (ray_engine_resident_memory_bytes{{{labels}}})", "{{replica}}")],
              0, 40, description="A replica's process; growth at a steady load is a leak"),
        # the counter exists only after a first step launched ahead: none where async scheduling is off
        panel("Steps launched ahead", "percentunit", [Query(
            f"{rate('ray_engine_steps_launched_ahead_total', 'replica', labels)} / "
            f"{rate('ray_engine_steps_total', 'replica', labels)} or vector(0)", "{{replica}}")], 12, 40,
              description="Share of steps launched before the step before them was read (async_scheduling: true), so "
                          "the host's work overlapped the GPU's; logprobs, penalties, bias, grammars, new arrivals and "
                          "prefills land a step first (0: async scheduling off, or no step could fly)"),
        # the counter exists only after a first adapter loaded from lora_root
        panel("LoRA adapter loads/s", "short", [Query(
            f"{rate('ray_engine_lora_loads_total', 'replica', labels)} or vector(0)", "{{replica}}")], 0, 48,
              description="Adapters read from lora_root and put on the model; a steady rate is replicas taking turns "
                          "with more adapters than max_loras holds: raise it, or add replicas (in split, an adapter's "
                          "requests go to a replica holding it)"),
    ]
    for p in panels:
        d = d.with_panel(p)
    return d


DASHBOARDS = {"overview.json": overview, "replica.json": per_replica}


def render() -> dict[str, str]:
    encoder = JSONEncoder(sort_keys=True, indent=2)
    return {name: encoder.encode(build().build()) + "\n" for name, build in DASHBOARDS.items()}


def panel_queries(dashboard_json: str) -> list[tuple[str, str]]:
    """(panel title, expr) for every target of every panel."""
    model = json.loads(dashboard_json)
    return [(p["title"], t["expr"]) for p in model.get("panels", []) for t in p.get("targets", []) if "expr" in t]


def main() -> None:
    check = "--check" in sys.argv
    OUT.mkdir(exist_ok=True)
    stale = []
    for name, text in render().items():
        path = OUT / name
        if check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            path.write_text(text)
            print(f"wrote {path}")
    if stale:
        sys.exit(f"stale dashboards (run python -m dashboards.build): {', '.join(stale)}")


if __name__ == "__main__":
    main()
