"""The environment Ray's processes start with: `ray start` (make serve, the load test, the cluster configs) and
the tests' own cluster read it from here. Ray Serve reads these variables when each of its processes starts, so they
belong to Ray's environment, not to the Serve config.

`python -m serve_app.ray_env [--throughput]` prints them as `NAME=value` words for a shell's `env`.
"""
from __future__ import annotations

import os
import sys

RAY_ENV = {
    # Ray starts workers at nice 15, and on a small box a nice-0 load generator or shell then starves the replicas
    # (2,720 against 7,720 req/h under Locust, BENCHMARKS.md)
    "RAY_worker_niceness": "0",
}

# Opt-in (`make serve THROUGHPUT=1`): Ray Serve's documented high-throughput mode. HAProxy (shipped with ray[serve]
# on Linux) takes the HTTP port in place of the Python proxy and forwards to the ingress replica's own HTTP server,
# and deployments talk gRPC: 19,920 against 17,000 req/h at 48 users on 2 cores (BENCHMARKS.md). Not the default:
# deleting an app while it streams left a new request hanging 60 s and then cut (Ray's HAProxy drain is still being
# fixed upstream: ray-project/ray#65698, #66056), where the Python proxy refuses it at once.
THROUGHPUT_ENV = {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_ENABLE_HA_PROXY": "1"}


def ray_env(throughput: bool = False) -> dict[str, str]:
    return {**RAY_ENV, **(THROUGHPUT_ENV if throughput else {})}


def setdefault_ray_env(throughput: bool = False) -> None:
    """For a `ray.init` in this process, whose Ray processes inherit its environment; what is already set wins."""
    for name, value in ray_env(throughput).items():
        os.environ.setdefault(name, value)


if __name__ == "__main__":
    print(" ".join(f"{name}={value}" for name, value in ray_env("--throughput" in sys.argv[1:]).items()))
