"""AppDeletion's bookkeeping (the controller's answer faked: the live case is tests/serve/test_shutdown.py behind
HAProxy, where a request sent during `serve.delete` waited for an engine replica until the ingress was killed)."""
import asyncio
import threading

import pytest

from serve_app import app_deletion
from serve_app.app_deletion import AppDeletion


@pytest.fixture
def controller(monkeypatch):
    """Answers as configured, counting questions; each question takes 50 ms, as a controller call might."""
    state = {"deleting": False, "fails": False, "asked": 0}
    lock = threading.Lock()

    def answer() -> bool:
        with lock:
            state["asked"] += 1
        threading.Event().wait(0.05)
        if state["fails"]:
            raise ConnectionError("controller unreachable")
        return state["deleting"]

    monkeypatch.setattr(app_deletion, "_app_is_being_deleted", answer)
    return state


async def test_waiting_requests_share_one_question_and_ask_again_only_after_the_interval(controller, monkeypatch):
    deletion = AppDeletion()
    assert await asyncio.gather(*(deletion.deleting() for _ in range(20))) == [False] * 20
    assert controller["asked"] == 1
    controller["deleting"] = True
    assert await deletion.deleting() is False  # answered less than a second ago
    assert controller["asked"] == 1
    monkeypatch.setattr(app_deletion, "CHECK_INTERVAL_S", 0.0)
    assert await deletion.deleting() is True
    assert controller["asked"] == 2
    controller["deleting"] = False
    assert await deletion.deleting() is True  # a deletion is not taken back
    assert controller["asked"] == 2


async def test_no_answer_refuses_nothing(controller, monkeypatch):
    monkeypatch.setattr(app_deletion, "CHECK_INTERVAL_S", 0.0)
    controller["fails"] = True
    deletion = AppDeletion()
    assert await deletion.deleting() is False
    controller["fails"], controller["deleting"] = False, True
    assert await deletion.deleting() is True


async def test_a_waiter_that_gives_up_leaves_the_question_to_the_others(controller):
    deletion = AppDeletion()
    controller["deleting"] = True
    first = asyncio.ensure_future(deletion.deleting())
    second = asyncio.ensure_future(deletion.deleting())
    await asyncio.sleep(0.01)
    first.cancel()  # its client went away
    assert await second is True
    assert controller["asked"] == 1
