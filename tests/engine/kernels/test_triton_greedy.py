"""The Triton greedy kernel (`engine/kernels/triton/greedy.py`) against the torch ops it replaces on CUDA
(`sampler.greedy_and_finite`): the same token for every row, ties to the first column, INVALID_TOKEN for any row with
a NaN or an infinity, in every dtype; on CPU under triton's interpreter, on the GPU where there is one."""
import pytest
import torch

from engine.kernels.triton.greedy import COLUMNS_PER_LOAD, LOADS_PER_PART, greedy_or_invalid
from engine.sampler import INVALID_TOKEN, _marked_invalid, greedy_and_finite
from tests.engine.helpers import logits_with_edge_rows

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
PART = COLUMNS_PER_LOAD * LOADS_PER_PART


def torch_greedy(logits: torch.Tensor) -> torch.Tensor:
    return _marked_invalid(*greedy_and_finite(logits))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, vocab", [(1, 10), (5, 1000), (3, COLUMNS_PER_LOAD), (2, 3 * COLUMNS_PER_LOAD + 5),
                                         (1, PART), (2, 2 * PART + 1), (4, 49152)])
def test_greedy_kernel_gives_the_torch_ops_tokens(dtype, rows, vocab):
    logits = logits_with_edge_rows(rows, vocab, dtype, DEVICE)
    got = greedy_or_invalid(logits, INVALID_TOKEN)
    assert got.dtype == torch.long and torch.equal(got, torch_greedy(logits))
    assert got[-8:].tolist()[:4] == [3, 7, vocab - 1, 0] and got[-4:].tolist() == [INVALID_TOKEN] * 4


def test_greedy_kernel_reads_rows_of_a_wider_buffer():
    """The graph's logits are a row slice of its largest bucket's output; the sampler may pass a strided view."""
    logits = logits_with_edge_rows(6, 3000, torch.bfloat16, DEVICE)
    wide = torch.full((logits.shape[0], 3100), 99.0, dtype=logits.dtype, device=DEVICE)
    wide[:, :3000] = logits
    assert torch.equal(greedy_or_invalid(wide[:, :3000], INVALID_TOKEN), torch_greedy(logits))
    assert greedy_or_invalid(logits[:0], INVALID_TOKEN).shape == (0,)


@pytest.mark.skipif(DEVICE == "cuda", reason="compiled, not interpreted")
def test_the_kernel_tests_run_with_the_interpreters_overflow_checks():
    """The rest of the suite turns them off for speed (tests/conftest.py); here an int32 overflow must still fail."""
    from triton.runtime.interpreter import interpreter_builder

    assert interpreter_builder.options.sanitize_overflow
