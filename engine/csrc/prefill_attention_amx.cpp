// Prefill attention on AMX tiles (Sapphire Rapids and later), with paged_prefill's contract. On these CPUs the
// AVX512-BF16 kernel above ran at half of torch's SDPA (oneDNN's brgemm on AMX): its 2,048 `vdpbf16ps` per 16 x 16
// scores are the bottleneck, where one `tdpbf16ps` does a 16 x 16 x 32 product.
//
// The chunk's context is packed first, once per KV head, into the layouts the tile products read (as vLLM's AMX
// backend keeps its whole cache, here only for the chunk): keys as [16 dimension pairs][16 keys] tiles, values as
// [16 key pairs][16 dimensions] tiles, padding keys zero. A work item is then 32 query rows ((position, query head)
// pairs of one KV head, as in the AVX kernel), two row tiles that share every key and value tile loaded, over steps
// of 32 keys: four score tiles by `tdpbf16ps`, an exact online softmax in AVX-512 (each row's running maximum in the
// log2 domain; a row's output rescaled when its maximum rises), the weights rounded to bf16 into two tiles, and the
// output accumulated in fp32 memory by one product per 16 rows and 16 output columns. Measured alone on 2 cores at
// head_dim 64, about half the time is the softmax and half the tiles' loads and stores; 32-row items took 20% off
// 16-row ones, while keeping a 16-row item's output in tiles, or computing the next step's scores during this step's
// softmax, did not measure faster.
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <sys/syscall.h>
#include <unistd.h>

namespace amx_prefill {

constexpr int kRows = 32;            // query rows of a work item: two tiles' rows, sharing each key and value tile
constexpr int kKeys = 32;            // keys of a step: the bf16 a tile row holds
constexpr int kTileWords = 16 * 16;  // a 1 KB tile as 32-bit words
// Tile registers. Macros, not constants: the intrinsics paste the number into the instruction's text.
#define TILE_TOP 0             // rows 0-15 of the item: their queries, then their weights
#define TILE_BOTTOM 1          // rows 16-31
#define TILE_KV 2              // a key tile, then a value tile
#define TILE_SCORES_TOP_0 3    // rows 0-15 against keys 0-15 of the step
#define TILE_SCORES_TOP_1 4    // rows 0-15 against keys 16-31
#define TILE_SCORES_BOTTOM_0 5
#define TILE_SCORES_BOTTOM_1 6
#define TILE_OUT 7             // 16 rows x 16 output columns, loaded from and stored to the fp32 output
constexpr int kTilesUsed = 8;

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// Linux gives a process the 8 KB tile state only once it asks (arch_prctl); oneDNN asks for its own use, not ours.
bool tiles_permitted() {
  static const bool permitted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return permitted;
}

void configure_tiles() {
  TileConfig config;
  for (int t = 0; t < kTilesUsed; ++t) {
    config.rows[t] = 16;
    config.bytes_per_row[t] = 64;
  }
  // gcc's _tile_loadconfig tells the compiler it reads 8 bytes, so the rows set above were dropped as dead stores
  asm volatile("" : : "r"(&config) : "memory");
  _tile_loadconfig(&config);
}

// The chunk's context, packed for one KV head: steps of 32 keys, each D / 32 x 2 key tiles and D / 16 value tiles.
template <int D>
struct Packed {
  uint32_t* base;
  int64_t steps;
  static constexpr int64_t kKeyTiles = 2 * (D / 32), kValueTiles = D / 16;
  static constexpr int64_t kStepWords = (kKeyTiles + kValueTiles) * kTileWords;
  // keys (16 * half .. 16 * half + 15) of a step, dimensions 32 * part .. 32 * part + 31
  uint32_t* keys(int64_t kv_head, int64_t step, int half, int part) const {
    return base + (kv_head * steps + step) * kStepWords + (half * (D / 32) + part) * kTileWords;
  }
  // the step's 32 keys, output dimensions 16 * part .. 16 * part + 15
  uint32_t* values(int64_t kv_head, int64_t step, int part) const {
    return base + (kv_head * steps + step) * kStepWords + (kKeyTiles + part) * kTileWords;
  }
};

// `rows` rows of D fp8 values (an fp8 pool's, kv_cache_dtype) widened to bf16, exactly: every fp8 value is one.
template <typename fp8_t, int D>
void widen_rows(const void* src, uint16_t* dst, int64_t rows) {
  const fp8_t* from = static_cast<const fp8_t*>(src);
  for (int64_t i = 0; i < rows * D; i += 16)
    _mm256_store_si256(reinterpret_cast<__m256i*>(dst + i), (__m256i)_mm512_cvtneps_pbh(load_lanes(from + i)));
}

// 16 keys and their values (one half of a step; block_size is a multiple of 16, so they lie in one block) into
// their tiles.
template <int D>
void pack_group(const prefill::Chunk& c, const Packed<D>& p, int64_t kv_head, int64_t group) {
  const int64_t key0 = group * 16, step = group / 2;
  const int half = static_cast<int>(group % 2);
  const int64_t valid = std::max<int64_t>(0, std::min<int64_t>(16, c.context_len - key0));
  const __mmask16 real = static_cast<__mmask16>((1u << valid) - 1);
  const uint32_t* k = nullptr;
  const uint16_t* v = nullptr;
  alignas(64) uint16_t wide_k[16 * D], wide_v[16 * D];  // an fp8 pool's rows, widened
  if (valid > 0) {
    const int64_t slot = c.table[key0 / c.block_size] * c.block_size + key0 % c.block_size;
    const int64_t offset = (kv_head * c.num_blocks * c.block_size + slot) * D;
    if (c.pool == at::kBFloat16) {
      k = reinterpret_cast<const uint32_t*>(static_cast<const uint16_t*>(c.k_cache) + offset);
      v = static_cast<const uint16_t*>(c.v_cache) + offset;
    } else {  // fp8: the 16 rows widened first, then packed from there as from a bf16 block
      const auto* k_bytes = static_cast<const uint8_t*>(c.k_cache) + offset;
      const auto* v_bytes = static_cast<const uint8_t*>(c.v_cache) + offset;
      if (c.pool == at::kFloat8_e4m3fn) {
        widen_rows<c10::Float8_e4m3fn, D>(k_bytes, wide_k, valid);
        widen_rows<c10::Float8_e4m3fn, D>(v_bytes, wide_v, valid);
      } else {
        widen_rows<c10::Float8_e5m2, D>(k_bytes, wide_k, valid);
        widen_rows<c10::Float8_e5m2, D>(v_bytes, wide_v, valid);
      }
      k = reinterpret_cast<const uint32_t*>(wide_k);
      v = wide_v;
    }
  }
  // key tile row w, lane j: the pair of dimensions (32 * part + 2w, + 1) of key j
  const __m512i key_rows = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                              _mm512_set1_epi32(D / 2));
  for (int part = 0; part < D / 32; ++part) {
    uint32_t* tile = p.keys(kv_head, step, half, part);
    for (int w = 0; w < 16; ++w) {
      const __m512i pairs = valid > 0 ? _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), real, key_rows,
                                                                    k + part * 16 + w, 4)
                                      : _mm512_setzero_si512();
      _mm512_store_si512(tile + w * 16, pairs);
    }
  }
  // value tile row 8 * half + i, lane n: dimension n of keys 2i (low half) and 2i + 1 (high half)
  for (int part = 0; part < D / 16; ++part) {
    uint32_t* tile = p.values(kv_head, step, part);
    for (int i = 0; i < 8; ++i) {
      const __m512i even = 2 * i < valid ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                                               reinterpret_cast<const __m256i*>(v + (2 * i) * D + part * 16)))
                                         : _mm512_setzero_si512();
      const __m512i odd = 2 * i + 1 < valid ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                                                  reinterpret_cast<const __m256i*>(v + (2 * i + 1) * D + part * 16)))
                                            : _mm512_setzero_si512();
      _mm512_store_si512(tile + (8 * half + i) * 16, _mm512_or_si512(even, _mm512_slli_epi32(odd, 16)));
    }
  }
}

template <int D>
struct Work {
  alignas(64) uint16_t q[D / 32][kRows][32];  // the rows' queries, 32 dimensions a tile
  alignas(64) float scores[kRows][kKeys];
  alignas(64) uint16_t weights[kRows][kKeys];
  alignas(64) float out[kRows][D];
  alignas(64) float total[kRows][16];  // each row's sum of weights, lane-wise
  alignas(64) float running_max[kRows];  // log2 domain
  alignas(64) float rescale[kRows];      // this step's factor for each row's output and total: its maximum rose
  int32_t position[kRows];
  uint16_t* row_out[kRows];            // nullptr: a padding row past the chunk
};

// 2^x for finite x <= 0 (masked scores are finite): 2^n * 2^f, f in [-0.5, 0.5] by a degree-4 fit of relative error
// 5e-6, far below the bf16 rounding of the weights it makes; no clamp, as scalef takes any n. (The exp2 was about
// 15% of the kernel's time, measured by leaving it out.)
inline __m512 exp2_weights(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(9.554105163801327e-3f), f, _mm512_set1_ps(5.5870408513703625e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402469660165126e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931280281735208e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.999994397928009e-1f));
  return _mm512_scalef_ps(p, n);
}

inline void scale_row(float* row, int64_t width, float factor) {
  const __m512 f = _mm512_set1_ps(factor);
  for (int64_t d = 0; d < width; d += 16) _mm512_store_ps(row + d, _mm512_mul_ps(_mm512_load_ps(row + d), f));
}

// Scores of the step into weights (bf16) for the value product, updating each row's maximum, total and output.
template <int D>
void softmax_step(Work<D>& w, int64_t key0, float log2_scale, bool edge) {
  const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i low_keys = _mm512_add_epi32(lanes, _mm512_set1_epi32(static_cast<int>(key0)));
  const __m512i high_keys = _mm512_add_epi32(low_keys, _mm512_set1_epi32(16));
  const __m512 masked = _mm512_set1_ps(prefill::kMasked);
  for (int r = 0; r < kRows; ++r) {  // the rows' maxima first, so a rise costs no mispredicted branch per row
    __m512 low = _mm512_load_ps(w.scores[r]), high = _mm512_load_ps(w.scores[r] + 16);  // unscaled
    if (edge) {  // causal: a row sees keys up to its own position (padding keys lie past every row's)
      const __m512i position = _mm512_set1_epi32(w.position[r]);
      low = _mm512_mask_mov_ps(masked, _mm512_cmple_epi32_mask(low_keys, position), low);
      high = _mm512_mask_mov_ps(masked, _mm512_cmple_epi32_mask(high_keys, position), high);
      _mm512_store_ps(w.scores[r], low);
      _mm512_store_ps(w.scores[r] + 16, high);
    }
    w.rescale[r] = _mm512_reduce_max_ps(_mm512_max_ps(low, high)) * log2_scale;  // the step's maximum, for now
  }
  uint32_t rose = 0;
  for (int r = 0; r < kRows; r += 16) {
    const __m512 old_max = _mm512_load_ps(w.running_max + r), step_max = _mm512_load_ps(w.rescale + r);
    const __m512 new_max = _mm512_max_ps(old_max, step_max);
    rose |= static_cast<uint32_t>(_mm512_cmp_ps_mask(step_max, old_max, _CMP_GT_OQ)) << r;
    _mm512_store_ps(w.rescale + r, prefill::exp2_nonpositive(_mm512_sub_ps(old_max, new_max)));
    _mm512_store_ps(w.running_max + r, new_max);
  }
  for (uint32_t rows = rose; rows != 0; rows &= rows - 1) scale_row(w.out[__builtin_ctz(rows)], D, w.rescale[__builtin_ctz(rows)]);
  const __m512 scale = _mm512_set1_ps(log2_scale);
  for (int r = 0; r < kRows; ++r) {
    const __m512 minus_max = _mm512_set1_ps(-w.running_max[r]);
    const __m512 low = exp2_weights(_mm512_fmadd_ps(_mm512_load_ps(w.scores[r]), scale, minus_max));
    const __m512 high = exp2_weights(_mm512_fmadd_ps(_mm512_load_ps(w.scores[r] + 16), scale, minus_max));
    const __m512 total = _mm512_mul_ps(_mm512_load_ps(w.total[r]), _mm512_set1_ps(w.rescale[r]));
    _mm512_store_ps(w.total[r], _mm512_add_ps(total, _mm512_add_ps(low, high)));
    _mm512_store_si512(w.weights[r], (__m512i)_mm512_cvtne2ps_pbh(high, low));
  }
}

template <int D>
void attend_rows(const prefill::Chunk& c, const Packed<D>& p, int64_t kv_head, int64_t item, Work<D>& w) {
  const int64_t rows = c.n * c.group, first = item * kRows, first_position = c.context_len - c.n;
  for (int r = 0; r < kRows; ++r) {
    const int64_t row = std::min(first + r, rows - 1), token = row / c.group, head = kv_head * c.group + row % c.group;
    const bool real = first + r < rows;
    const uint16_t* q = c.q + token * c.q_stride + head * D;
    for (int part = 0; part < D / 32; ++part)
      _mm512_store_si512(w.q[part][r], real ? _mm512_loadu_si512(q + part * 32) : _mm512_setzero_si512());
    w.row_out[r] = real ? c.out + (token * c.heads + head) * D : nullptr;
    w.position[r] = static_cast<int32_t>(first_position + token);  // a padding row repeats the last real one
    w.running_max[r] = prefill::kMasked;
    for (int64_t d = 0; d < D; d += 16) _mm512_store_ps(w.out[r] + d, _mm512_setzero_ps());
    _mm512_store_ps(w.total[r], _mm512_setzero_ps());
  }
  const int64_t lowest = w.position[0], keys = w.position[kRows - 1] + 1;
  const float log2_scale = c.scale * 1.4426950408889634f;
  for (int64_t step = 0; step * kKeys < keys; ++step) {
    _tile_zero(TILE_SCORES_TOP_0);
    _tile_zero(TILE_SCORES_TOP_1);
    _tile_zero(TILE_SCORES_BOTTOM_0);
    _tile_zero(TILE_SCORES_BOTTOM_1);
    for (int part = 0; part < D / 32; ++part) {
      _tile_loadd(TILE_TOP, w.q[part], 64);
      _tile_loadd(TILE_BOTTOM, w.q[part][16], 64);
      _tile_loadd(TILE_KV, p.keys(kv_head, step, 0, part), 64);
      _tile_dpbf16ps(TILE_SCORES_TOP_0, TILE_TOP, TILE_KV);
      _tile_dpbf16ps(TILE_SCORES_BOTTOM_0, TILE_BOTTOM, TILE_KV);
      _tile_loadd(TILE_KV, p.keys(kv_head, step, 1, part), 64);
      _tile_dpbf16ps(TILE_SCORES_TOP_1, TILE_TOP, TILE_KV);
      _tile_dpbf16ps(TILE_SCORES_BOTTOM_1, TILE_BOTTOM, TILE_KV);
    }
    _tile_stored(TILE_SCORES_TOP_0, w.scores, kKeys * sizeof(float));
    _tile_stored(TILE_SCORES_TOP_1, &w.scores[0][16], kKeys * sizeof(float));
    _tile_stored(TILE_SCORES_BOTTOM_0, w.scores[16], kKeys * sizeof(float));
    _tile_stored(TILE_SCORES_BOTTOM_1, &w.scores[16][16], kKeys * sizeof(float));
    softmax_step<D>(w, step * kKeys, log2_scale, step * kKeys + kKeys - 1 > lowest);
    _tile_loadd(TILE_TOP, w.weights, 64);
    _tile_loadd(TILE_BOTTOM, w.weights[16], 64);
    for (int part = 0; part < D / 16; ++part) {
      _tile_loadd(TILE_KV, p.values(kv_head, step, part), 64);
      _tile_loadd(TILE_OUT, &w.out[0][part * 16], D * sizeof(float));
      _tile_dpbf16ps(TILE_OUT, TILE_TOP, TILE_KV);
      _tile_stored(TILE_OUT, &w.out[0][part * 16], D * sizeof(float));
      _tile_loadd(TILE_OUT, &w.out[16][part * 16], D * sizeof(float));
      _tile_dpbf16ps(TILE_OUT, TILE_BOTTOM, TILE_KV);
      _tile_stored(TILE_OUT, &w.out[16][part * 16], D * sizeof(float));
    }
  }
  for (int r = 0; r < kRows; ++r) {
    if (w.row_out[r] == nullptr) continue;
    const __m512 inverse = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(_mm512_load_ps(w.total[r])));
    for (int64_t d = 0; d < D; d += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(w.row_out[r] + d),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(w.out[r] + d), inverse)));
  }
}

// Pack every chunk's context for every KV head, then hand out the work items of all chunks (32 rows of one KV head)
// from one list, costliest (most keys) first, so a step's short chunks share the threads in one call.
template <int D>
void attend_chunks(const std::vector<prefill::Chunk>& chunks, int64_t kv_heads) {
  std::vector<Packed<D>> packed;
  std::vector<int64_t> first_group{0};  // each chunk's first packing job, (KV head, 16 keys) pairs
  int64_t words = 0;
  for (const auto& c : chunks) {
    const int64_t steps = (c.context_len + kKeys - 1) / kKeys;
    packed.push_back({reinterpret_cast<uint32_t*>(words), steps});  // an offset until the buffer exists
    words += kv_heads * steps * Packed<D>::kStepWords;
    first_group.push_back(first_group.back() + kv_heads * 2 * steps);
  }
  const at::Tensor buffer = at::empty({words * 4 + 64}, at::kByte);
  const auto base = (reinterpret_cast<uintptr_t>(buffer.data_ptr()) + 63) & ~uintptr_t{63};
  for (auto& p : packed) p.base = reinterpret_cast<uint32_t*>(base) + reinterpret_cast<uintptr_t>(p.base);
  at::parallel_for(0, first_group.back(), 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const size_t c = std::upper_bound(first_group.begin(), first_group.end(), i) - first_group.begin() - 1;
      const int64_t job = i - first_group[c], groups = 2 * packed[c].steps;
      pack_group<D>(chunks[c], packed[c], job / groups, job % groups);
    }
  });
  struct Item { int64_t keys; int32_t chunk, kv_head, index; };
  std::vector<Item> items;
  for (size_t c = 0; c < chunks.size(); ++c) {
    const auto& ch = chunks[c];
    const int64_t rows = ch.n * ch.group;
    for (int64_t index = 0; index * kRows < rows; ++index) {
      const int64_t last_token = (std::min(rows, (index + 1) * kRows) - 1) / ch.group;
      for (int64_t h = 0; h < kv_heads; ++h)
        items.push_back({ch.context_len - ch.n + last_token + 1, int32_t(c), int32_t(h), int32_t(index)});
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.keys > b.keys; });
  std::atomic<size_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    configure_tiles();
    auto work = std::make_unique<Work<D>>();
    for (size_t i = next++; i < items.size(); i = next++)
      attend_rows<D>(chunks[items[i].chunk], packed[items[i].chunk], items[i].kv_head, items[i].index, *work);
    _tile_release();
  });
}

}  // namespace amx_prefill
#endif

bool has_amx_prefill() {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
  return amx_prefill::tiles_permitted();
#else
  return false;
#endif
}

// paged_prefill_batch's arguments and result, on AMX tiles.
at::Tensor paged_prefill_amx_batch(at::Tensor query, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
                                   at::Tensor query_starts, at::Tensor context_lens, double scale) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
  TORCH_CHECK(amx_prefill::tiles_permitted(), "the kernel refused AMX tile state (arch_prctl)");
  auto checked = prefill::checked_chunks(query, k_cache, v_cache, block_tables, query_starts, context_lens, scale,
                                         /*fp8_pools=*/true);
  ReleaseGil no_gil;
  if (checked.head_dim == 64) amx_prefill::attend_chunks<64>(checked.chunks, checked.kv_heads);
  else amx_prefill::attend_chunks<128>(checked.chunks, checked.kv_heads);
  return checked.out;
#else
  TORCH_CHECK(false, "paged_prefill_amx needs AMX-BF16; this build has none (has_amx_prefill() is false)");
  return query;
#endif
}

// paged_prefill's arguments and result (one chunk), on AMX tiles.
at::Tensor paged_prefill_amx(at::Tensor query, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_table,
                             int64_t context_len, double scale) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
  TORCH_CHECK(query.dim() == 3, "query [n, heads, D]");
  auto [table, starts, lens] = prefill::one_chunk(query, block_table, context_len);
  return paged_prefill_amx_batch(query, k_cache, v_cache, table, starts, lens, scale);
#else
  TORCH_CHECK(false, "paged_prefill_amx needs AMX-BF16; this build has none (has_amx_prefill() is false)");
  return query;
#endif
}
