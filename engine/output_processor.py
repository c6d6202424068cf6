"""The front end's output half: the core's new token ids per step become each request's text. Detokenizing, stop
strings (a request that ends on one is stopped in the core by the caller), the text held back while it could still
turn into a stop string, and the totals a reader sees, all accumulated here once. It runs on one thread (a fast
tokenizer is not shareable across threads): the core's thread in-process, the receiver thread beside a core process."""
from __future__ import annotations

import logging
import math
import sys
from array import array
from dataclasses import dataclass, field

from engine.core_messages import CoreOutput, EngineRequest
from engine.detokenizer import BytePieces, ByteLevelDetokenizer, IncrementalDetokenizer, detokenizer_for
from engine.errors import EngineInputError
from engine.admission import check_admission
from engine.sampling_params import SamplingParams
from engine.sequence import RequestMetrics

log = logging.getLogger(__name__)


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    text: str
    num_tokens: int  # len(token_ids), without copying them
    delta_text: str
    delta_token_ids: list[int]
    finish_reason: str | None
    metrics: RequestMetrics
    logprobs: list[dict[int, float]] | None = None
    error: str | None = field(default=None)
    error_param: str | None = None  # the request field at fault, when the error is the request's own
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, float] | None] | None = None  # by prompt position, when asked for
    prompt_ranks: list[int | None] | None = None  # with them, each prompt token's rank (1: the model's first choice)
    # The request's own list of output tokens, which only grows (as `logprobs` does): this output's are its first
    # num_tokens. A copy each output cost a stream O(length) a step (256 streams at 2,000 tokens: ~2 ms a step).
    live_token_ids: list[int] = field(default_factory=list, repr=False)
    embedding_f32: bytes | None = field(default=None, repr=False)  # an embedding request's, as the core sent it
    # vLLM's stop_reason: the stop string or stop token id that ended the output, "repetition_detected" for a
    # repeated pattern; None for an EOS, the length and anything else
    stop_reason: int | str | None = None

    @property
    def embedding(self) -> list[float] | None:
        """An embedding request's embedding (vLLM's `outputs.embedding`); None for a generation."""
        if self.embedding_f32 is None:
            return None
        values = array("f", self.embedding_f32)
        if sys.byteorder != "little":
            values.byteswap()
        return values.tolist()

    @property
    def token_ids(self) -> list[int]:
        """Every output token as of this output: a copy, made when asked for."""
        return self.token_ids_since(0)

    def token_ids_since(self, start: int) -> list[int]:
        """This output's tokens from `start` on, without copying those before."""
        return self.live_token_ids[start : self.num_tokens]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def checked(self) -> "RequestOutput":
        """This output, or the error the request ended with raised: EngineInputError where the request's own field
        was at fault, else RuntimeError."""
        if self.error:
            raise EngineInputError(self.error, self.error_param) if self.error_param else RuntimeError(self.error)
        return self


@dataclass
class RequestText:
    """One request's totals as its reader sees them."""

    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | ByteLevelDetokenizer
    stop_holdback: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_ranks: list[int | None] | None = None
    sent_text_len: int = 0
    sent_token_len: int = 0
    output_at: float = 0  # no output before this many tokens but the last (vLLM's FINAL_ONLY: never before it)
    stop_reason: int | str | None = None  # RequestOutput's, once it ends


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: list[int]):
        self.tokenizer = tokenizer  # this processor's own: see the module's docstring
        self.eos_token_ids = set(eos_token_ids)
        self.requests: dict[str, RequestText] = {}
        self.pieces = BytePieces.of(tokenizer)  # built once: ~0.2 s for a 152k vocabulary

    def add(self, request: EngineRequest, final_only: bool = False) -> None:
        """Track a request before the core can answer for it; EngineInputError for an id already in flight.
        `final_only`: its reader wants the finished output alone (a whole answer, not a stream), so no output is made
        or delivered for its steps before that, where each one cost a copy of the totals and a reader's wake-up."""
        check_admission(request.request_id, self.requests)
        params = request.params
        self.requests[request.request_id] = RequestText(
            prompt_token_ids=request.prompt_token_ids,
            params=params,
            detokenizer=detokenizer_for(self.tokenizer, self.pieces, request.prompt_token_ids,
                                        params.skip_special_tokens),
            stop_holdback=max((len(s) for s in params.stop_strings), default=1) - 1,
            logprobs=[] if params.logprobs is not None else None,
            output_at=math.inf if final_only else 0,
        )

    def hold(self, request_id: str, num_tokens: int) -> None:
        """Make no output for the request before it has `num_tokens` tokens, or ends: its reader would only wait for
        more (a stream's next chunk). Safe from the reader's thread: a late hold costs one early output, never a late one."""
        request = self.requests.get(request_id)
        if request is not None and num_tokens > request.output_at:
            request.output_at = num_tokens

    def forget(self, request_id: str) -> None:
        """A request the core never took."""
        self.requests.pop(request_id, None)

    def process(self, outputs: list[CoreOutput]) -> tuple[list[RequestOutput], dict[str, str]]:
        """The step's outputs for readers, and the requests ended here that the core must stop, with the reason to
        end them with ("stop" for a stop string). Outputs for requests already ended here are dropped."""
        results, ended = [], {}
        for out in outputs:
            request = self.requests.get(out.request_id)
            if request is None:
                continue
            try:
                reason, error = self._append(request, out)
            except Exception as exc:  # one request's text must not fail the step's others
                log.exception("post-processing of request %s failed", out.request_id)
                reason, error = "abort", f"post-processing failed: {type(exc).__name__}"
            if reason is not None and out.finish_reason is None:
                ended[out.request_id] = reason
            if reason is not None:
                del self.requests[out.request_id]
            elif len(request.token_ids) < request.output_at:
                continue
            results.append(self._output(out, request, reason, error))
        return results, ended

    def _append(self, request: RequestText, out: CoreOutput) -> tuple[str | None, str | None]:
        """Add the step's tokens to the text; the reason the request ended (here or in the core), and its error."""
        if out.prompt_logprobs is not None:
            request.prompt_logprobs, request.prompt_ranks = out.prompt_logprobs, out.prompt_ranks
        token_ids, add_token = request.token_ids, request.detokenizer.add
        logprobs = request.logprobs if out.new_logprobs is not None else None
        for i, token in enumerate(out.new_token_ids):
            token_ids.append(token)
            if logprobs is not None:
                logprobs.append(out.new_logprobs[i])
            if (stop := self._add_text(request, add_token(token))) is not None:
                request.stop_reason = stop
                return "stop", None  # the core's later tokens, accepted drafts included, are not the reader's
        if out.finish_reason in ("length", "repetition") or (out.finish_reason == "stop" and not (
                token_ids and token_ids[-1] in self.eos_token_ids)):
            self._add_text(request, request.detokenizer.flush())  # an EOS ends the text as it is
        if out.finish_reason is not None:
            request.stop_reason = "repetition_detected" if out.finish_reason == "repetition" else out.stop_token_id
        return out.finish_reason, out.error

    @staticmethod
    def _add_text(request: RequestText, chunk: str) -> str | None:
        """Append a token's text; where that completes a stop string (min_tokens reached), cut the text where the
        stop string starts (ends, with include_stop_str_in_output) and return it. Only the tail the chunk could
        complete is searched, as vLLM does."""
        if not chunk:
            return None
        start = len(request.text)
        request.text += chunk
        params = request.params
        if not params.stop_strings or len(request.token_ids) < params.min_tokens:
            return None
        hits = [(i, len(s), s) for i, s in ((request.text.find(s, max(0, start - len(s) + 1)), s)
                                            for s in params.stop_strings) if i >= 0]
        if not hits:
            return None
        at, length, stop = min(hits)
        request.text = request.text[:at + length if params.include_stop_str_in_output else at]
        return stop

    @staticmethod
    def _output(out: CoreOutput, request: RequestText, reason: str | None, error: str | None) -> RequestOutput:
        """The request's state now, with what is new since its last output as the deltas."""
        finished = reason is not None
        visible = len(request.text) if finished else max(request.sent_text_len, len(request.text) - request.stop_holdback)
        num_tokens = len(request.token_ids)
        result = RequestOutput(
            request_id=out.request_id,
            prompt_token_ids=request.prompt_token_ids,
            text=request.text[:visible],
            num_tokens=num_tokens,
            delta_text=request.text[request.sent_text_len:visible],
            delta_token_ids=request.token_ids[request.sent_token_len:],
            finish_reason=reason,
            metrics=out.metrics,
            logprobs=request.logprobs,
            error=error,
            error_param=out.error_param,
            num_cached_tokens=out.num_cached_tokens,
            prompt_logprobs=request.prompt_logprobs,
            prompt_ranks=request.prompt_ranks,
            live_token_ids=request.token_ids,
            embedding_f32=out.embedding,
            stop_reason=request.stop_reason,
        )
        request.sent_text_len, request.sent_token_len = visible, num_tokens
        return result
