"""A step's logits -> one token (and logprobs) per row: each row's sampling inputs gathered from its sequence, then
the Sampler on the whole batch; and the prompt logprobs of the prefill chunks that asked for them."""
from __future__ import annotations

from collections.abc import Collection

import torch

from engine.model_runner import PromptLogits, StepLogits
from engine.sampler import Sampler
from engine.sequence import Sequence
from engine.structured_output import allowed_tokens


class StepSampler:
    def __init__(self, eos_token_ids: Collection[int], cpu_nucleus_mask=None, cpu_greedy=None):
        self.eos_token_ids = set(eos_token_ids)
        self.sampler = Sampler(cpu_nucleus_mask, cpu_greedy)  # see Sampler: top-p and greedy in C++ on CPU, where built

    def __call__(self, step: StepLogits, drafts: dict[str, list[int]]) -> tuple[list[int], list]:
        """One token per logits row; a sequence with drafts has a row for each draft and one for the bonus token."""
        one_row_each = len(step.rows) == step.logits.shape[0]  # no drafts this step

        def per_row(values: list) -> list:  # one value per sequence, repeated for each of its rows
            return values if one_row_each else [value for value, rows in zip(values, step.rows) for _ in range(rows)]

        seqs = step.seqs
        params = per_row([seq.params for seq in seqs])
        penalties = any(p.has_penalties for p in params)  # the histories are copies: only where a penalty reads them
        return self.sampler(
            step.logits,
            params,
            per_row([seq.runtime.generator for seq in seqs]),
            per_row([seq.output_token_ids for seq in seqs]) if penalties else None,
            prompt_token_ids=per_row([seq.prompt_token_ids for seq in seqs]) if any(
                p.repetition_penalty != 1.0 for p in params) else None,
            banned_token_ids=per_row([self.banned(seq) for seq in seqs]),
            allowed_token_ids=per_row([_allowed(seq) for seq in seqs]),
            grammar=allowed_tokens(per_row([seq.runtime.grammar for seq in seqs]), step.logits.shape[1],
                                   step.logits.device),
            draft_token_ids=[d for seq in seqs for d in drafts.get(seq.request_id, []) + [None]] if drafts else None,
        )

    def on_device(self, step: StepLogits) -> torch.Tensor:
        """One token per sequence of a step whose rows need no host work around the draw (async scheduling), left
        on the device."""
        seqs = step.seqs
        if all(seq.runtime.greedy for seq in seqs):  # the usual async step: no per-row lists to build
            return self.sampler.greedy(step.logits)
        return self.sampler.tokens_on_device(step.logits, [seq.params for seq in seqs],
                                             [seq.runtime.generator for seq in seqs])

    def banned(self, seq: Sequence) -> tuple[int, ...] | set[int]:
        """The tokens `seq` may not produce next: those that would end it before min_tokens, and the last token of
        each bad word whose other tokens the output ends with."""
        params = seq.params
        banned = () if seq.num_output_tokens >= params.min_tokens else \
            set(params.stop_token_ids).union(() if params.ignore_eos else self.eos_token_ids)
        if params.bad_words_token_ids:
            banned = set(banned).union(_bad_words_next(params.bad_words_token_ids, seq.token_ids, seq.num_prompt_tokens))
        return banned

    def record_prompt_logprobs(self, part: PromptLogits) -> None:
        """By position, so a retried step or a recomputed (preempted) prompt writes the same entries again."""
        seq, first = part.seq, part.first_position
        targets = seq.token_ids[first : first + part.logits.shape[0]]
        entries, ranks = self.sampler.prompt_logprobs(part.logits, targets, seq.params.prompt_logprobs)
        seq.runtime.prompt_logprobs[first : first + len(entries)] = entries
        seq.runtime.prompt_ranks[first : first + len(ranks)] = ranks


def _allowed(seq: Sequence) -> torch.Tensor | None:
    """The only tokens `seq` may produce next: the one its thinking budget forces, else its allowed_token_ids."""
    thinking = seq.runtime.thinking
    forced = thinking.forced() if thinking is not None else None
    return seq.runtime.allowed_token_ids if forced is None else torch.tensor([forced])


def _bad_words_next(bad_words: tuple[tuple[int, ...], ...], token_ids: list[int], num_prompt_tokens: int) -> set[int]:
    """The last token of each bad word whose earlier tokens end the output, `token_ids[num_prompt_tokens:]` (a
    one-token word: always). A word's next-to-last token is compared first: most words stop there, so a step costs
    about one comparison a word, and the output is never copied."""
    num_output, end = len(token_ids) - num_prompt_tokens, len(token_ids)
    last = token_ids[-1] if num_output else None
    return {word[-1] for word in bad_words if len(word) == 1 or (
        word[-2] == last and len(word) <= num_output + 1 and token_ids[end - len(word) + 1:] == list(word[:-1]))}
