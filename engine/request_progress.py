"""A request's progress in the core: its sampled tokens appended, the stops the core can see (EOS, stop token ids, a
finished grammar, length), and what is new since its last output. Text, stop strings and totals are the front
end's (output_processor.py): the core deals in token ids only, as vLLM v1's does."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engine.core_messages import CoreOutput, EngineRequest
from engine.errors import EngineInputError
from engine.repetition import RepetitionRuns
from engine.sampler import UniformStream, make_generator
from engine.sequence import Sequence
from engine.thinking_budget import ThinkingCountdown


@dataclass
class RequestProgress:
    """What the core tracks per request beyond its KV bookkeeping (`Sequence.runtime`)."""

    generator: UniformStream | None  # a sampled request's draws
    max_tokens: int
    grammar: Any = None  # an llguidance matcher, advanced by every token, for structured output
    pending_grammar: Any = None  # the matcher while its constraint waits for params.constrain_after
    allowed_token_ids: torch.Tensor | None = None  # params.allowed_token_ids, made a tensor once
    logprobs: list[dict[int, float]] | None = None  # of the tokens not yet sent
    prompt_logprobs: list[dict[int, float] | None] | None = None  # by prompt position; the first has none
    prompt_ranks: list[int | None] | None = None  # each prompt token's rank among the model's predictions there
    sent_tokens: int = 0
    error: str | None = None
    error_param: str | None = None  # the request field at fault, when the error is the request's own
    embedding: bytes | None = None  # an embedding request's result (engine/pooler.py)
    # params.draws_from_logits_alone, once: async scheduling asks it of every row every step (0.2 ms at batch 256)
    draws_from_logits_alone: bool = False
    greedy: bool = False  # params.greedy, once: a step of rows that fly (async scheduling), all greedy, is an argmax
    repetition: RepetitionRuns | None = None  # params.repetition_detection's runs at the output's end
    stop_token_id: int | None = None  # the stop token id that ended the output, where no honoured EOS did (vLLM's)
    thinking: ThinkingCountdown | None = None  # params.thinking_budget's countdown


def new_progress(request: EngineRequest, grammar: Any) -> RequestProgress:
    params = request.params
    waits = grammar is not None and params.constrain_after is not None
    return RequestProgress(
        generator=make_generator(params),
        max_tokens=request.max_tokens,
        grammar=None if waits else grammar,
        pending_grammar=grammar if waits else None,
        allowed_token_ids=None if params.allowed_token_ids is None else torch.tensor(sorted(set(params.allowed_token_ids))),
        logprobs=[] if params.logprobs is not None else None,
        prompt_logprobs=[None] * len(request.prompt_token_ids) if params.prompt_logprobs is not None else None,
        prompt_ranks=[None] * len(request.prompt_token_ids) if params.prompt_logprobs is not None else None,
        draws_from_logits_alone=params.draws_from_logits_alone,
        greedy=params.greedy,
        repetition=RepetitionRuns.within(params.repetition_detection, request.max_tokens)
        if params.repetition_detection else None,
        thinking=ThinkingCountdown(params.thinking_budget, request.prompt_token_ids)
        if params.thinking_budget else None,
    )


class StopChecker:
    def __init__(self, eos_token_ids: set[int], max_model_len: int):
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def append(self, seq: Sequence, token: int, logprob: dict[int, float] | None) -> str | None:
        """Append one sampled token to `seq`; return why it finished, or None."""
        progress: RequestProgress = seq.runtime
        seq.append_token(token)
        if progress.logprobs is not None:
            progress.logprobs.append(logprob)
        # an errored matcher's mask allows only EOS, and it accepts that EOS: the output would end as if complete
        if progress.grammar is not None and (progress.grammar.is_error() or not progress.grammar.consume_token(token)):
            raise _grammar_failure(seq, progress.grammar.get_error())
        if progress.pending_grammar is not None:
            _start_grammar_after(seq, progress)
        if progress.thinking is not None:
            progress.thinking.append(seq.token_ids)
        repeated = progress.repetition is not None and progress.repetition.append(seq.token_ids, seq.num_prompt_tokens)
        return self._stop_reason(seq, token, repeated)

    def _stop_reason(self, seq: Sequence, token: int, repeated: bool) -> str | None:
        """vLLM's order: a stop token, then the length, then (from min_tokens on) a repeated pattern."""
        params, progress, produced = seq.params, seq.runtime, seq.num_output_tokens
        if produced >= params.min_tokens:
            if token in self.eos_token_ids and not params.ignore_eos:
                return "stop"  # vLLM checks EOS first: no stop_reason even where it is a stop token id too
            if token in params.stop_token_ids:
                progress.stop_token_id = token
                return "stop"
        if progress.grammar is not None and progress.grammar.is_stopped():
            return "stop"  # the structure is complete: only EOS could follow
        if produced >= progress.max_tokens or len(seq.token_ids) >= self.max_model_len:
            return "length"
        if repeated and produced >= params.min_tokens:
            return "repetition"
        return None


def _start_grammar_after(seq: Sequence, progress: RequestProgress) -> None:
    """The constraint applies from the token after the output first holds params.constrain_after."""
    after = seq.params.constrain_after
    if seq.num_output_tokens >= len(after) and tuple(seq.token_ids[-len(after):]) == after:
        progress.grammar, progress.pending_grammar = progress.pending_grammar, None


def core_output(seq: Sequence) -> CoreOutput:
    """The request's news since its last output: new token ids and their logprobs, its end, and with its first
    output the prompt's logprobs."""
    progress: RequestProgress = seq.runtime
    first = progress.sent_tokens == 0
    new_tokens = seq.token_ids[seq.num_prompt_tokens + progress.sent_tokens :]  # not a copy of all the output first
    new_logprobs = progress.logprobs
    if new_logprobs is not None:
        progress.logprobs = []
    progress.sent_tokens += len(new_tokens)
    return CoreOutput(seq.request_id, new_tokens, seq.metrics, seq.finish_reason, progress.error, new_logprobs,
                      seq.num_cached_tokens or 0, progress.prompt_logprobs if first else None, progress.error_param,
                      progress.prompt_ranks if first else None, progress.embedding, progress.stop_token_id)


def _grammar_failure(seq: Sequence, error: str) -> EngineInputError:
    """A constraint that failed mid-output: llguidance's per-token limits (items in a parser row, lexer fuel) can be
    met only by the path the output takes, so no check before admission catches every one. The client's constraint
    is at fault, and the error names it (the message is llguidance's non-verbose one: no schema text)."""
    param = seq.params.structured_output.param
    return EngineInputError(f"{param}: the constraint failed after {seq.num_output_tokens} output tokens, past this "
                            f"server's parser limits ({error.replace('<non-verbose/>', '').strip()})", param)
