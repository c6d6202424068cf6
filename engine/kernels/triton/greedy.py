"""Greedy tokens in one pass over the logits: each row's argmax (the first on ties, as torch's), or INVALID_TOKEN
where the row holds a NaN or an infinity. In torch that is a max and an amin over the whole [rows, vocab] plus four
small kernels (`sampler.greedy_and_finite`): on the first H100 run the max and the amin alone took ~100 us of a
batch-256 decode step over a 152k vocabulary (benchmarks/results/gpu-check-20261127-h100/profile-256.txt), each
reading the logits once.

Two launches: programs over (row, part of the vocabulary) find each part's best column, so a batch of one still
spreads its row over many SMs; then one program a row takes the best of its parts.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.triton.launch import Launch

COLUMNS_PER_LOAD = 2048  # 4 KB of bf16 logits
LOADS_PER_PART = 4  # a part is 8,192 columns: 19 parts for a 152k vocabulary


@triton.jit
def _greedy_part_kernel(logits, part_best, part_column, vocab, stride, parts,
                        BLOCK: tl.constexpr, LOADS: tl.constexpr):
    """Each part's max and the first column holding it; column -1 where the part has a NaN or an infinity."""
    row = tl.program_id(0)
    part = tl.program_id(1)
    start = logits + row.to(tl.int64) * stride
    lanes = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    best_column = tl.zeros([BLOCK], dtype=tl.int32)
    bad = tl.zeros([BLOCK], dtype=tl.int32)
    for load in range(LOADS):
        columns = (part * LOADS + load) * BLOCK + lanes
        inside = columns < vocab
        x = tl.load(start + columns, mask=inside, other=float("-inf")).to(tl.float32)
        bad = tl.maximum(bad, (inside & ((x != x) | (tl.abs(x) == float("inf")))).to(tl.int32))
        better = x > best  # strict: a lane keeps its earlier column on a tie
        best = tl.where(better, x, best)
        best_column = tl.where(better, columns, best_column)
    top = tl.max(best, 0)
    column = tl.min(tl.where(best == top, best_column, vocab), 0)
    tl.store(part_best + row * parts + part, top)
    tl.store(part_column + row * parts + part, tl.where(tl.max(bad, 0) > 0, -1, column))


@triton.jit
def _greedy_merge_kernel(part_best, part_column, out, vocab, parts, INVALID: tl.constexpr, PARTS: tl.constexpr):
    row = tl.program_id(0)
    index = tl.arange(0, PARTS)
    real = index < parts
    best = tl.load(part_best + row * parts + index, mask=real, other=float("-inf"))
    column = tl.load(part_column + row * parts + index, mask=real, other=vocab)
    top = tl.max(best, 0)
    first = tl.min(tl.where(best == top, column, vocab), 0)  # parts hold increasing columns: the first overall
    token = tl.where(tl.min(column, 0) < 0, INVALID, first)
    tl.store(out + row, token.to(tl.int64))


def greedy_launches(logits: torch.Tensor, out: torch.Tensor, invalid: int) -> tuple[Launch, Launch]:
    rows, vocab = logits.shape
    block = min(COLUMNS_PER_LOAD, triton.next_power_of_2(vocab))
    loads = min(LOADS_PER_PART, triton.cdiv(vocab, block))
    parts = triton.cdiv(vocab, block * loads)
    part_best = torch.empty((rows, parts), dtype=torch.float32, device=logits.device)
    part_column = torch.empty((rows, parts), dtype=torch.int32, device=logits.device)
    return (Launch(_greedy_part_kernel, (rows, parts), (logits, part_best, part_column, vocab, logits.stride(0), parts),
                   dict(BLOCK=block, LOADS=loads)),
            Launch(_greedy_merge_kernel, (rows,), (part_best, part_column, out, vocab, parts),
                   dict(INVALID=invalid, PARTS=triton.next_power_of_2(parts))))


def greedy_or_invalid(logits: torch.Tensor, invalid: int) -> torch.Tensor:
    """logits [rows, vocab] (rows contiguous) -> int64 [rows]: the argmax, or `invalid` where a row is not finite."""
    assert logits.dim() == 2 and logits.stride(1) == 1
    out = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
    if logits.shape[0]:
        for launch in greedy_launches(logits, out, invalid):
            launch.run()
    return out
