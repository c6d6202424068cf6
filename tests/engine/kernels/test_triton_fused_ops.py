"""The Triton fused ops (`engine/kernels/triton/fused_ops.py`) against the torch ops they replace, in every dtype: on
CPU under triton's interpreter, on the GPU where there is one. Shapes are ragged (rows off the programs' tiles, sizes
off powers of two) and the rotary rows are strided views of a merged projection, as the model passes them."""
import pytest
import torch
import torch.nn.functional as F

from engine.kernels.triton.fused_ops import TritonFusedOps
from engine.layers.rotary import apply_rotary

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ops = TritonFusedOps()


def randn(*shape, dtype, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


def close(got: torch.Tensor, expected: torch.Tensor, ulps: float = 3.0) -> bool:
    """Within a few units of the dtype's last place, relative to each value: an op rounds twice to its dtype (the
    norm before the weight, SiLU before the product), each side in its own order of fp32 arithmetic (measured: 2.7
    at most), and triton's interpreter casts fp32 to bf16 by truncation (triton 3.9), a GPU to the nearest."""
    eps = torch.finfo(expected.dtype).eps
    error = (got.float() - expected.float()).abs()
    return bool((error <= ulps * eps * expected.float().abs().clamp(min=1.0)).all())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, hidden", [(1, 64), (7, 576), (13, 1536), (3, 8192)])
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rms_norm_matches_the_torch_ops(dtype, rows, hidden, with_residual):
    x, weight = randn(rows, hidden, dtype=dtype, seed=0), randn(hidden, dtype=dtype, seed=1)
    residual = randn(rows, hidden, dtype=dtype, seed=2) if with_residual else None
    summed = x + residual if with_residual else x
    expected = F.rms_norm(summed.float(), (hidden,), eps=1e-6).to(dtype) * weight
    normed, total = ops.add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(total, summed) if DEVICE == "cuda" else close(total, summed, ulps=1.0)  # one rounded add
    assert (total is x) == (not with_residual)
    assert close(normed, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 2, 64), (12, 2, 128), (7, 1, 80), (28, 4, 128)])
def test_rotary_in_place_matches_the_torch_ops(dtype, heads, kv_heads, head_dim):
    tokens, max_position = 9, 300
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=3)
    positions = torch.tensor([0, 1, 5, 17, 63, 64, 128, 250, 299], device=DEVICE)
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float), 1.0 / 10000 ** (torch.arange(0, head_dim, 2) / head_dim))
    cos, sin = freqs.cos().to(DEVICE), freqs.sin().to(DEVICE)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=1)
    # the reference: the tables rounded to the dtype (as transformers casts them), arithmetic in fp32, one rounding
    c, s = (table[positions].to(dtype).float().unsqueeze(1) for table in (cos, sin))
    expected_q = apply_rotary(q.float().view(tokens, heads, head_dim), c, s).to(dtype)
    expected_k = apply_rotary(k.float().view(tokens, kv_heads, head_dim), c, s).to(dtype)
    untouched = v.clone()
    ops.rotary_inplace(qkv, positions, cos, sin, heads + kv_heads, head_dim)
    assert close(q.view(tokens, heads, head_dim), expected_q)
    assert close(k.view(tokens, kv_heads, head_dim), expected_k)
    assert torch.equal(v, untouched)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 2, 64), (16, 8, 128), (5, 1, 80)])
def test_rotary_with_head_norms_is_the_norms_then_the_rotary(dtype, heads, kv_heads, head_dim):
    """Qwen3's per-head q/k RMSNorm inside the rotary kernel: what engine/models/llama.py's torch ops give, each head
    normed over head_dim in fp32, rounded, weighted, rounded, then rotated."""
    tokens, max_position, eps = 9, 300, 1e-6
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=4) * 3
    q_weight, k_weight = randn(head_dim, dtype=dtype, seed=5), randn(head_dim, dtype=dtype, seed=6)
    positions = torch.tensor([0, 1, 5, 17, 63, 64, 128, 250, 299], device=DEVICE)
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float), 1.0 / 10000 ** (torch.arange(0, head_dim, 2) / head_dim))
    cos, sin = freqs.cos().to(DEVICE), freqs.sin().to(DEVICE)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=1)
    c, s = (table[positions].to(dtype).float().unsqueeze(1) for table in (cos, sin))
    expected = [apply_rotary((F.rms_norm(x.float().view(tokens, n, head_dim), (head_dim,), eps=eps).to(dtype) * w).float(),
                             c, s).to(dtype) for x, n, w in ((q, heads, q_weight), (k, kv_heads, k_weight))]
    untouched = v.clone()
    ops.rotary_inplace(qkv, positions, cos, sin, heads + kv_heads, head_dim, (q_weight, k_weight, eps, heads))
    ulps = 4.0 if DEVICE == "cuda" else 6.0  # three roundings to bf16, each a truncation under the interpreter (4.8 seen)
    assert close(q.view(tokens, heads, head_dim), expected[0], ulps)
    assert close(k.view(tokens, kv_heads, head_dim), expected[1], ulps)
    assert torch.equal(v, untouched)


@pytest.mark.parametrize("dtype, cache_dtype", [(torch.float32, None), (torch.bfloat16, None), (torch.float16, None),
                                                (torch.bfloat16, torch.float8_e4m3fn), (torch.float16, torch.float8_e5m2)])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 2, 64), (12, 2, 128), (7, 1, 80)])
@pytest.mark.parametrize("head_norms", [False, True])
def test_rotary_write_kv_is_the_rotary_then_the_kv_write(dtype, cache_dtype, heads, kv_heads, head_dim, head_norms):
    """One kernel for the two a layer ran before (rotary_inplace, then write_kv): the same q/k bits in the
    projection, the same bytes in the pool (an fp8 one included), nothing written for a padded row (slot -1) or to any
    slot not in the mapping."""
    from engine.kernels.triton.kv_write import write_kv

    tokens, max_position, block_size, blocks = 9, 300, 16, 6
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=7) * 3
    positions = torch.tensor([0, 1, 5, 17, 63, 64, 128, 250, 299], device=DEVICE)
    slots = torch.tensor([3, 17, 40, 41, 0, 95, 60, -1, 33], device=DEVICE)
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float), 1.0 / 10000 ** (torch.arange(0, head_dim, 2) / head_dim))
    cos, sin = freqs.cos().to(DEVICE), freqs.sin().to(DEVICE)
    norms = (randn(head_dim, dtype=dtype, seed=8), randn(head_dim, dtype=dtype, seed=9), 1e-6) if head_norms else None
    pool = torch.full((2, kv_heads, blocks, block_size, head_dim), 7.0, device=DEVICE).to(cache_dtype or dtype)
    expected_qkv, expected_pool = qkv.clone(), pool.clone()
    ops.rotary_inplace(expected_qkv, positions, cos, sin, heads + kv_heads, head_dim,
                       None if norms is None else (*norms, heads))
    _, k, v = expected_qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=1)
    write_kv(expected_pool[0], expected_pool[1], k.view(tokens, kv_heads, head_dim), v.view(tokens, kv_heads, head_dim),
             slots)
    ops.rotary_write_kv(qkv, positions, cos, sin, heads, kv_heads, head_dim, (pool[0], pool[1], slots), norms)
    assert torch.equal(qkv, expected_qkv)
    assert torch.equal(pool.view(torch.uint8), expected_pool.view(torch.uint8))
    written = pool.view(torch.uint8).ne(torch.full_like(pool, 7.0).view(torch.uint8)).any(-1).flatten(2)  # [2, kvh, slot]
    assert written.any(0).any(0).nonzero().flatten().tolist() == sorted(slots[slots >= 0].tolist())


def test_rotary_leaves_a_position_outside_the_table_alone():
    """The engine never schedules one; the kernel must not read past the tables for it."""
    qkv = randn(2, 2 * 64, dtype=torch.float32, seed=4)
    before = qkv.clone()
    table = torch.ones(8, 32, device=DEVICE)
    ops.rotary_inplace(qkv, torch.tensor([8, -1], device=DEVICE), table, table, 1, 64)
    assert torch.equal(qkv, before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, inner", [(1, 64), (5, 1536), (9, 8960)])
def test_silu_and_mul_matches_the_torch_ops(dtype, tokens, inner):
    gate_up = randn(tokens, 2 * inner, dtype=dtype, seed=5) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    assert close(ops.silu_and_mul(gate_up), F.silu(gate) * up)


def test_empty_batches_launch_nothing():
    x = torch.empty(0, 64, device=DEVICE)
    assert ops.add_rms_norm(x, None, torch.ones(64, device=DEVICE), 1e-6)[0].shape == (0, 64)
    assert ops.silu_and_mul(torch.empty(0, 128, device=DEVICE)).shape == (0, 64)
