"""LocalStream.cancel(): the colocated ingress's way to abort a generation must run the replica generator's
`finally` (where the engine's requests are aborted) whatever state the stream is in."""
import asyncio

from serve_app.replica_client import LocalStream


def replica_generation(events: list[str], step_started: asyncio.Event | None = None):
    async def generate():
        try:
            yield "admitted"
            if step_started is not None:
                step_started.set()
            await asyncio.sleep(30)  # a long step: the engine has nothing new yet
            yield "delta"
        finally:
            events.append("aborted in the engine")
    return generate()


async def closed_after(stream_setup) -> list[str]:
    events: list[str] = []
    closing: set[asyncio.Task] = set()
    await stream_setup(events, closing)
    for _ in range(100):
        if not closing:
            break
        await asyncio.sleep(0.01)
    assert not closing, "the closing task never ended"
    return events


def test_cancel_while_a_step_is_in_flight_aborts():
    async def setup(events, closing):
        started = asyncio.Event()
        stream = LocalStream(replica_generation(events, started), closing)
        assert await anext(stream) == "admitted"
        pending = asyncio.ensure_future(anext(stream))  # as the SSE loop's keep-alive wait leaves it
        await started.wait()
        stream.cancel()
        await asyncio.wait({pending})
        assert pending.cancelled()

    assert asyncio.run(closed_after(setup)) == ["aborted in the engine"]


def test_cancel_between_steps_aborts():
    async def setup(events, closing):
        stream = LocalStream(replica_generation(events), closing)
        assert await anext(stream) == "admitted"
        stream.cancel()
        stream.cancel()  # a second cancel (a timeout, then the response's finally) is a no-op

    assert asyncio.run(closed_after(setup)) == ["aborted in the engine"]


def test_cancel_before_the_first_step_leaves_nothing_running():
    async def setup(events, closing):
        generator = replica_generation(events)
        LocalStream(generator, closing).cancel()
        await asyncio.sleep(0.05)
        assert generator.ag_frame is None  # closed, never started: nothing to abort

    assert asyncio.run(closed_after(setup)) == []


def test_the_stream_ends_as_the_generator_does():
    async def collect():
        async def two():
            yield 1
            yield 2
        return [item async for item in LocalStream(two(), set())]

    assert asyncio.run(collect()) == [1, 2]
