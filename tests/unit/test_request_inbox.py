"""RequestInbox (engine/request_inbox.py) and retry_in_groups (engine/step_recovery.py): pure logic, no model."""
import threading

import pytest

from engine.errors import EngineInputError, EngineOverloadedError
from engine.request_inbox import RequestInbox
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence, SequenceStatus
from engine.step_recovery import retry_in_groups


def seq(rid: str, prompt=(1, 2, 3), outputs: int = 0) -> Sequence:
    s = Sequence(rid, list(prompt), SamplingParams(max_tokens=8))
    s.token_ids += [9] * outputs
    return s


def test_requests_and_aborts_reach_the_step_once_and_in_order():
    inbox = RequestInbox(max_waiting=None, num_scheduled_waiting=lambda: 0)
    a, b = seq("a"), seq("b")
    inbox.put(a)
    inbox.put(b)
    inbox.abort("b", "stop")  # the front end found a stop string
    inbox.abort("b")  # a cancelled stream and its closed generator may both abort
    inbox.abort("nobody")
    new, aborted = inbox.take()
    assert new == [a, b] and aborted == [(b, "stop")]  # once, with the first reason given
    assert inbox.take() == ([], []) and not inbox.has_pending


def test_a_finished_request_is_not_aborted_and_its_id_can_be_used_again():
    inbox = RequestInbox(max_waiting=None, num_scheduled_waiting=lambda: 0)
    a = seq("a")
    inbox.put(a)
    inbox.take()
    a.status = SequenceStatus.FINISHED
    inbox.abort("a")
    assert inbox.take() == ([], [])
    with pytest.raises(EngineInputError, match="already in flight") as refused:
        inbox.put(seq("a"))
    assert refused.value.param == "request_id"
    inbox.finished("a")
    inbox.put(seq("a"))


def test_the_queue_bound_counts_the_schedulers_waiting_requests_too():
    scheduled_waiting = [2]
    inbox = RequestInbox(max_waiting=3, num_scheduled_waiting=lambda: scheduled_waiting[0])
    inbox.put(seq("a"))
    assert inbox.num_waiting == 3
    with pytest.raises(EngineOverloadedError):
        inbox.put(seq("b"))
    scheduled_waiting[0] = 0
    inbox.put(seq("b"))


def test_a_follower_is_linked_to_its_leader_only_while_the_leader_is_in_flight():
    inbox = RequestInbox(max_waiting=None, num_scheduled_waiting=lambda: 0)
    leader, follower, late = seq("lead"), seq("f"), seq("late")
    inbox.put(leader)
    inbox.put(follower, prompt_leader="lead")
    inbox.finished("lead")
    inbox.put(late, prompt_leader="lead")
    assert follower.prompt_leader is leader and late.prompt_leader is None


def test_puts_from_many_threads_lose_nothing():
    inbox = RequestInbox(max_waiting=None, num_scheduled_waiting=lambda: 0)
    taken = []

    def put_many(t):
        for i in range(500):
            inbox.put(seq(f"{t}-{i}"))

    threads = [threading.Thread(target=put_many, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        taken += inbox.take()[0]
    taken += inbox.take()[0]
    assert sorted(s.request_id for s in taken) == sorted(f"{t}-{i}" for t in range(4) for i in range(500))


def batch_of(*seqs: Sequence) -> ScheduledBatch:
    batch = ScheduledBatch()
    for s in seqs:
        batch.add(s, 1)
    return batch


def test_a_retry_fails_only_the_new_request_that_breaks_the_step():
    old1, old2, new_ok, new_bad = seq("o1", outputs=2), seq("o2", outputs=1), seq("n1"), seq("bad")
    runs = []

    def execute(part):
        runs.append([s.request_id for s in part.seqs])
        if any(s.request_id == "bad" for s in part.seqs):
            raise RuntimeError("broken input")
        return [f"ran {s.request_id}" for s in part.seqs]

    outputs, nothing_ran = retry_in_groups(batch_of(new_ok, old1, new_bad, old2), execute, lambda s, why: f"failed {s.request_id}: {why}")
    assert runs == [["o1", "o2"], ["n1"], ["bad"]]  # the running ones together first, then each new one alone
    assert outputs == ["ran o1", "ran o2", "ran n1", "failed bad: engine step failed: RuntimeError"]
    assert not nothing_ran


def test_when_every_group_fails_the_step_says_nothing_could_run():
    def execute(part):
        raise RuntimeError("device lost")

    outputs, nothing_ran = retry_in_groups(batch_of(seq("o", outputs=1), seq("n")), execute, lambda s, why: s.request_id)
    assert outputs == ["o", "n"] and nothing_ran
