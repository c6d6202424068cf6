"""The native layers against the plain torch / transformers computations they replace."""
import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from engine.layers.linear import Linear, MergedLinear, can_pack
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding, apply_rotary


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


def test_rms_norm_with_fused_residual_equals_add_then_hf_norm():
    g = torch.Generator().manual_seed(0)
    x, residual, weight = torch.randn(6, 64, generator=g), torch.randn(6, 64, generator=g), torch.randn(64, generator=g)
    ours, reference = RMSNorm(64, 1e-5), LlamaRMSNorm(64, eps=1e-5)
    ours.weight.data.copy_(weight)
    reference.weight.data.copy_(weight)
    normed, new_residual = ours(x, residual)
    torch.testing.assert_close(new_residual, x + residual)
    torch.testing.assert_close(normed, reference(x + residual))


@pytest.mark.parametrize("rope_parameters", [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
])
def test_rotary_table_equals_hf_rotary(rope_parameters):
    config = LlamaConfig(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                         rope_parameters=rope_parameters)
    positions = torch.tensor([0, 1, 5, 63, 64, 300, 511])
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(len(positions), 2, 64, generator=g), torch.randn(len(positions), 1, 64, generator=g)
    cos_sin = RotaryEmbedding(config, 64, 512)(positions, torch.float32)
    ours = apply_rotary(q, *cos_sin), apply_rotary(k, *cos_sin)
    cos, sin = LlamaRotaryEmbedding(config)(q, positions[None])
    expected = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    for got, want in zip(ours, expected):
        torch.testing.assert_close(got, want[0].transpose(0, 1), rtol=1e-5, atol=1e-5)
