"""The C++ greedy pick on CPU (`engine/csrc/greedy_cpu.cpp`) against the torch ops it replaces
(`sampler.greedy_and_finite`): the same token for every row, ties to the first column (within a vector's lanes,
across them and in the scalar tail), INVALID_TOKEN for a row with a NaN or an infinity, in every dtype, on the
AVX-512 path, on AVX2's and on the scalar one (the builds other CPUs run); and the sampler takes it for its greedy rows."""
import pytest
import torch

from engine import SamplingParams
from engine.cpu_kernels import ISA_VARIANTS, build_kernels
from engine.sampler import INVALID_TOKEN, Sampler, _marked_invalid, greedy_and_finite
from tests.engine.helpers import logits_with_edge_rows
from tests.engine.kernel_builds import kernels_for


def torch_greedy(logits: torch.Tensor) -> torch.Tensor:
    return _marked_invalid(*greedy_and_finite(logits))


@pytest.mark.parametrize("isa", ["native", *ISA_VARIANTS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows, vocab", [(1, 10), (2, 16), (3, 17), (5, 1000), (1, 49152), (6, 49155)])
def test_greedy_kernel_gives_the_torch_ops_tokens(isa, dtype, rows, vocab):
    logits = logits_with_edge_rows(rows, vocab, dtype)
    lanes = [5, 5 + 16] if vocab > 21 else [5 % vocab, vocab - 1]  # one lane of two vectors, or vector and tail
    logits[0, lanes] = 50.0  # the first of them
    got = kernels_for(isa).greedy_or_invalid_cpu(logits, INVALID_TOKEN)
    assert got.dtype == torch.long and torch.equal(got, torch_greedy(logits))
    assert got[0] == lanes[0]
    assert got[-8:].tolist()[:4] == [3, 7, vocab - 1, 0] and got[-4:].tolist() == [INVALID_TOKEN] * 4


@pytest.mark.parametrize("isa", ["native", *ISA_VARIANTS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_kernel_takes_the_first_of_rows_at_the_lowest_value_and_of_signed_zeros(isa, dtype):
    lowest = torch.full((2, 70), torch.finfo(dtype).min, dtype=dtype)
    zeros = torch.full((3, 70), -1.0, dtype=dtype)
    zeros[0, [9, 40]], zeros[1, [9, 40]], zeros[2, [9, 66]] = -0.0, torch.tensor([0.0, -0.0], dtype=dtype), 0.0
    logits = torch.cat([lowest, zeros])
    got = kernels_for(isa).greedy_or_invalid_cpu(logits, INVALID_TOKEN)
    assert got.tolist() == [0, 0, 9, 9, 9] == torch_greedy(logits).tolist()


def test_greedy_kernel_reads_rows_of_a_wider_buffer():
    logits = logits_with_edge_rows(6, 3000, torch.bfloat16)
    wide = torch.full((logits.shape[0], 3100), 99.0, dtype=logits.dtype)
    wide[:, :3000] = logits
    kernel = build_kernels().greedy_or_invalid_cpu
    assert torch.equal(kernel(wide[:, :3000], INVALID_TOKEN), torch_greedy(logits))
    assert kernel(logits[:0], INVALID_TOKEN).shape == (0,)
    assert kernel(logits[:, :0], INVALID_TOKEN).tolist() == [INVALID_TOKEN] * logits.shape[0]


def test_the_sampler_picks_greedy_rows_with_the_kernel():
    calls = []
    kernel = build_kernels().greedy_or_invalid_cpu

    def counted(logits, invalid):
        calls.append(logits.shape[0])
        return kernel(logits, invalid)

    logits = logits_with_edge_rows(4, 500, torch.float32)
    params = [SamplingParams(temperature=0.0)] * logits.shape[0]
    tokens, _ = Sampler(cpu_greedy=counted)(logits, params, [None] * len(params), None)
    assert calls == [logits.shape[0]] and tokens == torch_greedy(logits).tolist()
    assert Sampler()(logits, params, [None] * len(params), None)[0] == tokens
