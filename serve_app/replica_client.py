"""How the ingress reaches an engine replica: through a Serve handle (`topology: split`, the replica a deployment of
its own) or in its own process (`topology: colocated`). Both give the ingress the same calls."""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, AsyncIterator, Protocol

from ray.serve.handle import DeploymentHandle

from serve_app.adapter_affinity import AdapterRoutes
from serve_app.app_deletion import AppDeletion
from engine.chat import DEFAULT_OPTIONS, ChatOptions
from serve_app.protocol import EmbeddingJob, Embeddings, GenerationJob, Refused, ReplicaStats, Tokens

if TYPE_CHECKING:
    from serve_app.replica import EngineReplica


class ReplicaStream(Protocol):
    """A generation's messages (Admitted or Refused, then Deltas); `cancel()` aborts it in the engine."""

    def __aiter__(self) -> AsyncIterator[Any]: ...

    def __anext__(self) -> Any: ...

    def cancel(self) -> None: ...


class ReplicaClient(Protocol):
    async def stats(self) -> ReplicaStats: ...

    async def info(self) -> dict: ...

    async def tokenize(self, prompt: str | list[dict], tools: list[dict] | None, with_strs: bool,
                       chat: ChatOptions = DEFAULT_OPTIONS) -> Tokens | Refused: ...

    async def detokenize(self, tokens: list[int]) -> str | Refused: ...

    def generate(self, job: GenerationJob) -> ReplicaStream: ...

    async def embed(self, job: EmbeddingJob) -> Embeddings | Refused: ...

    async def unroutable(self) -> bool:
        """Whether a generation not yet admitted never will be: no replica will come to take it."""
        ...

    def admitted(self, lora_name: str | None) -> None:
        """A request on `lora_name` was admitted: the adapter exists, and later requests may be routed by it."""
        ...


class RemoteReplica:
    """Replicas of the EngineReplica deployment, picked by Serve's router; every message a Ray message."""

    def __init__(self, handle: DeploymentHandle, adapter_routes: AdapterRoutes | None = None):
        self.handle = handle
        self.adapter_routes = adapter_routes  # None: adapters route as the base model (adapter_affinity.py)
        self._app_deletion = AppDeletion()

    async def stats(self) -> ReplicaStats:
        return await self.handle.stats.remote()

    async def info(self) -> dict:
        return await self.handle.info.remote()

    async def tokenize(self, prompt: str | list[dict], tools: list[dict] | None, with_strs: bool,
                       chat: ChatOptions = DEFAULT_OPTIONS) -> Tokens | Refused:
        return await self.handle.tokenize.remote(prompt, tools, with_strs, chat)

    async def detokenize(self, tokens: list[int]) -> str | Refused:
        return await self.handle.detokenize.remote(tokens)

    def generate(self, job: GenerationJob) -> ReplicaStream:
        return self._routed(job.lora_name).options(stream=True).generate.remote(job)

    async def embed(self, job: EmbeddingJob) -> Embeddings | Refused:
        return await self._routed(job.lora_name).embed.remote(job)

    def admitted(self, lora_name: str | None) -> None:
        if self.adapter_routes is not None:
            self.adapter_routes.admitted(lora_name)

    def _routed(self, lora_name: str | None) -> DeploymentHandle:
        return self.handle if self.adapter_routes is None else self.adapter_routes.handle(self.handle, lora_name)

    async def unroutable(self) -> bool:
        return await self._app_deletion.deleting()


class LocalReplica:
    """The engine replica in this process: its messages are Python objects handed over on this event loop."""

    def __init__(self, replica: EngineReplica):
        self.replica = replica
        self._closing: set[asyncio.Task] = set()  # held until done: the loop keeps only weak references to tasks

    async def stats(self) -> ReplicaStats:
        return self.replica.stats()

    async def info(self) -> dict:
        return self.replica.info()

    async def tokenize(self, prompt: str | list[dict], tools: list[dict] | None, with_strs: bool,
                       chat: ChatOptions = DEFAULT_OPTIONS) -> Tokens | Refused:
        return await self.replica.tokenize(prompt, tools, with_strs, chat)

    async def detokenize(self, tokens: list[int]) -> str | Refused:
        return await self.replica.detokenize(tokens)

    def generate(self, job: GenerationJob) -> ReplicaStream:
        return LocalStream(self.replica.generate(job), self._closing)

    async def embed(self, job: EmbeddingJob) -> Embeddings | Refused:
        return await self.replica.embed(job)

    async def unroutable(self) -> bool:
        return False  # the replica is this process: a request here is admitted or refused by it

    def admitted(self, lora_name: str | None) -> None:
        pass  # one replica: nothing to route


class LocalStream:
    """The replica's async generator with a handle stream's `cancel()`: closing it runs the replica's `finally`,
    which aborts the engine's requests, as a cancelled Ray stream does in the replica's process. Each step runs as
    a task, so a step still in flight when the consumer gives up (an SSE keep-alive went out meanwhile) is
    cancelled too, not left to finish into a generator nobody closes."""

    def __init__(self, generator, closing: set[asyncio.Task]):
        self._generator = generator
        self._step: asyncio.Future | None = None
        self._closing = closing
        self._cancelled = False

    def __aiter__(self) -> LocalStream:
        return self

    def __anext__(self) -> asyncio.Future:
        self._step = asyncio.ensure_future(self._generator.__anext__())
        return self._step

    def cancel(self) -> None:
        if self._cancelled:
            return
        self._cancelled = True
        task = asyncio.get_running_loop().create_task(self._close(self._step))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def _close(self, step: asyncio.Future | None) -> None:
        if step is not None and not step.done():
            step.cancel()
            await asyncio.wait({step})  # its CancelledError is the consumer's business, not this task's
        await self._generator.aclose()  # a no-op when the cancelled step already ended it


class MergedStreams:
    """Several generations' streams as one (a batch of prompts): (its index, message) in arrival order. Each stream
    is read by a task of its own; `cancel()` aborts them all. The consumer reads every message (the ingress writes
    them out), so the queue holds what arrived since its last read."""

    def __init__(self, streams: list[ReplicaStream]):
        self.streams = streams
        self._queue: asyncio.Queue = asyncio.Queue()
        self._open = len(streams)
        self._readers = [asyncio.ensure_future(self._read(k, stream)) for k, stream in enumerate(streams)]

    async def _read(self, k: int, stream: ReplicaStream) -> None:
        try:
            async for message in stream:
                self._queue.put_nowait((k, message))
        except Exception as exc:  # the stream's failure, raised to the consumer in its turn
            self._queue.put_nowait((k, exc))
        finally:
            self._queue.put_nowait((k, None))  # this stream is over

    def __aiter__(self) -> "MergedStreams":
        return self

    async def __anext__(self) -> tuple[int, Any]:
        while self._open:
            k, message = await self._queue.get()
            if message is None:
                self._open -= 1
            elif isinstance(message, Exception):
                raise message
            else:
                return k, message
        raise StopAsyncIteration

    def cancel(self) -> None:
        for reader in self._readers:
            reader.cancel()
        for stream in self.streams:
            stream.cancel()
