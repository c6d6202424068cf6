"""An OpenAI request's engine part: its SamplingParams (a forced tool call's grammar included), chat options and
tools, as the GenerationJob the ingress sends a replica. The engine's own checks become 400s naming the field."""
from __future__ import annotations

import dataclasses

from engine import EngineInputError, SamplingParams, StructuredOutput, tool_calls
from engine.beam_search import BeamSearchParams
from engine.chat import DEFAULT_OPTIONS, ChatOptions
from engine.sampling_defaults import SAMPLING_DEFAULTS
from serve_app.config import AppArgs
from serve_app.errors import OpenAIError
from serve_app.openai_protocol import ChatCompletionRequest, SamplingFields, TokenizeRequest
from serve_app.protocol import GenerationJob
from serve_app.reasoning import PARSERS, ReasoningFormat, ThinkingLimit


def generation_job(request_id: str, body: SamplingFields, prompt, args: AppArgs, lora_name: str | None,
                   reasoning: ReasoningFormat | None = None) -> GenerationJob:
    """The engine's part of a request. The engine's own checks (a SamplingParams that cannot be) become 400s that
    name the field."""
    tools = offered_tools(body)
    own_interval = body.stream_interval or 1  # vLLM's: raises the server's for this request, never lowers it
    try:
        chat = chat_options(body, args) if isinstance(body, ChatCompletionRequest) else DEFAULT_OPTIONS
        return GenerationJob(request_id, prompt, sampling_params(body, tools, args.tool_call_parser), body.n,
                             body.cache_salt, tools, echo=getattr(body, "echo", False),
                             stream_interval=max(args.stream_interval, own_interval) if body.stream else None,
                             stream_chunks_per_step=args.stream_chunks_per_step, least_stream_interval=own_interval,
                             chat=chat,
                             return_prompt_text=bool(getattr(body, "return_prompt_text", False)),
                             return_token_ids=body.return_token_ids,
                             return_tokens_as_token_ids=body.return_tokens_as_token_ids, priority=body.priority,
                             lora_name=lora_name, reasoning=reasoning, beam=beam_search_params(body),
                             defaulted=defaulted_fields(body), thinking=thinking_limit(body, args))
    except EngineInputError as exc:
        raise OpenAIError(400, str(exc), exc.param)


def thinking_limit(body: SamplingFields, args: AppArgs) -> ThinkingLimit | None:
    """vLLM's thinking_token_budget, whose sections the app's reasoning parser marks (vLLM's needs one too)."""
    if body.thinking_budget is None:
        return None
    if args.reasoning_parser is None:
        raise EngineInputError("thinking_token_budget needs the app's reasoning_parser: it names the markers of a "
                               "thinking section", "thinking_token_budget")
    return ThinkingLimit(body.thinking_budget, PARSERS[args.reasoning_parser])


def beam_search_params(body: SamplingFields) -> BeamSearchParams | None:
    """vLLM's use_beam_search: a search of width n, whose n best beams are the choices."""
    if not body.use_beam_search:
        return None
    return BeamSearchParams(body.n, body.requested_max_tokens, body.ignore_eos, body.length_penalty,
                            body.include_stop_str_in_output, body.skip_special_tokens)


def defaulted_fields(body: SamplingFields) -> frozenset[str]:
    """The sampling fields the request leaves unset, for the model's defaults (vLLM applies its generation config
    so); none in a beam search, which samples nothing."""
    return frozenset() if body.use_beam_search else SAMPLING_DEFAULTS - body.model_fields_set


def chat_options(body: ChatCompletionRequest | TokenizeRequest, args: AppArgs) -> ChatOptions:
    """How the request's messages become the prompt: its own options, tools described in the app's call format."""
    return dataclasses.replace(body.chat_options(), tool_format=args.tool_call_parser)


def sampling_params(body: SamplingFields, tools: list[dict] | None, tool_format: str) -> SamplingParams:
    return SamplingParams(
        max_tokens=body.requested_max_tokens, temperature=body.temperature, top_p=body.top_p,
        top_k=body.top_k if body.top_k is not None else -1, min_p=body.min_p, seed=body.seed, stop=body.stop,
        stop_token_ids=body.stop_token_ids, ignore_eos=body.ignore_eos, presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty, repetition_penalty=body.repetition_penalty,
        min_tokens=body.min_tokens, logprobs=None if body.logprob_token_ids else body.num_logprobs,
        logprob_token_ids=body.logprob_token_ids or None, skip_special_tokens=body.skip_special_tokens,
        include_stop_str_in_output=body.include_stop_str_in_output, truncate_prompt_tokens=body.truncate_prompt_tokens,
        truncation_side=body.truncation_side or "left",
        allowed_token_ids=body.allowed_token_ids, bad_words=body.bad_words,
        prompt_logprobs=body.num_logprobs if body.scores_prompt_by_echo else body.prompt_logprobs,
        logit_bias={int(token): bias for token, bias in body.logit_bias.items()} if body.logit_bias else None,
        structured_output=structured_output(body, tools, tool_format), repetition_detection=body.repetition_rule())


def structured_output(body: SamplingFields, tools: list[dict] | None, tool_format: str) -> StructuredOutput | None:
    """The constraint the request sets (response_format, structured_outputs or a guided_ field), or, when a tool
    call is forced (required or named), the grammar of one."""
    if isinstance(body, ChatCompletionRequest) and body.effective_tool_choice in ("required", "named"):
        return StructuredOutput(grammar=tool_calls.grammar(tools, body.forced_function, body.parallel_tool_calls,
                                                           tool_format),
                                param="tools")
    return body.structured_output()


def offers_tools(body: SamplingFields) -> bool:
    """A chat that offers tools: its reply is parsed for calls."""
    return isinstance(body, ChatCompletionRequest) and body.effective_tool_choice != "none"


def offered_tools(body: SamplingFields) -> list[dict] | None:
    if offers_tools(body):
        return [t.model_dump(exclude_none=True) for t in body.tools]
    return None
