"""The paged attention paths agree with plain SDPA over each sequence's contiguous context, at the head sizes of
the Llama family; the C++ kernel's build failure is an error, never a quiet fallback."""
import pytest
import torch
import torch.nn.functional as F

from engine import cpu_kernels
from engine.layers.attention import DecodeBatch, _decode_torch
from tests.engine.kernel_builds import kernels_for

HEADS, KV_HEADS, BLOCK = 9, 3, 16


def random_pool(num_blocks, head_dim, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (KV_HEADS, num_blocks, BLOCK, head_dim)
    return torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)


def reference_decode(q, k_cache, v_cache, tables, lens):
    outs, head_dim = [], q.shape[-1]
    for b in range(q.shape[0]):
        k = k_cache[:, tables[b]].reshape(KV_HEADS, -1, head_dim)[:, : lens[b]]
        v = v_cache[:, tables[b]].reshape(KV_HEADS, -1, head_dim)[:, : lens[b]]
        o = F.scaled_dot_product_attention(q[b].unsqueeze(1).float(), k.float(), v.float(), enable_gqa=True)
        outs.append(o[:, 0])
    return torch.stack(outs)


@pytest.fixture(params=["torch", "cpp"])
def decode_fn(request):
    if request.param == "torch":
        return lambda q, k, v, tables, lens: _decode_torch(q.transpose(0, 1), k, v, DecodeBatch(tables, lens, k.shape[2]),
                                                           q.shape[-1] ** -0.5)
    if not cpu_kernels.have_compiler():
        pytest.skip("no C++ compiler on this machine")  # the only reason to skip: a failed build raises below
    op = cpu_kernels.build_paged_decode()
    return lambda q, k, v, tables, lens: op(q, k, v, tables, lens, q.shape[-1] ** -0.5)


@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_decode_matches_sdpa_over_ragged_contexts(decode_fn, head_dim, dtype, tolerance):
    k_cache, v_cache = random_pool(64, head_dim, dtype)
    lens = torch.tensor([1, 15, 16, 17, 32, 100, 200])  # block boundaries: a kernel that drops the last block fails
    width = -(-int(lens.max()) // BLOCK)
    tables = torch.stack([torch.randperm(64, generator=torch.Generator().manual_seed(i))[:width] for i in range(len(lens))])
    q = torch.randn(len(lens), HEADS, head_dim).to(dtype)
    got = decode_fn(q, k_cache, v_cache, tables, lens).float()
    want = reference_decode(q, k_cache, v_cache, tables, lens)
    assert got.shape == (len(lens), HEADS, head_dim)
    torch.testing.assert_close(got, want, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("isa", ["native", "avx2"])
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 80, 128])
def test_decode_over_an_fp8_pool_equals_decode_over_its_widened_values(isa, cache_dtype, dtype, head_dim):
    """kv_cache_dtype fp8: the kernel widens each byte as it reads (e5m2 as fp16's top byte, e4m3 through fp16's
    places times 2^8), on the AVX-512 path and on the portable one (`-mno-avx512f`, what AVX2-only CPUs run), from
    subnormals (1e-3) to e4m3's largest, over one part and several (600 keys)."""
    if not cpu_kernels.have_compiler():
        pytest.skip("no C++ compiler on this machine")
    op = kernels_for(isa).paged_decode
    g = torch.Generator().manual_seed(head_dim)
    spread = torch.logspace(-3, 2.6, 64 * BLOCK).view(1, 64, BLOCK, 1)  # every magnitude, scattered over the blocks
    k8, v8 = ((torch.randn(KV_HEADS, 64, BLOCK, head_dim, generator=g) * spread).to(cache_dtype) for _ in range(2))
    lens = torch.tensor([1, 17, 100, 600])
    tables = torch.stack([torch.randperm(64, generator=g)[:38] for _ in lens])
    q = torch.randn(len(lens), HEADS, head_dim, generator=g).to(dtype) * 0.05
    got = op(q, k8, v8, tables, lens, head_dim**-0.5).float()
    want = op(q.float(), k8.float(), v8.float(), tables, lens, head_dim**-0.5)
    tolerance = 1e-6 if dtype == torch.float32 else 2e-2 * want.abs().max()  # bf16: the output's rounding
    assert (got - want).abs().max() <= tolerance


@pytest.mark.slow
def test_a_failed_kernel_build_raises_for_cpp_and_falls_back_for_auto(monkeypatch):
    import torch.utils.cpp_extension

    from engine import LLM

    def failing_build(**kwargs):
        raise RuntimeError("Error building extension 'engine_cpu_kernels': planted compile error")

    monkeypatch.setattr(cpu_kernels, "have_compiler", lambda: True)  # a compiler is there, and the build fails
    monkeypatch.setattr(torch.utils.cpp_extension, "load_inline", failing_build)
    cpu_kernels.build_kernels.cache_clear()
    try:
        with pytest.raises(cpu_kernels.KernelBuildError, match="planted compile error"):
            cpu_kernels.build_paged_decode()
        with pytest.raises(cpu_kernels.KernelBuildError):
            LLM(dtype="float32", num_kv_blocks=8, attention_backend="cpp")
        llm = LLM(dtype="float32", num_kv_blocks=8, attention_backend="auto")
        assert llm.engine.runner.decode_kernel is None
    finally:
        cpu_kernels.build_kernels.cache_clear()


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size,heads,kv_heads", [(8, 4, 4), (32, 8, 1), (16, 6, 2), (16, 4, 2), (16, 8, 2)])
def test_decode_at_other_block_sizes_and_head_groups(decode_fn, block_size, heads, kv_heads, head_dim):
    """The kernel walks keys 16 at a time across block boundaries of any size, for any query-head group."""
    g = torch.Generator().manual_seed(block_size)
    k_cache, v_cache = (torch.randn(kv_heads, 48, block_size, head_dim, generator=g) for _ in range(2))
    lens = torch.tensor([1, 7, 8, 9, 33, 150])
    width = -(-int(lens.max()) // block_size)
    tables = torch.stack([torch.randperm(48, generator=g)[:width] for _ in lens])
    q = torch.randn(len(lens), heads, head_dim, generator=g)
    got = decode_fn(q, k_cache, v_cache, tables, lens)
    for b, n in enumerate(lens.tolist()):
        k = k_cache[:, tables[b]].reshape(kv_heads, -1, head_dim)[:, :n]
        v = v_cache[:, tables[b]].reshape(kv_heads, -1, head_dim)[:, :n]
        want = F.scaled_dot_product_attention(q[b].unsqueeze(1), k, v, enable_gqa=True)[:, 0]
        torch.testing.assert_close(got[b], want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size", [16, 24])  # 24: the parts' boundaries fall inside blocks
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_decode_over_long_contexts_split_into_parts(decode_fn, block_size, dtype, tolerance):
    """Past 512 keys the kernel scores each part of a context as its own work item and merges the parts' softmax
    sums: lengths on either side of the parts' edges, and one sequence short enough to stay whole beside them."""
    g = torch.Generator().manual_seed(block_size)
    num_blocks = 160
    k_cache, v_cache = (torch.randn(KV_HEADS, num_blocks, block_size, 64, generator=g).to(dtype) for _ in range(2))
    lens = torch.tensor([511, 512, 513, 1025, 2100, 40])
    width = -(-int(lens.max()) // block_size)
    tables = torch.stack([torch.randperm(num_blocks, generator=g)[:width] for _ in lens])
    q = torch.randn(len(lens), HEADS, 64, generator=g).to(dtype)
    got = decode_fn(q, k_cache, v_cache, tables, lens).float()
    for b, n in enumerate(lens.tolist()):
        k = k_cache[:, tables[b]].reshape(KV_HEADS, -1, 64)[:, :n].float()
        v = v_cache[:, tables[b]].reshape(KV_HEADS, -1, 64)[:, :n].float()
        want = F.scaled_dot_product_attention(q[b].unsqueeze(1).float(), k, v, enable_gqa=True)[:, 0]
        torch.testing.assert_close(got[b], want, atol=tolerance, rtol=tolerance)


def test_bf16_decode_with_a_large_head_group(decode_fn):
    """32 query heads on one KV head (multi-query attention), bf16: the AVX512_BF16 key scoring keeps every head's query."""
    g = torch.Generator().manual_seed(7)
    k_cache, v_cache = (torch.randn(1, 32, BLOCK, 64, generator=g).to(torch.bfloat16) for _ in range(2))
    lens = torch.tensor([3, 40, 200])
    tables = torch.stack([torch.randperm(32, generator=g)[:13] for _ in lens])
    q = torch.randn(len(lens), 32, 64, generator=g).to(torch.bfloat16)
    got = decode_fn(q, k_cache, v_cache, tables, lens).float()
    for b, n in enumerate(lens.tolist()):
        k = k_cache[:, tables[b]].reshape(1, -1, 64)[:, :n].float()
        v = v_cache[:, tables[b]].reshape(1, -1, 64)[:, :n].float()
        want = F.scaled_dot_product_attention(q[b].unsqueeze(1).float(), k, v, enable_gqa=True)[:, 0]
        torch.testing.assert_close(got[b], want, atol=3e-2, rtol=3e-2)


def test_the_cpp_kernels_refuse_tables_and_positions_outside_their_buffers():
    """A bookkeeping bug must be an error, not a read of another request's cache (or past the pool)."""
    if not cpu_kernels.have_compiler():
        pytest.skip("no C++ compiler on this machine")
    op, fused = cpu_kernels.build_paged_decode(), cpu_kernels.build_fused_ops()
    k, v = random_pool(8, 64, torch.float32)
    q = torch.randn(2, HEADS, 64)
    tables, lens = torch.tensor([[0, 1], [2, 3]]), torch.tensor([20, 32])
    op(q, k, v, tables, lens, 0.125)  # in bounds
    with pytest.raises(RuntimeError, match="outside the pool"):
        op(q, k, v, torch.tensor([[0, 1], [2, 8]]), lens, 0.125)
    with pytest.raises(RuntimeError, match="outside its block table"):
        op(q, k, v, tables, torch.tensor([20, 33]), 0.125)
    cos = sin = torch.zeros(16, 32)
    qkv = torch.randn(3, 4 * 64)
    fused.rotary_inplace(qkv, torch.tensor([0, 5, 15]), cos, sin, 4, 64)
    with pytest.raises(RuntimeError, match="outside the rotary table"):
        fused.rotary_inplace(qkv, torch.tensor([0, 5, 16]), cos, sin, 4, 64)


PREFILL_KERNELS = ["avx512_bf16", "amx"]


def bf16_prefill_kernel(isa: str = "avx512_bf16"):
    """A bf16 prefill kernel, or a skip where this CPU cannot run it (SDPA serves where neither runs)."""
    if not cpu_kernels.have_compiler():
        pytest.skip("no C++ compiler on this machine")
    kernels = cpu_kernels.build_kernels()
    if not kernels.has_bf16_prefill():
        pytest.skip("this CPU has no AVX512-BF16: prefill attention runs on SDPA")
    if isa == "amx":
        if not kernels.has_amx_prefill():
            pytest.skip("this CPU has no AMX-BF16 tiles (or Linux refused them): the AVX512-BF16 kernel serves")
        return kernels.paged_prefill_amx
    return kernels.paged_prefill


def reference_prefill(q, k_cache, v_cache, table, context_len, dtype=torch.float32):
    """SDPA over the sequence's context gathered from the pool, each of the n rows causal at its own position."""
    kv_heads, _, block_size, head_dim = k_cache.shape
    k = k_cache[:, table].reshape(kv_heads, -1, head_dim)[:, :context_len].to(dtype)
    v = v_cache[:, table].reshape(kv_heads, -1, head_dim)[:, :context_len].to(dtype)
    rows = torch.arange(context_len - q.shape[0], context_len).unsqueeze(1)
    mask = torch.arange(context_len).unsqueeze(0) <= rows
    return F.scaled_dot_product_attention(q.transpose(0, 1).to(dtype), k, v, attn_mask=mask, scale=head_dim ** -0.5,
                                          enable_gqa=True).transpose(0, 1).float()


@pytest.mark.parametrize("isa", PREFILL_KERNELS)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size,heads,kv_heads", [(16, 9, 3), (32, 8, 8), (16, 8, 1)])
def test_the_bf16_prefill_kernels_match_sdpa_over_cached_contexts(isa, head_dim, block_size, heads, kv_heads):
    """Chunks with and without a cached context, lengths off the 16-row tiles and the 16- and 32-key steps, a
    context whose later keys sit in a lower block than its first (a shuffled table), and the query a strided view
    (rows of a fused QKV, as the native model passes it). The kernel's error against fp32 is bounded by bf16 SDPA's
    own (its weights are rounded to bf16 as torch's flash kernel rounds them)."""
    kernel = bf16_prefill_kernel(isa)
    g = torch.Generator().manual_seed(head_dim + block_size + heads)
    num_blocks = 40
    k_cache, v_cache = (torch.randn(kv_heads, num_blocks, block_size, head_dim, generator=g).to(torch.bfloat16)
                        for _ in range(2))
    for n, context_len in [(1, 1), (7, 7), (16, 16), (37, 37), (1, 50), (5, 40), (100, 333), (256, 256), (3, 600)]:
        table = torch.randperm(num_blocks, generator=g)[: -(-context_len // block_size)]
        fused = torch.randn(n, heads + 2 * kv_heads, head_dim, generator=g).to(torch.bfloat16)
        q = fused[:, :heads]
        got = kernel(q, k_cache, v_cache, table, context_len, head_dim ** -0.5).float()
        want = reference_prefill(q, k_cache, v_cache, table, context_len)
        sdpa_error = (reference_prefill(q, k_cache, v_cache, table, context_len, torch.bfloat16) - want).abs().max()
        error = (got - want).abs().max()
        assert got.shape == (n, heads, head_dim)
        assert error <= 1.5 * sdpa_error + 2e-3, f"n {n}, context {context_len}: error {error:.4f}, SDPA's {sdpa_error:.4f}"


@pytest.mark.parametrize("isa", PREFILL_KERNELS)
def test_a_steps_chunks_in_one_call_equal_each_chunk_alone(isa):
    """The engine's form: every prefill chunk of a step in one call (strided rows of one query, a padded table per
    sequence). Each chunk's rows come out bit for bit as a call of its own gives them; bad spans are refused."""
    kernel = bf16_prefill_kernel(isa)
    batch = getattr(cpu_kernels.build_kernels(), kernel.__name__ + "_batch")
    g = torch.Generator().manual_seed(7)
    heads, kv_heads, head_dim, block_size, num_blocks = 9, 3, 64, 16, 80
    k_cache, v_cache = (torch.randn(kv_heads, num_blocks, block_size, head_dim, generator=g).to(torch.bfloat16)
                        for _ in range(2))
    chunks = [(40, 40), (1, 300), (70, 150), (5, 5), (33, 500)]  # (new tokens, context once they are in)
    blocks = torch.randperm(num_blocks, generator=g).tolist()
    tables = [torch.tensor(blocks[sum(-(-c // block_size) for _, c in chunks[:i]):][: -(-ctx // block_size)])
              for i, (_, ctx) in enumerate(chunks)]
    rows = sum(n for n, _ in chunks)
    q = torch.randn(rows, heads + 2 * kv_heads, head_dim, generator=g).to(torch.bfloat16)[:, :heads]
    starts = torch.tensor([0] + [sum(n for n, _ in chunks[: i + 1]) for i in range(len(chunks))])
    padded = torch.nn.utils.rnn.pad_sequence(tables, batch_first=True)
    lens = torch.tensor([ctx for _, ctx in chunks])
    together = batch(q, k_cache, v_cache, padded, starts, lens, head_dim ** -0.5)
    for i, (table, (n, ctx)) in enumerate(zip(tables, chunks)):
        alone = kernel(q[starts[i] : starts[i + 1]], k_cache, v_cache, table, ctx, head_dim ** -0.5)
        assert torch.equal(together[starts[i] : starts[i + 1]], alone), f"chunk {i}"
        want = reference_prefill(q[starts[i] : starts[i + 1]], k_cache, v_cache, table, ctx)
        assert (alone.float() - want).abs().max() < 0.05
    with pytest.raises(RuntimeError, match="span the query"):
        batch(q, k_cache, v_cache, padded, starts - 1, lens, 0.125)
    with pytest.raises(RuntimeError, match="a chunk of 40 tokens in a context of 39"):
        batch(q, k_cache, v_cache, padded, starts, lens - torch.tensor([1, 0, 0, 0, 0]), 0.125)


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_the_amx_prefill_over_an_fp8_pool_equals_it_over_the_pool_widened(cache_dtype):
    """kv_cache_dtype fp8: the AMX kernel widens each 16-key group of an fp8 pool to bf16 (exactly: every fp8 value
    is a bf16 one) as it packs the tiles, so its output is bit for bit its output over the widened pool; the
    AVX512-BF16 kernel reads bf16 pools only and says so, and the engine then takes SDPA."""
    kernel = bf16_prefill_kernel("amx")
    g = torch.Generator().manual_seed(3)
    heads, kv_heads, head_dim, block_size, num_blocks = 9, 3, 128, 16, 48
    spread = torch.logspace(-3, 2.6, block_size).view(1, 1, block_size, 1)  # subnormals to e4m3's largest
    k8, v8 = ((torch.randn(kv_heads, num_blocks, block_size, head_dim, generator=g) * spread).to(cache_dtype)
              for _ in range(2))
    for n, context_len in [(1, 1), (37, 37), (5, 40), (100, 333), (3, 600)]:
        table = torch.randperm(num_blocks, generator=g)[: -(-context_len // block_size)]
        q = torch.randn(n, heads, head_dim, generator=g).to(torch.bfloat16)
        got = kernel(q, k8, v8, table, context_len, head_dim ** -0.5)
        assert torch.equal(got, kernel(q, k8.to(torch.bfloat16), v8.to(torch.bfloat16), table, context_len,
                                       head_dim ** -0.5)), f"n {n}, context {context_len}"
    with pytest.raises(RuntimeError, match="paged_prefill takes bf16 queries and a bf16 pool"):
        cpu_kernels.build_kernels().paged_prefill(q, k8, v8, table, context_len, head_dim ** -0.5)
    assert cpu_kernels.paged_prefill_op(torch.bfloat16, 128, 16, cache_dtype).__name__ == "paged_prefill_amx_batch"


def test_bf16_prefill_runs_on_amx_tiles_where_linux_grants_them():
    """Where both kernels run, the engine takes the AMX one (4-5x the other on such CPUs); fp32 and other head sizes
    keep SDPA."""
    bf16_prefill_kernel()
    amx = cpu_kernels.build_kernels().has_amx_prefill()
    chosen = cpu_kernels.paged_prefill_op(torch.bfloat16, 64, 16).__name__
    assert chosen == ("paged_prefill_amx_batch" if amx else "paged_prefill_batch")
    assert cpu_kernels.paged_prefill_op(torch.float32, 64, 16) is None
    assert cpu_kernels.paged_prefill_op(torch.bfloat16, 96, 16) is None


@pytest.mark.parametrize("isa", PREFILL_KERNELS)
def test_the_bf16_prefill_kernels_refuse_what_they_cannot_read(isa):
    kernel = bf16_prefill_kernel(isa)
    k, v = (c.to(torch.bfloat16) for c in random_pool(8, 64, torch.float32))
    q = torch.randn(20, HEADS, 64).to(torch.bfloat16)
    kernel(q, k, v, torch.tensor([0, 1]), 20, 0.125)  # in bounds
    with pytest.raises(RuntimeError, match="outside the pool"):
        kernel(q, k, v, torch.tensor([0, 8]), 20, 0.125)
    with pytest.raises(RuntimeError, match="outside its block table"):
        kernel(q, k, v, torch.tensor([0, 1]), 33, 0.125)
    with pytest.raises(RuntimeError, match="a chunk of 20 tokens in a context of 19"):
        kernel(q, k, v, torch.tensor([0, 1]), 19, 0.125)
    with pytest.raises(RuntimeError, match="bf16"):
        kernel(q.float(), k.float(), v.float(), torch.tensor([0, 1]), 20, 0.125)


@pytest.mark.slow
def test_a_bf16_engine_prefills_on_the_kernel_and_scores_prompts_as_sdpa_does():
    """The embedded model in bf16, a 300-token prompt in chunks of 64 (each after the first reads a cached
    context): prompt logprobs on the kernel against the same engine on SDPA."""
    from engine import LLM, SamplingParams

    bf16_prefill_kernel()
    llm = LLM(dtype="bfloat16", num_kv_blocks=128, max_num_batched_tokens=64, enable_prefix_caching=False)
    assert llm.engine.settings()["prefill_kernel"]
    prompt = " ".join(f"item {i} costs {i * 7 % 13} coins;" for i in range(50))
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)

    def scores():
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        return torch.tensor([scored[token] for scored, token in zip(out.prompt_logprobs[1:], out.prompt_token_ids[1:])])

    on_kernel = scores()
    kernel, llm.engine.runner.prefill_kernel = llm.engine.runner.prefill_kernel, None
    on_sdpa = scores()
    llm.engine.runner.prefill_kernel = kernel
    assert len(on_kernel) > 250
    difference = (on_kernel - on_sdpa).abs()
    assert difference.mean() < 0.05 and difference.max() < 1.0, (difference.mean(), difference.max())
