"""Serve apps deployed side by side on one local Ray cluster, for benchmarks that compare two settings of the app in
the same run: each app at its own route prefix, every engine replica running before the first request."""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from loadtest.loopback import wait_healthy  # noqa: E402


def deploy(apps: dict[str, dict], replicas: int, port: int, metrics_port: int | None = None) -> dict[str, str]:
    """Start Ray (2 CPUs, as `make serve` sets it up) and Serve on loopback `port`, deploy each app's args under its
    name, wait until each has `replicas` engine replicas running; each app's base URL."""
    import ray
    from ray import serve

    from serve_app.app import build_app
    from serve_app.ray_env import setdefault_ray_env

    setdefault_ray_env()  # as make serve
    metrics = {} if metrics_port is None else {"_metrics_export_port": metrics_port,
                                               "_system_config": {"metrics_report_interval_ms": 1000}}
    ray.init(_node_ip_address="127.0.0.1", num_cpus=2, include_dashboard=False, log_to_driver=False, **metrics)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    bases = {}
    for name, args in apps.items():
        serve.run(build_app(args), name=name, route_prefix=f"/{name}", blocking=False)
        bases[name] = f"http://127.0.0.1:{port}/{name}"
    for name, base in bases.items():
        wait_healthy(base, 600)
        while serve.status().applications[name].deployments["EngineReplica"].replica_states.get("RUNNING") != replicas:
            time.sleep(0.5)
    return bases
