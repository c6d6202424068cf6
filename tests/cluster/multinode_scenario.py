"""Scale-out, placement, node loss and scale-in on a local multi-node Ray cluster, all on 127.0.0.1.

Run by tests/cluster/test_multinode.py in its own process (Ray clusters do not mix within one process). A head with
0 GPUs holds the ingress and Serve's only proxy; 2 workers advertise 2 logical GPUs each. The engine is forced to
CPU with 1 thread. Then, on the same cluster, issue 44's comparison: one long-context ramp against two apps at once,
one scaled on request counts and one on engine signals. Prints one JSON line "RESULT {...}" with the measured times
and signals; any failed check exits non-zero.
"""
from __future__ import annotations

import os

# Without this, ray.init swaps the head's 127.0.0.1 for the machine's own address, which nothing listens on here.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

import asyncio
import dataclasses
import json
import signal
import sys
import threading
import time

import httpx
import ray
from ray import serve
from ray.cluster_utils import Cluster
from ray.util.state import list_actors

from loadtest.loopback import free_port
from serve_app.app import build_app
from serve_app.ray_env import setdefault_ray_env

REPLICA_CLASS = "EngineReplica"
DEADLINE_S = 600  # inside the test's own limit, so the cluster is always shut down here, never left running
HAPROXY = os.environ.get("LLM_TEST_CLUSTER_HAPROXY") == "1"
PROXY_CLASS = "HAProxyManager" if HAPROXY else "ProxyActor"
BODY = {"prompt": "Count from one to one hundred:", "max_tokens": 24, "ignore_eos": True}


def running_replicas(app: str = "llm") -> int:
    status = serve.status().applications[app].deployments[REPLICA_CLASS]
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

    def __init__(self, url: str, clients: int, body=lambda n: BODY):
        self.url, self.clients, self.body, self.results, self.stop = url, clients, body, [], False

    async def _client(self, http: httpx.AsyncClient) -> None:
        while not self.stop:
            start = time.monotonic()
            body = self.body(len(self.results))
            try:
                r = await http.post(self.url + "/v1/completions", json=body)
                status = r.status_code
                ok = status == 200 and r.json()["usage"]["completion_tokens"] == body["max_tokens"]
                message = "" if ok else r.text[:200]
            except httpx.HTTPError as exc:
                status, ok, message = 0, False, type(exc).__name__
            self.results.append({"start": start, "end": time.monotonic(), "status": status, "ok": ok, "message": message})
            if not ok:
                await asyncio.sleep(0.2)

    async def run(self) -> None:
        async with httpx.AsyncClient(timeout=120) as http:
            await asyncio.gather(*(self._client(http) for _ in range(self.clients)))

    def start(self) -> threading.Thread:
        runner = threading.Thread(target=asyncio.new_event_loop().run_until_complete, args=(self.run(),), daemon=True)
        runner.start()
        return runner


def _past_deadline(signum, frame):
    raise TimeoutError(f"the scenario ran past its {DEADLINE_S} s deadline")


def main() -> None:
    signal.signal(signal.SIGALRM, _past_deadline)
    signal.alarm(DEADLINE_S)
    # every node as cluster/ starts them: Ray's environment and Serve's Python proxy; LLM_TEST_CLUSTER_HAPROXY=1 runs
    # the same scenario in Serve's HAProxy mode, as make serve's single node
    setdefault_ray_env(throughput=HAPROXY)
    # a deleted app's ingress stays reachable this long behind HAProxy (Serve's default 30 s); it reloads in a second
    os.environ.setdefault("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "3")
    head_args = dict(node_ip_address="127.0.0.1", num_cpus=2, num_gpus=0, resources={"head": 1}, include_dashboard=True,
                     dashboard_host="127.0.0.1", dashboard_port=free_port())
    cluster = Cluster(initialize_head=True, head_node_args=head_args)
    workers = [cluster.add_node(node_ip_address="127.0.0.1", num_cpus=4, num_gpus=2) for _ in range(2)]
    ray.init(address=cluster.address, log_to_driver=False,
             runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}})
    try:
        port = free_port()
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        result = scenario(workers, cluster, port)
        serve.delete("llm")
        cluster.add_node(node_ip_address="127.0.0.1", num_cpus=4, num_gpus=2)  # 4 GPUs again after the node loss
        result["policies"] = policy_ramp(port)
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()
    print("RESULT " + json.dumps(result), flush=True)


def scenario(workers, cluster, port: int) -> dict:
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
    runner = load.start()

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


POLICIES = ("requests", "engine")
LONG_PROMPT = " ".join(f"fact {i} about the pool" for i in range(35))  # about 240 tokens: 16 blocks, 19 with the answer
WINDOW_S = 20  # measured once the engine app's second replica runs


def long_request(n: int) -> dict:
    return {"prompt": f"{n} {LONG_PROMPT}", "max_tokens": 48, "ignore_eos": True}  # a new prompt: no prefix-cache hit


def policy_ramp(port: int) -> dict:
    """Issue 44: the same long-context load against two apps at once, on request counts and on engine signals. Four
    clients per app keep 4 requests in flight, under target_ongoing_requests (8), so the count never scales. One
    replica's pool of 50 blocks admits three of their prompts (48) but not their answers (57): one request always
    waits, and the others preempt each other. The engine policy adds a second replica; then each holds 2 requests
    (38 blocks), now and then 3."""
    engine = dict(device="cpu", num_threads=1, max_num_seqs=16, num_kv_blocks=50, engine_process=False)
    common = dict(engine_config=engine, num_gpus=1, num_cpus=1, min_replicas=1, max_replicas=2,
                  target_ongoing_requests=8, upscale_delay_s=2, downscale_delay_s=5, look_back_period_s=2,
                  ingress_resources={"head": 0.01}, request_timeout_s=120)
    for policy in POLICIES:  # the engine signal targets are the defaults an operator gets
        serve.run(build_app({**common, "autoscaling_policy": policy}), name=policy, route_prefix=f"/{policy}")
    loads = {p: Load(f"http://127.0.0.1:{port}/{p}", clients=4, body=long_request) for p in POLICIES}
    sampler = StatsSampler(POLICIES)
    runners = [load.start() for load in loads.values()] + [sampler.start()]
    scale_out_s = wait_until(lambda: running_replicas("engine") == 2, 120, "the engine policy's second replica")
    window = (time.monotonic() + 2, time.monotonic() + 2 + WINDOW_S)  # the new replica's first requests admitted
    time.sleep(window[1] - time.monotonic())
    for load in loads.values():
        load.stop = True
    sampler.stop = True
    stopped = time.monotonic()  # the clients send nothing new; what is in flight finishes
    for runner in runners:
        runner.join(180)
    wait_until(lambda: running_replicas("engine") == 1, 120, "the engine policy's scale-in")
    scale_in_s = time.monotonic() - stopped
    result = {p: {**sampler.summary(p, window), **served(loads[p].results, window)} for p in POLICIES}
    result["engine"].update(scale_out_s=scale_out_s, scale_in_s=scale_in_s)
    result["requests"]["most_replicas"] = max(sampler.replicas["requests"])
    check_policies(result, loads)
    for policy in POLICIES:
        serve.delete(policy)
    return result


class StatsSampler:
    """Every replica's engine stats through each app's deployment handle, a few calls every 0.25 s (the router
    spreads them over the replicas), and each app's running replica count."""

    def __init__(self, apps):
        self.handles = {app: serve.get_deployment_handle(REPLICA_CLASS, app_name=app) for app in apps}
        self.samples = {app: [] for app in apps}  # (time, replica id, waiting, preemptions)
        self.replicas = {app: [] for app in apps}
        self.stop = False

    def _run(self) -> None:
        while not self.stop:
            for app, handle in self.handles.items():
                self.replicas[app].append(running_replicas(app))
                for reply in [handle.stats.remote() for _ in range(3)]:
                    stats = reply.result(timeout_s=30)
                    self.samples[app].append((stats.time, stats.placement.replica_id, stats.engine.num_waiting,
                                              stats.engine.num_preemptions))
            time.sleep(0.25)

    def start(self) -> threading.Thread:
        runner = threading.Thread(target=self._run, daemon=True)
        runner.start()
        return runner

    def summary(self, app: str, window: tuple[float, float]) -> dict:
        """Mean waiting requests per replica, and preemptions, inside the window (monotonic times; the samples
        carry wall-clock ones)."""
        offset = time.time() - time.monotonic()
        inside = [s for s in self.samples[app] if window[0] + offset <= s[0] <= window[1] + offset]
        by_replica: dict[str, list[int]] = {}
        for _, replica, _, preemptions in inside:
            by_replica.setdefault(replica, []).append(preemptions)
        return {"waiting_mean": sum(s[2] for s in inside) / max(len(inside), 1),
                "preemptions": sum(max(p) - min(p) for p in by_replica.values()),
                "replicas_sampled": len(by_replica), "samples": len(inside)}


def served(results: list[dict], window: tuple[float, float]) -> dict:
    done = [r for r in results if window[0] <= r["end"] <= window[1]]
    return {"completed": sum(r["ok"] for r in done), "failed": sum(not r["ok"] for r in results),
            "latency_mean_s": sum(r["end"] - r["start"] for r in done) / max(len(done), 1)}


def check_policies(result: dict, loads: dict) -> None:
    requests, engine = result["requests"], result["engine"]
    assert requests["most_replicas"] == 1, f"4 requests against a target of 8 scaled the count policy: {result}"
    failures = [r for load in loads.values() for r in load.results if not r["ok"]]
    assert requests["failed"] == engine["failed"] == 0, failures
    assert engine["replicas_sampled"] == 2 and engine["samples"] >= 20, result
    assert requests["preemptions"] >= 2 and requests["waiting_mean"] > 0.1, f"one pool did not overflow: {result}"
    # lower, not nil: the router now and then sends a third request to one replica
    assert engine["preemptions"] < requests["preemptions"], f"the second replica did not cut preemptions: {result}"
    assert engine["waiting_mean"] < requests["waiting_mean"], f"the second replica did not cut the queue: {result}"


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
    proxy_nodes = {a.node_id for a in actors if a.class_name == PROXY_CLASS}
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
