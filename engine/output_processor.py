"""From sampled tokens to what a request's reader sees: detokenizing, stop conditions (EOS, stop ids, stop strings, a
finished grammar, length), the text held back while it could still turn into a stop string, and the deltas sent."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engine.core_messages import EngineRequest
from engine.detokenizer import IncrementalDetokenizer
from engine.sampler import make_generator
from engine.sequence import RequestOutput, Sequence


@dataclass
class OutputState:
    """What the engine tracks per request to turn its tokens into text deltas (`Sequence.runtime`)."""

    detokenizer: IncrementalDetokenizer
    generator: torch.Generator | None
    max_tokens: int
    text: str = ""
    sent_text_len: int = 0
    sent_token_len: int = 0
    logprobs: list[dict[int, float]] | None = None
    error: str | None = None
    stop_holdback: int = 0
    grammar: Any = None  # an llguidance matcher, advanced by every token, for structured output
    prompt_logprobs: list[dict[int, float] | None] | None = None  # by prompt position; the first has none


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: set[int], max_model_len: int):
        self.tokenizer = tokenizer  # the step thread's own: fast tokenizers are not shareable across threads
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def new_state(self, request: EngineRequest, grammar: Any) -> OutputState:
        params, token_ids = request.params, request.prompt_token_ids
        return OutputState(
            detokenizer=IncrementalDetokenizer(self.tokenizer, token_ids, params.skip_special_tokens),
            generator=make_generator(params),
            max_tokens=request.max_tokens,
            logprobs=[] if params.logprobs is not None else None,
            stop_holdback=max((len(s) for s in params.stop_strings), default=1) - 1,
            grammar=grammar,
            prompt_logprobs=[None] * len(token_ids) if params.prompt_logprobs is not None else None,
        )

    def append(self, seq: Sequence, token: int, logprob: dict[int, float] | None) -> str | None:
        """Append one sampled token to `seq` and its text; return why it finished, or None."""
        state: OutputState = seq.runtime
        seq.append_token(token)
        if state.logprobs is not None:
            state.logprobs.append(logprob)
        if state.grammar is not None and not state.grammar.consume_token(token):
            raise RuntimeError(f"the grammar refused token {token}: {state.grammar.get_error()}")
        state.text += state.detokenizer.add(token)
        reason = self._stop_reason(seq, token)
        if reason is not None and (reason == "length" or token not in self.eos_token_ids):
            state.text += state.detokenizer.flush()
            self._truncate_at_stop_string(seq)
        return reason

    def output(self, seq: Sequence) -> RequestOutput:
        """The request's state now, with what is new since the last output as its deltas."""
        state: OutputState = seq.runtime
        finished = seq.is_finished
        visible = len(state.text) if finished else max(state.sent_text_len, len(state.text) - state.stop_holdback)
        output_ids = seq.output_token_ids
        out = RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            text=state.text[:visible],
            token_ids=output_ids,
            delta_text=state.text[state.sent_text_len:visible],
            delta_token_ids=output_ids[state.sent_token_len:],
            finish_reason=seq.finish_reason,
            metrics=seq.metrics,
            logprobs=state.logprobs,
            error=state.error,
            num_cached_tokens=seq.num_cached_tokens or 0,
            prompt_logprobs=state.prompt_logprobs,
        )
        state.sent_text_len, state.sent_token_len = visible, len(output_ids)
        return out

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        params, state = seq.params, seq.runtime
        if seq.num_output_tokens >= params.min_tokens:
            if token in self.eos_token_ids and not params.ignore_eos:
                return "stop"
            if token in params.stop_token_ids:
                return "stop"
            if params.stop_strings and self._stop_string_at(seq) is not None:
                return "stop"
        if state.grammar is not None and state.grammar.is_stopped():
            return "stop"  # the structure is complete: only EOS could follow
        if seq.num_output_tokens >= state.max_tokens or len(seq) >= self.max_model_len:
            return "length"
        return None

    @staticmethod
    def _stop_string_at(seq: Sequence) -> int | None:
        state = seq.runtime
        window_start = max(0, state.sent_text_len - state.stop_holdback)
        hits = [i for i in (state.text.find(s, window_start) for s in seq.params.stop_strings) if i >= 0]
        return min(hits) if hits else None

    def _truncate_at_stop_string(self, seq: Sequence) -> None:
        if seq.params.stop_strings:
            cut = self._stop_string_at(seq)
            if cut is not None:
                seq.runtime.text = seq.runtime.text[:cut]
