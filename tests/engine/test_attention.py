"""The paged attention paths agree with plain SDPA over each sequence's contiguous context."""
import pytest
import torch
import torch.nn.functional as F

from engine.attention import DecodeBatch, _decode_torch
from engine.cpu_kernels import paged_decode_op

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def random_pool(num_blocks, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (KV_HEADS, num_blocks, BLOCK, HEAD_DIM)
    return torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)


def reference_decode(q, k_cache, v_cache, tables, lens):
    outs = []
    for b in range(q.shape[0]):
        k = k_cache[:, tables[b]].reshape(KV_HEADS, -1, HEAD_DIM)[:, : lens[b]]
        v = v_cache[:, tables[b]].reshape(KV_HEADS, -1, HEAD_DIM)[:, : lens[b]]
        o = F.scaled_dot_product_attention(q[b].unsqueeze(1).float(), k.float(), v.float(), enable_gqa=True)
        outs.append(o[:, 0])
    return torch.stack(outs)


@pytest.fixture(params=["torch", "cpp"])
def decode_fn(request):
    if request.param == "torch":
        return lambda q, k, v, tables, lens: _decode_torch(q.transpose(0, 1), k, v, DecodeBatch(tables, lens, BLOCK), HEAD_DIM**-0.5)
    op = paged_decode_op()
    if op is None:
        pytest.skip("no C++ compiler here")
    return lambda q, k, v, tables, lens: op(q, k, v, tables, lens, HEAD_DIM**-0.5)


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_decode_matches_sdpa_over_ragged_contexts(decode_fn, dtype, tolerance):
    k_cache, v_cache = random_pool(64, dtype)
    lens = torch.tensor([1, 15, 16, 17, 100, 200])
    width = -(-int(lens.max()) // BLOCK)
    tables = torch.stack([torch.randperm(64, generator=torch.Generator().manual_seed(i))[:width] for i in range(len(lens))])
    q = torch.randn(len(lens), HEADS, HEAD_DIM).to(dtype)
    got = decode_fn(q, k_cache, v_cache, tables, lens).float()
    want = reference_decode(q, k_cache, v_cache, tables, lens)
    assert got.shape == (len(lens), HEADS, HEAD_DIM)
    torch.testing.assert_close(got, want, atol=tolerance, rtol=tolerance)
