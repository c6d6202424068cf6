"""What the attention kernels share: constants and the one matrix product they all take."""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634  # the kernels take exp2 of scores pre-scaled by this
MIN_DOT = 16  # the smallest M, N and K that tl.dot compiles for on NVIDIA GPUs
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def dot(a, b, IEEE: tl.constexpr, WIDEN: tl.constexpr):
    """a @ b accumulated in fp32. IEEE: fp32 operands multiplied in full fp32, not TF32 (the parity tests compare
    fp32 to transformers). WIDEN: bf16 operands widened first, for triton's interpreter, whose bf16 product is wrong
    (it multiplies the raw 16-bit patterns; triton 3.9)."""
    if WIDEN:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


def dot_flags(dtype: torch.dtype) -> dict:
    return dict(IEEE=dtype == torch.float32, WIDEN=INTERPRETED and dtype == torch.bfloat16)
