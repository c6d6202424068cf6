"""Sampler: logit bias, bans and grammar masks, penalties, temperature, top-k/top-p/min-p, and a per-request random
stream."""
from __future__ import annotations

from collections.abc import Callable, Collection
from typing import NamedTuple

import torch

from engine.host_memory import to_device
from engine.sampling_columns import SamplingColumns
from engine.sampling_params import SamplingParams

# top-p on CPU: the top 64 tokens, then the top 1,024, then 4,096, each for the rows the one before did not cover,
# then a sort. A row of 49,152 took 0.06 ms for the top 64, 0.25 for 1,024, 0.36 for 4,096, 2 for a sort (2-core
# Zen 4). SmolLM2's nucleus at temperature 0.8, top-p 0.95 held over 64 tokens in 8.5% of rows and never over 1,024;
# at temperature 1.0, over 1,024 in 6% of rows and over 4,096 in under 1%
NUCLEUS_CANDIDATES = (64, 1024, 4096)
CDF_BLOCK = 1024
DRAWS_AHEAD = 64  # uniform draws a request's stream takes from its generator at once
PROMPT_LOGPROB_ROWS = 256  # prompt logprobs are worked in chunks of this many rows (each an fp32 [rows, vocab])
INVALID_TOKEN = -1  # a row whose logits are not finite, or leave no token with weight: the engine fails that request
NO_ALLOWED_TOKEN = -2  # a row whose own restrictions (allowed ids, bans, grammar) left it no token: its client's fault


class UniformStream:
    """A sampled request's own uniform draws, one a token, taken from its generator DRAWS_AHEAD at a time: the CPU
    generator fills a tensor serially, so these are the very values one `torch.rand(1)` a token gives (checked in
    tests/unit/test_sampler.py), at a fraction of the cost (2.2 us a call: 0.57 ms a step of 256 sampled rows)."""

    def __init__(self, seed: int | None):
        self.generator = torch.Generator()
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)
        self._ahead: list[float] = []  # the next draws, last first

    def next(self) -> float:
        if not self._ahead:
            self._ahead = torch.rand(DRAWS_AHEAD, generator=self.generator).tolist()[::-1]
        return self._ahead.pop()


def make_generator(params: SamplingParams) -> UniformStream | None:
    """A seeded request owns its random stream, so its draws never depend on the batch around it; an unseeded one
    draws from the sampler's stream with its batch-mates, one call a step for all of them (vLLM's sampler keeps
    generators for seeded requests alone likewise). A stream lives on the host whatever the device: a draw is one
    number a token, and a CUDA generator would cost a device round trip per seeded row per step (the step's draws go
    to the device together). The same seed gives the same stream on every device."""
    if params.greedy or params.seed is None:
        return None
    return UniformStream(params.seed)


def finite_rows(logits: torch.Tensor) -> torch.Tensor:
    """Rows without NaN or inf: both extremes are finite (NaN propagates through each). On bf16 [256, 49152] this
    measured 2.1 ms, where a float32 sum measured 13.7 ms (and overflowed to inf on large finite rows)."""
    return logits.amax(-1).isfinite() & logits.amin(-1).isfinite()


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """The argmax of each row (the first on ties, as argmax). `max(dim)` measured 1.8 ms on bf16 [128, 49152] on CPU
    where `argmax` took 10.4 ms (BENCHMARKS.md)."""
    return logits.max(dim=-1).indices


def greedy_and_finite(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`greedy_tokens` and `finite_rows` in two passes, not three: the row max (NaN propagates through it) serves
    both. bf16 [64, 49152]: 1.59 against 2.07 ms on an AMX Xeon."""
    best = logits.max(dim=-1)
    return best.indices, best.values.isfinite() & logits.amin(-1).isfinite()


def greedy_or_invalid(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax, or INVALID_TOKEN where the row is not finite, left on the device. On CUDA one Triton kernel
    reads the logits once, where the torch ops read them twice and launch six kernels."""
    if logits.is_cuda:
        from engine.kernels.triton.greedy import greedy_or_invalid as one_pass  # imports triton: only where it runs

        return one_pass(logits if logits.stride(-1) == 1 else logits.contiguous(), INVALID_TOKEN)
    return _marked_invalid(*greedy_and_finite(logits))


class GrammarMask(NamedTuple):
    """Which tokens each constrained row may take next: `allowed[j]` (bool [vocab]) is row `rows[j]`'s."""
    rows: list[int]
    allowed: torch.Tensor

    def within(self, subset: list[int]) -> GrammarMask:
        """The same mask, its rows renumbered as positions in `subset` (which holds every constrained row)."""
        position = {row: j for j, row in enumerate(subset)}
        return GrammarMask([position[row] for row in self.rows], self.allowed)


class Sampler:
    def __init__(self, cpu_nucleus_mask: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                 cpu_greedy: Callable[[torch.Tensor, int], torch.Tensor] | None = None):
        """`cpu_nucleus_mask(probs, top_p)`: top-p in place on CPU, the compiled kernel (cpu_kernels.nucleus_mask_op)
        where the engine has it, else `nucleus_threshold_by_candidates` and a masked_fill. `cpu_greedy(logits,
        invalid)`: greedy_or_invalid's result in one pass on CPU (cpu_kernels.greedy_op), else the torch ops."""
        self.cpu_nucleus_mask = cpu_nucleus_mask
        self.cpu_greedy = cpu_greedy
        self.columns: SamplingColumns | None = None  # the last sampled step's, kept while its rows stay the same
        self.work: torch.Tensor | None = None  # see _float_copy
        self.stream = torch.Generator()  # the unseeded rows' draws
        self.stream.seed()

    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[UniformStream | None],
        output_token_ids: list[list[int]] | None,
        prompt_token_ids: list[list[int]] | None = None,
        banned_token_ids: list[Collection[int]] | None = None,
        grammar: GrammarMask | None = None,
        draft_token_ids: list[int | None] | None = None,
        allowed_token_ids: list[torch.Tensor | None] | None = None,
    ) -> tuple[list[int], list[dict[int, float] | None]]:
        """logits [n, vocab] -> one token id per row (INVALID_TOKEN where the row has no valid distribution,
        NO_ALLOWED_TOKEN where its finite logits had every token masked), and its logprobs where asked for. Never an
        id outside [0, vocab).

        Logprobs are the model's own (before any bias, mask or penalty). Then, in order: logit_bias, the only tokens
        a row may produce (`allowed_token_ids`), the tokens it may not produce now (`banned_token_ids`: EOS and stop
        ids before min_tokens, bad words), the grammar's mask,
        penalties (repetition over prompt and output), then temperature and truncation.

        A row with a speculative draft returns the draft if it is accepted; a greedy row, by its argmax as always, a
        sampled row by the rejection rule that keeps the row's distribution (`_verify_drafts`).

        Plain greedy rows take the argmax of the logits as they are; only the other rows get a float copy to work
        on, so one constrained or sampled request does not tax its batch-mates."""
        n = len(params)
        banned_token_ids = banned_token_ids or [()] * n
        allowed_token_ids = allowed_token_ids or [None] * n
        constrained = set(grammar.rows) if grammar is not None else set()
        worked = [i for i, p in enumerate(params) if i in constrained or banned_token_ids[i]
                  or allowed_token_ids[i] is not None or not _plain_greedy(p)]
        if len(worked) == n:
            return self._work(logits, params, generators, output_token_ids, prompt_token_ids, banned_token_ids,
                              grammar, draft_token_ids, allowed_token_ids)
        tokens, logprobs = self.greedy(logits).tolist(), [None] * n  # no float copy of the logits
        if worked:
            pick = lambda values: [values[i] for i in worked] if values is not None else None  # noqa: E731
            rows = torch.tensor(worked, device=logits.device)
            part_tokens, part_logprobs = self._work(
                logits.index_select(0, rows), pick(params), pick(generators), pick(output_token_ids),
                pick(prompt_token_ids), pick(banned_token_ids), grammar.within(worked) if grammar else None,
                pick(draft_token_ids), pick(allowed_token_ids))
            for j, i in enumerate(worked):
                tokens[i], logprobs[i] = part_tokens[j], part_logprobs[j]
        return tokens, logprobs

    def _work(self, logits, params, generators, output_token_ids, prompt_token_ids, banned_token_ids, grammar,
              draft_token_ids, allowed_token_ids) -> tuple[list[int], list[dict[int, float] | None]]:
        """The rows that need more than an argmax, on a float copy of their logits."""
        finite = finite_rows(logits)
        logits = self._float_copy(logits)  # worked on in place from here
        logprobs = self._logprobs(logits, params)
        self._restrict(logits, params, banned_token_ids, grammar, allowed_token_ids)
        emptied = finite & (logits.amax(-1) == float("-inf"))  # the row's own masks left it nothing to choose
        if any(p.has_penalties for p in params):
            logits = self._apply_penalties(logits, params, output_token_ids, prompt_token_ids)
        candidates = finite & (logits.amax(-1) > float("-inf"))  # a penalty may push the last one to -inf too
        if all(p.greedy for p in params):
            tokens = _valid_or_invalid(greedy_tokens(logits), candidates, emptied)
        else:
            tokens = _valid_or_invalid(*self._sample(logits, params, generators, candidates, draft_token_ids), emptied)
        return tokens, self._pick_logprobs(logprobs, tokens, params)

    @staticmethod
    def _restrict(logits, params, banned_token_ids, grammar, allowed_token_ids) -> None:
        """logit_bias, then the allowed tokens, the bans and the grammar mask, in place; one index_put per kind for
        the whole batch."""
        vocab, device = logits.shape[1], logits.device
        biased = [(row, t, b) for row, p in enumerate(params) for t, b in (p.logit_bias or {}).items() if t < vocab]
        if biased:
            rows, tokens, biases = zip(*biased)
            logits.index_put_((torch.tensor(rows, device=device), torch.tensor(tokens, device=device)),
                              torch.tensor(biases, dtype=logits.dtype, device=device), accumulate=True)
        allowed = [(row, ids) for row, ids in enumerate(allowed_token_ids) if ids is not None]
        if allowed:
            keep = torch.zeros(len(allowed), vocab, dtype=torch.bool, device=device)
            for j, (_, ids) in enumerate(allowed):
                keep[j, to_device(ids, device)] = True
            rows = torch.tensor([row for row, _ in allowed], device=device)
            logits.index_copy_(0, rows, logits.index_select(0, rows).masked_fill_(~keep, float("-inf")))
        banned = [(row, t) for row, ids in enumerate(banned_token_ids) for t in ids if t < vocab]
        if banned:
            rows, tokens = zip(*banned)
            logits[torch.tensor(rows, device=device), torch.tensor(tokens, device=device)] = float("-inf")
        if grammar is not None:
            rows = torch.tensor(grammar.rows, device=device)
            logits.index_copy_(0, rows, logits.index_select(0, rows).masked_fill_(~grammar.allowed, float("-inf")))

    @staticmethod
    def _apply_penalties(logits, params, output_token_ids, prompt_token_ids) -> torch.Tensor:
        for row, (p, history) in enumerate(zip(params, output_token_ids)):
            if p.repetition_penalty != 1.0:
                seen = set(history).union(prompt_token_ids[row] if prompt_token_ids else ())
                ids = torch.tensor(sorted(seen), dtype=torch.long, device=logits.device)
                values = logits[row, ids]
                logits[row, ids] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
            if (p.presence_penalty or p.frequency_penalty) and history:
                counts = torch.bincount(torch.tensor(history, device=logits.device), minlength=logits.shape[1]).to(logits.dtype)
                logits[row] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
        return logits

    def tokens_on_device(self, logits: torch.Tensor, params: list[SamplingParams],
                         generators: list[UniformStream | None]) -> torch.Tensor:
        """The tokens of rows that need no host work before or after the draw (no logprobs, bias, bans, grammar,
        penalties), left on the device: INVALID_TOKEN where a row has no valid distribution. Never waits for a CUDA
        device (async scheduling). The same tokens as `__call__` gives them."""
        if all(_plain_greedy(p) for p in params):
            return self.greedy(logits)
        finite = finite_rows(logits)  # every entry finite: no mask here leaves a row without a candidate
        logits = self._float_copy(logits)
        return _marked_invalid(*self._sample(logits, params, generators, finite))

    def greedy(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's argmax, or INVALID_TOKEN where the row is not finite, left on the device."""
        if self.cpu_greedy is not None and logits.device.type == "cpu" and logits.stride(-1) == 1:
            return self.cpu_greedy(logits, INVALID_TOKEN)
        return greedy_or_invalid(logits)

    def _sample(self, logits: torch.Tensor, params: list[SamplingParams], generators: list[UniformStream | None],
                finite: torch.Tensor, draft_token_ids: list[int | None] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row at once: temperature, then the top-k / top-p / min-p masks, then the inverse CDF at one uniform
        draw from the row's own generator (one random number per token, where a Gumbel race needs one per vocab entry).
        `logits` is the sampler's own float copy: it is worked on in place, since each fresh [n, vocab] temporary
        costs page faults on CPU."""
        device = logits.device
        columns = self._columns(params, logits)
        greedy = columns.greedy
        greedy_rows = greedy_tokens(logits.index_select(0, greedy)) if greedy is not None else None
        if columns.temperatures is not None:
            logits.div_(columns.temperatures)
        if columns.top_k_max:
            kth = logits.topk(columns.top_k_max, dim=-1).values.gather(1, columns.kth_index)
            # rows without top-k keep everything (masked_fill: a boolean index would read the device back)
            kth.masked_fill_(columns.keeps_all, float("-inf"))
            logits.masked_fill_(logits < kth, float("-inf"))
        weights = logits.sub_(logits.amax(-1, keepdim=True)).exp_()  # softmax up to each row's total
        if columns.top_p is not None and columns.nucleus_rows is None:  # the usual batch: every row, in place
            self._nucleus(weights.div_(weights.sum(-1, keepdim=True)), columns.top_p)
        elif columns.top_p is not None:
            rows = columns.nucleus_rows
            selected = weights[rows]
            weights[rows] = self._nucleus(selected.div_(selected.sum(-1, keepdim=True)), columns.top_p)
        if columns.min_p is not None:
            weights.masked_fill_(weights < columns.min_p * weights.amax(-1, keepdim=True), 0.0)
        draws = to_device(self._draws(columns.seeded, generators), device)[:, None]
        verified = [i for i, d in enumerate(draft_token_ids or ()) if d is not None and not params[i].greedy]
        accepted = Sampler._verify_drafts(weights, draws, verified, [draft_token_ids[i] for i in verified]) if verified else None
        tokens, has_mass = inverse_cdf(weights, draws)
        if accepted is not None:
            tokens[accepted[0]] = accepted[1]
        if greedy_rows is not None:
            tokens[greedy] = greedy_rows
        return tokens, finite & has_mass

    def _draws(self, seeded: list[int], generators: list[UniformStream | None]) -> torch.Tensor:
        """One fp32 uniform draw in (0, 1] a row: the sampler's stream, but a seeded row's own (a greedy row's is
        unread)."""
        draws = torch.rand(len(generators), generator=self.stream).neg_().add_(1.0)
        if seeded:
            draws[seeded] = torch.tensor([1.0 - generators[i].next() for i in seeded])
        return draws

    def _float_copy(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits as the sampler's own fp32 copy to work on, in a buffer kept across steps: on CPU a fresh
        [256, 49152] fp32 tensor (48 MiB) is over glibc's largest mmap threshold (32 MiB), so each step's copy
        faulted in every page again (39 ms a step against 5 ms into the kept buffer, a Zen 3 core)."""
        rows, vocab = logits.shape
        work = self.work
        if work is None or work.shape[0] < rows or work.shape[1] != vocab or work.device != logits.device:
            self.work = work = torch.empty((rows, vocab), dtype=torch.float32, device=logits.device)
        return work[:rows].copy_(logits)

    def _columns(self, params: list[SamplingParams], logits: torch.Tensor) -> SamplingColumns:
        """The rows' sampling settings on the device: the last step's where its rows are these."""
        vocab = logits.shape[1]
        if self.columns is None or not self.columns.fits(params, vocab, logits.device):
            self.columns = SamplingColumns(params, vocab, logits.device)
        return self.columns

    @staticmethod
    def _verify_drafts(weights: torch.Tensor, draws: torch.Tensor, rows: list[int], drafts: list[int]
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """Speculative sampling for a draft proposed with certainty (n-gram): accept it with probability p(draft),
        else draw from p without it, renormalised, so each token keeps probability p (Leviathan et al. 2023, with q
        a point mass). One uniform draw does both: the draft is put first in the row's order. Rejected rows get
        their draft's weight zeroed and their draw rescaled in place. Returns the (rows, drafts) accepted."""
        index, draft = torch.tensor(rows, device=weights.device), torch.tensor(drafts, device=weights.device)
        total, mass = weights[index].sum(-1), weights[index, draft]
        target = draws[index, 0] * total
        accept = (mass > 0) & ((target <= mass) | (total - mass <= 0))
        rejected = ~accept
        weights[index[rejected], draft[rejected]] = 0.0
        draws[index[rejected], 0] = ((target - mass) / (total - mass))[rejected]
        return index[accept], draft[accept]

    def _nucleus(self, probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
        """`probs` (rows summing to 1) with the tokens outside each row's nucleus zeroed, in place: a token stays when
        the mass above it is at most top_p, and so do its ties. On CUDA the threshold comes from one Triton kernel,
        which never reads the device back (async scheduling)."""
        if probs.is_cuda:
            from engine.kernels.triton.nucleus import nucleus_threshold  # imports triton: only where it runs

            threshold = nucleus_threshold(probs, top_p)[:, None]
        elif self.cpu_nucleus_mask is not None and probs.is_contiguous() and probs.dtype == torch.float32:
            self.cpu_nucleus_mask(probs, top_p.contiguous())
            return probs
        else:
            threshold = nucleus_threshold_by_candidates(probs, top_p)
        return probs.masked_fill_(probs < threshold, 0.0)

    @staticmethod
    def _logprobs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor | None:
        if all(p.logprobs is None for p in params):
            return None
        return torch.log_softmax(logits, dim=-1)

    @staticmethod
    def prompt_logprobs(logits: torch.Tensor, targets: list[int], top: int) -> tuple[list[dict[int, float]], list[int]]:
        """Per row, the logprob of its target token and of the `top` most likely, and the target's rank (1: the most
        likely), from the model's own logits; in chunks of PROMPT_LOGPROB_ROWS, so the fp32 log-softmax of a long
        chunk costs a bounded [rows, vocab]."""
        entries: list[dict[int, float]] = []
        ranks: list[int] = []
        for start in range(0, logits.shape[0], PROMPT_LOGPROB_ROWS):
            rows = logits[start : start + PROMPT_LOGPROB_ROWS]
            logprobs = torch.log_softmax(rows.float(), dim=-1)
            chunk_targets = targets[start : start + rows.shape[0]]
            chosen = logprobs.gather(1, torch.tensor(chunk_targets, device=logits.device)[:, None])
            ranks += ((logprobs > chosen).sum(-1) + 1).tolist()
            chunk = [{token: value} for token, value in zip(chunk_targets, chosen.squeeze(1).tolist())]
            if top:
                best = logprobs.topk(top, dim=-1)
                for entry, ids, values in zip(chunk, best.indices.tolist(), best.values.tolist()):
                    entry.update(zip(ids, values))
            entries += chunk
        return entries, ranks

    @staticmethod
    def _pick_logprobs(logprobs, tokens, params) -> list[dict[int, float] | None]:
        """The chosen token's logprob and the top ones (or the ids a row lists in logprob_token_ids, in its order),
        for the rows that asked: one gather and one topk for the batch, a few host transfers in all, not one per
        row."""
        picked: list[dict[int, float] | None] = [None] * len(tokens)
        rows = [i for i, p in enumerate(params) if p.logprobs is not None and tokens[i] >= 0]
        if logprobs is None or not rows:
            return picked
        index = torch.tensor(rows, device=logprobs.device)
        chosen = logprobs[index, torch.tensor([tokens[i] for i in rows], device=logprobs.device)].tolist()
        listed = _listed_logprobs(logprobs, rows, [params[i].logprob_token_ids for i in rows])
        k = min(max((params[i].logprobs for i in rows if params[i].logprob_token_ids is None), default=0),
                logprobs.shape[-1])
        top_ids, top_values = [[]] * len(rows), [[]] * len(rows)
        if k:
            top = logprobs[index].topk(k, dim=-1)
            top_ids, top_values = top.indices.tolist(), top.values.tolist()
        for j, row in enumerate(rows):
            entry = {tokens[row]: chosen[j]}
            ids = params[row].logprob_token_ids
            if ids is not None:
                entry.update(zip(ids, listed[j]))
            else:
                wanted = params[row].logprobs
                entry.update(zip(top_ids[j][:wanted], top_values[j][:wanted]))
            picked[row] = entry
        return picked


def _listed_logprobs(logprobs: torch.Tensor, rows: list[int], lists: list[list[int] | None]) -> list[list[float]]:
    """For each of `rows` (of the batch), the logprobs of the ids its logprob_token_ids lists (`lists`, aligned with
    `rows`; empty where none): one gather over the rows that list some, their lists padded to the longest."""
    listing = [j for j, ids in enumerate(lists) if ids]
    values: list[list[float]] = [[] for _ in lists]
    if not listing:
        return values
    width = max(len(lists[j]) for j in listing)
    padded = torch.tensor([lists[j] + [0] * (width - len(lists[j])) for j in listing], device=logprobs.device)
    batch_rows = torch.tensor([rows[j] for j in listing], device=logprobs.device)
    gathered = logprobs[batch_rows[:, None], padded].tolist()
    for j, row in zip(listing, gathered):
        values[j] = row[: len(lists[j])]
    return values


def nucleus_threshold_by_candidates(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-p on CPU in torch, where the C++ kernel (csrc/nucleus_cpu.cpp) is not built: each row's threshold [rows, 1],
    the least probability its nucleus keeps. A sort of the vocabulary costs ~2 ms a row there, so the rows' top
    candidates are tried first, in NUCLEUS_CANDIDATES tiers: they cover a row when their mass exceeds top_p (the next
    token then has more than top_p above it); rows a tier does not cover go on to the next, and to the sort last
    (which needs the device read: free on CPU)."""
    threshold = torch.empty((probs.shape[0], 1), dtype=probs.dtype, device=probs.device)
    top_p = top_p.reshape(-1, 1)
    rows = None  # all of them
    for k in (*NUCLEUS_CANDIDATES, probs.shape[-1]):
        part, part_p = (probs, top_p) if rows is None else (probs[rows], top_p[rows])
        if k < probs.shape[-1]:
            values = part.topk(k, dim=-1).values
            covered = values.sum(-1, keepdim=True) > part_p
        else:
            values = part.sort(dim=-1, descending=True).values
            covered = torch.ones_like(part_p, dtype=torch.bool)
        kept = values.masked_fill(values.cumsum(-1) - values > part_p, float("inf"))
        found = kept.amin(-1, keepdim=True)
        if rows is None:
            threshold.copy_(found)
        else:
            threshold[rows] = found
        done = covered.squeeze(1)
        if bool(done.all()):
            break
        rows = (~done).nonzero().squeeze(1) if rows is None else rows[~done]
    return threshold


def _plain_greedy(p: SamplingParams) -> bool:
    return (p.greedy and not p.has_penalties and p.logprobs is None and not p.logit_bias
            and not p.restricts_vocabulary)


def _marked_invalid(tokens: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    return torch.where(valid, tokens, INVALID_TOKEN)


def _valid_or_invalid(tokens: torch.Tensor, valid: torch.Tensor, emptied: torch.Tensor) -> list[int]:
    """Each valid row's token; NO_ALLOWED_TOKEN where the row's own masks left no token, else INVALID_TOKEN."""
    marked = torch.where(emptied, NO_ALLOWED_TOKEN, INVALID_TOKEN)
    return torch.where(valid, tokens, marked).tolist()  # one host sync for the whole batch


def inverse_cdf(weights: torch.Tensor, draws: torch.Tensor, block: int = CDF_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """weights [n, vocab] >= 0 (any scale), draws [n, 1] in (0, 1] -> per row, the first index whose running sum
    reaches draw * total, and whether the row had a finite, positive total to draw from (ids stay in range either
    way). Two levels (block sums, then one block's running sum) instead of a cumsum over the whole vocabulary,
    which costs several ms a step on CPU."""
    n, vocab = weights.shape
    full = vocab - vocab % block
    sums = weights[:, :full].view(n, full // block, block).sum(-1)
    if full < vocab:
        sums = torch.cat([sums, weights[:, full:].sum(-1, keepdim=True)], dim=1)
    running = sums.cumsum(-1)
    targets = draws * running[:, -1:]
    chosen = torch.searchsorted(running, targets).clamp_(max=sums.shape[1] - 1)  # [n, 1]: a block with mass
    targets = targets - (running.gather(1, chosen) - sums.gather(1, chosen))
    columns = chosen * block + torch.arange(block, device=weights.device)
    inside = weights.gather(1, columns.clamp(max=vocab - 1)).masked_fill_(columns >= vocab, 0.0).cumsum(-1)
    # rounding may push the target just outside its block; the clamp keeps it on a token with weight
    targets = torch.minimum(targets.clamp(min=torch.finfo(weights.dtype).tiny), inside[:, -1:])
    offsets = torch.searchsorted(inside, targets)
    total = running[:, -1]
    has_mass = total.isfinite() & (total > 0)
    return (chosen * block + offsets).squeeze(1).clamp_(0, vocab - 1), has_mass
