"""Engine metrics, defined once (design.md section 5): specs, a sink interface, and the prometheus_client sink.

The engine flushes one batch of updates per step through `StepMetrics`; the sink decides where they go. Inside Ray
Serve that is `serve_app.metrics.RaySink`; standalone it is `PrometheusSink`. Counters are named by their base name:
both sinks export them with a `_total` suffix.
"""
from __future__ import annotations

import operator
import time
from dataclasses import dataclass, field
from typing import Callable, Literal, Protocol

from engine.core_messages import MetricUpdate
from engine.engine_stats import EngineStats
from engine.step_stats import GENERATIONS, PHASES

Kind = Literal["counter", "gauge", "histogram"]

TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 45, 60)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2.5, 5)
# Prometheus interpolates a quantile linearly inside its bucket, so a wide bucket at the SLO misreads it: with
# 20 -> 30 s the dashboard's p95 read 29-30 s while Locust measured 23.2 s. From 5 to 60 s (the SLO, 30 s by default,
# and the load test's range) each bucket is at most 10% wider than the last: the p95 reads within 5% of the true
# one (tests/engine/test_metrics.py checks it against a real Prometheus).
E2E_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 5.5, 6, 6.5, 7, 7.5, 8, 8.5, 9, 9.5, 10, 11, 12, 13, 14, 15, 16.5, 18, 19.5, 21,
               23, 25, 27.5, 30, 33, 36, 39, 42, 46, 50, 55, 60, 75, 90, 120, 180, 300, 450, 600)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600)
STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


@dataclass(frozen=True)
class Metric:
    name: str
    kind: Kind
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()


METRICS: dict[str, Metric] = {m.name: m for m in [
    Metric("engine_num_requests_running", "gauge", "Sequences in the running batch"),
    Metric("engine_num_requests_waiting", "gauge", "Requests queued, not yet scheduled"),
    Metric("engine_kv_cache_usage_ratio", "gauge", "Used KV blocks / total KV blocks"),
    Metric("engine_kv_cache_blocks", "gauge", "KV blocks in the pool: num_kv_blocks, or what the memory profile chose"),
    Metric("engine_cache_config_info", "gauge", "1, labelled with the KV cache's settings (vLLM's cache_config_info)",
           ("kv_cache_dtype", "block_size")),
    Metric("engine_prompt_tokens", "counter", "Prefill tokens computed"),
    Metric("engine_generation_tokens", "counter", "Tokens generated"),
    Metric("engine_prefix_cache_queries", "counter", "Prompt tokens looked up in the prefix cache"),
    Metric("engine_prefix_cache_hits", "counter", "Prompt tokens found in the prefix cache"),
    Metric("engine_num_preemptions", "counter", "Sequences preempted (recomputed later)"),
    Metric("engine_request_success", "counter", "Finished requests", ("finish_reason",)),
    Metric("engine_steps", "counter", "Engine steps"),
    Metric("engine_steps_launched_ahead", "counter",
           "Steps launched before the step before them was read (async scheduling): their host work overlapped"),
    Metric("engine_spec_decode_num_drafts", "counter", "Sequence-steps that verified speculative drafts"),
    Metric("engine_spec_decode_num_draft_tokens", "counter", "Speculative draft tokens verified"),
    Metric("engine_spec_decode_num_accepted_tokens", "counter", "Speculative draft tokens accepted"),
    Metric("engine_time_to_first_token_seconds", "histogram", "Arrival to first token", buckets=TTFT_BUCKETS),
    Metric("engine_inter_token_latency_seconds", "histogram", "Time between tokens of a request", buckets=ITL_BUCKETS),
    Metric("engine_e2e_request_latency_seconds", "histogram", "Arrival to finish", buckets=E2E_BUCKETS),
    Metric("engine_request_queue_time_seconds", "histogram", "Arrival to first scheduled", buckets=QUEUE_BUCKETS),
    Metric("engine_iteration_tokens", "histogram", "Tokens per engine step", buckets=STEP_TOKEN_BUCKETS),
    Metric("engine_step_phase_seconds", "counter", "Step time by phase: schedule, prepare, forward, sample, output",
           ("phase",)),
    Metric("engine_gc_collections", "counter", "Garbage collections in the engine's process", ("generation",)),
    Metric("engine_gc_pause_seconds", "counter", "Time the garbage collector paused the process", ("generation",)),
    Metric("engine_resident_memory_bytes", "gauge", "Resident memory of the engine's process"),
    Metric("engine_lora_requests", "counter", "Requests on a LoRA adapter, counted at their first token", ("lora_name",)),
    Metric("engine_lora_generation_tokens", "counter", "Tokens generated on a LoRA adapter", ("lora_name",)),
    Metric("engine_lora_loads", "counter", "LoRA adapters loaded from lora_root, each time again after being dropped"),
]}
# counter -> the EngineStats field that holds its running total
COUNTER_SOURCES = {"engine_prompt_tokens": "prompt_tokens", "engine_generation_tokens": "generation_tokens",
                   "engine_prefix_cache_queries": "prefix_cache_queries", "engine_prefix_cache_hits": "prefix_cache_hits",
                   "engine_num_preemptions": "num_preemptions", "engine_steps": "num_steps",
                   "engine_steps_launched_ahead": "num_steps_ahead", "engine_lora_loads": "lora_loads",
                   "engine_spec_decode_num_drafts": "spec_drafts", "engine_spec_decode_num_draft_tokens": "spec_draft_tokens",
                   "engine_spec_decode_num_accepted_tokens": "spec_accepted_tokens"}
# labelled counter -> (its label, the EngineStats field holding the running totals by label value, the values)
LABELLED_COUNTER_SOURCES = {
    "engine_step_phase_seconds": ("phase", "step_seconds", PHASES),
    "engine_gc_collections": ("generation", "gc_collections", GENERATIONS),
    "engine_gc_pause_seconds": ("generation", "gc_pause_seconds", GENERATIONS),
}
Reading = Callable[[EngineStats], float]


class MetricsSink(Protocol):
    """Where updates go. `labels` always holds model_name plus the metric's own labels."""

    def inc(self, name: str, value: float, labels: dict[str, str]) -> None: ...
    def set(self, name: str, value: float, labels: dict[str, str]) -> None: ...
    def observe(self, name: str, values: list[float], labels: dict[str, str]) -> None: ...


class PrometheusSink:
    """prometheus_client objects for a standalone engine; `serve(port)` exposes them on 127.0.0.1."""

    def __init__(self, registry=None):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = registry or CollectorRegistry()
        kinds = {"counter": Counter, "gauge": Gauge, "histogram": Histogram}
        self._metrics = {}
        for m in METRICS.values():
            extra = {"buckets": m.buckets} if m.kind == "histogram" else {}
            self._metrics[m.name] = kinds[m.kind](m.name, m.help, ("model_name", *m.labels), registry=self.registry, **extra)

    def inc(self, name: str, value: float, labels: dict[str, str]) -> None:
        self._metrics[name].labels(**labels).inc(value)

    def set(self, name: str, value: float, labels: dict[str, str]) -> None:
        self._metrics[name].labels(**labels).set(value)

    def observe(self, name: str, values: list[float], labels: dict[str, str]) -> None:
        child = self._metrics[name].labels(**labels)
        for value in values:
            child.observe(value)

    def serve(self, port: int, addr: str = "127.0.0.1") -> None:
        from prometheus_client import start_http_server

        start_http_server(port, addr, registry=self.registry)


class RecordingSink:
    """Keeps the calls instead of making them: an engine core process sends them to the front end, whose sink
    (Ray's metrics) lives there."""

    def __init__(self):
        self.updates: list[MetricUpdate] = []

    def inc(self, name: str, value: float, labels: dict[str, str]) -> None:
        self.updates.append(MetricUpdate("inc", name, value, labels))

    def set(self, name: str, value: float, labels: dict[str, str]) -> None:
        self.updates.append(MetricUpdate("set", name, value, labels))

    def observe(self, name: str, values: list[float], labels: dict[str, str]) -> None:
        self.updates.append(MetricUpdate("observe", name, list(values), labels))

    def take(self) -> list[MetricUpdate]:
        updates, self.updates = self.updates, []
        return updates


def replay(updates: list[MetricUpdate], sink: MetricsSink) -> None:
    for update in updates:
        getattr(sink, update.kind)(update.name, update.value, update.labels)


@dataclass
class StepMetrics:
    """What one engine step produced, gathered while it runs and flushed to the sink once at its end."""

    sink: MetricsSink
    model_name: str
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    queue_time: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    finish_reasons: dict[str, int] = field(default_factory=dict)
    lora_requests: dict[str, int] = field(default_factory=dict)  # adapter -> requests that got their first token
    lora_tokens: dict[str, int] = field(default_factory=dict)  # adapter -> tokens generated
    update_seconds: float = 0.0  # time spent flushing, to show it stays a small share of the step
    cache_config: dict[str, str] | None = None  # engine_cache_config_info's labels, set by the engine attaching
    _counters: list[tuple[str, Reading, dict[str, str]]] = field(init=False)
    _reported: list[float] = field(init=False)  # each counter's total at its last flush

    def __post_init__(self) -> None:
        self._counters = _counters({"model_name": self.model_name})  # built once, not in every step's flush
        self._reported = [0.0] * len(self._counters)

    def start_from(self, stats: EngineStats) -> None:
        self._reported = [read(stats) for _, read, _ in self._counters]

    def token(self, arrival: float, first_scheduled: float | None, previous_token: float | None, now: float,
              lora_name: str | None = None) -> None:
        if previous_token is None:
            self.ttft.append(now - arrival)
            self.queue_time.append((first_scheduled or now) - arrival)
        else:
            self.itl.append(now - previous_token)
        if lora_name is not None:
            self.lora_tokens[lora_name] = self.lora_tokens.get(lora_name, 0) + 1
            if previous_token is None:
                self.lora_requests[lora_name] = self.lora_requests.get(lora_name, 0) + 1

    def finished(self, arrival: float, now: float, reason: str) -> None:
        self.e2e.append(now - arrival)
        self.finish_reasons[reason] = self.finish_reasons.get(reason, 0) + 1

    def flush(self, stats: EngineStats, step_tokens: int) -> None:
        start = time.perf_counter()
        base = {"model_name": self.model_name}
        sink = self.sink
        sink.set("engine_num_requests_running", stats.num_running, base)
        sink.set("engine_num_requests_waiting", stats.num_waiting, base)
        sink.set("engine_kv_cache_usage_ratio", stats.kv_usage, base)
        sink.set("engine_kv_cache_blocks", stats.kv_blocks_total, base)  # what the memory profile chose
        if self.cache_config is not None:  # every flush, as every gauge: Ray's exporter drops one left unset a while
            sink.set("engine_cache_config_info", 1, {**base, **self.cache_config})
        sink.set("engine_resident_memory_bytes", stats.resident_bytes, base)
        for i, (name, read, labels) in enumerate(self._counters):
            total = read(stats)
            if total != self._reported[i]:
                sink.inc(name, total - self._reported[i], labels)
                self._reported[i] = total
        for reason, count in self.finish_reasons.items():
            sink.inc("engine_request_success", count, {**base, "finish_reason": reason})
        for name, counts in (("engine_lora_requests", self.lora_requests), ("engine_lora_generation_tokens", self.lora_tokens)):
            for adapter, count in counts.items():
                sink.inc(name, count, {**base, "lora_name": adapter})
        for name, values in (("engine_time_to_first_token_seconds", self.ttft), ("engine_inter_token_latency_seconds", self.itl),
                             ("engine_request_queue_time_seconds", self.queue_time), ("engine_e2e_request_latency_seconds", self.e2e)):
            if values:
                sink.observe(name, values, base)
        if step_tokens:
            sink.observe("engine_iteration_tokens", [step_tokens], base)
        self.ttft, self.itl, self.queue_time, self.e2e, self.finish_reasons = [], [], [], [], {}
        self.lora_requests, self.lora_tokens = {}, {}
        self.update_seconds += time.perf_counter() - start


def _counters(base: dict[str, str]) -> list[tuple[str, Reading, dict[str, str]]]:
    """(metric name, how to read its running total, labels) of every counter, a labelled one once per label value."""
    return [*((name, operator.attrgetter(source), base) for name, source in COUNTER_SOURCES.items()),
            *((name, _by_label(source, value), {**base, label: str(value)})
              for name, (label, source, values) in LABELLED_COUNTER_SOURCES.items() for value in values)]


def _by_label(source: str, value: str | int) -> Reading:
    return lambda stats: getattr(stats, source).get(value, 0)
