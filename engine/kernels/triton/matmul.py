"""y = x W^T + b for a linear layer's few rows (a decode step's batch), split along K where the output alone has too
few tiles to fill the GPU.

On the first H100 run (benchmarks/results/gpu-check-20261127-h100/profile-256.txt) cuBLAS's kernel for a batch-256
step's down projection ([256, 8960] x [8960, 1536], by its 64 x 64 tiles and its count) took 21 us, 334 TFLOP/s, a
third of the part's peak: 1,536 output columns make 96 such tiles on 132 SMs. Here a program takes one (M, N) tile and one of SPLIT_K slices of K;
with SPLIT_K > 1 each writes its fp32 partial and a second kernel sums them, adds the bias and rounds once, so the
result does not depend on which program finishes first (atomics would). Programs that share a weight tile run
next to each other, so the M tiles after the first read it from L2.

Which of cuBLAS and these tilings is faster depends on the GPU and the shape: `engine/gemm_plan.py` times them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.kernels.triton.common import dot_flags, silu_mul
from engine.kernels.triton.launch import Launch


@dataclass(frozen=True)
class Tiling:
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 4
    # the weight is a merged gate/up projection's [2N, K], and a program computes a tile of the gate and the same
    # tile of up, and writes SiLU(gate) * up [M, N]: the MLP's activation in the projection's epilogue, one kernel
    # and a [M, 2N] write and read fewer a layer. Never split along K (the activation needs the whole sum)
    gated: bool = False


# What the plan tries beside cuBLAS, for 64 rows and more: 64-row tiles (one Hopper warpgroup's MMA) with K cut in 1
# to 8 slices for the narrow outputs, and two wider tiles for the wide ones (gate/up). Each is one compile per dtype
# and bias; few, so the plan's first start stays short
TILINGS = (Tiling(64, 64, 128, 1), Tiling(64, 64, 128, 2), Tiling(64, 64, 128, 4), Tiling(64, 64, 128, 8),
           Tiling(64, 128, 64, 1), Tiling(128, 64, 128, 1), Tiling(128, 128, 64, 1, num_warps=8, num_stages=3))


@triton.jit
def _matmul_kernel(x, w, bias, y, partial, M, N, K, stride_xm, stride_wn, stride_ym,
                   HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   SPLIT_K: tl.constexpr, GATED: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    tiles_m = (M + BLOCK_M - 1) // BLOCK_M
    tile = tl.program_id(0)
    split = tl.program_id(1)
    rm = (tile % tiles_m) * BLOCK_M + tl.arange(0, BLOCK_M)  # M fastest: neighbours share the weight tile
    rn = (tile // tiles_m) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    per_split = (K + SPLIT_K * BLOCK_K - 1) // (SPLIT_K * BLOCK_K) * BLOCK_K
    k_start = split * per_split
    k_end = tl.minimum(k_start + per_split, K)
    x_rows = x + rm.to(tl.int64)[:, None] * stride_xm
    w_rows = w + rn.to(tl.int64)[:, None] * stride_wn
    m_ok, n_ok = (rm < M)[:, None], (rn < N)[:, None]
    acc = tl.full([BLOCK_M, BLOCK_N], 0.0, dtype=tl.float32)
    acc_up = tl.full([BLOCK_M, BLOCK_N], 0.0, dtype=tl.float32)  # read only where GATED: dead code elsewhere
    for k0 in range(k_start, k_end, BLOCK_K):
        k = k0 + rk
        k_ok = (k < k_end)[None, :]
        a = tl.load(x_rows + k[None, :], mask=m_ok & k_ok, other=0.0).to(DOT_DTYPE)
        b = tl.load(w_rows + k[None, :], mask=n_ok & k_ok, other=0.0).to(DOT_DTYPE)
        acc += tl.dot(a, tl.trans(b), input_precision=PRECISION)
        if GATED:  # the up rows, N below the gate rows
            b = tl.load(w_rows + N * stride_wn + k[None, :], mask=n_ok & k_ok, other=0.0).to(DOT_DTYPE)
            acc_up += tl.dot(a, tl.trans(b), input_precision=PRECISION)
    out_mask = (rm < M)[:, None] & (rn < N)[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        out = acc.to(y.dtype.element_ty)
        if GATED:  # each half rounded as the projection's own output would be, then the activation kernel's math
            if HAS_BIAS:
                acc_up += tl.load(bias + N + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
            out = silu_mul(out.to(tl.float32), acc_up.to(y.dtype.element_ty).to(tl.float32), y.dtype.element_ty)
        tl.store(y + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :], out, mask=out_mask)
    else:  # partial [SPLIT_K, M, N] fp32, contiguous
        offsets = (split * M + rm.to(tl.int64))[:, None] * N + rn[None, :]
        tl.store(partial + offsets, acc, mask=out_mask)


@triton.jit
def _split_sum_kernel(partial, bias, y, M, N, stride_ym, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
                      BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    total = tl.full([BLOCK], 0.0, dtype=tl.float32)
    for split in range(SPLIT_K):  # in split order, every time: the same sum whatever ran first
        total += tl.load(partial + (split * M + row).to(tl.int64) * N + cols, mask=ok, other=0.0)
    if HAS_BIAS:
        total += tl.load(bias + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(y + row.to(tl.int64) * stride_ym + cols, total.to(y.dtype.element_ty), mask=ok)


SUM_COLUMNS = 1024


def matmul_launches(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor,
                    tiling: Tiling) -> list[Launch]:
    rows, k = x.shape
    n = weight.shape[0] // 2 if tiling.gated else weight.shape[0]  # gated: the output is the activation's [M, N]
    assert x.stride(1) == 1 and weight.stride(1) == 1 and y.stride(1) == 1 and weight.shape[1] == k
    assert not tiling.gated or (tiling.split_k == 1 and weight.shape[0] % 2 == 0), "gated: one slice, gate/up rows"
    block_m = tiling.block_m
    tiles = triton.cdiv(rows, block_m) * triton.cdiv(n, tiling.block_n)
    split = tiling.split_k
    partial = torch.empty((split, rows, n), dtype=torch.float32, device=x.device) if split > 1 else y
    options = dict(num_warps=tiling.num_warps, num_stages=tiling.num_stages)
    launches = [Launch(_matmul_kernel, (tiles, split),
                       (x, weight, bias if bias is not None else weight, y, partial, rows, n, k, x.stride(0),
                        weight.stride(0), y.stride(0)),
                       dict(HAS_BIAS=bias is not None and split == 1, BLOCK_M=block_m, BLOCK_N=tiling.block_n,
                            BLOCK_K=tiling.block_k, SPLIT_K=split, GATED=tiling.gated, **dot_flags(x.dtype)),
                       options)]
    if split > 1:
        launches.append(Launch(_split_sum_kernel, (rows, triton.cdiv(n, SUM_COLUMNS)),
                               (partial, bias if bias is not None else weight, y, rows, n, y.stride(0)),
                               dict(HAS_BIAS=bias is not None, SPLIT_K=split, BLOCK=SUM_COLUMNS)))
    return launches


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tiling: Tiling) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T + bias [N] -> [M, N] in x's dtype, accumulated in fp32; with a gated tiling the
    weight is [2N, K] (gate rows, then up rows) and the result SiLU(gate) * up, [M, N]."""
    y = x.new_empty((x.shape[0], weight.shape[0] // (2 if tiling.gated else 1)))
    if x.shape[0]:
        for launch in matmul_launches(x, weight, bias, y, tiling):
            launch.run()
    return y
