"""Async scheduling (vLLM's `--async-scheduling`) for decode steps whose every row draws its token with no host work
around the draw (greedy, or sampled by temperature, top-k, top-p and min-p): the host launches step N+1 before it reads
step N's tokens, so its scheduling, input preparation and launch overlap the GPU's work on step N instead of
following it (on the first H100 run, ~5 of a 9.8 ms batch-256 step was host time with the GPU idle). Step N+1 takes
step N's sampled ids on the device as its input tokens; a sequence that step N finishes (EOS, a stop id, its length)
keeps a row in step N+1, whose token is dropped.

One step is in flight at most. Anything else (a new request, a prefill, logprobs, penalties, logit bias, a
grammar, drafts, a block the pool cannot give without preempting) lands the step in flight and runs the ordinary,
synchronous step. Freed blocks stay safe while a step still writes to them: every later writer is queued behind it
on the stream, and the block a step writes into is never a published (prefix-cache) one, since its last token is
not yet computed."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.host_memory import to_device
from engine.model_runner import StepLogits
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence
from engine.thinking_budget import ThinkingCountdown


@dataclass
class InFlight:
    """A launched step whose tokens the host has not read: one row per sequence, in `step.seqs` order."""

    batch: ScheduledBatch
    step: StepLogits
    tokens: torch.Tensor  # on the device; INVALID_TOKEN (-1) where a row has no valid distribution
    host_tokens: torch.Tensor  # their copy on the host, written when `ready` is
    ready: torch.cuda.Event | None

    def read_tokens(self) -> list[int]:
        """Waits for this step only, never for a step launched after it."""
        if self.ready is not None:
            self.ready.synchronize()
        return self.host_tokens.tolist()


def launch(batch: ScheduledBatch, step: StepLogits, tokens: torch.Tensor) -> InFlight:
    """A step whose tokens are drawn on the device (`StepSampler.on_device`), their copy to the host queued now,
    before the next step's work, so reading it waits for this step only."""
    if tokens.device.type != "cuda":
        return InFlight(batch, step, tokens, tokens, None)
    host_tokens = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
    host_tokens.copy_(tokens, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return InFlight(batch, step, tokens, host_tokens, ready)


def flies(seq: Sequence) -> bool:
    """Whether a running sequence's next step may be launched before its last token is read: a decode whose draw
    depends on nothing but that token, and needs no host work before or after it (no logprobs, bias, penalties,
    grammar, allowed tokens, bad words, bans before min_tokens, a thinking budget's forced token soon)."""
    progress = seq.runtime
    return (progress.draws_from_logits_alone and seq.num_computed_tokens == len(seq) - 1 >= seq.num_prompt_tokens
            and progress.grammar is None and progress.pending_grammar is None
            and seq.num_output_tokens >= seq.params.min_tokens
            and thinking_flies(progress.thinking))


def thinking_flies(countdown: ThinkingCountdown | None) -> bool:
    """Whether a thinking budget lets the row's step be launched before its last token is read: neither that token
    nor the next can be forced, whatever that token is."""
    return countdown is None or countdown.free_tokens() >= 2


def next_input_ids(landing: InFlight, seqs: list[Sequence]) -> torch.Tensor:
    """The landing step's tokens as the next step's inputs, for the rows of `seqs` (those still running). A row
    without a valid token gets id 0: its request fails when the step lands, and its next row is dropped."""
    tokens = landing.tokens
    if len(seqs) != len(landing.step.seqs):
        row = {id(seq): i for i, seq in enumerate(landing.step.seqs)}
        tokens = tokens[to_device(torch.tensor([row[id(seq)] for seq in seqs]), tokens.device)]
    return tokens.clamp(min=0)
