"""The Triton linear (`engine/kernels/triton/matmul.py`) against torch's, on CPU under triton's interpreter and on
the GPU where there is one: ragged shapes (rows and columns off the tiles, K off the slices), every tiling the plan
tries, with and without a bias, a row-strided input; gated, a gate/up projection that writes the MLP's activation."""
import pytest
import torch
import torch.nn.functional as F

import dataclasses

from engine.kernels.triton.fused_ops import TritonFusedOps
from engine.kernels.triton.matmul import TILINGS, Tiling, matmul

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def randn(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


@pytest.mark.parametrize("tiling", TILINGS, ids=str)
@pytest.mark.parametrize("rows, n, k", [(1, 96, 200), (5, 130, 384), (33, 64, 1000)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_every_tiling_matches_torch_in_fp32(tiling, rows, n, k, with_bias):
    x, weight = randn(rows, k, seed=1), randn(n, k, seed=2)
    bias = randn(n, seed=3) if with_bias else None
    expected = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    got = matmul(x, weight, bias, tiling)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_inputs_round_once_from_an_fp32_sum(dtype):
    """Split along K, the partials stay fp32 until the one rounding at the end: within one unit in the last place of
    the exact sum (the products of 16-bit inputs are exact in fp32; triton's interpreter truncates its cast to bf16,
    triton 3.9, and a GPU rounds to the nearest after summing in its own order). Rounded at each slice, the split
    results would be off by several."""
    x, weight, bias = randn(7, 512, dtype=dtype, seed=4), randn(72, 512, dtype=dtype, seed=5), randn(72, dtype=dtype, seed=6)
    exact = F.linear(x.double(), weight.double(), bias.double())
    for tiling in (Tiling(64, 64, 128, 1), Tiling(64, 64, 128, 4)):
        got = matmul(x, weight, bias, tiling)
        assert got.dtype == dtype
        assert ((got.double() - exact).abs() <= torch.finfo(dtype).eps * exact.abs().clamp(min=1.0)).all()


def test_a_row_strided_input_and_more_splits_than_slices():
    """The model passes views (a merged projection's columns); a K too short for its slices leaves some empty."""
    wide = randn(6, 300, seed=7)
    x, weight = wide[:, :200], randn(40, 200, seed=8)
    assert x.stride(0) == 300
    got = matmul(x, weight, None, Tiling(64, 64, 128, 8))  # 2 slices of 128 hold all of K; 6 are empty
    torch.testing.assert_close(got, F.linear(x, weight), rtol=1e-5, atol=1e-4)


def test_no_rows_launch_nothing():
    assert matmul(randn(0, 64), randn(32, 64), None, TILINGS[0]).shape == (0, 32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("tiling", [TILINGS[0], TILINGS[4]], ids=str)
def test_a_gated_tiling_equals_the_same_tiling_then_the_activation_kernel(dtype, with_bias, tiling):
    """A merged gate/up projection on a gated tiling writes SiLU(gate) * up: to the bit what the same tiling's
    [M, 2N] output then the activation kernel give (each half rounded as the projection's output is, then one
    shared helper), so the fused MLP changes no output. Bias on both halves (Qwen2's MLP has none; others may)."""
    inner = 72  # off the tiles
    x, weight = randn(9, 200, dtype=dtype, seed=9), randn(2 * inner, 200, dtype=dtype, seed=10)
    bias = randn(2 * inner, dtype=dtype, seed=11) if with_bias else None
    # each half on its own, so that a column sits where the gated kernel computes it: numpy's matmul under the
    # interpreter rounds an fp32 column differently by its place in the tile
    halves = [matmul(x, weight[part], None if bias is None else bias[part], tiling)
              for part in (slice(0, inner), slice(inner, None))]
    separate = TritonFusedOps.silu_and_mul(torch.cat(halves, dim=1))
    fused = matmul(x, weight, bias, dataclasses.replace(tiling, gated=True))
    assert fused.shape == (9, inner) and torch.equal(fused, separate)
    gate_up = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    exact = F.silu(gate_up[:, :inner]) * gate_up[:, inner:]
    # bf16: both halves, the activation and the result each rounded to 8 bits of mantissa
    scale = 2e-2 * exact.abs().max().item() if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(fused.double(), exact, rtol=1e-5, atol=scale)
    with pytest.raises(AssertionError, match="gated: one slice"):
        matmul(x, weight, bias, Tiling(64, 64, 128, 2, gated=True))
