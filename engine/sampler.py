"""Sampler: penalties, temperature, top-k/top-p/min-p, and a per-request random stream."""
from __future__ import annotations

import torch

from engine.sampling_params import SamplingParams


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """Each sampled request owns its generator, so its draws never depend on the batch around it."""
    if params.greedy:
        return None
    generator = torch.Generator(device=device)
    if params.seed is None:
        generator.seed()
    else:
        generator.manual_seed(params.seed)
    return generator


class Sampler:
    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        output_token_ids: list[list[int]],
    ) -> tuple[list[int], list[dict[int, float] | None]]:
        """logits [n, vocab] -> one token id per row, and its logprobs where asked for."""
        if all(p.greedy and not p.has_penalties and p.logprobs is None for p in params):
            return logits.argmax(dim=-1).tolist(), [None] * len(params)  # the common case: no float copy of the logits
        logits = logits.float()
        logprobs = self._logprobs(logits, params)
        if any(p.has_penalties for p in params):
            logits = self._apply_penalties(logits.clone(), params, output_token_ids)
        if all(p.greedy for p in params):
            tokens = logits.argmax(dim=-1).tolist()
        else:
            tokens = [self._sample_row(row, p, g) for row, p, g in zip(logits, params, generators)]
        return tokens, self._pick_logprobs(logprobs, tokens, params)

    @staticmethod
    def _apply_penalties(logits, params, output_token_ids) -> torch.Tensor:
        for row, (p, history) in enumerate(zip(params, output_token_ids)):
            if not p.has_penalties or not history:
                continue
            counts = torch.bincount(torch.tensor(history, device=logits.device), minlength=logits.shape[1]).to(logits.dtype)
            logits[row] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
        return logits

    @staticmethod
    def _sample_row(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> int:
        if p.greedy:
            return int(logits.argmax())
        logits = logits / p.temperature
        if p.top_k > 0 and p.top_k < logits.shape[0]:
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            drop = sorted_probs.cumsum(0) - sorted_probs > p.top_p  # keep the smallest set reaching top_p
            probs = probs.scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
        if p.min_p > 0.0:
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        # Exponential race: argmax(p / E) draws from p, using only this request's generator.
        noise = torch.empty_like(probs).exponential_(generator=generator)
        return int((probs / noise).argmax())

    @staticmethod
    def _logprobs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor | None:
        if all(p.logprobs is None for p in params):
            return None
        return torch.log_softmax(logits, dim=-1)

    @staticmethod
    def _pick_logprobs(logprobs, tokens, params) -> list[dict[int, float] | None]:
        if logprobs is None:
            return [None] * len(tokens)
        picked = []
        for row, (token, p) in enumerate(zip(tokens, params)):
            if p.logprobs is None:
                picked.append(None)
                continue
            entry = {token: float(logprobs[row, token])}
            if p.logprobs:
                top = torch.topk(logprobs[row], p.logprobs)
                entry.update(zip(top.indices.tolist(), top.values.tolist()))
            picked.append(entry)
        return picked
