"""The Triton attention kernels against the engine's torch path (`engine/layers/attention.py`), which the parity
tests hold to transformers: on CPU under triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 where no GPU
is), on the GPU where there is one. Shapes are small and ragged: one token, exactly one block, lengths across block
edges, block tables out of order, GQA groups 1, 3 and 7, every head size the engine's models use."""
import pytest
import torch

from engine.kernels.triton.decode import decode_attention, num_splits_for
from engine.kernels.triton.kv_write import write_kv
from engine.kernels.triton.prefill import prefill_attention
from engine.layers.attention import AttentionMetadata, DecodeBatch, PrefillBatch, PrefillChunk, _decode, _prefill
from engine.layers.kv_cache_dtype import raw

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK_SIZE = 16
# max |triton - torch| over outputs of O(1): fp32 differs by summation order only; bf16 and fp16 by their rounding
# of the probabilities before the second product (the torch path rounds the same place, in another order)
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}


def pool(kv_heads, num_blocks, head_dim, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    shape = (kv_heads, num_blocks, BLOCK_SIZE, head_dim)
    return [torch.randn(shape, generator=generator).to(DEVICE, dtype) for _ in range(2)]


def block_tables(context_lens, num_blocks, seed=1):
    """Each sequence's blocks drawn out of order from the whole pool, padded with block 0 to the widest."""
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(num_blocks, generator=generator).tolist()
    tables, used = [], 0
    for length in context_lens:
        count = -(-length // BLOCK_SIZE)
        tables.append(order[used : used + count])
        used += count
    width = max(map(len, tables))
    return [t + [0] * (width - len(t)) for t in tables], tables


def as_tensor(values):
    return torch.tensor(values, dtype=torch.long, device=DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128])
@pytest.mark.parametrize("group", [1, 3, 7])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_matches_the_torch_path(dtype, head_dim, group, num_splits):
    error = decode_error(dtype, dtype, head_dim, group, num_splits, [1, 16, 17, 37, 100], num_blocks=24)
    assert error < TOLERANCE[dtype]


def decode_error(dtype, cache_dtype, head_dim, group, num_splits, context_lens, num_blocks) -> float:
    """max |Triton - torch path| over one decode batch: queries of `dtype`, 2 KV heads in a pool of `cache_dtype`."""
    kv_heads = 2
    k_cache, v_cache = pool(kv_heads, num_blocks, head_dim, cache_dtype)
    padded, _ = block_tables(context_lens, num_blocks)
    generator = torch.Generator().manual_seed(2)
    query = torch.randn(len(context_lens), kv_heads * group, head_dim, generator=generator).to(DEVICE, dtype)
    decode = DecodeBatch(as_tensor(padded), as_tensor(context_lens), BLOCK_SIZE)
    expected = _decode(query, k_cache, v_cache, decode, head_dim**-0.5)
    got = decode_attention(query, k_cache, v_cache, decode.block_tables, decode.context_lens, head_dim**-0.5, num_splits)
    return (got.float() - expected.float()).abs().max()


def test_split_count_fills_the_gpu_only_where_the_batch_does_not():
    assert num_splits_for(batch=256, kv_heads=2, max_context=32768, num_sms=132) == 1
    assert num_splits_for(batch=1, kv_heads=2, max_context=32768, num_sms=132) == 16
    assert num_splits_for(batch=1, kv_heads=2, max_context=200, num_sms=132) == 1  # too short to pay for a merge
    assert num_splits_for(batch=4, kv_heads=2, max_context=2048, num_sms=132) == 8


# (tokens cached before the chunk, tokens in the chunk) per sequence
CHUNKS = {
    "fresh prompts": [(0, 1), (0, 16), (0, 37)],
    "over cached prefixes": [(16, 5), (31, 1), (100, 20), (3, 13)],
    "longer than a tile": [(0, 70), (50, 130)],
}


def torch_reference(query, k_cache, v_cache, spans, padded, scaling):
    """The engine's torch path: SDPA per chunk over the gathered context (K/V already written)."""
    prefills, start, new_rows = [], 0, []
    for (cached, new), table in zip(spans, padded):
        length = cached + new
        prefills.append(PrefillChunk(start, start + new, length, as_tensor(table[: -(-length // BLOCK_SIZE)])))
        new_rows += [(table[p // BLOCK_SIZE], p % BLOCK_SIZE) for p in range(cached, length)]
        start += new
    blocks, offsets = as_tensor([b for b, _ in new_rows]), as_tensor([o for _, o in new_rows])
    key, value = (cache[:, blocks, offsets].transpose(0, 1) for cache in (k_cache, v_cache))  # the chunks' own rows
    out = query.new_empty(query.shape)
    for chunk in prefills:
        out[chunk.start : chunk.end] = _prefill(query, key, value, k_cache, v_cache, chunk, scaling)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize("group", [1, 3, 7])
@pytest.mark.parametrize("case", list(CHUNKS))
def test_chunked_prefill_matches_the_torch_path(dtype, head_dim, group, case):
    spans, kv_heads = CHUNKS[case], 2
    context_lens = [cached + new for cached, new in spans]
    k_cache, v_cache = pool(kv_heads, 48, head_dim, dtype)
    padded, _ = block_tables(context_lens, 48)
    starts = [0]
    for _, new in spans:
        starts.append(starts[-1] + new)
    query = torch.randn(starts[-1], kv_heads * group, head_dim, generator=torch.Generator().manual_seed(3)).to(DEVICE, dtype)
    expected = torch_reference(query, k_cache, v_cache, spans, padded, head_dim**-0.5)
    got = prefill_attention(query, k_cache, v_cache, as_tensor(padded), as_tensor(starts), as_tensor(context_lens),
                            max(new for _, new in spans), head_dim**-0.5)
    assert (got.float() - expected.float()).abs().max() < TOLERANCE[dtype]


@pytest.mark.parametrize("group", [3, 6, 7])
def test_a_prefill_program_writes_only_its_own_tokens(group):
    """The rows a program takes are its tile's tokens times the group, packed, with a few left over where the group
    is not a power of two. Only the first tile's programs are launched here: every output past its tokens must be
    as it was. A leftover row that wrote the next tile's first token would race that tile's program on a GPU; under
    the interpreter, which runs programs in order, the full launch would hide it."""
    from engine.kernels.triton.prefill import prefill_launch

    kv_heads, head_dim, new = 2, 64, 40
    k_cache, v_cache = pool(kv_heads, 8, head_dim, torch.float32)
    padded, _ = block_tables([new], 8)
    query = torch.randn(new, kv_heads * group, head_dim, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    out = torch.full_like(query, float("nan"))
    launch = prefill_launch(query, k_cache, v_cache, as_tensor(padded), as_tensor([0, new]), as_tensor([new]), new,
                            head_dim**-0.5, out)
    tokens = launch.constexprs["BLOCK_Q"]
    assert tokens * group < launch.constexprs["ROWS"] and tokens < new  # rows left over, and a second tile
    launch.grid = (launch.grid[0], 1, launch.grid[2])
    launch.run()
    expected = torch_reference(query, k_cache, v_cache, [(0, new)], padded, head_dim**-0.5)
    assert (out[:tokens] - expected[:tokens]).abs().max() < TOLERANCE[torch.float32]
    assert out[tokens:].isnan().all()


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kv_write_puts_each_row_in_its_slot_and_skips_padding(cache_dtype):
    kv_heads, head_dim = 3, 80
    k_cache, v_cache = (torch.zeros(kv_heads, 8, BLOCK_SIZE, head_dim, dtype=cache_dtype, device=DEVICE) for _ in range(2))
    key, value = (torch.randn(4, kv_heads, head_dim, device=DEVICE).to(cache_dtype) for _ in range(2))
    slots = [5, -1, 7 * BLOCK_SIZE + 15, BLOCK_SIZE]  # -1: a padded row, written nowhere
    write_kv(k_cache, v_cache, key, value, as_tensor(slots))
    for row, slot in enumerate(slots):
        if slot >= 0:
            assert torch.equal(k_cache[:, slot // BLOCK_SIZE, slot % BLOCK_SIZE], key[row])
            assert torch.equal(v_cache[:, slot // BLOCK_SIZE, slot % BLOCK_SIZE], value[row])
    assert int((k_cache != 0).any(-1).sum()) == 3 * kv_heads and int((v_cache != 0).any(-1).sum()) == 3 * kv_heads


def far_apart_heads(kv_heads, num_blocks, head_dim, dtype):
    """K and V pools whose KV heads lie 2^30 + 1 elements apart, so the last head starts past 2^31: one layer's pool
    on a large GPU (a 16-layer model filling an H200 has ~2^31 elements a layer). Only the rows used are ever
    touched; the rest of the ~4.3 GB stays unallocated on a CPU."""
    head_stride, head = (1 << 30) + 1, num_blocks * BLOCK_SIZE * head_dim
    storage = torch.empty((kv_heads - 1) * head_stride + 2 * head, dtype=dtype, device=DEVICE)
    generator = torch.Generator().manual_seed(5)
    views = []
    for offset in (0, head):
        view = storage.as_strided((kv_heads, num_blocks, BLOCK_SIZE, head_dim),
                                  (head_stride, BLOCK_SIZE * head_dim, head_dim, 1), offset)
        for h in range(kv_heads):
            view[h].copy_(torch.randn(num_blocks, BLOCK_SIZE, head_dim, generator=generator))
        views.append(view)
    return views


def test_kernels_address_a_kv_head_that_starts_past_2_to_the_31_elements():
    """A KV head's offset in the pool is computed in 64 bits: in 32 it wrapped, and the kernels read and wrote
    outside the pool (a crash under the interpreter, an illegal address on a GPU)."""
    kv_heads, group, head_dim, dtype = 3, 2, 64, torch.bfloat16
    k_cache, v_cache = far_apart_heads(kv_heads, 4, head_dim, dtype)
    assert (kv_heads - 1) * k_cache.stride(0) >= 1 << 31 > k_cache.stride(0)
    spans = [(0, 10), (16, 14)]  # (cached, new) tokens of each sequence
    context_lens = [cached + new for cached, new in spans]
    padded = [[2, 0], [1, 3]]  # each sequence's blocks
    key, value = (torch.randn(1, kv_heads, head_dim, device=DEVICE).to(dtype) for _ in range(2))
    write_kv(k_cache, v_cache, key, value, as_tensor([3 * BLOCK_SIZE + 5]))
    assert torch.equal(k_cache[:, 3, 5], key[0]) and torch.equal(v_cache[:, 3, 5], value[0])
    generator = torch.Generator().manual_seed(6)
    query = torch.randn(len(spans), kv_heads * group, head_dim, generator=generator).to(DEVICE, dtype)
    decode = DecodeBatch(as_tensor(padded), as_tensor(context_lens), BLOCK_SIZE)
    expected = _decode(query, k_cache, v_cache, decode, head_dim**-0.5)
    got = decode_attention(query, k_cache, v_cache, decode.block_tables, decode.context_lens, head_dim**-0.5)
    assert (got.float() - expected.float()).abs().max() < TOLERANCE[dtype]
    query = torch.randn(sum(new for _, new in spans), kv_heads * group, head_dim, generator=generator).to(DEVICE, dtype)
    expected = torch_reference(query, k_cache, v_cache, spans, padded, head_dim**-0.5)
    got = prefill_attention(query, k_cache, v_cache, as_tensor(padded), as_tensor([0, 10, 24]), as_tensor(context_lens),
                            14, head_dim**-0.5)
    assert (got.float() - expected.float()).abs().max() < TOLERANCE[dtype]


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kv_write_to_an_fp8_cache_stores_torchs_saturated_cast(cache_dtype, dtype):
    """kv_cache_dtype fp8: the bytes of torch's cast, rounded to nearest even and saturated at the format's largest
    value, from subnormals (1e-9) to past the range (1.6e5); -0.0 stays -0.0. Triton's interpreter casts without
    carrying a rounded-up mantissa into the exponent, so a kernel leaving the rounding to the cast fails here."""
    kv_heads, head_dim, tokens = 2, 64, 40
    generator = torch.Generator().manual_seed(7)
    scale = torch.logspace(-9, 5.2, tokens)[:, None, None]
    key, value = ((torch.randn(tokens, kv_heads, head_dim, generator=generator) * scale).to(DEVICE, dtype)
                  for _ in range(2))
    key[0, 0, :8] = torch.tensor([7.77, 500.0, -1000.0, 1e5, 0.0123, 0.0, -0.0, 447.9])
    k_cache, v_cache = (torch.zeros(kv_heads, 4, BLOCK_SIZE, head_dim, dtype=cache_dtype, device=DEVICE) for _ in range(2))
    slots = torch.randperm(4 * BLOCK_SIZE, generator=generator)[:tokens].to(DEVICE)
    write_kv(k_cache, v_cache, key, value, slots)
    largest = torch.finfo(cache_dtype).max
    for cache, rows in ((k_cache, key), (v_cache, value)):
        stored = cache.view(kv_heads, -1, head_dim)[:, slots].transpose(0, 1)
        assert torch.equal(stored.view(torch.uint8), rows.clamp(-largest, largest).to(cache_dtype).view(torch.uint8))


@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_decode_over_an_fp8_cache_matches_the_torch_path(cache_dtype, num_splits):
    error = decode_error(torch.bfloat16, cache_dtype, 128, 7, num_splits, [1, 17, 100, 300], num_blocks=40)
    assert error < TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize(("dtype", "cache_dtype"), [
    (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
    (torch.bfloat16, torch.float8_e4m3fn), (torch.float32, torch.float8_e5m2)])
def test_a_mixed_step_through_the_layer_matches_the_torch_path(dtype, cache_dtype):
    """Decodes first, then prefill chunks, the KV write included: the whole of one layer's attention, over a cache
    of the model's dtype or an fp8 one (kv_cache_dtype), where the fresh prompt too reads its K/V back rounded."""
    kv_heads, group, head_dim, scaling = 2, 3, 64, 0.125
    decodes, spans = [9, 33], [(0, 12), (20, 7)]
    lengths = decodes + [cached + new for cached, new in spans]
    padded, tables = block_tables(lengths, 32)
    tokens = len(decodes) + sum(new for _, new in spans)
    slots = []
    for length, table in zip(decodes, tables):
        slots.append(table[(length - 1) // BLOCK_SIZE] * BLOCK_SIZE + (length - 1) % BLOCK_SIZE)
    for (cached, new), table in zip(spans, tables[len(decodes):]):
        slots += [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(cached, cached + new)]
    generator = torch.Generator().manual_seed(4)
    query = torch.randn(tokens, kv_heads * group, head_dim, generator=generator).to(DEVICE, dtype)
    key, value = (torch.randn(tokens, kv_heads, head_dim, generator=generator).to(DEVICE, dtype) for _ in range(2))
    decode = DecodeBatch(as_tensor(padded[: len(decodes)]), as_tensor(decodes), BLOCK_SIZE)
    chunks, start = [], len(decodes)
    for (cached, new), table in zip(spans, tables[len(decodes):]):
        chunks.append(PrefillChunk(start, start + new, cached + new, as_tensor(table)))
        start += new
    batch = PrefillBatch(as_tensor([0, 12, 19]), as_tensor([12, 27]), as_tensor(padded[len(decodes):]), 12)
    results = []
    for triton in (False, True):
        k_cache, v_cache = pool(kv_heads, 32, head_dim, cache_dtype)
        meta = AttentionMetadata([(k_cache, v_cache)], as_tensor(slots), decode, [] if triton else chunks,
                                 prefill_batch=batch if triton else None, triton=triton)
        results.append((meta.attend(query, key, value, 0, scaling), raw(k_cache), raw(v_cache)))
    (expected, k_ref, v_ref), (got, k_got, v_got) = results
    assert torch.equal(k_ref, k_got) and torch.equal(v_ref, v_got)
    assert (got.float() - expected.float()).abs().max() < TOLERANCE[dtype]
