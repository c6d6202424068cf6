"""EngineReplica: one AsyncLLMEngine per replica (per GPU). Admission is batched; generation streams back."""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import ray
from ray import serve

from engine import AsyncLLMEngine, EngineInputError, EngineOverloadedError, SamplingParams
from engine.async_engine import RequestStream
from engine.metrics import StepMetrics
from serve_app.config import AppArgs
from serve_app.errors import envelope
from serve_app.metrics import RaySink

log = logging.getLogger("ray.serve")

# @serve.batch only amortises tokenization and enqueueing: it returns as soon as the batch is queued, so
# continuous batching in the engine never waits on admission. 5 ms costs TTFT little and fills batches under load.
ADMISSION_BATCH_SIZE = 32
ADMISSION_WAIT_S = 0.005


class EngineReplica:
    def __init__(self, args: AppArgs):
        self.args = args
        # Tokenizing a long prompt takes a while: off the event loop, on one thread (a fast tokenizer is not
        # shareable across threads), so streams on this replica keep flowing meanwhile.
        self._tokenizer_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
        self.engine = AsyncLLMEngine(args.engine)
        self._warm_up()
        self.engine.engine.attach_metrics(StepMetrics(RaySink(), args.model_name))  # after warm-up: it is not traffic
        self.engine.start()
        self.model_info = {"max_model_len": self.engine.engine.max_model_len, "model": args.model_name,
                           "engine": effective_engine_settings(self.engine.engine)}
        self.placement = {"replica_id": serve.get_replica_context().replica_id.unique_id,
                          "node_id": ray.get_runtime_context().get_node_id(),
                          "gpu_ids": [str(g) for g in ray.get_gpu_ids()]}

    def _warm_up(self) -> None:
        """One short generation before the replica reports ready: first-call costs stay out of user latency."""
        llm = self.engine.engine
        llm.add_request("warmup", [0, 1, 2, 3], SamplingParams(max_tokens=2, temperature=0.0))
        while llm.has_unfinished_requests():
            llm.step()

    @serve.batch(max_batch_size=ADMISSION_BATCH_SIZE, batch_wait_timeout_s=ADMISSION_WAIT_S)
    async def _admit(self, requests: list[dict]) -> list[tuple[RequestStream, int] | dict]:
        prompts = await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, self._tokenize_all, requests)
        return [self._enqueue(r, p) for r, p in zip(requests, prompts)]  # one bad request must not fail its batch-mates

    def _tokenize_all(self, requests: list[dict]) -> list[list[int] | dict]:
        return [self._tokenize(r) for r in requests]

    def _tokenize(self, request: dict) -> list[int] | dict:
        try:
            return self.engine.engine.tokenize(request["prompt"])
        except Exception as exc:
            return _refusal(exc, request)

    def _enqueue(self, request: dict, token_ids: list[int] | dict) -> tuple[RequestStream, int] | dict:
        if isinstance(token_ids, dict):
            return token_ids
        try:
            # Serve may retry a request under the same public id; an abort queued for the old attempt must never
            # hit the new one, so the engine sees an id of its own per attempt.
            engine_id = f"{request['request_id']}#{uuid.uuid4().hex[:12]}"
            params = SamplingParams(**request["params"])
            stream = self.engine.add_request(engine_id, token_ids, params, cache_salt=request.get("cache_salt"))
            return stream, len(token_ids)
        except Exception as exc:
            return _refusal(exc, request)

    async def generate(self, request: dict):
        """Streams: first {"admitted": ...} or an error, then {"text", "completion_tokens", "finish_reason"} deltas."""
        admitted = await self._admit(request)
        if isinstance(admitted, dict):
            yield admitted
            return
        stream, num_prompt_tokens = admitted
        if self.args.log_prompts:
            log.info("request %s prompt=%r", request["request_id"], request["prompt"])
        try:
            yield {"admitted": True, "prompt_tokens": num_prompt_tokens}
            async for first in stream:
                outputs = [first, *stream.ready()]  # coalesce what is already there: fewer, fuller chunks
                last = outputs[-1]
                yield {"text": "".join(o.delta_text for o in outputs), "completion_tokens": len(last.token_ids),
                       "finish_reason": last.finish_reason, "error": last.error}
        finally:
            await stream.aclose()  # a disconnect cancels us here: abort, so the blocks free on the next step

    def stats(self) -> dict:
        return {**self.engine.stats(), **self.placement, "time": time.time(),
                "health_problem": self.engine.health_problem(),
                "metrics_share_of_step": self.engine.engine.metrics_share_of_step}

    def info(self) -> dict:
        return self.model_info

    async def check_health(self) -> None:
        """Serve replaces this replica when it raises: a dead loop, repeated failed steps or a hung step."""
        problem = self.engine.health_problem()
        if problem:
            raise RuntimeError(problem)

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown(timeout=1.0)


def _refusal(exc: Exception, request: dict) -> dict:
    """An admission refused: statuses are the ingress's to send, this says which and why."""
    if isinstance(exc, EngineInputError):
        return {"status": 400, **envelope(400, str(exc), exc.param)}
    if isinstance(exc, EngineOverloadedError):
        return {"status": 429, **envelope(429, str(exc), code="overloaded")}
    log.error("admission failed for %s", request.get("request_id"), exc_info=exc)  # never crash the replica on one request
    return {"status": 500, **envelope(500, f"admission failed: {type(exc).__name__}")}


def effective_engine_settings(engine) -> dict:
    """What the running engine actually uses, read from its live parts rather than its config: a knob that was
    set but never applied shows here."""
    linear = next(m for m in engine.model.modules() if type(m).__name__ in ("Linear", "Linear4bit", "Linear8bitLt"))
    return {
        "dtype": str(engine.dtype).removeprefix("torch."),
        "model_impl": engine.model.impl,
        "linear_type": type(linear).__name__,
        "packed_weights": getattr(linear, "packed", None) is not None,
        "block_weights": getattr(linear, "blocks", None) is not None,  # GGUF blocks for small batches (quantization: gguf)
        "num_kv_blocks": engine.runner.num_blocks,
        "block_size": engine.block_manager.block_size,
        "enable_prefix_caching": engine.block_manager.enable_prefix_caching,
        "max_num_seqs": engine.scheduler.max_num_seqs,
        "max_num_batched_tokens": engine.scheduler.max_num_batched_tokens,
        "max_model_len": engine.max_model_len,
        "decode_kernel": engine.runner.decode_kernel is not None,
        "device": engine.device.type,
    }
