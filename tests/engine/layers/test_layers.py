"""The native layers against the plain torch / transformers computations they replace."""
import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from transformers.models.llama.modeling_llama import LlamaMLP

from engine import cpu_kernels
from engine.cpu_kernels import build_fused_ops
from engine.layers.activation import silu_and_mul
from engine.layers.linear import Linear, MergedLinear, can_pack
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from tests.engine.kernel_builds import kernels_for

FUSED = [pytest.param(False, id="torch-ops"), pytest.param(True, id="fused-cpu-ops")]


def fused_or_none(fused: bool):
    return build_fused_ops() if fused else None  # a build failure fails the test: the fused ops are the CPU default


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_packed_linear_equals_f_linear(dtype, tolerance, rows):
    g = torch.Generator().manual_seed(rows)
    layer = Linear(96, 160, bias=True).to(dtype)
    layer.weight.data.copy_(torch.randn(160, 96, generator=g))
    layer.bias.data.copy_(torch.randn(160, generator=g))
    weight, bias = layer.weight.data.clone(), layer.bias.data.clone()
    layer.pack()
    assert (layer.packed is not None) == can_pack(weight) and (layer.weight is None) == can_pack(weight)
    x = torch.randn(rows, 96, generator=g).to(dtype)
    expected = F.linear(x.float(), weight.float(), bias.float())
    torch.testing.assert_close(layer(x).float(), expected, rtol=tolerance, atol=tolerance * expected.abs().max().item())


def test_a_linear_without_blocks_takes_zero_rows():
    """A step whose every sequence is mid-prefill samples nothing: the LM head gets 0 rows."""
    layer = Linear(32, 8)
    layer.pack()
    assert layer(torch.randn(0, 32)).shape == (0, 8)


def test_merged_linear_is_its_shards_side_by_side():
    g = torch.Generator().manual_seed(0)
    shards = [torch.randn(n, 32, generator=g) for n in (48, 16, 16)]
    merged = MergedLinear(32, [48, 16, 16], bias=False)
    for i, w in enumerate(shards):
        merged.load_shard(i, "weight", w)
    merged.pack()
    x = torch.randn(5, 32, generator=g)
    for got, w in zip(merged.split(merged(x)), shards):
        torch.testing.assert_close(got, x @ w.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fused", FUSED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [True, False])
def test_rms_norm_with_fused_residual_equals_add_then_hf_norm(fused, dtype, with_residual):
    g = torch.Generator().manual_seed(0)
    x, residual, weight = (torch.randn(shape, generator=g).to(dtype) for shape in ((6, 64), (6, 64), (64,)))
    ours, reference = RMSNorm(64, 1e-5).to(dtype), LlamaRMSNorm(64, eps=1e-5).to(dtype)
    ours.weight.data.copy_(weight)
    reference.weight.data.copy_(weight)
    ours.fused = fused_or_none(fused)
    total = x + residual if with_residual else x
    normed, new_residual = ours(x, residual if with_residual else None)
    torch.testing.assert_close(new_residual, total, rtol=0, atol=0)
    exact = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
    torch.testing.assert_close(normed, reference(total), **exact)


@pytest.mark.parametrize("fused", FUSED)
@pytest.mark.parametrize("rope_parameters", [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
])
def test_rotary_table_equals_hf_rotary(rope_parameters, fused):
    config = LlamaConfig(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                         rope_parameters=rope_parameters)
    positions = torch.tensor([0, 1, 5, 63, 64, 300, 511])
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(len(positions), 4 * 64, generator=g)  # q (2 heads), k (1), v (1), as the merged projection
    q, k, v = qkv.clone().split([128, 64, 64], dim=-1)
    rope = RotaryEmbedding(config, 64, 512)(positions, torch.float32, fused_or_none(fused))
    work = qkv.clone()
    ours = rope.rotate(work, work[:, :128].view(-1, 2, 64), work[:, 128:192].view(-1, 1, 64))
    cos, sin = LlamaRotaryEmbedding(config)(q, positions[None])
    expected = apply_rotary_pos_emb(q.view(-1, 2, 64).transpose(0, 1)[None], k.view(-1, 1, 64).transpose(0, 1)[None], cos, sin)
    for got, want in zip(ours, expected):
        torch.testing.assert_close(got, want[0].transpose(0, 1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(work[:, 192:], v, rtol=0, atol=0)  # v is never touched


@pytest.mark.parametrize("fused", FUSED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_equals_hf_mlp_activation(fused, dtype):
    g = torch.Generator().manual_seed(0)
    gate_up = (torch.randn(5, 2 * 48, generator=g) * 3).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    expected = LlamaMLP(LlamaConfig(hidden_size=8, intermediate_size=48, num_attention_heads=1, num_key_value_heads=1)).act_fn(gate) * up
    torch.testing.assert_close(silu_and_mul(gate_up, fused_or_none(fused)), expected, rtol=1e-5, atol=1e-5)


def test_fused_kv_write_lands_in_the_slots_index_copy_would():
    g = torch.Generator().manual_seed(0)
    kv_heads, blocks, block_size, head_dim, tokens = 2, 6, 4, 16, 5
    merged = torch.randn(tokens, 3 * kv_heads * head_dim, generator=g)  # key and value as strided views of it
    key = merged[:, kv_heads * head_dim : 2 * kv_heads * head_dim].view(tokens, kv_heads, head_dim)
    value = merged[:, 2 * kv_heads * head_dim :].view(tokens, kv_heads, head_dim)
    slots = torch.tensor([3, 9, 10, 22, 0])
    ours = [torch.zeros(kv_heads, blocks, block_size, head_dim) for _ in range(2)]
    build_fused_ops().write_kv(*ours, key, value, slots)
    for cache, new in zip(ours, (key, value)):
        expected = torch.zeros(kv_heads, blocks * block_size, head_dim).index_copy_(1, slots, new.transpose(0, 1))
        assert torch.equal(cache.view(kv_heads, -1, head_dim), expected)


@pytest.mark.parametrize("isa", ["native", "avx2"])
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fused_kv_write_to_an_fp8_pool_stores_torchs_saturated_cast(isa, cache_dtype, dtype):
    """kv_cache_dtype fp8: the bytes of torch's cast (round to nearest even, saturated at the format's largest
    value) from subnormals (1e-9) to past the range, -0.0 kept; rows of 88 values take the AVX-512 path (fp32 and
    bf16) and its scalar tail, and the portable build (`-mno-avx512f`) the scalar one."""
    kernels = kernels_for(isa)
    g = torch.Generator().manual_seed(1)
    tokens, kv_heads, head_dim = 40, 2, 88
    scale = torch.logspace(-9, 5.2, tokens)[:, None, None]
    key, value = ((torch.randn(tokens, kv_heads, head_dim, generator=g) * scale).to(dtype) for _ in range(2))
    key[0, 0, :8] = torch.tensor([7.77, 500.0, -1000.0, 1e5, 0.0123, 0.0, -0.0, 447.9])
    pools = [torch.zeros(kv_heads, 4, 16, head_dim, dtype=cache_dtype) for _ in range(2)]
    slots = torch.randperm(64, generator=g)[:tokens]
    kernels.write_kv(*pools, key, value, slots)
    largest = torch.finfo(cache_dtype).max
    for pool, rows in zip(pools, (key, value)):
        stored = pool.view(torch.uint8).view(kv_heads, -1, head_dim)[:, slots].transpose(0, 1)
        assert torch.equal(stored, rows.clamp(-largest, largest).to(cache_dtype).view(torch.uint8))
