"""AsyncLLMEngine: the front end of the engine. Requests are validated and tokenized here, on the caller's
thread (input_processor.py); the core (scheduler, model, sampler) runs on a background thread or, with
`engine_process`, in a child process of its own, and answers in token ids, which become text here
(output_processor.py); each request gets an async stream of outputs."""
from __future__ import annotations

import asyncio
import logging
import uuid
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, AsyncIterator

from engine.config import EngineConfig
from engine.core_messages import CoreOutput
from engine.core_protocol import EngineCore
from engine.engine_stats import EngineStats
from engine.beam_search import BeamSearchOutput, BeamSearchParams
from engine.errors import EngineDeadError, EngineOverloadedError
from engine.metrics import StepMetrics
from engine.pooling_params import PoolingParams
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:  # imported where the engine starts: torch and transformers load while its core process starts
    from engine.input_processor import Prompt
    from engine.output_processor import RequestOutput

log = logging.getLogger(__name__)
QUEUE_RETRY_S = 0.02  # a beam search's next step, when the queue was full


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

    def hold(self, num_tokens: int) -> None:
        """No output before the request has `num_tokens` tokens, or ends: this reader would not send it yet (a
        stream's chunk of several tokens), and each one costs the front end a copy of the totals and this task a
        wake-up."""
        self._engine.outputs.hold(self.request_id, num_tokens)

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

    async def final(self) -> RequestOutput:
        """The request's last output (a final_only request's one). An error it ended with is raised:
        EngineInputError where the request's own field was at fault, else RuntimeError."""
        async for output in self:
            if output.checked().finished:
                return output
        raise RuntimeError(f"the engine ended request {self.request_id} without a final output")

    async def aclose(self) -> None:
        if not self.finished:
            self.finished = True
            await self._engine.abort(self.request_id)


class AsyncLLMEngine:
    def __init__(self, config: EngineConfig | None = None, **overrides: Any):
        config = config or EngineConfig()
        self.config = config = config.model_copy(update=overrides) if overrides else config
        self._streams: dict[str, RequestStream] = {}
        self.dead_reason: str | None = None
        # one tokenizer per thread that uses it (fast tokenizers are not shareable): callers' and the core's outputs'.
        # This module imports neither torch nor transformers, so a Serve replica spawns its core process before the
        # front end's own imports, which run on the tokenizers' thread while the core starts; the core's class is
        # imported first, so that two threads never import at once
        core_class = _core_class(config)
        with ThreadPoolExecutor(1, thread_name_prefix="load-tokenizers") as pool:
            tokenizers = pool.submit(_two_tokenizers, config)
            self.core: EngineCore = core_class(config, self._dispatch, self._die)
            input_tokenizer, output_tokenizer = tokenizers.result()
        from engine.input_processor import InputProcessor
        from engine.output_processor import OutputProcessor

        limits = self.core.limits
        self.inputs = InputProcessor(config, input_tokenizer, limits, self.core.grammars)  # on callers' threads
        self.outputs = OutputProcessor(output_tokenizer, limits.eos_token_ids)  # on the thread that calls _dispatch
        self.max_model_len = limits.max_model_len
        self.settings = self.core.settings  # what the running engine actually uses

    def warm_up(self) -> None:
        """One short generation before serving (the core process does its own before it reports ready), and the
        front end's grammar compiler: building its view of the tokenizer holds the interpreter lock about a second,
        which the first structured request would otherwise take from every stream on this event loop."""
        self.core.warm_up()
        self.inputs.grammars.warm_up()

    def attach_metrics(self, metrics: StepMetrics) -> None:
        """Report step metrics from now on. Call before the first request."""
        self.core.attach_metrics(metrics)

    def start(self) -> "AsyncLLMEngine":
        self.core.start()
        return self

    @property
    def is_running(self) -> bool:
        return self.health_problem() is None

    def health_problem(self) -> str | None:
        """Why this engine should be replaced, or None."""
        return self.dead_reason or self.core.health_problem()

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None,
                    cache_salt: str | None = None, prompt_leader: str | None = None,
                    final_only: bool = False, priority: int = 0, lora_name: str | None = None,
                    pooling: PoolingParams | None = None) -> RequestStream:
        """Validate, tokenize and enqueue now (raises EngineInputError); outputs arrive through the stream, with
        `final_only` one, finished (a whole answer: no output per step for a reader who would wait for the last);
        `lora_name`: one of the engine's LoRA adapters (EngineConfig.lora_modules) runs it; `pooling`: an embedding
        request (no `params`), whose one output carries `.embedding`."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        request = self.inputs.process(request_id, prompt, params, cache_salt=cache_salt, prompt_leader=prompt_leader,
                                      priority=priority, lora_name=lora_name, pooling=pooling)
        self.start()
        self.outputs.add(request, final_only)  # refuses an id in flight
        stream = RequestStream(request_id, self, asyncio.get_running_loop())
        self._streams[request_id] = stream
        try:
            self.core.add(request)
        except BaseException:
            self._streams.pop(request_id, None)
            self.outputs.forget(request_id)
            raise
        return stream

    async def generate(self, prompt: Prompt, params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        stream = self.add_request(request_id or uuid.uuid4().hex, prompt, params)
        try:
            async for output in stream:
                yield output
        finally:
            await stream.aclose()

    async def beam_search(self, request_id: str, prompt: Prompt, params: BeamSearchParams,
                          decode: Callable[[list[int]], str], cache_salt: str | None = None, priority: int = 0,
                          lora_name: str | None = None) -> BeamSearchOutput:
        """vLLM's beam search (engine/beam_search.py): each step, every live beam is a one-token request. `decode`
        turns the best beams' tokens into text on the caller's tokenizer (a fast tokenizer is not shared across
        threads). Raises as add_request does, before the first step; a step's failure ends the search, raised."""
        search = self.inputs.beam_search(prompt, params, cache_salt, priority, lora_name)
        step_params, cached = search.params.step_params(), None
        while not search.done:
            streams: list[RequestStream] = []
            waits: list[asyncio.Future] = []
            try:
                for i, tokens in enumerate(search.beam_prompts()):
                    streams.append(await self._add_when_room(f"{request_id}-beam-{search.steps}-{i}", tokens,
                                                             step_params, cache_salt, final_only=True,
                                                             priority=priority, lora_name=lora_name))
                    waits.append(asyncio.ensure_future(streams[-1].final()))
                finals = await asyncio.gather(*waits)
            finally:  # one that failed, or a caller that left: the others stop too
                for wait in waits:
                    wait.cancel()
                for stream in streams:
                    await stream.aclose()
            cached = finals[0].num_cached_tokens if cached is None else cached
            search.advance([final.logprobs[0] for final in finals])
        return search.result(decode, cached or 0)

    async def _add_when_room(self, *args, **kwargs) -> RequestStream:
        """add_request for a step of work already accepted (a beam search's): a full queue is waited out, not a
        failure of the whole search."""
        while True:
            try:
                return self.add_request(*args, **kwargs)
            except EngineOverloadedError:
                await asyncio.sleep(QUEUE_RETRY_S)

    async def abort(self, request_id: str) -> None:
        self.abort_now(request_id)

    def abort_now(self, request_id: str) -> None:
        """Stop a request; its blocks free on the core's next step."""
        if self.dead_reason is None:
            self.core.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    @property
    def num_open_streams(self) -> int:
        """Requests whose outputs this engine still delivers: running, waiting or just added. No core round trip."""
        return len(self._streams)

    def stats(self) -> EngineStats:
        return self.core.stats()

    def shutdown(self, timeout: float = 5.0) -> None:
        self.core.shutdown(timeout)
        self._fail_all(EngineDeadError("the engine was shut down"))

    # -- called from the core's thread ---------------------------------------------------------------

    def _dispatch(self, core_outputs: list[CoreOutput]) -> None:
        outputs, ended = self.outputs.process(core_outputs)
        for request_id, reason in ended.items():
            self.core.abort(request_id, reason)
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, RequestOutput]]] = defaultdict(list)
        for output in outputs:
            stream = self._streams.pop(output.request_id, None) if output.finished else self._streams.get(output.request_id)
            if stream is not None:
                by_loop[stream._loop].append((stream, output))
        for loop, items in by_loop.items():
            _call_soon(loop, _deliver, items)

    def _die(self, reason: str) -> None:
        self.dead_reason = reason
        self._fail_all(EngineDeadError(reason))

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


def _core_class(config: EngineConfig) -> type[EngineCore]:
    if config.engine_process:
        from engine.core_client import ProcessCore

        return ProcessCore
    from engine.core_thread import ThreadCore

    return ThreadCore


def _two_tokenizers(config: EngineConfig) -> tuple:
    from engine.models.loader import load_tokenizer

    return load_tokenizer(config), load_tokenizer(config)
