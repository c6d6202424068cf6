"""One served model's side of the ingress: its requests validated against its args and sent to its engine replicas,
their results told in the API's shape. The ingress holds one a model and routes each request by its `model`."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable

from fastapi import Request
from fastapi.responses import StreamingResponse
from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError

from engine import EngineInputError, PoolingParams
from engine.config import ADAPTER_NAME
from engine.scoring import cosine_scores
from serve_app.aio import all_or_none
from serve_app.config import AppArgs
from serve_app.errors import OpenAIError, envelope
from serve_app.generation_job import chat_options, generation_job, offered_tools, offers_tools
from serve_app.openai_protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, SamplingFields,
                                      StreamOptions, TokenizeRequest)
from serve_app.protocol import Admitted, Delta, EmbeddingJob, GenerationJob, Refused, ReplicaStats, Tokens
from serve_app.replica_client import MergedStreams, ReplicaClient
from serve_app import (embeddings_api, generative_scoring_api, messages_api_output, responses_api, responses_api_output,
                       score_api)
from serve_app.embeddings_api import EmbeddingRequest
from serve_app.generative_scoring_api import GenerativeScoringRequest
from serve_app.messages_api import CountTokensRequest, MessagesRequest
from serve_app.score_api import RerankRequest, ScoreRequest
from serve_app.responses import (KEEP_ALIVE, Choice, CompletionResponse, StreamedChoice, chunk_body, completion_body, sse,
                                 usage, vllm_prompt_logprobs)
from serve_app.reasoning import PARSERS, ReasoningFormat, ReasoningSplitter
from serve_app.responses_api import ResponsesRequest

log = logging.getLogger("ray.serve")
HEALTH_TIMEOUT_S = 2.0
CONTROL_TIMEOUT_S = 10.0  # model info and other short calls to the replica
ADMISSION_ATTEMPTS = 6  # with a backoff of 0.05 s doubling: 1.55 s for Serve to drop a lost node's replicas
ADMISSION_BACKOFF_S = 0.05
ADMISSION_CHECK_S = 1.0  # an admission slower than this asks whether it can come at all


class ModelFront:
    def __init__(self, replica: ReplicaClient, args: AppArgs):
        self.replica = replica
        self.args = args  # this model's fields, with the app's server-wide ones
        self._model_info: dict | None = None
        self.adapters = args.engine_config.lora_module_names  # servable as `model`

    def serves(self, model_id: str) -> bool:
        """Whether `model_id` names this model or one of its LoRA adapters (one under lora_root: whether it is
        there, the replica says, a 404 if not)."""
        return (model_id in self.args.model_names or model_id in self.adapters
                or (self.args.engine_config.lora_root is not None and ADAPTER_NAME.fullmatch(model_id) is not None))

    async def stats(self) -> ReplicaStats:
        return await asyncio.wait_for(self.replica.stats(), HEALTH_TIMEOUT_S)

    async def cards(self) -> list[dict]:
        """The base model, then each LoRA adapter with the base as its `parent` (vLLM's listing): lora_modules', then
        those under lora_root where this process can see it (as Ray Serve LLM lists its dynamic adapters)."""
        on_demand = _adapters_under(self.args.engine_config.lora_root, self.adapters)
        names = [*self.args.model_names, *self.adapters, *on_demand]
        return [await self.card(name) for name in names]

    async def card(self, model_id: str) -> dict:
        """OpenAI's model object for the model or an adapter served (`GET /v1/models/{model}`)."""
        info = await self._info()
        card = {"id": model_id, "object": "model", "created": 0, "owned_by": "llm-serve",
                "max_model_len": info["max_model_len"]}
        return card | ({"parent": self.args.model_name} if self._lora_name(model_id) is not None else {})

    def _lora_name(self, model_id: str | None) -> str | None:
        """The LoRA adapter a request's `model` names, None for the base model (the ingress routed it here)."""
        return None if model_id is None or model_id in self.args.model_names else model_id

    def _model_name(self, model_id: str | None) -> str:
        """The `model` a response names: the adapter or the base model's name the request chose, else the first."""
        return self._lora_name(model_id) or (model_id if model_id in self.args.model_names else self.args.model_name)

    async def tokenize(self, body: TokenizeRequest) -> dict:
        """vLLM's /tokenize: the ids a completion or chat completion with this prompt would count."""
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        tokens = await self._prompt_tokens(body, body.template_input(), tools, body.return_token_strs)
        info = await self._info()
        return {"count": len(tokens.ids), "max_model_len": info["max_model_len"], "tokens": tokens.ids,
                "token_strs": tokens.strs}

    async def _prompt_tokens(self, body: TokenizeRequest | ChatCompletionRequest, prompt, tools: list[dict] | None,
                             strs: bool = False) -> Tokens:
        """The ids of a prompt, or of chat messages with the tools offered, as a generation would count them."""
        try:
            options = chat_options(body, self.args)
        except EngineInputError as exc:
            raise OpenAIError(400, str(exc), exc.param)
        tokens = await self._call(self.replica.tokenize(prompt, tools, strs, options), self.args.request_timeout_s)
        self._raise_if_refused(tokens)
        return tokens

    async def detokenize(self, body: DetokenizeRequest) -> dict:
        """vLLM's /detokenize: the text of token ids."""
        text = await self._call(self.replica.detokenize(body.tokens), self.args.request_timeout_s)
        self._raise_if_refused(text)
        return {"prompt": text}

    async def embed(self, body: EmbeddingRequest, request: Request) -> dict:
        """OpenAI's /v1/embeddings: each input's embedding from the model (or the adapter `model` names)."""
        request_id = body.request_id or request.state.request_id
        result = await self._embedded(request_id, body.model, body.inputs, None, body.pooling_params, body.priority,
                                      body.cache_salt)
        return embeddings_api.response_body(request_id, self._model_name(body.model), result.vectors,
                                            result.prompt_tokens, body.encoding_format, body.endianness)

    async def score(self, body: ScoreRequest, request: Request) -> dict:
        """vLLM's /v1/score: each text pair's cosine similarity of embeddings."""
        request_id = body.request_id or request.state.request_id
        result = await self._embedded(request_id, body.model, *body.texts(), body.pooling_params, body.priority,
                                      body.cache_salt)
        return score_api.score_body(request_id, self._model_name(body.model), cosine_scores(
            result.vectors, len(body.firsts)), result.prompt_tokens)

    async def rerank(self, body: RerankRequest, request: Request) -> dict:
        """vLLM's /v1/rerank (Cohere's and Jina's shape): documents by their similarity to the query, best first."""
        request_id = body.request_id or request.state.request_id
        result = await self._embedded(request_id, body.model, *body.texts(), body.pooling_params, body.priority,
                                      body.cache_salt)
        return score_api.rerank_body(request_id, self._model_name(body.model), body,
                                     cosine_scores(result.vectors, 1), result.prompt_tokens)

    async def _embedded(self, request_id: str, model: str | None, inputs: list, sources: list | None,
                        pooling: Callable[[], PoolingParams], priority: int, cache_salt: str | None):
        """The embeddings of `inputs` from the model (or the adapter `model` names), in order; `sources`: each
        input's field and name in errors, where the route calls them otherwise than /v1/embeddings; `pooling`: the
        body's parameters, made here, where an error in them is the client's 400."""
        lora_name = self._lora_name(model)
        try:
            job = EmbeddingJob(request_id, inputs, pooling(), priority, lora_name, sources, cache_salt)
        except EngineInputError as exc:
            raise OpenAIError(400, str(exc), exc.param)
        result = await self._call(self._retrying_lost_replicas(lambda: self.replica.embed(job)),
                                  self.args.request_timeout_s)
        self._raise_if_refused(result)
        self.replica.admitted(lora_name)
        return result

    async def generative_scoring(self, body: GenerativeScoringRequest, request: Request) -> dict:
        """vLLM's /generative_scoring: each item's score from one greedy token's logprobs of the label tokens."""
        request_id = body.request_id or request.state.request_id
        lora_name, params = self._lora_name(body.model), body.sampling_params()
        jobs = [GenerationJob(f"{request_id}-{k}", prompt, params, cache_salt=body.cache_salt, priority=body.priority,
                              lora_name=lora_name) for k, prompt in enumerate(body.prompts())]
        choices = [Choice(0, chat=False) for _ in jobs]
        try:
            results = await all_or_none([self._whole(job, [choice]) for job, choice in zip(jobs, choices)])
        except OpenAIError as exc:
            raise generative_scoring_api.renamed(exc) from None
        labels = body.label_token_ids
        scores = [body.score(generative_scoring_api.label_logprobs(c.logprobs[0], labels)) for c in choices]
        return generative_scoring_api.response_body(request_id, self._model_name(body.model), scores,
                                                    sum(admitted.prompt_tokens for admitted, _ in results),
                                                    sum(c.completion_tokens for c in choices))

    # -- one request ---------------------------------------------------------------------------------

    async def _info(self) -> dict:
        if self._model_info is None:
            self._model_info = await self._call(self.replica.info(), CONTROL_TIMEOUT_S)
        return self._model_info

    async def respond(self, body: SamplingFields, prompt, chat: bool, request: Request):
        request_id = body.request_id or request.state.request_id
        if body.stream:
            chunks = await self.stream_chunks(body, prompt, chat, request_id)
            return StreamingResponse(self._sse(chunks, request_id), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return CompletionResponse(await self.whole_body(body, prompt, chat, request_id))

    async def respond_to_responses(self, body: ResponsesRequest, request: Request):
        """OpenAI's Responses API (`POST /v1/responses`): the request becomes a chat completion, whose result or
        chunks become a response object or its stream of typed events."""
        request_id = f"resp_{request.state.request_id}"
        try:
            chat = body.chat_request()
            body.sampled_with((await self._info()).get("sampling_defaults", {}))  # what the response shows
            messages = [m.for_template() for m in chat.messages]
            if body.stream:
                chunks = await self.stream_chunks(chat, messages, True, request_id)
                events = responses_api_output.event_stream(chunks, body, request_id, self._model_name(body.model),
                                                           _stream_error)
                return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
            whole = await self.whole_body(chat, messages, True, request_id)
        except OpenAIError as exc:
            raise responses_api.renamed(exc) from None
        return CompletionResponse(responses_api_output.response_object(whole, body, request_id,
                                                                       self._model_name(body.model)))

    async def respond_to_messages(self, body: MessagesRequest, request: Request):
        """Anthropic's Messages API (`POST /v1/messages`), as vLLM serves it: the request becomes a chat completion,
        whose result or chunks become a message or its stream of typed events."""
        message_id = f"msg_{request.state.request_id}"
        model = self._model_name(body.model)
        try:
            chat = body.chat_request(parses_reasoning=self.args.reasoning_parser is not None)
            messages = [m.for_template() for m in chat.messages]
            if body.stream:
                chunks = await self.stream_chunks(chat, messages, True, message_id)
                events = messages_api_output.event_stream(chunks, message_id, model, _stream_error,
                                                          warm_only=body.max_tokens == 0)
                return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
            whole = await self.whole_body(chat, messages, True, message_id)
        except OpenAIError as exc:
            raise body.renamed(exc) from None
        return CompletionResponse(messages_api_output.message_object(whole, message_id, model, body.max_tokens == 0))

    async def count_message_tokens(self, body: CountTokensRequest) -> dict:
        """Anthropic's `POST /v1/messages/count_tokens`: the prompt's tokens as a Messages request would count them."""
        try:
            chat = body.chat_request(parses_reasoning=self.args.reasoning_parser is not None)
            tokens = await self._prompt_tokens(chat, [m.for_template() for m in chat.messages], offered_tools(chat))
        except OpenAIError as exc:
            raise body.renamed(exc) from None
        return {"input_tokens": len(tokens.ids)}

    def _jobs(self, body: SamplingFields, prompt, request_id: str) -> list[GenerationJob]:
        lora_name = self._lora_name(body.model)
        if body.n > self.args.max_n:
            raise OpenAIError(400, f"n: at most {self.args.max_n} choices per request, got {body.n}", "n")
        prompts = body.prompts if isinstance(body, CompletionRequest) else [prompt]
        # a batch of prompts: one job each, its choices numbered after the prompts before it (k * n + i)
        fmt, _ = self._reasoning(body, isinstance(body, ChatCompletionRequest))
        return [generation_job(request_id if len(prompts) == 1 else f"{request_id}-{k}", body, p, self.args, lora_name, fmt)
                for k, p in enumerate(prompts)]

    async def stream_chunks(self, body: SamplingFields, prompt, chat: bool, request_id: str):
        """Admit every job (refusals raise here, before any header is sent), then the stream's chunks: dicts, and
        None where a keep-alive is due."""
        jobs = self._jobs(body, prompt, request_id)
        parse_tools = offers_tools(body)
        started, n = await self._admit_all(jobs), body.n
        ids = body.return_token_ids
        fmt, show = self._reasoning(body, chat)
        choices = [StreamedChoice(k * n + i, chat, parse_tools, admitted.prompt_text or "",
                                  pending_token_ids=[] if ids else None,
                                  prompt_token_ids=None if chat else admitted.prompt_token_ids,
                                  reasoning=ReasoningSplitter(fmt) if fmt is not None else None, show_reasoning=show,
                                  tool_format=self.args.tool_call_parser)
                   for k, (_, admitted) in enumerate(started) for i in range(n)]
        stream = started[0][0] if len(started) == 1 else MergedStreams([s for s, _ in started])
        return self._chunks(stream, request_id, int(time.time()), chat, choices, sum(a.prompt_tokens for _, a in started),
                            body.stream_options or StreamOptions(), self._shows_cached_tokens(body), n,
                            chat_prompt_fields(body, started[0][1]), self._model_name(body.model))

    def _reasoning(self, body: SamplingFields, chat: bool) -> tuple[ReasoningFormat | None, bool]:
        """A chat's reasoning format (the app's reasoning parser), and whether its reasoning is shown."""
        fmt = PARSERS[self.args.reasoning_parser] if chat and self.args.reasoning_parser is not None else None
        return fmt, getattr(body, "include_reasoning", True)

    async def whole_body(self, body: SamplingFields, prompt, chat: bool, request_id: str) -> dict:
        """Every prompt's choices, generated together; a replica lost for good mid-generation surfaces from _call:
        a 503 in the envelope, like any handle failure."""
        jobs = self._jobs(body, prompt, request_id)
        parse_tools = offers_tools(body)
        created, n = int(time.time()), body.n
        fmt, show = self._reasoning(body, chat)
        groups = [[Choice(k * n + i, chat, parse_tools, reasoning=fmt, show_reasoning=show,
                          tool_format=self.args.tool_call_parser) for i in range(n)]
                  for k in range(len(jobs))]
        results = await all_or_none([self._whole(job, group) for job, group in zip(jobs, groups)])
        for group, (admitted, _) in zip(groups, results):
            for choice in group:
                choice.prefix = admitted.prompt_text or ""
                choice.prompt_token_ids = None if chat else admitted.prompt_token_ids
        choices = [choice for group in groups for choice in group]
        tokens = sum(c.completion_tokens for c in choices)
        shown = sum(cached for _, cached in results) if self._shows_cached_tokens(body) else None
        prompt_tokens = sum(admitted.prompt_tokens for admitted, _ in results)
        thinking = sum(c.reasoning_tokens for c in choices) if fmt is not None else None
        response = completion_body(request_id, self._model_name(body.model), choices, chat,
                                   usage(prompt_tokens, tokens, shown, thinking), created)
        response |= chat_prompt_fields(body, results[0][0])
        if chat and body.prompt_logprobs is not None:  # vLLM's place for a chat's; completions' are per choice
            response["prompt_logprobs"] = vllm_prompt_logprobs(choices[0].prompt_scores)
        return response

    def _whole(self, job: GenerationJob, choices: list[Choice]):
        return self._call(self._retrying_lost_replicas(lambda: self._generate_whole(job, choices)),
                          self.args.request_timeout_s)

    def _shows_cached_tokens(self, body) -> bool:
        """An unsalted request's cached-token count would tell its caller whether another tenant sent the same
        prefix; a salted one's counts only its own salt's blocks. vLLM likewise shows it only when turned on."""
        return body.cache_salt is not None or self.args.report_cached_tokens

    async def _retrying_lost_replicas(self, attempt):
        """Run `attempt()` again on another replica when the one it reached is lost before anything was sent to the
        client: at admission, or anywhere in a non-streamed generation (a node's replicas can admit work for a moment
        after the node is removed, then die). The router may pick a dead replica again until Serve's replica set
        catches up, so the attempts back off; immediate retries ran out when half the replicas had gone."""
        for number in range(1, ADMISSION_ATTEMPTS + 1):
            try:
                return await attempt()
            except RayActorError as exc:
                if number == ADMISSION_ATTEMPTS:
                    raise
                log.warning("engine replica lost before any output was sent (%s); retrying elsewhere", type(exc).__name__)
                await asyncio.sleep(ADMISSION_BACKOFF_S * 2 ** (number - 1))

    async def _admit_all(self, jobs: list[GenerationJob]) -> list[tuple]:
        """Admit every job at once: (stream, admission) each. A refusal or failure of any cancels them all and is
        raised: a batch of prompts is answered whole or refused."""
        tasks = [asyncio.ensure_future(self._started(job)) for job in jobs]
        try:
            started = await asyncio.gather(*tasks)
            for _, admitted in started:
                self._raise_if_refused(admitted)
            return started
        except BaseException:
            for task in tasks:
                task.cancel()  # those still admitting cancel their own stream (_admit)
                if task.done() and not task.cancelled() and task.exception() is None:
                    task.result()[0].cancel()
            raise

    def _started(self, job: GenerationJob):
        return self._call(self._retrying_lost_replicas(lambda: self._admit(job)), self.args.request_timeout_s)

    async def _admit(self, job: GenerationJob):
        """Start a generation: the stream and the replica's admission result (its first message)."""
        stream = self.replica.generate(job)
        try:
            admitted = await self._first_message(stream)
            if isinstance(admitted, Admitted):
                self.replica.admitted(job.lora_name)
            return stream, admitted
        except BaseException:
            stream.cancel()
            raise

    async def _first_message(self, stream):
        """The replica's admission result. While it is slow to come, whether any replica ever will take the job
        is asked every ADMISSION_CHECK_S: during an app's deletion none will, and the request is refused now."""
        deadline = asyncio.get_running_loop().time() + self.args.request_timeout_s
        async with contextlib.aclosing(_with_keep_alive(stream, ADMISSION_CHECK_S, deadline)) as waiting:
            async for first in waiting:
                if first is not None:
                    return first
                if await self.replica.unroutable():
                    raise OpenAIError(503, "the application is being deleted: no engine replica will take the request")
        raise StopAsyncIteration  # the stream ended without one, as anext() would have said

    async def _generate_whole(self, job: GenerationJob, choices: list[Choice]) -> tuple[Admitted, int]:
        """A non-streamed generation into `choices`: (admission, cached prompt tokens); refusals raise."""
        stream, admitted = await self._admit(job)
        self._raise_if_refused(admitted)
        for choice in choices:  # a retry on another replica starts over
            choice.text, choice.logprobs, choice.prefix_logprobs, choice.prompt_scores = "", None, None, None
            choice.token_ids = [] if job.return_token_ids else None
        cached_tokens = 0
        try:
            async for delta in stream:
                if delta.error:
                    raise _generation_failed(delta)
                if delta.prompt_logprobs is not None:
                    for choice in choices:  # echo's, in OpenAI's logprobs; or vLLM's prompt_logprobs
                        choice.prefix_logprobs = delta.prompt_logprobs if job.echo else None
                        choice.prompt_scores = None if job.echo else delta.prompt_logprobs
                choices[delta.index].add(delta.text, delta.completion_tokens, delta.finish_reason, delta.logprobs,
                                         delta.token_ids, delta.reasoning_tokens, delta.stop_reason)
                cached_tokens = delta.cached_tokens if delta.index == 0 else cached_tokens
            return admitted, cached_tokens
        except BaseException:
            stream.cancel()
            raise

    def _raise_if_refused(self, admitted: Admitted | Tokens | str | Refused) -> None:
        if isinstance(admitted, Refused):
            raise OpenAIError(admitted.status, admitted.message, admitted.param, admitted.code,
                              self.args.retry_after_s if admitted.status in (429, 503) else None)

    @staticmethod
    async def _sse(chunks, request_id: str):
        """Chat and completion chunks as SSE, an error after the headers in-band, then [DONE]. Closed at once when the
        client goes, so the engine stops its requests then, not when the collector finds the generator."""
        async with contextlib.aclosing(chunks):
            try:
                async for chunk in chunks:
                    yield KEEP_ALIVE if chunk is None else sse(chunk)
            except Exception as exc:  # headers are gone: report in-band, then end the stream properly
                yield sse(_stream_error(exc, request_id))
        yield "data: [DONE]\n\n"

    async def _chunks(self, stream, request_id: str, created: int, chat: bool, choices: list[StreamedChoice],
                      prompt_tokens: int, options: StreamOptions, shows_cached_tokens: bool, n: int,
                      first_chunk_fields: dict, model: str):
        tokens = [0] * len(choices)
        cached = [0] * (len(choices) // n)  # each prompt's cached tokens, as its first choice reports them
        thinking = [0] * len(choices) if choices and choices[0].reasoning is not None else None

        def usage_so_far() -> dict:
            return usage(prompt_tokens, sum(tokens), sum(cached) if shows_cached_tokens else None,
                         sum(thinking) if thinking is not None else None)

        deadline = asyncio.get_running_loop().time() + self.args.request_timeout_s
        try:
            async for delta in _with_keep_alive(stream, self.args.sse_keepalive_s, deadline):
                if delta is None:
                    yield None
                    continue
                job, delta = delta if isinstance(delta, tuple) else (0, delta)  # MergedStreams says whose
                if delta.error:
                    raise _generation_failed(delta)
                first = job * n
                tokens[first + delta.index] = delta.completion_tokens
                if thinking is not None and delta.reasoning_tokens is not None:
                    thinking[first + delta.index] = delta.reasoning_tokens
                if delta.index == 0:
                    cached[job] = delta.cached_tokens
                if delta.prompt_logprobs is not None:
                    for choice in choices[first:first + n]:
                        choice.score_prompt(delta.prompt_logprobs)
                for choice in choices[first + delta.index].chunks(delta.text, delta.finish_reason, delta.logprobs,
                                                                  delta.token_ids, delta.stop_reason):
                    chunk = chunk_body(request_id, model, [choice], chat, created)
                    if first_chunk_fields:  # a chat's prompt ids and text, when asked for: on the first chunk
                        chunk, first_chunk_fields = chunk | first_chunk_fields, {}
                    if options.usage_on_every_chunk:
                        chunk["usage"] = usage_so_far()
                    yield chunk
            if options.include_usage:
                final = chunk_body(request_id, model, [], chat, created)
                final["usage"] = usage_so_far()
                yield final
        finally:
            stream.cancel()

    async def _call(self, awaitable, timeout_s: float):
        """Await a handle call within `timeout_s`, turning Serve's failures into OpenAI errors; a timeout's message
        names the limit that was waited for."""
        try:
            return await asyncio.wait_for(awaitable, timeout_s)
        except BackPressureError:
            raise OpenAIError(429, "server overloaded, retry later", code="overloaded", retry_after_s=self.args.retry_after_s)
        except (asyncio.TimeoutError, TimeoutError):  # one class from Python 3.11; _with_keep_alive raises the builtin
            raise OpenAIError(504, f"request timed out after {timeout_s:g} s", code="timeout")
        except OpenAIError:
            raise
        except Exception as exc:
            log.warning("engine call failed: %s", type(exc).__name__)
            raise OpenAIError(503, f"no engine replica could serve the request ({type(exc).__name__})",
                              retry_after_s=self.args.retry_after_s)



def chat_prompt_fields(body: SamplingFields, admitted: Admitted) -> dict:
    """A chat's prompt, where vLLM puts it (the response, or a stream's first chunk): its ids with return_token_ids,
    the template's text with return_prompt_text. Completions carry theirs per choice."""
    if not isinstance(body, ChatCompletionRequest):
        return {}
    return ({"prompt_token_ids": admitted.prompt_token_ids} if body.return_token_ids else {}) | (
        {"prompt_text": admitted.prompt_text} if body.return_prompt_text else {})


def _generation_failed(delta: Delta) -> OpenAIError:
    """A generation the engine ended with an error (its message is the engine's own, written for clients): the
    request's own fault (a constraint it set failed it, its adapter could not load) is a 400 naming the field, any
    other a 500."""
    if delta.error_param is not None:
        return OpenAIError(400, delta.error, "model" if delta.error_param == "lora_name" else delta.error_param)
    return OpenAIError(500, f"generation failed: {delta.error}")


def _stream_error(exc: Exception, request_id: str) -> dict:
    """The in-band error of a stream. Only the engine's own messages reach the client: a Ray error's text holds a
    remote traceback, actor ids and node addresses, which go to the server log under the request id instead."""
    if isinstance(exc, TimeoutError):
        return envelope(504, "request timed out", code="timeout")
    if isinstance(exc, OpenAIError):
        return exc.body()
    log.warning("stream %s failed: %s: %s", request_id, type(exc).__name__, exc)
    return envelope(503, f"the engine replica serving request {request_id} failed; retry the request")


async def _with_keep_alive(stream, interval_s: float, deadline: float):
    """The stream's items, with None whenever `interval_s` passes without one (a queued request, a long prefill);
    TimeoutError once the loop's clock passes `deadline`. The deadline is checked only while waiting here: an
    `asyncio.timeout` around a generator's `yield` can fire while the consumer is sending, which cancels the
    response itself (a stream cut without its error chunk or [DONE], seen once in a full test run)."""
    loop = asyncio.get_running_loop()
    iterator = stream.__aiter__()
    pending = None
    try:
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise TimeoutError
            pending = pending or asyncio.ensure_future(iterator.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=min(interval_s, remaining))
            if not done:
                if loop.time() >= deadline:
                    raise TimeoutError
                yield None
                continue
            pending, task = None, pending
            try:
                yield task.result()
            except StopAsyncIteration:
                return
    finally:
        if pending is not None:
            pending.cancel()


def _adapters_under(root: str | None, listed: list[str], limit: int = 1000) -> list[str]:
    """The adapters in lora_root's subdirectories not already listed, by name; none where this process cannot see it."""
    if root is None:
        return []
    try:
        names = sorted(entry.name for entry in os.scandir(root) if ADAPTER_NAME.fullmatch(entry.name)
                       and os.path.isfile(os.path.join(entry.path, "adapter_config.json")))
    except OSError:
        return []
    return [name for name in names if name not in listed][:limit]
