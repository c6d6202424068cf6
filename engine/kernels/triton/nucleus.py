"""Top-p on the device without a sort and without reading anything back: each row's nucleus threshold, found by a
search over the probabilities' bit patterns. On CPU the sampler takes each row's top candidates (64, 1,024, then 4,096) and
sorts the whole row only where they fall short of top_p, which it must read back to know; on CUDA that read would land every
async-scheduled step (engine/async_scheduling.py), and a sort of [256, 152k] costs milliseconds.

A token is kept when the mass of the tokens above it is at most top_p (the sampler's rule), so the kept set is
{p >= t} for t the largest value with mass(p >= t) > top_p. Probabilities are non-negative floats, whose bit
patterns order as integers: one program a row searches the integers between 0 and its max's bits, trying PROBES
thresholds in each pass over the row, so about 9 passes find it where bisection takes 31 (an estimate of ~0.5 ms at
batch 256 over a 152k vocabulary, from the bytes; not measured). A pass keeps each probe's mass per lane and sums
the lanes once at its end: summed at every load, the sm_90 loop was 639 instructions a load (112 warp shuffles, 10
barriers), 211 without (`python benchmarks/kernel_sass.py`), where the H200's sampled batch-256 step took 7-10 ms
against greedy's 3.27 (BENCHMARKS.md, 2026-12-04).
A value tied with the threshold is always kept, on CPU too.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.triton.launch import Launch

COLUMNS_PER_LOAD = 512
PROBES = 15  # thresholds a pass tries: each pass cuts the interval 16-fold, ~8 passes where halving takes ~30


@triton.jit
def _nucleus_threshold_kernel(probs, top_p, threshold, vocab, stride, BLOCK: tl.constexpr, PROBES: tl.constexpr,
                              PROBES_PAD: tl.constexpr):
    row = tl.program_id(0)
    start = probs + row.to(tl.int64) * stride
    lanes = tl.arange(0, BLOCK)
    p = tl.load(top_p + row)
    top = tl.zeros([BLOCK], dtype=tl.int32)
    for first in range(0, vocab, BLOCK):
        columns = first + lanes
        bits = tl.load(start + columns, mask=columns < vocab, other=0.0).to(tl.int32, bitcast=True)
        top = tl.maximum(top, bits)
    # invariant: mass(p >= lo) > top_p >= mass(p >= hi), in bit patterns
    lo = tl.full([], 0, tl.int64)  # mass(p >= 0.0) is the whole row's
    hi = tl.max(top, 0).to(tl.int64) + 1  # nothing is at or above it
    probe = tl.arange(0, PROBES_PAD)
    while hi - lo > 1:
        # PROBES thresholds spread over (lo, hi); the padding probes repeat lo, whose mass is known to exceed top_p
        cuts = tl.where(probe < PROBES, lo + (hi - lo) * (probe + 1) // (PROBES + 1), lo).to(tl.int32)
        # each probe's mass per lane, summed across the lanes once a pass (see above)
        lane_mass = tl.zeros([PROBES_PAD, BLOCK], dtype=tl.float32)
        for first in range(0, vocab, BLOCK):
            columns = first + lanes
            x = tl.load(start + columns, mask=columns < vocab, other=0.0)
            above = x.to(tl.int32, bitcast=True)[None, :] >= cuts[:, None]
            lane_mass += tl.where(above, x[None, :], 0.0)
        mass = tl.sum(lane_mass, 1)
        heavy = (mass > p) & (probe < PROBES)  # thresholds still leaving more than top_p above them
        new_lo = tl.max(tl.where(heavy, cuts, lo.to(tl.int32)), 0).to(tl.int64)
        hi = tl.min(tl.where((probe < PROBES) & ~heavy & (cuts.to(tl.int64) > new_lo), cuts, hi.to(tl.int32)), 0).to(tl.int64)
        lo = new_lo
    tl.store(threshold + row, lo.to(tl.int32).to(tl.float32, bitcast=True))


def nucleus_threshold_launch(probs: torch.Tensor, top_p: torch.Tensor, threshold: torch.Tensor) -> Launch:
    rows, vocab = probs.shape
    return Launch(_nucleus_threshold_kernel, (rows,), (probs, top_p, threshold, vocab, probs.stride(0)),
                  dict(BLOCK=min(COLUMNS_PER_LOAD, triton.next_power_of_2(vocab)), PROBES=PROBES,
                       PROBES_PAD=triton.next_power_of_2(PROBES + 1)))


def nucleus_threshold(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """probs [rows, vocab] fp32, each row summing to 1, rows contiguous; top_p [rows] or [rows, 1] -> each row's
    threshold [rows]: its nucleus is the tokens at or above it."""
    assert probs.dim() == 2 and probs.dtype == torch.float32 and probs.stride(1) == 1
    threshold = torch.empty(probs.shape[0], dtype=torch.float32, device=probs.device)
    if probs.shape[0]:
        nucleus_threshold_launch(probs, top_p.reshape(-1).to(torch.float32).contiguous(), threshold).run()
    return threshold


def nucleus(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """`probs` with the tokens outside each row's nucleus zeroed, as a new tensor."""
    return probs.masked_fill(probs < nucleus_threshold(probs, top_p)[:, None], 0.0)
