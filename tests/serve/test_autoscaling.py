"""Engine-signal autoscaling through real Ray Serve (issue 44): a few long-context requests fill a replica's KV pool
while the request count stays far under target_ongoing_requests, where Serve's default policy would hold at one
replica (tests/unit/test_autoscaling_policy.py shows that on the same figures). The engine policy adds the second replica,
then removes it once the load is gone."""
import asyncio
import time

import httpx
import pytest

from tests.serve.conftest import whole_app


def running_replicas(app: str) -> int:
    from ray import serve

    deployment = serve.status().applications[app].deployments["EngineReplica"]
    return deployment.replica_states.get("RUNNING", 0)


def wait_for_replicas(app: str, count: int, timeout_s: float) -> float:
    started = time.monotonic()
    while running_replicas(app) != count:
        assert time.monotonic() - started < timeout_s, f"{app} did not reach {count} replicas in {timeout_s} s"
        time.sleep(0.5)
    return time.monotonic() - started


@pytest.fixture(scope="module")
def scaling_app(serve_app):
    engine_config = {**serve_app["args"]["engine_config"], "num_kv_blocks": 24, "max_num_seqs": 8}
    with whole_app(serve_app, "scaling", served_model_name="scaling", engine_config=engine_config, num_cpus=0.25,
                   autoscaling_policy="engine", min_replicas=1, max_replicas=2, target_ongoing_requests=64,
                   upscale_delay_s=0, downscale_delay_s=4, look_back_period_s=3,
                   # the pool, the queue or preemptions must say it: a TTFT target this loose never does on this CPU
                   engine_signal_targets={"kv_usage_high": 0.7, "ttft_p90_slo_s": 60}) as base:
        yield base


async def test_a_full_kv_pool_adds_a_replica_that_goes_when_the_load_does(scaling_app, auth):
    assert running_replicas("scaling") == 1
    long_prompt = " ".join(f"fact {i} about the pool" for i in range(35))  # about 240 tokens of the 384 in the pool

    async def one(client, i):
        body = {"prompt": f"{i} {long_prompt}", "max_tokens": 120, "ignore_eos": True}
        return await client.post(scaling_app + "/v1/completions", json=body, headers=auth)

    scaled_out = asyncio.Event()

    async def keep_one_in_flight(client, i):
        """Until the second replica runs: a load that ended first would have the policy take back the replica
        it was still starting, after the down-delay (a start took longer than the load on a busy machine)."""
        replies = [await one(client, i)]
        while not scaled_out.is_set():
            replies.append(await one(client, f"{i}.{len(replies)}"))  # a new prompt: no prefix-cache hit
        return replies

    async with httpx.AsyncClient(timeout=300) as client:
        load = asyncio.gather(*(keep_one_in_flight(client, i) for i in range(3)))  # 3 in flight, a target of 64
        try:
            scaled_out_after = await asyncio.to_thread(wait_for_replicas, "scaling", 2, 150)
        finally:
            scaled_out.set()
        replies = [r for sent in await load for r in sent]
    assert all(r.status_code == 200 for r in replies), [r.text[:200] for r in replies]
    scaled_in_after = await asyncio.to_thread(wait_for_replicas, "scaling", 1, 90)
    print(f"scaled out after {scaled_out_after:.1f} s, back in {scaled_in_after:.1f} s after the load")
