"""The engine's metrics through ray.serve.metrics: Ray adds deployment/replica/application tags, prefixes `ray_`,
and exports them on each node's metrics port, so every replica is scraped (prometheus_client servers would collide)."""
from __future__ import annotations

from ray.serve import metrics as serve_metrics

from engine.metrics import METRICS


class RaySink:
    def __init__(self):
        self._metrics = {}
        for m in METRICS.values():
            tags = ("model_name", *m.labels)
            if m.kind == "counter":
                self._metrics[m.name] = serve_metrics.Counter(m.name, m.help, tag_keys=tags)
            elif m.kind == "gauge":
                self._metrics[m.name] = serve_metrics.Gauge(m.name, m.help, tag_keys=tags)
            else:
                self._metrics[m.name] = serve_metrics.Histogram(m.name, m.help, list(m.buckets), tag_keys=tags)

    def inc(self, name: str, value: float, labels: dict[str, str]) -> None:
        self._metrics[name].inc(value, labels)

    def set(self, name: str, value: float, labels: dict[str, str]) -> None:
        self._metrics[name].set(value, labels)

    def observe(self, name: str, values: list[float], labels: dict[str, str]) -> None:
        histogram = self._metrics[name]
        for value in values:
            histogram.observe(value, labels)
