"""AsyncLLMEngine: the step loop runs in a background thread; each request gets an async stream of deltas."""
from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections import defaultdict
from typing import Any, AsyncIterator

from engine.config import EngineConfig
from engine.errors import EngineDeadError
from engine.llm_engine import LLMEngine, Prompt
from engine.sampling_params import SamplingParams
from engine.sequence import RequestOutput

log = logging.getLogger(__name__)
IDLE_WAIT_S = 0.5


class RequestStream:
    """Async iterator of one request's outputs. Closing or cancelling it aborts the request."""

    def __init__(self, request_id: str, engine: "AsyncLLMEngine", loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self._engine = engine
        self._loop = loop
        self._queue: asyncio.Queue[RequestOutput | Exception] = asyncio.Queue()
        self.finished = False

    def put(self, item: RequestOutput | Exception) -> None:
        self._queue.put_nowait(item)

    def ready(self) -> list[RequestOutput]:
        """Outputs already delivered, taken without waiting (to coalesce deltas); stops at the final one."""
        items = []
        while not self.finished and not self._queue.empty():
            item = self._queue.get_nowait()
            if isinstance(item, Exception):
                self._queue.put_nowait(item)  # raised by the next __anext__
                break
            self.finished = item.finished
            items.append(item)
        return items

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
        except asyncio.CancelledError:
            await self.aclose()
            raise
        if isinstance(item, Exception):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    async def aclose(self) -> None:
        if not self.finished:
            self.finished = True
            await self._engine.abort(self.request_id)


class AsyncLLMEngine:
    def __init__(self, config: EngineConfig | None = None, **overrides: Any):
        self.engine = LLMEngine(config, **overrides)
        self._streams: dict[str, RequestStream] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.dead_reason: str | None = None
        self.loop_threads = 0  # torch threads as seen from the step loop's own thread

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.dead_reason is None

    def health_problem(self) -> str | None:
        """Why this engine should be replaced, or None: a dead loop, K steps in a row in which no request could
        run, or one step running past its deadline (a hung kernel or device)."""
        if not self.is_running:
            return self.dead_reason or "the engine loop is not running"
        engine, config = self.engine, self.engine.config
        started = engine.step_started_at
        if started is not None and time.monotonic() - started > config.step_timeout_s:
            return f"an engine step has run for {time.monotonic() - started:.0f} s (limit {config.step_timeout_s:g} s)"
        if engine.consecutive_failed_steps >= config.max_consecutive_failed_steps:
            return f"{engine.consecutive_failed_steps} engine steps in a row failed"
        return None

    def start(self) -> "AsyncLLMEngine":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run_loop, name="engine-step-loop", daemon=True)
            self._thread.start()
        return self

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None,
                    cache_salt: str | None = None, prompt_leader: str | None = None) -> RequestStream:
        """Validate, tokenize and enqueue now (raises EngineInputError); outputs arrive through the stream."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        self.start()
        stream = RequestStream(request_id, self, asyncio.get_running_loop())
        self._streams[request_id] = stream
        try:
            self.engine.add_request(request_id, prompt, params, cache_salt=cache_salt, prompt_leader=prompt_leader)
        except BaseException:
            if self._streams.get(request_id) is stream:
                del self._streams[request_id]
            raise
        self._wake.set()
        return stream

    async def generate(self, prompt: Prompt, params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        stream = self.add_request(request_id or uuid.uuid4().hex, prompt, params)
        try:
            async for output in stream:
                yield output
        finally:
            await stream.aclose()

    async def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)
        self._wake.set()

    def stats(self) -> dict[str, int]:
        return {**self.engine.stats(), "loop_threads": self.loop_threads}

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self._fail_all(EngineDeadError("the engine was shut down"))

    # -- the loop thread -----------------------------------------------------------------------------

    def _run_loop(self) -> None:
        try:
            self.loop_threads = self.engine.claim_threads()
            while not self._stop.is_set():
                if not self.engine.has_unfinished_requests():
                    self._wake.wait(IDLE_WAIT_S)
                    self._wake.clear()
                    continue
                self._dispatch(self.engine.step())
        except BaseException as exc:  # step() contains per-request failures; reaching here means the engine is broken
            log.exception("engine loop died")
            self.dead_reason = f"engine loop died: {type(exc).__name__}: {exc}"
            self._fail_all(EngineDeadError(self.dead_reason))

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, RequestOutput]]] = defaultdict(list)
        for output in outputs:
            stream = self._streams.pop(output.request_id, None) if output.finished else self._streams.get(output.request_id)
            if stream is not None:
                by_loop[stream._loop].append((stream, output))
        for loop, items in by_loop.items():
            _call_soon(loop, _deliver, items)

    def _fail_all(self, error: Exception) -> None:
        streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            _call_soon(stream._loop, stream.put, error)


def _deliver(items: list[tuple[RequestStream, Any]]) -> None:
    for stream, item in items:
        stream.put(item)


def _call_soon(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # that caller's loop is closed; nobody is listening
        pass
