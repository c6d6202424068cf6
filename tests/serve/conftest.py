"""One local Ray cluster and one Serve app for the whole session, on loopback, torn down whatever happens."""
import contextlib
import os
import time

import pytest

from loadtest.loopback import free_port, wait_healthy

pytestmark = pytest.mark.slow

API_KEY = "test-key-123"


@pytest.fixture(scope="session")
def serve_app():
    import ray
    from ray import serve

    from serve_app.app import build_app
    from serve_app.ray_env import setdefault_ray_env

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # as `make serve`: workers at nice 0 (at Ray's 15, on a slow 2-core AVX2 box the Locust smoke completed 6
    # requests in 20 s instead of dozens)
    # Ray Serve's HAProxy mode, as `make serve`; LLM_TEST_PYTHON_PROXY=1: the same tests behind Serve's Python proxy
    setdefault_ray_env(throughput=os.environ.get("LLM_TEST_PYTHON_PROXY") != "1")
    # behind HAProxy an app's deletion keeps its ingress reachable this long for load balancers to deregister it
    # (Serve's default 30 s); HAProxy here reloads within a second, and at 3 s each of the suite's ~10 deletions took 4 s
    os.environ.setdefault("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "1")
    # replicas push autoscaling metrics every second instead of 10, so the autoscaling test sees its load in time
    os.environ.setdefault("RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S", "1")
    header_timeout_s = 2.0  # Serve's proxy reads it when it starts (serve_app/header_deadline.py)
    os.environ["LLM_SERVE_HEADER_TIMEOUT_S"] = str(header_timeout_s)
    metrics_port = free_port()
    # metrics every second instead of Ray's 10 s, so the Prometheus test does not wait on export
    # address="local": a cluster of the tests' own, even where `make serve` already runs one
    ray.init(address="local", _node_ip_address="127.0.0.1", num_cpus=2, include_dashboard=False, log_to_driver=False,
             _metrics_export_port=metrics_port, _system_config={"metrics_report_interval_ms": 1000},
             runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}})
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        # the default body limit (1 MiB), so a prompt over the character bound can arrive; short keep-alives and
        # body deadline, so the tests that watch them run in seconds; 180 s for a request, as the echo attack of
        # test_hostile_input took 57-60 s per request on a 2-core Zen 4 in fp32 (its point is the stream beside it)
        args = dict(engine_config=dict(dtype="float32", num_kv_blocks=1024, max_num_seqs=64, max_waiting=64, max_tokens_limit=256),
                    api_key=API_KEY, request_timeout_s=180, retry_after_s=1, sse_keepalive_s=0.5, body_timeout_s=3)
        serve.run(build_app(args), name="llm", route_prefix="/", blocking=False)
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base, 300)
        yield {"base_url": base, "api_key": API_KEY, "args": args, "metrics_port": metrics_port,
               "header_timeout_s": header_timeout_s}
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


@pytest.fixture(scope="session")
def replica_handle(serve_app):
    from ray import serve

    return serve.get_deployment_handle("EngineReplica", app_name="llm")


@pytest.fixture(scope="session")
def base_url(serve_app):
    return serve_app["base_url"]


@pytest.fixture(scope="session")
def auth():
    return {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(autouse=True)
def replica_blocks_free_after_test(request):
    """Every serve test ends with the replica idle and every KV block free (within 10 s of in-flight aborts)."""
    yield
    if "serve_app" not in request.fixturenames:
        return
    wait_idle(request.getfixturevalue("replica_handle"))


def wait_idle(handle, timeout_s: float = 10) -> dict:
    """The replica's stats once nothing runs or waits and every KV block is free; fails after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = handle.stats.remote().result(timeout_s=10)
        if stats.engine.idle:
            return stats
        assert time.monotonic() < deadline, stats
        time.sleep(0.05)


@contextlib.contextmanager
def whole_app(serve_app, name: str, kill_on_exit: bool = False, **changes):
    """A second app, ingress and engine replica, built from the session's args with `changes`, at /{name}: for
    engine settings the session's replica does not have. Yields its base URL and deletes the app afterwards; with
    `kill_on_exit`, its replicas are killed as it is deleted, for an app whose test leaves one starting (Serve's
    delete waits out a starting replica's model load: 13 s of the suite's teardown in test_prefix_routing)."""
    from ray import serve

    from serve_app.app import build_app

    serve.run(build_app({**serve_app["args"], **changes}), name=name, route_prefix=f"/{name}", blocking=False)
    try:
        base = serve_app["base_url"] + f"/{name}"
        wait_healthy(base, 300)
        yield base
    finally:
        if kill_on_exit:
            _delete_killing_replicas(name)
        else:
            serve.delete(name)


def _delete_killing_replicas(name: str, timeout_s: float = 60) -> None:
    """Delete the app without waiting, kill its replicas (the controller, deleting it, starts none again), then wait
    until the app is gone."""
    import ray
    from ray import serve

    serve.delete(name, _blocking=False)
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["namespace"] == "serve" and actor["name"].startswith(f"SERVE_REPLICA::{name}#"):
            with contextlib.suppress(ValueError):  # gone already
                ray.kill(ray.get_actor(actor["name"], namespace="serve"))
    deadline = time.monotonic() + timeout_s
    while name in serve.status().applications:
        assert time.monotonic() < deadline, f"app {name} still there {timeout_s} s after its deletion"
        time.sleep(0.2)


@contextlib.contextmanager
def ingress_only_app(serve_app, replica_handle, name: str, **changes):
    """A second ingress, with its own args, in front of the session's engine replica: no second model to load.
    Yields its base URL and deletes the app afterwards."""
    from ray import serve

    from serve_app.config import AppArgs
    from serve_app.ingress import IngressDeployment

    args = AppArgs(**{**serve_app["args"], **changes})
    ingress = serve.deployment(IngressDeployment).options(name=f"{name}-ingress", ray_actor_options={"num_cpus": 0})
    serve.run(ingress.bind(replica_handle, args), name=name, route_prefix=f"/{name}", blocking=False)
    try:
        base = serve_app["base_url"] + f"/{name}"
        wait_healthy(base, 60)
        yield base
    finally:
        serve.delete(name)
