"""The Triton linear (`engine/kernels/triton/matmul.py`) against torch's, on CPU under triton's interpreter and on
the GPU where there is one: ragged shapes (rows and columns off the tiles, K off the slices), every tiling the plan
tries, with and without a bias, a row-strided input."""
import pytest
import torch
import torch.nn.functional as F

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
