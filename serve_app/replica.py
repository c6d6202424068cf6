"""EngineReplica: one AsyncLLMEngine per replica (per GPU). Admission is batched; generation streams back."""
from __future__ import annotations

import logging
import time
import uuid

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
        self.engine = AsyncLLMEngine(args.engine_config())
        self._warm_up()
        self.engine.engine.attach_metrics(StepMetrics(RaySink(), args.model_name))  # after warm-up: it is not traffic
        self.engine.start()
        self.model_info = {"max_model_len": self.engine.engine.max_model_len, "model": args.model_name}
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
        return [self._admit_one(r) for r in requests]  # one bad request must not fail its batch-mates

    def _admit_one(self, request: dict) -> tuple[RequestStream, int] | dict:
        try:
            token_ids = self.engine.engine.tokenize(request["prompt"])
            params = dict(request["params"])
            if params.get("max_tokens") is None:
                remaining = self.engine.engine.max_model_len - len(token_ids)
                params["max_tokens"] = max(1, min(self.args.default_max_tokens or remaining, self.args.max_tokens_limit, remaining))
            # Serve may retry a request under the same public id; an abort queued for the old attempt must never
            # hit the new one, so the engine sees an id of its own per attempt.
            engine_id = f"{request['request_id']}#{uuid.uuid4().hex[:12]}"
            return self.engine.add_request(engine_id, token_ids, SamplingParams(**params)), len(token_ids)
        except EngineInputError as exc:
            return {"status": 400, **envelope(400, str(exc), exc.param)}
        except EngineOverloadedError as exc:
            return {"status": 429, **envelope(429, str(exc), code="overloaded")}
        except Exception as exc:  # never crash the replica on one request
            log.exception("admission failed for %s", request.get("request_id"))
            return {"status": 500, **envelope(500, f"admission failed: {type(exc).__name__}")}

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
        return {**self.engine.stats(), **self.placement, "engine_running": self.engine.is_running, "time": time.time(),
                "metrics_share_of_step": self.engine.engine.metrics_share_of_step}

    def info(self) -> dict:
        return self.model_info

    async def check_health(self) -> None:
        if not self.engine.is_running:
            raise RuntimeError(self.engine.dead_reason or "engine loop is not running")

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown(timeout=1.0)
