// Prefill attention straight from the paged KV pool, for bf16 on CPUs with AVX512-BF16 (Zen 4, Sapphire Rapids and
// later): one chunk of a sequence, causal over its cached context and itself. torch's flash SDPA ran at 60-120 GFLOP/s
// here (small GEMMs at head_dim 64, and the cached context gathered into a copy first); vLLM's CPU kernel at about 150.
//
// A tile is 16 query rows, one per vector lane: the rows are (position, query head) pairs of one KV head, so a GQA
// group shares every key it loads. Each step takes 16 keys: their scores (16 vectors, one per key, lanes = rows) are
// `vdpbf16ps` of the rows' query pairs with each key's pair broadcast from the pool, so the online softmax is
// lane-wise with no horizontal reduction; the weights, rounded to bf16 as torch's flash kernel rounds them, go
// through `vdpbf16ps` again against value pairs of two keys. Outputs stay in a per-tile fp32 accumulator.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <tuple>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

bool has_bf16_prefill() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

#if defined(__AVX512BF16__)
namespace prefill {  // named: the kernels share one translation unit

constexpr int kTile = 16;  // query rows of a tile, and keys of a step
constexpr float kMasked = -1e30f;     // finite: -ffast-math assumes no infinities

// 2^t for t <= 0 (and a little above): 2^n * 2^f with f in [-0.5, 0.5] by its Taylor series to degree 6 (relative
// error ~1e-7); t is clamped at -125.5, where 2^t is already below the smallest normal float.
inline __m512 exp2_nonpositive(__m512 t) {
  t = _mm512_max_ps(t, _mm512_set1_ps(-125.5f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.540353039338161e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618129107628477e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550410866482158e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402265069591007e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931471805599453e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

inline __m512 exp_nonpositive(__m512 x) { return exp2_nonpositive(_mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f))); }

inline __m512 dot_pairs(__m512 acc, __m512i a, uint32_t pair) {
  return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)_mm512_set1_epi32(static_cast<int>(pair)));
}

// One chunk of one sequence: its queries, its pool and where its keys are.
struct Chunk {
  const uint16_t* q;  // [n, heads, D] with rows q_stride apart
  int64_t q_stride, n, heads, group, context_len, block_size, num_blocks;
  const void *k_cache, *v_cache;  // [kv_heads, num_blocks, block_size, D], bf16, or fp8 bytes where fp8 is set
  const int64_t* table;
  float scale;
  uint16_t* out;  // [n, heads, D], contiguous
  at::ScalarType pool = at::kBFloat16;  // the AMX kernel also reads fp8 pools (kv_cache_dtype)
};

template <int D>
struct Tile {
  alignas(64) uint32_t q[D / 2][kTile];  // the rows' query pairs (d, d + 1), lane = row
  alignas(64) float o[D][kTile];         // weighted values, lane = row
  alignas(64) uint32_t v[kTile / 2][D];  // value pairs of keys (2w, 2w + 1) of the current step
  int32_t position[kTile];               // each row's position in the sequence
  const uint16_t* row_q[kTile];          // nullptr: a padding row past the chunk
  uint16_t* row_out[kTile];
};

template <int D>
void attend_tile(const Chunk& c, int64_t kv_head, int64_t tile_index, Tile<D>& t) {
  const int64_t rows = c.n * c.group, first = tile_index * kTile, first_position = c.context_len - c.n;
  for (int r = 0; r < kTile; ++r) {
    const int64_t row = std::min(first + r, rows - 1), token = row / c.group, head = kv_head * c.group + row % c.group;
    const bool real = first + r < rows;
    t.row_q[r] = real ? c.q + token * c.q_stride + head * D : nullptr;
    t.row_out[r] = real ? c.out + (token * c.heads + head) * D : nullptr;
    t.position[r] = static_cast<int32_t>(first_position + token);  // a padding row repeats the last real one
    const uint32_t* pairs = reinterpret_cast<const uint32_t*>(c.q + token * c.q_stride + head * D);
    for (int w = 0; w < D / 2; ++w) t.q[w][r] = real ? pairs[w] : 0u;
  }
  for (int d = 0; d < D; ++d) _mm512_store_ps(t.o[d], _mm512_setzero_ps());
  const __m512i position = _mm512_loadu_si512(t.position);
  const int64_t lowest = t.position[0], keys = t.position[kTile - 1] + 1;
  __m512 running_max = _mm512_set1_ps(kMasked), total = _mm512_setzero_ps();
  const int64_t head_offset = kv_head * c.num_blocks * c.block_size * D;
  const __m512i pair_order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                              6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);

  for (int64_t key0 = 0; key0 < keys; key0 += kTile) {
    const int64_t slot = c.table[key0 / c.block_size] * c.block_size + key0 % c.block_size;
    const uint16_t* k = static_cast<const uint16_t*>(c.k_cache) + head_offset + slot * D;
    const uint16_t* v = static_cast<const uint16_t*>(c.v_cache) + head_offset + slot * D;
    const int64_t valid = std::min<int64_t>(kTile, c.context_len - key0);
    const uint32_t* k_pairs = reinterpret_cast<const uint32_t*>(k);

    __m512 s[kTile];
    for (int j = 0; j < kTile; ++j) s[j] = _mm512_setzero_ps();
    for (int w = 0; w < D / 2; ++w) {
      const __m512i qw = _mm512_load_si512(t.q[w]);
      for (int j = 0; j < kTile; ++j) s[j] = dot_pairs(s[j], qw, k_pairs[j * (D / 2) + w]);
    }
    const __m512 scale = _mm512_set1_ps(c.scale);
    const bool edge = key0 + kTile - 1 > lowest || valid < kTile;  // some row must not see some key here
    for (int j = 0; j < kTile; ++j) {
      s[j] = _mm512_mul_ps(s[j], scale);
      if (edge) {
        const __mmask16 sees = j < valid ? _mm512_cmpge_epi32_mask(position, _mm512_set1_epi32(key0 + j)) : 0;
        s[j] = _mm512_mask_mov_ps(_mm512_set1_ps(kMasked), sees, s[j]);
      }
    }
    __m512 step_max = s[0];
    for (int j = 1; j < kTile; ++j) step_max = _mm512_max_ps(step_max, s[j]);
    const __m512 new_max = _mm512_max_ps(running_max, step_max);
    const __m512 rescale = exp_nonpositive(_mm512_sub_ps(running_max, new_max));
    running_max = new_max;
    total = _mm512_mul_ps(total, rescale);
    for (int j = 0; j < kTile; ++j) {
      s[j] = exp_nonpositive(_mm512_sub_ps(s[j], new_max));
      total = _mm512_add_ps(total, s[j]);
    }
    __m512i weight_pairs[kTile / 2];  // lane = row: (weight of key 2w, weight of key 2w + 1) in bf16
    for (int w = 0; w < kTile / 2; ++w)
      weight_pairs[w] = _mm512_permutexvar_epi16(pair_order, (__m512i)_mm512_cvtne2ps_pbh(s[2 * w + 1], s[2 * w]));

    for (int w = 0; w < kTile / 2; ++w) {  // keys past the context (an unused slot's stale values) count as zeros
      const uint16_t* even = v + (2 * w) * D;
      const uint16_t* odd = v + (2 * w + 1) * D;
      const uint32_t even_mask = 2 * w < valid ? 0xffffu : 0u, odd_mask = 2 * w + 1 < valid ? 0xffffu : 0u;
      for (int d = 0; d < D; ++d) t.v[w][d] = (even[d] & even_mask) | (uint32_t(odd[d] & odd_mask) << 16);
    }
    for (int d0 = 0; d0 < D; d0 += kTile) {
      __m512 acc[kTile];
      for (int i = 0; i < kTile; ++i) acc[i] = _mm512_mul_ps(_mm512_load_ps(t.o[d0 + i]), rescale);
      for (int w = 0; w < kTile / 2; ++w)
        for (int i = 0; i < kTile; ++i) acc[i] = dot_pairs(acc[i], weight_pairs[w], t.v[w][d0 + i]);
      for (int i = 0; i < kTile; ++i) _mm512_store_ps(t.o[d0 + i], acc[i]);
    }
  }

  const __m512 inverse = _mm512_div_ps(_mm512_set1_ps(1.f), total);
  alignas(64) uint16_t lanes[kTile];
  for (int d = 0; d < D; ++d) {
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes),
                       (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(t.o[d]), inverse)));
    for (int r = 0; r < kTile; ++r)
      if (t.row_out[r] != nullptr) t.row_out[r][d] = lanes[r];
  }
}

// Tiles of every KV head, the costliest (latest rows, most keys) first, taken one at a time by each thread.
template <int D>
void attend_chunk(const Chunk& c, int64_t kv_heads) {
  const int64_t tiles = (c.n * c.group + kTile - 1) / kTile, items = tiles * kv_heads;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    Tile<D> tile;
    for (int64_t item = next++; item < items; item = next++)
      attend_tile<D>(c, item % kv_heads, tiles - 1 - item / kv_heads, tile);
  });
}

}  // namespace prefill
#endif

// query [T, heads, D] bf16: the step's prefill rows, chunk i at rows query_starts[i]..query_starts[i + 1] (rows may
// be strided, as a view of the step's fused QKV); caches [kv_heads, num_blocks, block_size, D] with the chunks' K/V
// already written; block_tables [S, width]: each sequence's blocks; context_lens [S]: its tokens once its chunk is
// in. -> [T, heads, D]. The single-chunk entry points (the kernels' tests) are S = 1.
#if defined(__AVX512BF16__)
namespace prefill {

// The checked arguments of a step's chunks, with the tensors their pointers point into (shared with the AMX kernel).
struct CheckedChunks {
  at::Tensor tables, out;
  std::vector<Chunk> chunks;
  int64_t kv_heads, head_dim;
};

inline CheckedChunks checked_chunks(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                    const at::Tensor& block_tables, const at::Tensor& query_starts,
                                    const at::Tensor& context_lens, double scale, bool fp8_pools = false) {
  const auto pool = k_cache.scalar_type();
  const bool pool_ok = pool == at::kBFloat16 || (fp8_pools && is_fp8(pool));  // paged_attention_cpu.cpp's
  TORCH_CHECK(query.scalar_type() == at::kBFloat16 && pool_ok && v_cache.scalar_type() == pool,
              fp8_pools ? "paged_prefill_amx takes bf16 queries and a bf16 or fp8 pool"
                        : "paged_prefill takes bf16 queries and a bf16 pool");
  TORCH_CHECK(query.device().is_cpu() && k_cache.is_contiguous() && v_cache.is_contiguous(), "a contiguous CPU pool");
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1 && query.stride(1) == query.size(2), "query [n, heads, D]");
  const int64_t rows = query.size(0), heads = query.size(1), head_dim = query.size(2);
  const int64_t kv_heads = k_cache.size(0), num_blocks = k_cache.size(1), block_size = k_cache.size(2);
  TORCH_CHECK(head_dim == 64 || head_dim == 128, "paged_prefill has head_dim 64 and 128, not ", head_dim);
  TORCH_CHECK(heads % kv_heads == 0 && block_size % kTile == 0 && k_cache.size(3) == head_dim, "pool geometry");
  auto tables = block_tables.to(at::kLong).contiguous();
  auto starts = query_starts.to(at::kLong).contiguous(), lens = context_lens.to(at::kLong).contiguous();
  const int64_t count = lens.numel(), width = tables.numel() / std::max<int64_t>(count, 1);
  TORCH_CHECK(count >= 1 && starts.numel() == count + 1 && tables.numel() == count * width,
              "block tables [S, width], query starts [S + 1] and context lengths [S]");
  const int64_t *start = starts.data_ptr<int64_t>(), *len = lens.data_ptr<int64_t>();
  TORCH_CHECK(start[0] == 0 && start[count] == rows, "the query starts span the query's ", rows, " rows");
  for (int64_t i = 0; i < count; ++i) {
    const int64_t n = start[i + 1] - start[i];
    TORCH_CHECK(n >= 1 && len[i] >= n, "a chunk of ", n, " tokens in a context of ", len[i]);
  }
  // paged_attention_cpu.cpp's check, on every table and length
  check_block_tables(tables.data_ptr<int64_t>(), width, len, count, num_blocks, block_size);
  auto out = at::empty({rows, heads, head_dim}, query.options().memory_format(at::MemoryFormat::Contiguous));
  const auto* q = reinterpret_cast<const uint16_t*>(query.data_ptr<at::BFloat16>());
  auto* o = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  std::vector<Chunk> chunks;
  for (int64_t i = 0; i < count; ++i)
    chunks.push_back(Chunk{q + start[i] * query.stride(0), query.stride(0), start[i + 1] - start[i], heads,
                           heads / kv_heads, len[i], block_size, num_blocks, k_cache.data_ptr(), v_cache.data_ptr(),
                           tables.data_ptr<int64_t>() + i * width, static_cast<float>(scale),
                           o + start[i] * heads * head_dim, pool});
  return {tables, out, std::move(chunks), kv_heads, head_dim};
}

// One chunk's arguments as a step of one: [n] block table, its context length.
inline std::tuple<at::Tensor, at::Tensor, at::Tensor> one_chunk(const at::Tensor& query, const at::Tensor& block_table,
                                                                int64_t context_len) {
  auto table = block_table.to(at::kLong).reshape({1, -1});
  auto starts = at::empty({2}, at::kLong), lens = at::empty({1}, at::kLong);
  starts.data_ptr<int64_t>()[0] = 0;
  starts.data_ptr<int64_t>()[1] = query.size(0);
  lens.data_ptr<int64_t>()[0] = context_len;
  return {table, starts, lens};
}

}  // namespace prefill
#endif

at::Tensor paged_prefill_batch(at::Tensor query, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
                               at::Tensor query_starts, at::Tensor context_lens, double scale) {
#if defined(__AVX512BF16__)
  auto checked = prefill::checked_chunks(query, k_cache, v_cache, block_tables, query_starts, context_lens, scale);
  ReleaseGil no_gil;
  for (const auto& chunk : checked.chunks) {  // each chunk's tiles over every thread
    if (checked.head_dim == 64) prefill::attend_chunk<64>(chunk, checked.kv_heads);
    else prefill::attend_chunk<128>(chunk, checked.kv_heads);
  }
  return checked.out;
#else
  TORCH_CHECK(false, "paged_prefill needs AVX512-BF16; this build has none (has_bf16_prefill() is false)");
  return query;
#endif
}

at::Tensor paged_prefill(at::Tensor query, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_table,
                         int64_t context_len, double scale) {
#if defined(__AVX512BF16__)
  TORCH_CHECK(query.dim() == 3, "query [n, heads, D]");
  auto [table, starts, lens] = prefill::one_chunk(query, block_table, context_len);
  return paged_prefill_batch(query, k_cache, v_cache, table, starts, lens, scale);
#else
  TORCH_CHECK(false, "paged_prefill needs AVX512-BF16; this build has none (has_bf16_prefill() is false)");
  return query;
#endif
}
