"""A decode step's layers over interleaved GGUF blocks in one OpenMP region (`engine/csrc/decode_region_cpu.cpp`)
give what the same native call gives op by op (`decoder_cpu.cpp`), bit for bit: hidden states, residual and every
layer's KV write, over random weights with and without biases, Q4_1 and Q8_0 linears, GQA groups, head_dim 64 and
128, one to nine rows. The model-level check (greedy tokens and logprobs against the layers in Python) is in
tests/engine/test_gguf_generation.py."""
import pytest
import torch

from engine.cpu_kernels import build_kernels
from tests.engine.models.test_gguf import random_blocks

BLOCK_SIZE = 16

pytestmark = pytest.mark.skipif(not build_kernels().interleaved_rows(), reason="interleaved blocks: AVX-512 and AVX2 builds")


def linear(kind: str, outputs: int, inputs: int, seed: int, dtype, bias: bool) -> list[torch.Tensor]:
    packed = random_blocks(kind, outputs, inputs, seed).pack()
    assert packed.codes.dim() == 3
    b = torch.randn(outputs, generator=torch.Generator().manual_seed(seed)).to(dtype) if bias else torch.empty(0)
    return [packed.codes, packed.scales, packed.mins, b]


def random_step(rows, heads, kv_heads, head_dim, dtype, bias, layers=2, hidden=128, inner=96, width=6):
    g = torch.Generator().manual_seed(rows * 100 + head_dim)
    weights = []
    for layer in range(layers):
        kinds = ("q8", "q4") if layer % 2 else ("q4", "q8")  # both block types in both kinds of place
        # small norm weights: the random blocks' weights are up to 6 in size, and the layers' outputs stay finite
        norm = lambda: (0.05 * (1 + 0.1 * torch.randn(hidden, generator=g))).to(dtype)  # noqa: E731
        weights += [norm(), *linear(kinds[0], (heads + 2 * kv_heads) * head_dim, hidden, 10 * layer + 1, dtype, bias),
                    *linear(kinds[1], hidden, heads * head_dim, 10 * layer + 2, dtype, bias), norm(),
                    *linear(kinds[0], 2 * inner, hidden, 10 * layer + 3, dtype, bias),
                    *linear(kinds[1], hidden, inner, 10 * layer + 4, dtype, bias), torch.empty(0), torch.empty(0)]
    num_blocks = rows * width + 2
    caches = [torch.randn(kv_heads, num_blocks, BLOCK_SIZE, head_dim, generator=g).to(dtype) for _ in range(2 * layers)]
    tables = torch.randperm(num_blocks, generator=g)[: rows * width].view(rows, width)
    lens = torch.randint(1, width * BLOCK_SIZE + 1, (rows,), generator=g)
    positions = lens - 1
    slots = tables.gather(1, (positions // BLOCK_SIZE)[:, None])[:, 0] * BLOCK_SIZE + positions % BLOCK_SIZE
    angles = torch.arange(width * BLOCK_SIZE)[:, None] * 0.01 * torch.arange(1, head_dim // 2 + 1)[None, :]
    hidden_in = torch.randn(rows, hidden, generator=g).to(dtype)
    return hidden_in, weights, caches, positions, angles.cos(), angles.sin(), slots, tables.int(), lens.int()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 64), (6, 2, 64), (2, 1, 128), (4, 4, 128)])
@pytest.mark.parametrize("rows", [1, 2, 3, 9])
@pytest.mark.parametrize("bias", [False, True])
def test_one_region_gives_the_op_by_op_numbers(dtype, heads, kv_heads, head_dim, rows, bias):
    assert_region_equals_op_by_op(random_step(rows, heads, kv_heads, head_dim, dtype, bias), heads, kv_heads, head_dim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3])
def test_one_region_over_contexts_split_into_parts(dtype, rows):
    """Contexts up to 1,280 keys: the attention's parts (past 512 keys) merged inside the region too."""
    step = random_step(rows, 6, 2, 64, dtype, False, width=80)
    assert step[-1].max() > 512
    assert_region_equals_op_by_op(step, 6, 2, 64)


def assert_region_equals_op_by_op(step, heads, kv_heads, head_dim):
    kernels = build_kernels()
    hidden_in, weights, caches, positions, cos, sin, slots, tables, lens = step
    results = {}
    for one_region in (False, True):
        pool = [c.clone() for c in caches]
        out = kernels.decode_layers(hidden_in, weights, pool, positions, cos, sin, slots, tables, lens, heads,
                                    kv_heads, head_dim, 1e-5, head_dim ** -0.5, one_region)
        results[one_region] = (out, pool)
    (hidden_a, residual_a), pool_a = results[False]
    (hidden_b, residual_b), pool_b = results[True]
    assert torch.isfinite(hidden_a).all()
    assert torch.equal(hidden_a, hidden_b) and torch.equal(residual_a, residual_b)
    assert all(torch.equal(a, b) for a, b in zip(pool_a, pool_b))
    assert not all(torch.equal(a, c) for a, c in zip(pool_a, caches))  # the new keys and values were written
    assert hidden_b.abs().max() > 0 and torch.isfinite(hidden_b).all() and torch.isfinite(residual_b).all()


def test_one_region_refuses_what_it_cannot_run():
    """head_dim 80 (the region is built for 64 and 128) and blocks in the file's layout (not whole groups of 16
    rows): an error, where op by op runs them."""
    kernels = build_kernels()
    args = random_step(1, 2, 1, 64, torch.float32, False, layers=1)
    hidden_in, weights, caches, positions, cos, sin, slots, tables, lens = args
    file_layout = random_blocks("q4", 40, 128, 0).pack()  # o projection of 40 outputs: not whole groups
    assert file_layout.codes.dim() == 2
    wrong = [*weights[:5], file_layout.codes, file_layout.scales, file_layout.mins, torch.empty(0), *weights[9:]]
    with pytest.raises(RuntimeError, match="one region takes interleaved GGUF blocks"):
        kernels.decode_layers(hidden_in, wrong, caches, positions, cos, sin, slots, tables, lens, 2, 1, 64, 1e-5, 0.125,
                              True)
    with pytest.raises(RuntimeError, match="one region takes interleaved GGUF blocks"):
        kernels.decode_layers(hidden_in, weights, caches, positions, cos, sin, slots, tables, lens, 2, 1, 80, 1e-5,
                              0.125, True)


def test_one_region_checks_slots_and_positions_before_it_starts():
    kernels = build_kernels()
    hidden_in, weights, caches, positions, cos, sin, slots, tables, lens = random_step(2, 4, 2, 64, torch.float32,
                                                                                       False)

    def call(**kw):
        return kernels.decode_layers(hidden_in, weights, caches, kw.get("positions", positions), cos, sin,
                                     kw.get("slots", slots), tables, lens, 4, 2, 64, 1e-5, 0.125, True)

    with pytest.raises(RuntimeError, match="slot out of the pool"):
        call(slots=torch.tensor([0, caches[0].shape[1] * BLOCK_SIZE]))
    with pytest.raises(RuntimeError, match="position outside the rotary table"):
        call(positions=torch.tensor([0, cos.shape[0]]))
