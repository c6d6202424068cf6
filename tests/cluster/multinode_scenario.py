"""Scale-out, placement, node loss and scale-in on a local multi-node Ray cluster, all on 127.0.0.1.

Run by tests/cluster/test_multinode.py in its own process (Ray clusters do not mix within one process). A head with
0 GPUs holds the ingress and Serve's only proxy; 2 workers advertise 2 logical GPUs each. The engine is forced to
CPU with 1 thread. Prints one JSON line "RESULT {...}" with the measured times; any failed check exits non-zero.
"""
from __future__ import annotations

import os

# Without this, ray.init swaps the head's 127.0.0.1 for the machine's own address, which nothing listens on here.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

import asyncio
import dataclasses
import json
import signal
import socket
import sys
import threading
import time

import httpx
import ray
from ray import serve
from ray.cluster_utils import Cluster
from ray.util.state import list_actors

from serve_app.app import build_app

REPLICA_CLASS = "EngineReplica"
DEADLINE_S = 420  # inside the test's own limit, so the cluster is always shut down here, never left running
BODY = {"prompt": "Count from one to one hundred:", "max_tokens": 24, "ignore_eos": True}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def running_replicas() -> int:
    status = serve.status().applications["llm"].deployments[REPLICA_CLASS]
    return status.replica_states.get("RUNNING", 0)


def wait_until(check, timeout: float, what: str) -> float:
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.5)
    return time.monotonic() - start


class Load:
    """Closed-loop clients in a background asyncio loop; every result is kept with its start and end time."""

    def __init__(self, url: str, clients: int):
        self.url, self.clients, self.results, self.stop = url, clients, [], False

    async def _client(self, http: httpx.AsyncClient) -> None:
        while not self.stop:
            start = time.monotonic()
            try:
                r = await http.post(self.url + "/v1/completions", json=BODY)
                status, ok = r.status_code, r.status_code == 200 and r.json()["usage"]["completion_tokens"] == BODY["max_tokens"]
                message = "" if ok else r.text[:200]
            except httpx.HTTPError as exc:
                status, ok, message = 0, False, type(exc).__name__
            self.results.append({"start": start, "end": time.monotonic(), "status": status, "ok": ok, "message": message})
            if not ok:
                await asyncio.sleep(0.2)

    async def run(self) -> None:
        async with httpx.AsyncClient(timeout=120) as http:
            await asyncio.gather(*(self._client(http) for _ in range(self.clients)))


def _past_deadline(signum, frame):
    raise TimeoutError(f"the scenario ran past its {DEADLINE_S} s deadline")


def main() -> None:
    signal.signal(signal.SIGALRM, _past_deadline)
    signal.alarm(DEADLINE_S)
    head_args = dict(node_ip_address="127.0.0.1", num_cpus=2, num_gpus=0, resources={"head": 1}, include_dashboard=True,
                     dashboard_host="127.0.0.1", dashboard_port=free_port())
    cluster = Cluster(initialize_head=True, head_node_args=head_args)
    workers = [cluster.add_node(node_ip_address="127.0.0.1", num_cpus=4, num_gpus=2) for _ in range(2)]
    ray.init(address=cluster.address, log_to_driver=False,
             runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}})
    try:
        result = scenario(workers, cluster)
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()
    print("RESULT " + json.dumps(result), flush=True)


def scenario(workers, cluster) -> dict:
    port = free_port()
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    # the thread core: four replicas start on two cores without four more interpreters importing torch; the core
    # process under Serve (its death, the replica's replacement) is tests/serve/test_resilience.py's
    engine = dict(device="cpu", num_threads=1, max_num_seqs=16, max_waiting=64, num_kv_blocks=256, engine_process=False)
    args = dict(engine_config=engine, num_gpus=1, num_cpus=1,
                min_replicas=1, max_replicas=4, target_ongoing_requests=2, upscale_delay_s=1, downscale_delay_s=5,
                look_back_period_s=2, ingress_resources={"head": 0.01}, request_timeout_s=120)
    serve.run(build_app(args), name="llm", route_prefix="/")
    url = f"http://127.0.0.1:{port}"
    assert running_replicas() == 1

    head_id = cluster.head_node.node_id
    worker_ids = {w.node_id for w in workers}
    load = Load(url, clients=16)
    thread_loop = asyncio.new_event_loop()
    runner = threading.Thread(target=thread_loop.run_until_complete, args=(load.run(),), daemon=True)
    runner.start()

    scale_out_s = wait_until(lambda: running_replicas() == 4, 300, "4 replicas under load")
    placement = check_placement(head_id, worker_ids)

    victim = workers[0]
    removed_at = time.monotonic()
    cluster.remove_node(victim, allow_graceful=False)
    wait_until(lambda: recovered_since(load.results, removed_at) >= 16, 120, "16 requests served after the node loss")
    load.stop = True
    runner.join(180)
    loss = check_node_loss(load.results, removed_at)

    scale_in_s = wait_until(lambda: running_replicas() == 1, 180, "scale-in to 1 replica")
    return {"scale_out_s": scale_out_s, "scale_in_s": scale_in_s, **loss, "placement": placement,
            "requests": len(load.results)}


def recovered_since(results: list[dict], removed_at: float) -> int:
    """Successful requests that started after the node loss and after the last failure."""
    last_failure = max((r["end"] for r in results if not r["ok"]), default=removed_at)
    return sum(1 for r in list(results) if r["ok"] and r["start"] > max(removed_at, last_failure))


def check_placement(head_id: str, worker_ids: set[str]) -> list[dict]:
    handle = serve.get_deployment_handle(REPLICA_CLASS, app_name="llm")
    seen: dict[str, dict] = {}
    deadline = time.monotonic() + 60
    while len(seen) < 4:
        assert time.monotonic() < deadline, f"saw only {len(seen)} replicas through the handle"
        stats = handle.stats.remote().result(timeout_s=30)
        seen[stats.placement.replica_id] = stats.placement
    slots = [(p.node_id, g) for p in seen.values() for g in p.gpu_ids]
    assert all(len(p.gpu_ids) == 1 for p in seen.values()), seen
    assert len(set(slots)) == 4, f"a GPU is shared: {seen}"
    assert {p.node_id for p in seen.values()} == worker_ids, f"replicas not on the two GPU workers: {seen}"

    actors = [a for a in list_actors(filters=[("state", "=", "ALIVE")], limit=1000)]
    engine_nodes = [a.node_id for a in actors if REPLICA_CLASS in a.class_name]
    assert sorted(engine_nodes) == sorted(p.node_id for p in seen.values()), (engine_nodes, seen)
    ingress_nodes = {a.node_id for a in actors if "Ingress" in a.class_name}
    proxy_nodes = {a.node_id for a in actors if "ProxyActor" in a.class_name}
    assert ingress_nodes == {head_id} and proxy_nodes == {head_id}, (ingress_nodes, proxy_nodes)
    return [dataclasses.asdict(p) for p in seen.values()]


def check_node_loss(results: list[dict], removed_at: float) -> dict:
    """Only requests already in flight when the node went may fail, each with a clear 5xx in the envelope; one sent
    after it is admitted elsewhere (the ingress retries a replica found dead at admission)."""
    failed = [r for r in results if not r["ok"]]
    for r in failed:
        assert 500 <= r["status"] < 600, f"a failure that is not a clear 5xx: {r}"
        assert r["start"] <= removed_at + 0.5, f"a request sent after the node loss failed: {r}"
        assert '"error"' in r["message"], r
    in_flight = [r for r in results if r["start"] <= removed_at <= r["end"]]
    after = sorted((r for r in results if r["start"] > removed_at), key=lambda r: r["start"])
    last_failure = max((r["end"] for r in failed), default=removed_at)
    recovered = [r for r in after if r["start"] > last_failure]
    assert recovered and all(r["ok"] for r in recovered), "requests did not recover after the node loss"
    return {"failed_after_node_loss": len(failed), "in_flight_at_node_loss": len(in_flight),
            "recovery_s": last_failure - removed_at, "succeeded_after_recovery": len(recovered)}


if __name__ == "__main__":
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    sys.exit(main())
