"""Prefix-affinity routing's memory: affinity keys and the chunk index (pure logic; the served router is tested in
tests/serve/test_prefix_routing.py)."""
import pytest
from pydantic import ValidationError

from engine import SamplingParams
from serve_app.config import AppArgs
from serve_app.prefix_affinity import PrefixIndex, PrefixLog, affinity_key
from serve_app.protocol import GenerationJob

SYSTEM = {"role": "system", "content": "You are a terse assistant. " * 12}


def job(prompt, **fields) -> GenerationJob:
    return GenerationJob("r", prompt, SamplingParams(max_tokens=4), **fields)


def test_next_turn_key_extends_the_last_turns_key():
    turn1 = [SYSTEM, {"role": "user", "content": "Name a colour."}]
    turn2 = turn1 + [{"role": "assistant", "content": "Red."}, {"role": "user", "content": "Another?"}]
    assert affinity_key(job(turn2)).startswith(affinity_key(job(turn1)))


def test_salt_adapter_and_tools_come_first_and_separate_keys():
    plain = affinity_key(job("Hello there"))
    salted = affinity_key(job("Hello there", cache_salt="tenant-a"))
    other_salt = affinity_key(job("Hello there", cache_salt="tenant-b"))
    with_tools = affinity_key(job("Hello there", tools=[{"type": "function", "function": {"name": "f"}}]))
    adapted = affinity_key(job("Hello there", lora_name="pirate"))  # an adapter's blocks serve that adapter only
    keys = (plain, salted, other_salt, with_tools, adapted)
    assert len(set(keys)) == 5
    assert all(key.endswith("Hello there") for key in keys)


def test_token_id_prompts_count_one_character_a_token():
    assert affinity_key(job([1, 2, 3])) == "\x01\x02\x03"
    assert affinity_key(job([151_000, 7])).startswith(chr(151_000))


def test_chunk_hashes_chain_so_equal_hashes_mean_equal_starts():
    index = PrefixIndex(chunk_chars=4, max_chunks=100)
    a, b = index.chunk_hashes("abcdefghij"), index.chunk_hashes("abcdXfghij")
    assert len(a) == 2  # the partial last chunk "ij" is not counted
    assert a[0] == b[0] and a[1] != b[1]
    assert index.chunk_hashes("efgh")[0] != a[1]  # a chunk's hash depends on what came before it


def test_longest_match_names_the_replicas_sent_the_longest_start():
    index = PrefixIndex(chunk_chars=4, max_chunks=100)
    shared = "sys-sys-"
    index.record(index.chunk_hashes(shared + "one-turn"), "r1")
    index.record(index.chunk_hashes(shared + "two-turn"), "r2")
    assert index.longest_match(index.chunk_hashes(shared + "one-turn-two"), {"r1", "r2"}) == (4, {"r1"})
    assert index.longest_match(index.chunk_hashes(shared + "new-turn"), {"r1", "r2"}) == (2, {"r1", "r2"})
    assert index.longest_match(index.chunk_hashes("unrelated"), {"r1", "r2"}) == (0, set())


def test_only_live_replicas_match():
    index = PrefixIndex(chunk_chars=4, max_chunks=100)
    index.record(index.chunk_hashes("aaaabbbb"), "r1")
    assert index.longest_match(index.chunk_hashes("aaaabbbb"), {"r2"}) == (0, set())
    index.forget("r1")
    assert len(index) == 0


def test_bound_forgets_least_recently_routed_tails_before_heads():
    index = PrefixIndex(chunk_chars=4, max_chunks=3)
    index.record(index.chunk_hashes("aaaabbbbcccc"), "r1")
    index.record(index.chunk_hashes("ddddeeee"), "r2")
    assert len(index) == 3
    # the first key kept its start: what is left of it still routes
    assert index.longest_match(index.chunk_hashes("aaaabbbbcccc"), {"r1", "r2"}) == (1, {"r1"})
    assert index.longest_match(index.chunk_hashes("ddddeeee"), {"r1", "r2"}) == (2, {"r2"})


def test_prefix_affinity_needs_the_split_topology():
    with pytest.raises(ValidationError, match="topology: split"):
        AppArgs(request_router="prefix_affinity", topology="colocated")
    with pytest.raises(ValidationError, match="max_load_gap"):
        AppArgs(request_router="prefix_affinity", prefix_affinity={"max_load_gap": -1})


def bare_router(**options):
    """The router's decision logic without Serve's machinery: no replicas pushed, no probes."""
    from ray.serve._private.request_router.common import ReplicaQueueLengthCache

    from serve_app.prefix_router import PrefixAffinityRouter

    router = PrefixAffinityRouter.__new__(PrefixAffinityRouter)
    router.initialize_state(**options)
    router._replica_queue_len_cache = ReplicaQueueLengthCache()
    router._sharing = "not here"  # no event loop: sharing between ingress replicas is tested served
    return router


def replicas(*names):
    from types import SimpleNamespace

    from ray.serve._private.common import DeploymentID, ReplicaID

    return [SimpleNamespace(replica_id=ReplicaID(name, DeploymentID(name="EngineReplica", app_name="llm")))
            for name in names]


def test_router_prefers_the_holder_until_it_is_busier_than_the_gap():
    from types import SimpleNamespace

    router = bare_router(max_load_gap=3)
    a, b = replicas("a", "b")
    history = [SYSTEM, {"role": "user", "content": "Tell me about lighthouses. " * 10}]
    router.on_request_routed(SimpleNamespace(args=[job(history)]), a.replica_id, None)
    next_turn = router._index.chunk_hashes(affinity_key(job(history + [{"role": "assistant", "content": "Ships."}])))
    assert router._holders(next_turn, [a, b]) == [a]
    assert router._unshared == [(a.replica_id.to_full_id_str(), router._index.chunk_hashes(affinity_key(job(history))))]
    router._replica_queue_len_cache.update(a.replica_id, 5)
    router._replica_queue_len_cache.update(b.replica_id, 2)
    assert router._holders(next_turn, [a, b]) == [a]  # 3 more in flight: within the gap
    router._replica_queue_len_cache.update(a.replica_id, 6)
    assert router._holders(next_turn, [a, b]) == []  # 4 more: power of two choices decides
    assert router._holders(router._index.chunk_hashes("An unrelated prompt " * 20), [a, b]) == []


def test_router_shares_no_more_chunks_a_period_than_it_remembers():
    from types import SimpleNamespace

    router = bare_router(chunk_chars=16, max_chunks=10)
    a, = replicas("a")
    for number in range(3):
        router.on_request_routed(SimpleNamespace(args=[job(f"{number} " + "x" * 70)]), a.replica_id, None)  # 4 chunks
    assert [len(hashes) for _, hashes in router._unshared] == [4, 4]


def test_router_ignores_a_start_shorter_than_the_match_share():
    from types import SimpleNamespace

    router = bare_router(min_match_share=0.5)
    a, b = replicas("a", "b")
    router.on_request_routed(SimpleNamespace(args=[job([SYSTEM])]), a.replica_id, None)
    short_tail = [SYSTEM, {"role": "user", "content": "Hi"}]
    long_tail = [SYSTEM, {"role": "user", "content": "A much longer question than the system prompt. " * 10}]
    assert router._holders(router._index.chunk_hashes(affinity_key(job(short_tail))), [a, b]) == [a]
    assert router._holders(router._index.chunk_hashes(affinity_key(job(long_tail))), [a, b]) == []


def test_log_hands_each_router_the_others_routes_once():
    log = PrefixLog(max_chunks=100)
    assert log.exchange("x", [("r1", [1, 2])], 0) == ([], 1)
    assert log.exchange("y", [("r2", [3])], 0) == ([("r1", [1, 2])], 2)
    news, cursor = log.exchange("x", [], 1)
    assert (news, cursor) == ([("r2", [3])], 2)
    assert log.exchange("x", [], cursor) == ([], 2)


def test_log_drops_its_oldest_routes_past_the_bound_and_restarts_a_foreign_cursor():
    log = PrefixLog(max_chunks=3)
    log.exchange("x", [("r1", [1, 2]), ("r1", [3, 4])], 0)
    assert log.exchange("y", [], 0) == ([("r1", [3, 4])], 2)  # [1, 2] dropped: 4 chunks > 3
    assert log.exchange("y", [], 99) == ([("r1", [3, 4])], 2)  # a cursor from a log that died: read from the start


def test_chunk_hashes_are_the_same_in_every_process():
    import subprocess
    import sys

    code = "from serve_app.prefix_affinity import PrefixIndex; print(PrefixIndex(4, 10).chunk_hashes('abcdefgh\\ud800xyz'))"
    runs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
            for _ in range(2)}
    assert len(runs) == 1 and runs.pop().strip() == str(PrefixIndex(4, 10).chunk_hashes("abcdefgh\ud800xyz"))


def run_sharing_for(router, seconds: float, exchange) -> None:
    """The router's sharing loop for `seconds`, against a log whose `exchange.remote` is the coroutine `exchange`."""
    import asyncio
    from types import SimpleNamespace

    router._shared_log = lambda: SimpleNamespace(exchange=SimpleNamespace(remote=exchange))

    async def share_a_while():
        sharing = asyncio.create_task(router._share_forever())
        await asyncio.sleep(seconds)
        sharing.cancel()

    asyncio.run(share_a_while())


def test_router_exchanges_at_once_and_learns_live_replicas_routes():
    """The first exchange starts the log actor (seconds), so it comes at the sharing's start, not a period later."""
    router = bare_router(share_period_s=30)
    live, gone = replicas("live", "gone")
    router._replica_id_set = {live.replica_id}
    log, calls = PrefixLog(max_chunks=100), []
    routes = [(live.replica_id.to_full_id_str(), [1, 2]), (gone.replica_id.to_full_id_str(), [3])]
    log.exchange("other ingress", routes, 0)

    async def exchange(*args):
        calls.append(args)
        return log.exchange(*args)

    run_sharing_for(router, 0.5, exchange)
    assert len(calls) == 1
    assert router._index.longest_match([1, 2], [live.replica_id.to_full_id_str()])[0] == 2
    assert len(router._index) == 2  # the gone replica's route is not learnt


def test_router_waits_a_period_after_a_failed_exchange():
    router, calls = bare_router(share_period_s=0.2), []

    async def exchange(*args):
        calls.append(args)
        raise RuntimeError("the log died with its owner")

    run_sharing_for(router, 0.5, exchange)
    assert 1 < len(calls) <= 3  # at 0, 0.2 and (unless late) 0.4 s; not one after another
