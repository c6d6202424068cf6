"""What the kernels share: constants, how they take their matrix products, and device helpers."""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634  # the kernels take exp2 of scores pre-scaled by this
MIN_DOT = 16  # the smallest M, N and K that tl.dot compiles for on NVIDIA GPUs
MIN_TILE = 64  # context positions a kernel reads per step of its loop: several blocks, gathered through the table
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def dot_flags(dtype: torch.dtype) -> dict:
    """The kernels' matrix-product settings for operands of `dtype`: DOT_DTYPE, what the operands are cast to (fp32
    for bf16 under triton's interpreter, whose bf16 product multiplies the raw 16-bit patterns, triton 3.9; else the
    operands' own type, a no-op), and PRECISION, full fp32 where the operands are fp32 (not TF32: the parity tests
    compare fp32 to transformers)."""
    widen = dtype == torch.float32 or (INTERPRETED and dtype == torch.bfloat16)
    dot_dtype = tl.float32 if widen else {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[dtype]
    return dict(DOT_DTYPE=dot_dtype, PRECISION="ieee" if widen else "tf32")


def tile_for(block_size: int) -> int:
    return max(block_size, MIN_TILE)


def launch_options(num_warps: int | None, num_stages: int | None) -> dict:
    """Triton's launch options where given (benchmarks/triton_attention.py sweeps them); its defaults otherwise."""
    return {name: value for name, value in (("num_warps", num_warps), ("num_stages", num_stages)) if value is not None}


def _load_kv_tile(k_cache, v_cache, block_table, position, visible, d, d_ok, head_offset, stride_cb, stride_co,
                  BLOCK_SIZE: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """K and V [TILE, D_PAD] at context `position`s through the sequence's `block_table`; zeros where not visible.
    `head_offset` comes in int64 (callers widen the head before the product): on a large GPU a layer's pool passes
    2^31 elements, and the last KV head's offset wrapped in int32."""
    block = tl.load(block_table + position // BLOCK_SIZE, mask=visible, other=0).to(tl.int64)
    offset = head_offset + block[:, None] * stride_cb + (position % BLOCK_SIZE)[:, None] * stride_co + d[None, :]
    mask = visible[:, None] & d_ok[None, :]
    k = tl.load(k_cache + offset, mask=mask, other=0.0).to(DOT_DTYPE)
    v = tl.load(v_cache + offset, mask=mask, other=0.0).to(DOT_DTYPE)
    return k, v


def _soft_cap(s, cap):
    """cap * tanh(s / cap), for scores in the kernels' log2 units with `cap` in the same units (Gemma 2's attention
    logit soft-capping); tanh from exp2 of a non-positive argument, so it cannot overflow."""
    y = s / cap
    e = tl.exp2(-2.8853900817779268 * tl.abs(y))  # e^(-2|y|); a jit function reads no float globals
    t = (1.0 - e) / (1.0 + e)
    return cap * tl.where(y < 0, -t, t)


def _round_to_fp8(x, MANTISSA: tl.constexpr, MIN_NORMAL: tl.constexpr, LARGEST: tl.constexpr):
    """fp32 `x` rounded to the nearest value of an fp8 format with MANTISSA bits (ties to even), saturated at its
    LARGEST finite value, still in fp32: exactly representable, so the cast that follows is exact whoever does it.
    Triton 3.9's interpreter casts to fp8 without carrying a rounded-up mantissa into the exponent (7.77 became 4 in
    e4m3) and without saturating; the GPU's cast rounds and saturates itself. Rounding here makes both store the same
    bytes, torch's cast's. Subnormals sit on a grid of MIN_NORMAL * 2**-MANTISSA: shifted up by MIN_NORMAL, that grid
    is their ulp at MANTISSA bits."""
    magnitude = tl.minimum(tl.abs(x), LARGEST)
    small = magnitude < MIN_NORMAL
    shifted = tl.where(small, magnitude + MIN_NORMAL, magnitude)
    bits = shifted.to(tl.int32, bitcast=True)
    dropped = 23 - MANTISSA
    bits = (bits + ((1 << (dropped - 1)) - 1) + ((bits >> dropped) & 1)) & -(1 << dropped)
    rounded = bits.to(tl.float32, bitcast=True)
    rounded = tl.where(small, rounded - MIN_NORMAL, rounded)
    sign = x.to(tl.int32, bitcast=True) & -(1 << 31)  # kept as is, so -0.0 and tiny negatives stay -0.0
    return (rounded.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


def _silu_mul(gate, up, OUT_DTYPE: tl.constexpr):
    """SiLU(gate) * up from fp32 gate and up, in OUT_DTYPE; SiLU's output rounded to OUT_DTYPE first, as F.silu's
    is. The activation kernel and the linear that applies it as it loads (matmul.py's GATED) share it, so both give
    the same values to the bit."""
    act = (gate / (1.0 + tl.exp(-gate))).to(OUT_DTYPE).to(tl.float32)
    return (act * up).to(OUT_DTYPE)


# Under triton's interpreter every call of a jit function from a kernel patches triton.language anew (~1 ms of
# Python, triton 3.9; triton's own tl.cdiv, tl.zeros, tl.max and tl.sum are such functions): about a fifth of an
# interpreted engine step was that. There this helper is plain Python, which the interpreted kernel calls as it would
# any function; compiled, it is a device function as usual. The hot kernels spell cdiv and zeros with builtins.
load_kv_tile = _load_kv_tile if INTERPRETED else triton.jit(_load_kv_tile)
round_to_fp8 = _round_to_fp8 if INTERPRETED else triton.jit(_round_to_fp8)
soft_cap = _soft_cap if INTERPRETED else triton.jit(_soft_cap)
silu_mul = _silu_mul if INTERPRETED else triton.jit(_silu_mul)


def score_shape_args(shape, scaling: float) -> tuple[tuple, dict]:
    """A layer's ScoreShape (engine/layers/attention.py) as the attention kernels take it: runtime (window, cap in
    log2 units) and the constexprs that compile the masking and the cap in only where a model has them."""
    window = 0 if shape is None or shape.window is None else shape.window
    cap = 0.0 if shape is None or shape.softcap is None else shape.softcap * LOG2E
    return (window, cap), dict(WINDOWED=window > 0, CAPPED=cap > 0)
