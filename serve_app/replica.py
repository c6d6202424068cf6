"""EngineReplica: one AsyncLLMEngine per replica (per GPU). Admission is batched; generation streams back."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING
from concurrent.futures import ThreadPoolExecutor

import ray
from ray import serve

from engine import (AsyncLLMEngine, EngineDeadError, EngineInputError, EngineOverloadedError, SamplingParams,
                    ThinkingBudget)
from engine.async_engine import RequestStream
from engine.chat import DEFAULT_OPTIONS, ChatOptions
from engine.metrics import StepMetrics
from engine.step_stats import freeze_gc_heap
from serve_app.adapter_affinity import adapter_record
from serve_app.aio import all_or_none
from serve_app.autoscaling import ReplicaSignals
from serve_app.config import AppArgs
from serve_app.protocol import Admitted, Delta, EmbeddingJob, Embeddings, GenerationJob, Placement, Refused, ReplicaStats, TokenLogprob, Tokens
from serve_app.metrics import RaySink
from serve_app.reasoning import ReasoningFormat, ThinkingLimit, reasoning_token_count

if TYPE_CHECKING:
    from engine.output_processor import RequestOutput

log = logging.getLogger("ray.serve")

# @serve.batch only amortises tokenization and enqueueing: it returns as soon as the batch is queued, so
# continuous batching in the engine never waits on admission. 5 ms costs TTFT little and fills batches under load.
ADMISSION_BATCH_SIZE = 32
ADMISSION_WAIT_S = 0.005
# of one embeddings request's inputs in the engine at once, and at most half its queue (max_waiting): a request of
# 2,048 inputs neither fills the queue for everyone else nor waits behind a round trip per input
EMBEDDINGS_IN_FLIGHT = 32


class EngineReplica:
    def __init__(self, args: AppArgs):
        self.args = args
        # Tokenizing a long prompt takes a while: off the event loop, on one thread (a fast tokenizer is not
        # shareable across threads), so streams on this replica keep flowing meanwhile.
        self._tokenizer_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
        self.frontend = AsyncLLMEngine(args.engine_config)
        from engine.detokenizer import TokenTexts  # torch and transformers: loaded while the core process started
        from engine.models.loader import load_tokenizer

        self._token_texts = TokenTexts(load_tokenizer(args.engine_config))  # logprobs' token texts and echo, on the event loop
        # a scored prompt's thousands of entries are formatted on the tokenizer thread, with the tokenizer that thread
        # already uses for prompts (the front end's input half is only ever called there with text)
        self._scoring_texts = TokenTexts(self.frontend.inputs.tokenizer)
        self._reasoning_markers: dict[ReasoningFormat, tuple[list[int], list[int]]] = {}  # token ids of <think>, </think>
        self.frontend.warm_up()  # first-call costs stay out of user latency
        self.frontend.attach_metrics(StepMetrics(RaySink(), args.model_name))  # after warm-up: it is not traffic
        self.frontend.start()
        self.signals = ReplicaSignals()  # what the engine-signal autoscaling policy reads (serve_app/autoscaling.py)
        engine = args.engine_config  # the adapters it loads on demand, told to Serve's router (adapter_affinity.py)
        self._hold_adapter = adapter_record(engine.max_loras) if engine.lora_root is not None else None
        self._loaded_at_start = set(engine.lora_module_names)
        self.model_info = {"max_model_len": self.frontend.max_model_len, "model": args.model_name,
                           "engine": self.frontend.settings,
                           "sampling_defaults": self.frontend.inputs.limits.sampling_defaults}
        self.placement = Placement(serve.get_replica_context().replica_id.unique_id,
                                   ray.get_runtime_context().get_node_id(), [str(g) for g in ray.get_gpu_ids()])
        freeze_gc_heap()

    @serve.batch(max_batch_size=ADMISSION_BATCH_SIZE, batch_wait_timeout_s=ADMISSION_WAIT_S)
    async def _admit(self, jobs: list[GenerationJob]) -> list[tuple[list[RequestStream], list[int]] | Refused]:
        prompts = await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, self._tokenize_all, jobs)
        return [self._enqueue(job, p) for job, p in zip(jobs, prompts)]  # one bad request must not fail its batch-mates

    def _tokenize_all(self, jobs: list[GenerationJob]) -> list[tuple[list[int], SamplingParams] | Refused]:
        return [self._tokenize(job) for job in jobs]

    def _tokenize(self, job: GenerationJob) -> tuple[list[int], SamplingParams] | Refused:
        """Tokens of the prompt, and the grammar checked (an in-process engine: compiled): both slow, both off the
        loop. With the job's sampling parameters, whose constraint may wait for the end of the model's reasoning."""
        try:
            if job.params.structured_output is not None:
                self.frontend.inputs.grammars.check(job.params.structured_output)
            inputs = self.frontend.inputs
            params = inputs.with_defaults(job.params, job.defaulted)
            token_ids = inputs.truncated(inputs.tokenize(job.prompt, job.tools, job.chat), params)
            params = self._with_thinking_limit(job.thinking, params)
            return token_ids, self._constraint_after_reasoning(job.reasoning, params, token_ids)
        except Exception as exc:
            return _refusal(exc, job)

    def _constraint_after_reasoning(self, fmt: ReasoningFormat | None, params: SamplingParams,
                                    token_ids: list[int]) -> SamplingParams:
        """With a reasoning parser, a constraint (response_format, a forced tool call) waits for the end of the
        reasoning, as vLLM's does: unless the prompt already closed it (Qwen3's template with thinking off)."""
        if fmt is not None:
            self._markers(fmt)  # here, on the tokenizer's thread, for the usage's reasoning tokens later
        if fmt is None or params.structured_output is None:
            return params
        text = self.frontend.inputs.tokenizer.decode(token_ids)
        if text.rfind(fmt.end) > text.rfind(fmt.start):
            return params
        return dataclasses.replace(params, constrain_after=tuple(self._markers(fmt)[1]))

    def _with_thinking_limit(self, limit: ThinkingLimit | None, params: SamplingParams) -> SamplingParams:
        if limit is None:
            return params
        start, end = self._markers(limit.fmt)
        return dataclasses.replace(params, thinking_budget=ThinkingBudget(limit.tokens, tuple(start), tuple(end)))

    def _markers(self, fmt: ReasoningFormat) -> tuple[list[int], list[int]]:
        """The token ids of a reasoning format's start and end markers, tokenized once."""
        if fmt not in self._reasoning_markers:
            encode = self.frontend.inputs.tokenizer.encode
            self._reasoning_markers[fmt] = tuple(encode(m, add_special_tokens=False) for m in (fmt.start, fmt.end))
        return self._reasoning_markers[fmt]

    def _enqueue(self, job: GenerationJob, tokenized: tuple[list[int], SamplingParams] | Refused
                 ) -> tuple[list[RequestStream], list[int]] | Refused:
        """One engine request per choice; the later ones share the first one's prompt blocks. All or none."""
        if isinstance(tokenized, Refused):
            return tokenized
        token_ids, params = tokenized
        limit = self.args.max_prompt_logprob_tokens
        if job.params.prompt_logprobs is not None and len(token_ids) > limit:
            field = "echo" if job.echo else "prompt_logprobs"  # echo with logprobs, or vLLM's field
            return Refused(400, f"{'echo with logprobs' if job.echo else field} scores every prompt token; this "
                                f"prompt has {len(token_ids)} tokens and the server scores at most {limit}", field)
        if job.beam is not None:  # its steps' requests are the search's own (AsyncLLMEngine.beam_search)
            try:
                self.frontend.inputs.beam_search(token_ids, job.beam, job.cache_salt, job.priority, job.lora_name)
            except Exception as exc:
                return _refusal(exc, job)
            return [], token_ids
        streams: list[RequestStream] = []
        try:
            for index in range(job.n):
                # Serve may retry a request under the same public id; an abort queued for the old attempt must never
                # hit the new one, so the engine sees an id of its own per attempt.
                engine_id = f"{job.request_id}#{uuid.uuid4().hex[:12]}"
                leader = streams[0].request_id if streams else None
                streams.append(self.frontend.add_request(engine_id, token_ids, _choice_params(params, index),
                                                       cache_salt=job.cache_salt, prompt_leader=leader,
                                                       final_only=job.stream_interval is None, priority=job.priority,
                                                       lora_name=job.lora_name))
            return streams, token_ids
        except Exception as exc:
            for stream in streams:
                self.frontend.abort_now(stream.request_id)
            return _refusal(exc, job)

    async def _holds_adapter(self, lora_name: str | None) -> None:
        """Tell Serve this replica holds `lora_name`, an adapter under lora_root that a request runs here (one
        that is not there is never recorded: hostile names cannot push real ones out of the record)."""
        if (self._hold_adapter is not None and lora_name is not None and lora_name not in self._loaded_at_start
                and self.args.engine_config.lora_path(lora_name) is not None):
            await self._hold_adapter(lora_name)

    async def _admitted(self, job: GenerationJob) -> tuple[list[RequestStream], list[int]] | Refused:
        """The job's admission. A caller that goes meanwhile (a client's disconnect cancels us) does not stop its
        batch, which enqueues the job anyway: its requests are aborted once enqueued, or they would run to
        max_tokens for nobody."""
        admission = asyncio.ensure_future(self._admit(job))
        try:
            return await asyncio.shield(admission)
        except asyncio.CancelledError:
            admission.add_done_callback(self._abort_admitted)
            raise

    def _abort_admitted(self, admission: asyncio.Future) -> None:
        admitted = None if admission.cancelled() or admission.exception() else admission.result()
        if admitted is not None and not isinstance(admitted, Refused):
            for stream in admitted[0]:
                self.frontend.abort_now(stream.request_id)

    async def generate(self, job: GenerationJob):
        """Streams: first Admitted or Refused, then Deltas, each for one choice."""
        started = time.monotonic()
        admitted = await self._admitted(job)
        if isinstance(admitted, Refused):
            yield admitted
            return
        streams, prompt_ids = admitted
        await self._holds_adapter(job.lora_name)
        if self.args.log_prompts:
            log.info("request %s prompt=%r", job.request_id, job.prompt)
        try:
            text = self._token_texts.tokenizer.decode(prompt_ids) if job.echo or job.return_prompt_text else None
            yield Admitted(len(prompt_ids), text, list(prompt_ids) if job.return_token_ids else None)
            if job.beam is not None:
                async for delta in self._beams(job, prompt_ids):
                    if delta.index == 0 and delta.error is None:  # beams come whole at the end: the first is the first chunk
                        self.signals.first_token(time.monotonic() - started)
                    yield delta
                return
            sent_tokens: list[int | None] = [None] * len(streams)  # None: nothing sent yet
            held_text: list[str] = [""] * len(streams)  # text of outputs not sent yet; the latest output has the rest
            prompt_scores: list[TokenLogprob] | None = None  # the first choice's, formatted once for every choice
            scores_sent = False
            async for index, outputs in _each_choice(streams):
                last = outputs[-1]
                held_text[index] += "".join(o.delta_text for o in outputs)
                if index == 0 and prompt_scores is None and last.prompt_logprobs is not None:
                    prompt_scores = await asyncio.get_running_loop().run_in_executor(
                        self._tokenizer_thread, self._prompt_logprobs, last, job.params.prompt_logprobs,
                        _token_id_text if job.return_tokens_as_token_ids else self._scoring_texts)
                waits_for_scores = job.params.prompt_logprobs is not None and prompt_scores is None
                interval = self._interval(job)
                if (waits_for_scores and last.finish_reason is None) or not _due(last, sent_tokens[index], interval):
                    _hold(streams[index], sent_tokens[index], interval)
                    continue  # a later choice waits for the first one's prompt scores (they come first in practice)
                delta = self._delta(index, held_text[index], last, sent_tokens[index] or 0, job)
                if prompt_scores is not None and not scores_sent:  # once for all n: each copy cost the ingress 40 ms
                    delta.prompt_logprobs, scores_sent = prompt_scores, True
                if all(sent is None for sent in sent_tokens):  # the request's first chunk
                    self.signals.first_token(time.monotonic() - started)
                sent_tokens[index], held_text[index] = last.num_tokens, ""
                _hold(streams[index], sent_tokens[index], interval)
                yield delta
        finally:
            for stream in streams:
                await stream.aclose()  # a disconnect cancels us here: abort, so the blocks free on the next step

    async def _beams(self, job: GenerationJob, prompt_ids: list[int]):
        """A beam search's best beams, each choice one Delta at the end (streamed too: no beam is final before)."""
        tokenizer = self._token_texts.tokenizer  # the event loop's
        try:
            found = await self.frontend.beam_search(
                f"{job.request_id}#{uuid.uuid4().hex[:12]}", prompt_ids, job.beam,
                lambda ids: tokenizer.decode(ids, skip_special_tokens=job.beam.skip_special_tokens), job.cache_salt,
                job.priority, job.lora_name)
        except (EngineInputError, RuntimeError) as exc:
            yield Delta(0, "", 0, error=str(exc), error_param=getattr(exc, "param", None))
            return
        for index, beam in enumerate(found.sequences):
            ids = beam.output_token_ids(len(prompt_ids))
            thinking = None if job.reasoning is None else \
                reasoning_token_count(ids, job.reasoning, *self._markers(job.reasoning))
            yield Delta(index, beam.text, len(ids), beam.finish_reason, cached_tokens=found.num_cached_tokens,
                        token_ids=ids if job.return_token_ids else None, reasoning_tokens=thinking)

    async def embed(self, job: EmbeddingJob) -> Embeddings | Refused:
        """Each input's embedding: tokenized on the tokenizer thread, then run as engine requests, at most
        EMBEDDINGS_IN_FLIGHT of one job at a time."""
        prompts = await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, self._embedding_inputs, job)
        if isinstance(prompts, Refused):
            return prompts
        queue = self.args.engine_config.max_waiting
        window = asyncio.Semaphore(max(1, min(EMBEDDINGS_IN_FLIGHT, queue // 2 if queue else EMBEDDINGS_IN_FLIGHT)))

        async def one(ids: list[int]) -> bytes:
            async with window:
                stream = self.frontend.add_request(f"{job.request_id}#{uuid.uuid4().hex[:12]}", ids, final_only=True,
                                                   priority=job.priority, lora_name=job.lora_name, pooling=job.pooling,
                                                   cache_salt=job.cache_salt)
                try:
                    return (await stream.final()).embedding_f32
                finally:
                    await stream.aclose()

        await self._holds_adapter(job.lora_name)
        try:
            vectors = await all_or_none([one(ids) for ids in prompts])  # a cancelled one's stream aborts
        except Exception as exc:
            return _refusal(exc, job)
        return Embeddings(vectors, sum(map(len, prompts)))

    def _embedding_inputs(self, job: EmbeddingJob) -> list[list[int]] | Refused:
        """Each input's token ids, truncated as asked and checked against the model's context."""
        inputs, prompts = self.frontend.inputs, []
        try:
            inputs.check_dimensions(job.pooling.dimensions)
            for i, text in enumerate(job.inputs):
                try:
                    prompts.append(inputs.truncated_for_embedding(inputs.tokenize(text), job.pooling))
                except EngineInputError as exc:
                    if exc.param not in ("prompt", "input"):
                        raise
                    if job.sources is not None:  # another route's names for its texts
                        field, name = job.sources[i]
                        raise EngineInputError(re.sub(r"^(prompt|input)\b", name, str(exc)), field) from None
                    said = str(exc).replace("prompt", "input", 1)  # the embeddings API's name for it
                    raise EngineInputError(f"{said} (input {i})" if len(job.inputs) > 1 else said, "input") from None
        except EngineInputError as exc:
            return Refused(400, str(exc), exc.param)
        return prompts

    def _interval(self, job: GenerationJob) -> int | None:
        """Tokens per chunk for this job now: its stream_interval, or under `stream_chunks_per_step` fewer while few
        streams share the replica (each chunk is a message, so the messages a step costs stay bounded)."""
        per_step = job.stream_chunks_per_step
        if job.stream_interval is None or per_step is None:
            return job.stream_interval
        return min(job.stream_interval, max(job.least_stream_interval, -(-self.frontend.num_open_streams // per_step)))

    def _delta(self, index: int, text: str, last: RequestOutput, sent_tokens: int, job: GenerationJob) -> Delta:
        logprobs, top_logprobs = None, job.params.logprobs
        if top_logprobs is not None and last.logprobs is not None:
            texts = _token_id_text if job.return_tokens_as_token_ids else self._token_texts
            listed = job.params.logprob_token_ids is not None
            logprobs = [_token_logprob(texts, token, entry, top_logprobs, listed=listed)
                        for token, entry in zip(last.token_ids_since(sent_tokens), last.logprobs[sent_tokens:])]
        thinking = None
        if job.reasoning is not None and last.finished:
            thinking = reasoning_token_count(last.token_ids, job.reasoning, *self._markers(job.reasoning))
        return Delta(index, text, last.num_tokens, last.finish_reason, last.error, logprobs, last.num_cached_tokens,
                     error_param=last.error_param,
                     token_ids=list(last.token_ids_since(sent_tokens)) if job.return_token_ids else None,
                     reasoning_tokens=thinking, stop_reason=last.stop_reason)

    @staticmethod
    def _prompt_logprobs(output: RequestOutput, top: int, texts) -> list[TokenLogprob]:
        """Every prompt token's score, with its id and rank (vLLM's prompt_logprobs shows them)."""
        ids = output.prompt_token_ids
        text, raw = texts(ids[0])
        scores = [TokenLogprob(text, None, raw, token_id=ids[0])]
        return scores + [_token_logprob(texts, token, entry, top, rank) for token, entry, rank
                         in zip(ids[1:], output.prompt_logprobs[1:], output.prompt_ranks[1:])]

    async def tokenize(self, prompt: str | list[dict], tools: list[dict] | None, with_strs: bool,
                       chat: ChatOptions = DEFAULT_OPTIONS) -> Tokens | Refused:
        """The ids a generation with this prompt would start from (vLLM's /tokenize), on the tokenizer thread."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, self._tokens, prompt, tools,
                                                                with_strs, chat)

    def _tokens(self, prompt: str | list[dict], tools: list[dict] | None, with_strs: bool,
                chat: ChatOptions) -> Tokens | Refused:
        inputs = self.frontend.inputs
        try:
            ids = inputs.tokenize(prompt, tools, chat)
        except EngineInputError as exc:
            return Refused(400, str(exc), exc.param)
        return Tokens(ids, inputs.tokenizer.convert_ids_to_tokens(ids) if with_strs else None)

    async def detokenize(self, tokens: list[int]) -> str | Refused:
        """The text of token ids (vLLM's /detokenize), on the tokenizer thread."""
        try:
            self.frontend.inputs.check_in_vocabulary(tokens, "tokens")
        except EngineInputError as exc:
            return Refused(400, str(exc), exc.param)
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread,
                                                                self.frontend.inputs.tokenizer.decode, tokens)

    def stats(self) -> ReplicaStats:
        return ReplicaStats(self.frontend.stats(), self.placement, time.time(), self.frontend.health_problem())

    def info(self) -> dict:
        return self.model_info

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom-metrics hook: the engine's signals, for `autoscaling_policy: engine`."""
        return self.signals.report(self.frontend.stats())

    async def check_health(self) -> None:
        """Serve replaces this replica when it raises: a dead loop, repeated failed steps or a hung step."""
        problem = self.frontend.health_problem()
        if problem:
            raise RuntimeError(problem)

    def close_engine(self) -> None:
        engine = getattr(self, "frontend", None)  # absent when __init__ failed before the engine was made
        if engine is not None:
            engine.shutdown(timeout=1.0)

    def __del__(self):
        self.close_engine()


def _token_id_text(token: int) -> tuple[str, list[int]]:
    """return_tokens_as_token_ids: a token named by its id, as vLLM writes it (a piece of a character has no
    text of its own)."""
    text = f"token_id:{token}"
    return text, list(text.encode())


def _token_logprob(texts: Callable[[int], tuple[str, list[int]]], token: int, entry: dict[int, float], top: int,
                   rank: int | None = None, listed: bool = False) -> TokenLogprob:
    """The engine's entry holds the chosen token and the top ones; OpenAI wants them apart, the top ranked. With
    the token's `rank` (a prompt token's), the ids too, as vLLM's prompt_logprobs keys them. An entry of `listed`
    ids (logprob_token_ids) is shown whole, in its order: the chosen token, then the request's ids (vLLM's)."""
    text, raw = texts(token)
    best = list(entry.items()) if listed else sorted(entry.items(), key=lambda item: -item[1])[:top]
    ranked = []
    for other, logprob in best:
        other_text, other_raw = texts(other)
        ranked.append((other_text, logprob, other_raw))
    score = TokenLogprob(text, entry[token], raw, ranked, top_ids=[other for other, _ in best] if listed else None)
    if rank is not None:
        score.token_id, score.rank, score.top_ids = token, rank, [other for other, _ in best]
    return score


def _refusal(exc: Exception, job: GenerationJob) -> Refused:
    """An admission refused: statuses are the ingress's to send, this says which and why."""
    if isinstance(exc, EngineInputError) and exc.param == "lora_name":  # the request named it as its model
        return Refused(404, f"model {str(job.lora_name)[:256]!r} does not exist: no such LoRA adapter is served here",
                       "model", "model_not_found")
    if isinstance(exc, EngineInputError):
        return Refused(400, str(exc), exc.param)
    if isinstance(exc, EngineOverloadedError):
        return Refused(429, str(exc), code="overloaded")
    if isinstance(exc, EngineDeadError):  # Serve replaces this replica on its next health check
        return Refused(503, "the engine replica is restarting; retry the request")
    log.error("admission failed for %s", job.request_id, exc_info=exc)  # never crash the replica on one request
    return Refused(500, f"admission failed: {type(exc).__name__}")


def _choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice i of a seeded request draws from seed + i (as vLLM does): the same seed repeats, choices differ.
    Only the first choice scores the prompt (echo with logprobs): the others share its prompt's blocks and its
    scores, where each scoring the prompt again would skip the prefix cache and multiply the work by n."""
    if index == 0:
        return params
    return dataclasses.replace(params, seed=None if params.seed is None else params.seed + index, prompt_logprobs=None)


async def _each_choice(streams: list[RequestStream]):
    """(choice index, outputs ready now) as they arrive, across every choice's stream; a lone stream directly."""
    if len(streams) == 1:
        async for first in streams[0]:
            yield 0, [first, *streams[0].ready()]  # coalesce what is already there: fewer, fuller chunks
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for first in stream:
                queue.put_nowait((index, [first, *stream.ready()]))
        except Exception as exc:
            queue.put_nowait((index, exc))
        finally:
            queue.put_nowait((index, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        open_streams = len(streams)
        while open_streams:
            index, item = await queue.get()
            if item is None:
                open_streams -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


def _hold(stream: RequestStream, sent_tokens: int | None, stream_interval: int | None) -> None:
    """Wake this choice's reader next when its next chunk is due by the interval as it stands (it may change before
    then: `_due` decides when it wakes), or at the end."""
    if sent_tokens is not None and stream_interval is not None:
        stream.hold(sent_tokens + stream_interval)


def _due(last: RequestOutput, sent_tokens: int | None, stream_interval: int | None) -> bool:
    """Whether a choice's held outputs go out now. Each Delta is a Ray message to the ingress and, streamed, an HTTP
    chunk through the proxy, so under load fewer, fuller ones leave the engine's cores more time (vLLM's FINAL_ONLY
    outputs and --stream-interval). The end and a stream's first token never wait."""
    if last.finished or last.error:
        return True
    if stream_interval is None:
        return False
    return sent_tokens is None or last.num_tokens - sent_tokens >= stream_interval
