"""`request_router: prefix_affinity` (serve_app/prefix_router.py) with two engine replicas behind two ingress
replicas: every turn of a conversation lands on the replica whose prefix cache holds the turns before it, whichever
ingress replica routes it. Under Serve's default router each later turn finds its history with a chance of about one
half, so ten later turns all finding it would happen once in 1,024 runs; without the ingress replicas sharing what
they routed, a turn that reaches the other ingress replica finds it as often. The same app loads LoRA adapters on
demand (`lora_root`): each adapter's requests go to the replica that holds it (serve_app/adapter_affinity.py)."""
import shutil
import time

import httpx
import pytest

from engine.config import DEFAULT_MODEL
from tests.fixtures.lora_adapters import make_adapter
from tests.serve.conftest import wait_idle, whole_app

pytestmark = pytest.mark.slow
BLOCK_SIZE = 16  # EngineConfig's default: a cache hit covers whole blocks
PASSAGE = ("The lighthouse keeper climbed the spiral stairs each evening, counting the steps, trimming the wick and "
           "polishing the great lens until it threw its beam far across the grey water. ") * 4
CONVERSATIONS, TURNS = 5, 3  # odd: HAProxy's leastconn takes idle ingress replicas in turn, so a conversation's
                             # consecutive turns reach different ingress replicas
APP, SHARE_PERIOD_S = "affinity", 0.1  # how often the ingress replicas exchange what they routed (0.5 s by default)
ADAPTERS = ("pirate-a", "pirate-b")  # one adapter's copies under lora_root, loaded when first named


@pytest.fixture(scope="module")
def lora_root(tmp_path_factory) -> str:
    adapter = make_adapter(DEFAULT_MODEL, tmp_path_factory.mktemp("adapter") / "pirate", 7, b_std=0.02, r=8,
                           lora_alpha=16, target_modules=["q_proj", "v_proj"])
    root = tmp_path_factory.mktemp("lora-root")
    for name in ADAPTERS:
        shutil.copytree(adapter, root / name)
    return str(root)


@pytest.fixture(scope="module")
def two_replicas(serve_app, lora_root):
    from ray import serve

    engine = {**serve_app["args"]["engine_config"], "num_threads": 1, "lora_root": lora_root}
    with whole_app(serve_app, APP, kill_on_exit=True, request_router="prefix_affinity", min_replicas=2,
                   max_replicas=2, ingress_min_replicas=2, num_cpus=0, report_cached_tokens=True, engine_config=engine,
                   prefix_affinity={"share_period_s": SHARE_PERIOD_S}) as base:
        deadline = time.monotonic() + 300
        deployments = serve.status().applications[APP].deployments
        while any(deployments[d].replica_states.get("RUNNING") != 2 for d in ("EngineReplica", "Ingress")):
            assert time.monotonic() < deadline, "a second replica never started"
            time.sleep(0.5)
            deployments = serve.status().applications[APP].deployments
        yield base


@pytest.fixture(autouse=True)
def both_replicas_free_after_test(two_replicas):
    """As conftest's check for the session's replica: every running replica of this app idle, every block free.
    A stats call reaches one replica at random, so calls go on until each running one has answered idle."""
    from ray import serve

    yield
    handle = serve.get_deployment_handle("EngineReplica", app_name=APP)
    running = serve.status().applications[APP].deployments["EngineReplica"].replica_states.get("RUNNING", 0)
    idle, deadline = set(), time.monotonic() + 30
    while len(idle) < running:
        assert time.monotonic() < deadline, f"only {len(idle)} of {running} replicas seen idle"
        idle.add(wait_idle(handle).placement.replica_id)


def converse(base: str, auth: dict, conversations: list[list[dict]], turns: int) -> list[list[dict]]:
    """`turns` more turns of each conversation, one request at a time, interleaved, each round once the last one's
    routes are shared; each turn's usage."""
    usages, logged = [[] for _ in conversations], routes_logged()
    with httpx.Client(base_url=base, headers=auth, timeout=120) as http:
        for turn in range(turns):
            wait_until_shared(logged + turn * len(conversations))
            for messages, usage in zip(conversations, usages):
                r = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 8, "temperature": 0})
                assert r.status_code == 200, r.text
                usage.append(r.json()["usage"])
                messages += [{"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]},
                             {"role": "user", "content": "And then?"}]
    return usages


def routes_logged() -> int:
    """How many routes the ingress replicas have sent the deployment's PrefixLog (none before its first exchange)."""
    import ray

    from serve_app.prefix_affinity import prefix_log_name

    try:
        log = ray.get_actor(prefix_log_name(APP, "EngineReplica"), namespace="serve")
    except ValueError:
        return 0
    return ray.get(log.exchange.remote("test-reader", [], 0), timeout=30)[1]


def wait_until_shared(routes: int) -> None:
    """Until the log holds `routes` routes, then two share periods, in which every ingress replica takes them: the
    test asks where routing sends a turn, not how fast routes spread (the first exchange starts the log actor, which
    took longer than a round of turns on a fast 2-core VM, and a second turn missed its history)."""
    deadline = time.monotonic() + 60
    while routes_logged() < routes:
        assert time.monotonic() < deadline, f"{routes_logged()} of {routes} routes shared in 60 s"
        time.sleep(SHARE_PERIOD_S)
    time.sleep(2 * SHARE_PERIOD_S)


def assert_history_found(usage: list[dict]) -> None:
    for before, after in zip(usage, usage[1:]):
        assert after["prompt_tokens_details"]["cached_tokens"] >= before["prompt_tokens"] - BLOCK_SIZE, usage


def new_conversations(tag: str) -> list[list[dict]]:
    return [[{"role": "user", "content": f"{tag} conversation {number}. {PASSAGE} What did the keeper count?"}]
            for number in range(CONVERSATIONS)]


def test_each_conversation_stays_on_the_replica_holding_its_history(two_replicas, auth):
    # one request at a time, turns interleaved across conversations: every replica idle when a turn is routed, so
    # load says nothing about where its history is (with concurrent closed-loop clients, the replica that just
    # finished a conversation's turn is often the less busy one, which makes Serve's default look sticky)
    for usage in converse(two_replicas, auth, new_conversations("First"), TURNS):
        assert_history_found(usage)


def test_each_adapters_requests_go_to_the_replica_holding_it(two_replicas, auth, serve_app):
    """Requests on two adapters loaded on demand, one at a time and alternating, every replica idle when each is
    routed: under Serve's default router each would land on either replica, so both replicas would load both
    adapters (each adapter's four requests all on one replica: one run in 64). Here each adapter's requests all
    reach one replica, and the second adapter, routed while the first is held, goes to the replica holding fewer."""
    with httpx.Client(base_url=two_replicas, headers=auth, timeout=120) as http:
        for round_ in range(4):
            for name in ADAPTERS:
                body = {"model": name, "prompt": f"Round {round_}: the sea", "max_tokens": 2, "temperature": 0}
                r = http.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
    counts = lora_requests_by_replica(serve_app["metrics_port"], total=2 * 4)
    assert all(len(counts[name]) == 1 for name in ADAPTERS), counts
    assert set(counts[ADAPTERS[0]]) != set(counts[ADAPTERS[1]]), counts


def lora_requests_by_replica(metrics_port: int, total: int) -> dict[str, dict[str, float]]:
    """This app's requests on each adapter, by the replica that served them, from the replicas' own counters as Ray
    exports them; once they add up to `total` (the export lags a second or so)."""
    from prometheus_client.parser import text_string_to_metric_families

    deadline = time.monotonic() + 30
    while True:
        counts: dict[str, dict[str, float]] = {}
        text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                tags = sample.labels
                if (sample.name == "ray_engine_lora_requests_total" and tags.get("application") == APP
                        and sample.value > 0):
                    counts.setdefault(tags["lora_name"], {})[tags["replica"]] = sample.value
        if sum(v for by_replica in counts.values() for v in by_replica.values()) >= total:
            return counts
        assert time.monotonic() < deadline, counts
        time.sleep(0.5)


def test_conversations_on_a_replica_that_dies_carry_on_elsewhere(two_replicas, auth):
    """The holder of half the histories is killed: their next turns are served (by the other replica, or its
    replacement), and the turns after those find their history again there."""
    import ray
    from ray import serve

    conversations = new_conversations("Second")
    converse(two_replicas, auth, conversations, 1)
    victim = serve.get_deployment_handle("EngineReplica", app_name=APP).stats.remote().result(timeout_s=30)
    ray.kill(ray.get_actor(f"SERVE_REPLICA::{APP}#EngineReplica#{victim.placement.replica_id}", namespace="serve"))
    for usage in converse(two_replicas, auth, conversations, 2):
        assert_history_found(usage)
