// Decode attention straight from the paged KV pool: one query token per sequence, each sequence read only up to
// its own length through its block table. No gather copy and no padding, which is where the torch path spends its time.
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <cmath>
#include <algorithm>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

// Widen one row of head_dim values to float.
template <typename scalar_t>
static inline void load_row(const scalar_t* src, float* dst, int64_t n) {
  for (int64_t d = 0; d < n; ++d) dst[d] = static_cast<float>(src[d]);
}

#if defined(__AVX512F__)
template <>
inline void load_row<c10::BFloat16>(const c10::BFloat16* src, float* dst, int64_t n) {
  int64_t d = 0;
  for (; d + 16 <= n; d += 16) {
    __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + d));
    __m512 wide = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
    _mm512_storeu_ps(dst + d, wide);
  }
  for (; d < n; ++d) dst[d] = static_cast<float>(src[d]);
}

static inline float dot(const float* a, const float* b, int64_t n) {
  __m512 sum = _mm512_setzero_ps();
  int64_t d = 0;
  for (; d + 16 <= n; d += 16) sum = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), _mm512_loadu_ps(b + d), sum);
  float total = _mm512_reduce_add_ps(sum);
  for (; d < n; ++d) total += a[d] * b[d];
  return total;
}

static inline void axpy(float p, const float* x, float* y, int64_t n) {
  const __m512 scale = _mm512_set1_ps(p);
  int64_t d = 0;
  for (; d + 16 <= n; d += 16) _mm512_storeu_ps(y + d, _mm512_fmadd_ps(scale, _mm512_loadu_ps(x + d), _mm512_loadu_ps(y + d)));
  for (; d < n; ++d) y[d] += p * x[d];
}
#else
static inline float dot(const float* a, const float* b, int64_t n) {
  float total = 0.f;
  for (int64_t d = 0; d < n; ++d) total += a[d] * b[d];
  return total;
}

static inline void axpy(float p, const float* x, float* y, int64_t n) {
  for (int64_t d = 0; d < n; ++d) y[d] += p * x[d];
}
#endif

// In place: scores -> exp(score - their peak); returns the sum, and the peak in *peak_out.
static inline float exp_in_place(float* s, int64_t len, float* peak_out) {
  float peak = -std::numeric_limits<float>::infinity();
  for (int64_t t = 0; t < len; ++t) peak = std::max(peak, s[t]);
  float total = 0.f;
#pragma omp simd reduction(+ : total)
  for (int64_t t = 0; t < len; ++t) { s[t] = std::exp(s[t] - peak); total += s[t]; }
  *peak_out = peak;
  return total;
}

// In place: scores of one query head over its context -> attention weights.
static inline void softmax(float* s, int64_t len) {
  float peak;
  const float inv = 1.f / exp_in_place(s, len, &peak);
  for (int64_t t = 0; t < len; ++t) s[t] *= inv;
}

// kHeadDim > 0 fixes head_dim at compile time, so the per-row loops unroll (2x faster measured); 0 reads it at run time.
template <typename scalar_t, typename cache_t, int64_t kHeadDim>
static void decode_impl(const scalar_t* q, const cache_t* k_cache, const cache_t* v_cache, const int64_t* block_tables,
                        const int64_t* context_lens, scalar_t* out, int64_t batch, int64_t heads, int64_t kv_heads,
                        int64_t runtime_head_dim, int64_t num_blocks, int64_t block_size, int64_t max_blocks, float scale) {
  const int64_t head_dim = kHeadDim > 0 ? kHeadDim : runtime_head_dim;
  const int64_t group = heads / kv_heads;
  const int64_t head_stride = num_blocks * block_size * head_dim;
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * head_dim), acc(group * head_dim), row(head_dim), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / kv_heads, kvh = task % kv_heads, len = context_lens[b];
      const int64_t* table = block_tables + b * max_blocks;
      load_row(q + (b * heads + kvh * group) * head_dim, qf.data(), group * head_dim);
      for (auto& x : qf) x *= scale;
      scores.resize(group * len);
      const cache_t* k_head = k_cache + kvh * head_stride;
      for (int64_t first = 0; first < len; first += block_size) {
        const cache_t* kp = k_head + table[first / block_size] * block_size * head_dim;
        for (int64_t t = first; t < std::min(len, first + block_size); ++t, kp += head_dim) {
          load_row(kp, row.data(), head_dim);
          for (int64_t g = 0; g < group; ++g) scores[g * len + t] = dot(qf.data() + g * head_dim, row.data(), head_dim);
        }
      }
      for (int64_t g = 0; g < group; ++g) softmax(scores.data() + g * len, len);
      std::fill(acc.begin(), acc.end(), 0.f);
      const cache_t* v_head = v_cache + kvh * head_stride;
      for (int64_t first = 0; first < len; first += block_size) {
        const cache_t* vp = v_head + table[first / block_size] * block_size * head_dim;
        for (int64_t t = first; t < std::min(len, first + block_size); ++t, vp += head_dim) {
          load_row(vp, row.data(), head_dim);
          for (int64_t g = 0; g < group; ++g) axpy(scores[g * len + t], row.data(), acc.data() + g * head_dim, head_dim);
        }
      }
      scalar_t* o = out + (b * heads + kvh * group) * head_dim;
      for (int64_t i = 0; i < group * head_dim; ++i) o[i] = static_cast<scalar_t>(acc[i]);
    }
  });
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#define PAGED_DECODE_VECTORS 1
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
// The block kernel below in AVX-512's 16 lanes and 32 registers, or AVX2's 8 and 16: the loads, the lane sums and
// the register budget differ, the walk over blocks, the parts and the merge do not.
using vfloat = __m512;
constexpr int64_t kFloatLanes = 16;
static inline vfloat vzero() { return _mm512_setzero_ps(); }
static inline vfloat vset1(float x) { return _mm512_set1_ps(x); }
static inline vfloat vmul(vfloat a, vfloat b) { return _mm512_mul_ps(a, b); }
static inline vfloat vfmadd(vfloat a, vfloat b, vfloat c) { return _mm512_fmadd_ps(a, b, c); }
static inline void vstore(float* p, vfloat v) { _mm512_storeu_ps(p, v); }
static inline void vstore_aligned(float* p, vfloat v) { _mm512_store_ps(p, v); }

// 16 values widened to float, from any pool dtype.
static inline vfloat load_lanes(const float* p) { return _mm512_loadu_ps(p); }
static inline vfloat load_lanes(const c10::BFloat16* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
static inline vfloat load_lanes(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
// fp8 pools (kv_cache_dtype): an e5m2 byte is the top byte of the fp16 of the same value; an e4m3 byte's exponent
// and mantissa, moved to fp16's places, read as the value times 2^-8 (the biases differ by 8), subnormals included.
static inline __m256i widen_bytes(const void* p) {
  return _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
static inline vfloat load_lanes(const c10::Float8_e5m2* p) {
  return _mm512_cvtph_ps(_mm256_slli_epi16(widen_bytes(p), 8));
}
static inline vfloat load_lanes(const c10::Float8_e4m3fn* p) {
  const __m256i bytes = widen_bytes(p);
  const __m256i half = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(bytes, _mm256_set1_epi16(0x80)), 8),
                                       _mm256_slli_epi16(_mm256_and_si256(bytes, _mm256_set1_epi16(0x7F)), 7));
  return _mm512_mul_ps(_mm512_cvtph_ps(half), _mm512_set1_ps(256.f));
}

// v[t] holds 16 partial sums of key t's score; returns the 16 scores, lane t = the sum of v[t]. A transposing
// tree of 15 adds and 30 shuffles, where one horizontal reduction per key costs about 8 dependent steps each.
static inline vfloat transpose_reduce(const vfloat* v) {
  __m512 pairs[8], quads[4], halves[2];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // per 128-bit lane: the four keys 4i..4i+3, each summed over that lane
    quads[i] = _mm512_add_ps(_mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 2; ++i)  // then across the four 128-bit lanes, two at a time
    halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(halves[0], halves[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(halves[0], halves[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// Query heads whose value accumulators share the 32 registers in one pass over the values, and the vectors of
// head_dim a pass holds (all of them).
template <int64_t kHeadDim>
constexpr int kHeadsPerPass = kHeadDim / 16 <= 5 ? 4 : 2;
template <int64_t kHeadDim>
constexpr int64_t kVecsPerPass = kHeadDim / 16;
#elif defined(PAGED_DECODE_VECTORS)
// AVX2 (with FMA and F16C: every AVX2 CPU has them): 8 lanes, 16 registers.
using vfloat = __m256;
constexpr int64_t kFloatLanes = 8;
static inline vfloat vzero() { return _mm256_setzero_ps(); }
static inline vfloat vset1(float x) { return _mm256_set1_ps(x); }
static inline vfloat vmul(vfloat a, vfloat b) { return _mm256_mul_ps(a, b); }
static inline vfloat vfmadd(vfloat a, vfloat b, vfloat c) { return _mm256_fmadd_ps(a, b, c); }
static inline void vstore(float* p, vfloat v) { _mm256_storeu_ps(p, v); }
static inline void vstore_aligned(float* p, vfloat v) { _mm256_store_ps(p, v); }

static inline vfloat load_lanes(const float* p) { return _mm256_loadu_ps(p); }
static inline vfloat load_lanes(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
static inline vfloat load_lanes(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
// fp8 as in the AVX-512 loads above: 8 bytes widened to fp16's places
static inline __m128i widen_bytes(const void* p) {
  return _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
static inline vfloat load_lanes(const c10::Float8_e5m2* p) { return _mm256_cvtph_ps(_mm_slli_epi16(widen_bytes(p), 8)); }
static inline vfloat load_lanes(const c10::Float8_e4m3fn* p) {
  const __m128i bytes = widen_bytes(p);
  const __m128i half = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(bytes, _mm_set1_epi16(0x80)), 8),
                                    _mm_slli_epi16(_mm_and_si128(bytes, _mm_set1_epi16(0x7F)), 7));
  return _mm256_mul_ps(_mm256_cvtph_ps(half), _mm256_set1_ps(256.f));
}

// v[t] holds 8 partial sums of key t's score; returns the 8 scores, lane t = the sum of v[t]: three rounds of
// pairwise adds within 128-bit lanes, then the two lanes' halves added.
static inline vfloat transpose_reduce(const vfloat* v) {
  const __m256 q0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 q1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(q0, q1, 0x20), _mm256_permute2f128_ps(q0, q1, 0x31));
}

// With 16 registers a pass over the values holds one query head's accumulators, at most 10 (head_dim 128 takes
// two passes of 64 values), beside the row's loads and the head's weight. Measured on the engine's own pool (Zen 3,
// fp32, 30 layers): three heads of 32 values a pass, and key scores summed in two chains, were faster in cache but
// no faster over the pool (27.6 against 24.9 ms at 48 rows of 250 keys; 11.8 against 9.6 ms at one of 2,000).
template <int64_t kHeadDim>
constexpr int kHeadsPerPass = 1;
template <int64_t kHeadDim>
constexpr int64_t kVecsPerPass = kHeadDim / 8 <= 10 ? kHeadDim / 8 : kHeadDim / 16;
#endif

#if defined(PAGED_DECODE_VECTORS)
// Element offsets of a sequence's rows in the pool, in order, through its block table.
struct BlockWalk {
  const int64_t* table;
  int64_t block_size, row_elems, offset = 0, block = 0;
  BlockWalk(const int64_t* t, int64_t bs, int64_t re) : table(t), block_size(bs), row_elems(re) {}
  int64_t next() {
    if (offset == block_size) { offset = 0; ++block; }
    return (table[block] * block_size + offset++) * row_elems;
  }
};

// Ask for a row's cache lines ahead of use: blocks are 2 KB runs scattered over a cold pool, where the hardware
// prefetcher barely helps (measured: 9.7 GB/s of a 43.6 GB/s read bandwidth without this).
template <int64_t kRowBytes>
static inline void prefetch_row(const void* row) {
  for (int64_t b = 0; b < kRowBytes; b += 64) _mm_prefetch(static_cast<const char*>(row) + b, _MM_HINT_T0);
}
constexpr int64_t kPrefetchRows = 32;  // 16: 33.0 ms, 32: 27.3 ms, 64: 28.4 ms for 30 cold layers

// How a query group is held, and one key row scored against it, per pool dtype: by default the query is widened to
// fp32 with the scale folded in, and so is each K row, once, in registers, shared by the group.
template <typename cache_t, int64_t kHeadDim>
struct KeyRowScorer {
  static constexpr int64_t kVecs = kHeadDim / kFloatLanes;
  vfloat* qv;
  int64_t group;
  float scale_after = 1.f;

  template <typename q_t>  // the pool's dtype, or any where the pool is fp8
  KeyRowScorer(const q_t* q_group, int64_t group, float scale, vfloat* room) : qv(room), group(group) {
    for (int64_t i = 0; i < group * kVecs; ++i) qv[i] = vmul(load_lanes(q_group + i * kFloatLanes), vset1(scale));
  }
  // partial[g * kFloatLanes]: head g's lane sums against the row at kp
  void operator()(const cache_t* kp, vfloat* partial) const {
    vfloat k[kVecs];
    for (int64_t i = 0; i < kVecs; ++i) k[i] = load_lanes(kp + i * kFloatLanes);
    for (int64_t g = 0; g < group; ++g) {
      vfloat sum = vmul(qv[g * kVecs], k[0]);
      for (int64_t i = 1; i < kVecs; ++i) sum = vfmadd(qv[g * kVecs + i], k[i], sum);
      partial[g * kFloatLanes] = sum;
    }
  }
};

#if defined(__AVX512BF16__)
// A bf16 pool where the CPU has AVX512_BF16: vdpbf16ps multiplies bf16 pairs exactly and sums them in fp32, so K
// is never widened (half the instructions per key); the scale goes on the summed scores.
template <>
struct KeyRowScorer<c10::BFloat16, 64> {
  __m512bh* qv;  // 2 per head, in the caller's room for 4 widened vectors a head
  int64_t group;
  float scale_after;

  KeyRowScorer(const c10::BFloat16* q_group, int64_t group, float scale, __m512* room)
      : qv(reinterpret_cast<__m512bh*>(room)), group(group), scale_after(scale) {
    for (int64_t i = 0; i < 2 * group; ++i) qv[i] = (__m512bh)_mm512_loadu_si512(q_group + i * 32);
  }
  void operator()(const c10::BFloat16* kp, __m512* partial) const {
    const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kp), k1 = (__m512bh)_mm512_loadu_si512(kp + 32);
    for (int64_t g = 0; g < group; ++g)
      partial[g * 16] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), qv[2 * g], k0), qv[2 * g + 1], k1);
  }
};
#endif

// Scores of a group's query heads, a vector's lanes of keys at a time, scaled: scores[g * padded + t].
template <typename scalar_t, typename cache_t, int64_t kHeadDim>
static void key_scores(const scalar_t* q_group, const cache_t* k_head, BlockWalk rows, int64_t len, int64_t group,
                       float scale, vfloat* q_room, vfloat* partial, float* scores, int64_t padded) {
  constexpr int64_t kRowBytes = kHeadDim * sizeof(cache_t);
  const KeyRowScorer<cache_t, kHeadDim> score(q_group, group, scale, q_room);
  const vfloat scale_after = vset1(score.scale_after);
  BlockWalk ahead = rows;
  for (int64_t t = 0; t < std::min(len, kPrefetchRows); ++t) prefetch_row<kRowBytes>(k_head + ahead.next());
  for (int64_t first = 0; first < len; first += kFloatLanes) {
    for (int64_t j = 0; j < kFloatLanes; ++j) {
      if (first + j >= len) {
        for (int64_t g = 0; g < group; ++g) partial[g * kFloatLanes + j] = vzero();
        continue;
      }
      if (first + j + kPrefetchRows < len) prefetch_row<kRowBytes>(k_head + ahead.next());
      score(k_head + rows.next(), partial + j);
    }
    for (int64_t g = 0; g < group; ++g)
      vstore(scores + g * padded + first, vmul(scale_after, transpose_reduce(&partial[g * kFloatLanes])));
  }
}

// out[g] = sum over t of scores[g * padded + t] * V[t], for kChunk query heads at once and the first kVecsPerPass
// vectors of head_dim from v_head and out on: the accumulators stay in registers (a loop over a run-time group kept
// them in memory, one store-to-load chain per key).
template <typename scalar_t, int64_t kHeadDim, int kChunk, typename out_t = scalar_t>
static void weighted_values(const scalar_t* v_head, BlockWalk rows, int64_t len, const float* scores, int64_t padded,
                            out_t* out) {
  constexpr int64_t kVecs = kVecsPerPass<kHeadDim>, kPassBytes = kVecs * kFloatLanes * sizeof(scalar_t);
  vfloat acc[kChunk][kVecs];
  for (int g = 0; g < kChunk; ++g)
    for (int64_t i = 0; i < kVecs; ++i) acc[g][i] = vzero();
  BlockWalk ahead = rows;
  for (int64_t t = 0; t < std::min(len, kPrefetchRows); ++t) prefetch_row<kPassBytes>(v_head + ahead.next());
  for (int64_t t = 0; t < len; ++t) {
    if (t + kPrefetchRows < len) prefetch_row<kPassBytes>(v_head + ahead.next());
    const scalar_t* vp = v_head + rows.next();
    vfloat v[kVecs];
    for (int64_t i = 0; i < kVecs; ++i) v[i] = load_lanes(vp + i * kFloatLanes);
    for (int g = 0; g < kChunk; ++g) {
      const vfloat p = vset1(scores[g * padded + t]);
      for (int64_t i = 0; i < kVecs; ++i) acc[g][i] = vfmadd(p, v[i], acc[g][i]);
    }
  }
  alignas(64) float lanes[kFloatLanes];
  for (int g = 0; g < kChunk; ++g)
    for (int64_t i = 0; i < kVecs; ++i) {
      vstore_aligned(lanes, acc[g][i]);
      for (int64_t d = 0; d < kFloatLanes; ++d) out[g * kHeadDim + i * kFloatLanes + d] = static_cast<out_t>(lanes[d]);
    }
}

// Room one thread reuses across decode tasks: the query group in registers' layout, partial sums, scores.
struct DecodeRoom {
  std::vector<vfloat> qv, partial;
  std::vector<float> scores;
  DecodeRoom(int64_t group, int64_t head_dim) : qv(group * (head_dim / kFloatLanes)), partial(group * kFloatLanes) {}
};

// One layer's decode attention: query [B, heads, D], caches [kv_heads, num_blocks, block_size, D], out like query.
// The caches hold the query's dtype, or fp8 (cache_t).
template <typename scalar_t, typename cache_t>
struct DecodeArgs {
  const scalar_t* q;
  const cache_t *k_cache, *v_cache;
  const int64_t *block_tables, *context_lens;
  scalar_t* out;
  int64_t heads, kv_heads, num_blocks, block_size, max_blocks;
  float scale;
  int64_t group() const { return heads / kv_heads; }
};

// A context's keys in parts of this many, each part a work item, merged after (vLLM's paged attention v2 splits by
// 512 too): one sequence's 3 KV heads on 2 threads left one thread idle a third of the attention (one row, 30
// layers, bf16: 3.15 -> 2.55 ms at 3,000 keys, 1.56 -> 1.38 at 1,500; 4 rows unchanged; 1,024-key parts gained
// half as much). A fixed size, not one fitted to the batch, so a sequence's numbers never depend on its batch.
constexpr int64_t kKeysPerPart = 512;

// A step's items: item i is part (i - first[task]) of task (sequence task / kv_heads, KV head task % kv_heads).
struct DecodeSplit {
  std::vector<int64_t> first;
  DecodeSplit(const int64_t* context_lens, int64_t batch, int64_t kv_heads) : first(batch * kv_heads + 1, 0) {
    for (int64_t task = 0; task < batch * kv_heads; ++task)
      first[task + 1] = first[task] + (context_lens[task / kv_heads] + kKeysPerPart - 1) / kKeysPerPart;
  }
  int64_t tasks() const { return static_cast<int64_t>(first.size()) - 1; }
  int64_t items() const { return first.back(); }
  bool any_split() const { return items() > tasks(); }
  bool split(int64_t task) const { return first[task + 1] - first[task] > 1; }
  int64_t task_of(int64_t item) const {
    return std::upper_bound(first.begin(), first.end(), item) - first.begin() - 1;
  }
};

// A split part's result per query head: its unnormalized weighted values [group][D], then its score peaks [group]
// and its sums of exp(score - peak) [group].
template <int64_t kHeadDim>
constexpr int64_t part_floats(int64_t group) { return group * (kHeadDim + 2); }

// The weighted values of a group's query heads over keys [first, first + len), in passes whose accumulators fit
// the registers (kHeadsPerPass heads, kVecsPerPass vectors of head_dim); `scores` already weights (normalized or
// not), `out` [group][D].
template <typename scalar_t, int64_t kHeadDim, typename out_t>
static void group_values(const scalar_t* v_head, BlockWalk rows, int64_t len, const float* scores, int64_t padded,
                         int64_t group, out_t* out) {
  constexpr int kMaxChunk = kHeadsPerPass<kHeadDim>;
  for (int64_t g = 0; g < group; g += kMaxChunk) {
    const float* s = scores + g * padded;
    out_t* o = out + g * kHeadDim;
    for (int64_t first = 0; first < kHeadDim; first += kVecsPerPass<kHeadDim> * kFloatLanes) {
      const scalar_t* v = v_head + first;
      switch (std::min<int64_t>(kMaxChunk, group - g)) {
        case 1: weighted_values<scalar_t, kHeadDim, 1>(v, rows, len, s, padded, o + first); break;
        case 2: weighted_values<scalar_t, kHeadDim, std::min(2, kMaxChunk)>(v, rows, len, s, padded, o + first); break;
        case 3: weighted_values<scalar_t, kHeadDim, std::min(3, kMaxChunk)>(v, rows, len, s, padded, o + first); break;
        default: weighted_values<scalar_t, kHeadDim, std::min(4, kMaxChunk)>(v, rows, len, s, padded, o + first); break;
      }
    }
  }
}

// Part `part` of a task (all of it when part < 0): scores of its query-head group over those keys, then either the
// softmax and the output (whole) or the part's values, peaks and sums (part_out, see part_floats).
template <typename scalar_t, typename cache_t, int64_t kHeadDim>
static void decode_keys(int64_t task, int64_t part, const DecodeArgs<scalar_t, cache_t>& a, float* part_out,
                        DecodeRoom& room) {
  const int64_t group = a.group(), head_stride = a.num_blocks * a.block_size * kHeadDim;
  const int64_t b = task / a.kv_heads, kvh = task % a.kv_heads, first_head = b * a.heads + kvh * group;
  const int64_t first = part < 0 ? 0 : part * kKeysPerPart;
  const int64_t len = part < 0 ? a.context_lens[b] : std::min(kKeysPerPart, a.context_lens[b] - first);
  BlockWalk rows(a.block_tables + b * a.max_blocks, a.block_size, kHeadDim);
  rows.block = first / a.block_size;
  rows.offset = first % a.block_size;
  const int64_t padded = (len + kFloatLanes - 1) / kFloatLanes * kFloatLanes;
  room.scores.resize(group * padded);
  float* scores = room.scores.data();
  key_scores<scalar_t, cache_t, kHeadDim>(a.q + first_head * kHeadDim, a.k_cache + kvh * head_stride, rows, len, group,
                                          a.scale, room.qv.data(), room.partial.data(), scores, padded);
  const cache_t* v_head = a.v_cache + kvh * head_stride;
  if (part < 0) {
    for (int64_t g = 0; g < group; ++g) softmax(scores + g * padded, len);
    return group_values<cache_t, kHeadDim>(v_head, rows, len, scores, padded, group, a.out + first_head * kHeadDim);
  }
  float *peaks = part_out + group * kHeadDim, *sums = peaks + group;
  for (int64_t g = 0; g < group; ++g) sums[g] = exp_in_place(scores + g * padded, len, peaks + g);
  group_values<cache_t, kHeadDim>(v_head, rows, len, scores, padded, group, part_out);
}

// One item of a step's split: a whole task, or one part of a split one into `parts` (items x part_floats).
template <typename scalar_t, typename cache_t, int64_t kHeadDim>
static void decode_item(int64_t item, const DecodeSplit& split, const DecodeArgs<scalar_t, cache_t>& a, float* parts,
                        DecodeRoom& room) {
  const int64_t task = split.task_of(item);
  if (!split.split(task)) return decode_keys<scalar_t, cache_t, kHeadDim>(task, -1, a, nullptr, room);
  decode_keys<scalar_t, cache_t, kHeadDim>(task, item - split.first[task], a,
                                           parts + item * part_floats<kHeadDim>(a.group()), room);
}

// A split task's output from its parts: each part's values and sum rescaled by exp(its peak - the highest peak).
template <typename scalar_t, typename cache_t, int64_t kHeadDim>
static void merge_parts(int64_t task, const DecodeSplit& split, const DecodeArgs<scalar_t, cache_t>& a,
                        const float* parts) {
  const int64_t group = a.group(), stride = part_floats<kHeadDim>(group);
  const int64_t count = split.first[task + 1] - split.first[task];
  const float* base = parts + split.first[task] * stride;
  scalar_t* out = a.out + ((task / a.kv_heads) * a.heads + (task % a.kv_heads) * group) * kHeadDim;
  for (int64_t g = 0; g < group; ++g) {
    float peak = -std::numeric_limits<float>::infinity(), total = 0.f, acc[kHeadDim] = {};
    for (int64_t p = 0; p < count; ++p) peak = std::max(peak, base[p * stride + group * kHeadDim + g]);
    for (int64_t p = 0; p < count; ++p) {
      const float* part = base + p * stride;
      const float weight = std::exp(part[group * kHeadDim + g] - peak);
      total += weight * part[group * kHeadDim + group + g];
      for (int64_t d = 0; d < kHeadDim; ++d) acc[d] += weight * part[g * kHeadDim + d];
    }
    for (int64_t d = 0; d < kHeadDim; ++d) out[g * kHeadDim + d] = static_cast<scalar_t>(acc[d] / total);
  }
}

template <typename scalar_t, typename cache_t, int64_t kHeadDim>
static void decode_vectors(const scalar_t* q, const cache_t* k_cache, const cache_t* v_cache,
                           const int64_t* block_tables, const int64_t* context_lens, scalar_t* out, int64_t batch,
                           int64_t heads, int64_t kv_heads, int64_t, int64_t num_blocks, int64_t block_size, int64_t max_blocks, float scale) {
  const DecodeArgs<scalar_t, cache_t> args{q, k_cache, v_cache, block_tables, context_lens, out, heads, kv_heads,
                                           num_blocks, block_size, max_blocks, scale};
  const DecodeSplit split(context_lens, batch, kv_heads);
  std::vector<float> parts(split.any_split() ? split.items() * part_floats<kHeadDim>(args.group()) : 0);
  at::parallel_for(0, split.items(), 1, [&](int64_t begin, int64_t end) {
    DecodeRoom room(args.group(), kHeadDim);
    for (int64_t item = begin; item < end; ++item)
      decode_item<scalar_t, cache_t, kHeadDim>(item, split, args, parts.data(), room);
  });
  if (!split.any_split()) return;
  at::parallel_for(0, split.tasks(), 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task)
      if (split.split(task)) merge_parts<scalar_t, cache_t, kHeadDim>(task, split, args, parts.data());
  });
}
#endif

// The kernel trusts the tables it reads: a bookkeeping bug would read another request's cache, or past the pool.
// A few compares a block per call (the used part of each row) make it an error instead.
static void check_block_tables(const int64_t* table, int64_t width, const int64_t* len, int64_t batch,
                               int64_t num_blocks, int64_t block_size) {
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(len[b] >= 1 && len[b] <= width * block_size, "context length ", len[b], " outside its block table");
    for (int64_t j = 0, used = (len[b] + block_size - 1) / block_size; j < used; ++j)
      TORCH_CHECK(table[b * width + j] >= 0 && table[b * width + j] < num_blocks, "block id ", table[b * width + j],
                  " outside the pool of ", num_blocks);
  }
}

// The pool's element type where it is fp8 (kv_cache_dtype), for the dispatch below.
template <typename Fn>
static void with_fp8_cache(at::ScalarType pool, Fn&& fn) {
  if (pool == at::kFloat8_e4m3fn) return fn(static_cast<const c10::Float8_e4m3fn*>(nullptr));
  fn(static_cast<const c10::Float8_e5m2*>(nullptr));
}

static bool is_fp8(at::ScalarType type) { return type == at::kFloat8_e4m3fn || type == at::kFloat8_e5m2; }

// query [B, heads, D]; caches [kv_heads, num_blocks, block_size, D] of the query's dtype or fp8; block_tables
// [B, max_blocks]; context_lens [B]
at::Tensor paged_decode(at::Tensor query, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
                        at::Tensor context_lens, double scale) {
  TORCH_CHECK(query.device().is_cpu() && k_cache.device().is_cpu(), "paged_decode runs on CPU tensors");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the KV pool must be contiguous");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "K and V pools must share a dtype");
  const bool fp8 = is_fp8(k_cache.scalar_type());
  TORCH_CHECK(fp8 || query.scalar_type() == k_cache.scalar_type(),
              "query and KV pool must share a dtype, or the pool be fp8");
  TORCH_CHECK(!fp8 || query.scalar_type() != at::kDouble, "an fp8 pool takes fp32, bf16 or fp16 queries");
  auto q = query.contiguous();
  auto tables = block_tables.to(at::kLong).contiguous();
  auto lens = context_lens.to(at::kLong).contiguous();
  auto out = at::empty_like(q);
  const int64_t batch = q.size(0), heads = q.size(1), head_dim = q.size(2);
  const int64_t kv_heads = k_cache.size(0), num_blocks = k_cache.size(1), block_size = k_cache.size(2);
  TORCH_CHECK(heads % kv_heads == 0, "heads must be a multiple of kv_heads");
  TORCH_CHECK(tables.size(0) == batch && lens.size(0) == batch, "one block table and one context length per sequence");
  check_block_tables(tables.data_ptr<int64_t>(), tables.size(1), lens.data_ptr<int64_t>(), batch, num_blocks,
                     block_size);
  ReleaseGil no_gil;  // other Python threads (the replica's event loop) run meanwhile
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    auto on_pool = [&](auto pool_tag) {
      using cache_t = std::remove_const_t<std::remove_pointer_t<decltype(pool_tag)>>;
      auto run = [&](auto kernel) {
        kernel(q.data_ptr<scalar_t>(), static_cast<const cache_t*>(k_cache.data_ptr()),
               static_cast<const cache_t*>(v_cache.data_ptr()), tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(),
               out.data_ptr<scalar_t>(), batch, heads, kv_heads, head_dim, num_blocks, block_size, tables.size(1),
               static_cast<float>(scale));
      };
#if defined(PAGED_DECODE_VECTORS)
      if constexpr (!std::is_same_v<scalar_t, double>) {
        if (head_dim == 64) return run(decode_vectors<scalar_t, cache_t, 64>);
        if (head_dim == 80) return run(decode_vectors<scalar_t, cache_t, 80>);
        if (head_dim == 128) return run(decode_vectors<scalar_t, cache_t, 128>);
      }
#endif
      if (head_dim == 64) run(decode_impl<scalar_t, cache_t, 64>);
      else if (head_dim == 128) run(decode_impl<scalar_t, cache_t, 128>);
      else run(decode_impl<scalar_t, cache_t, 0>);
    };
    if constexpr (std::is_same_v<scalar_t, double>) {
      on_pool(static_cast<const scalar_t*>(nullptr));
    } else if (fp8) {
      with_fp8_cache(k_cache.scalar_type(), on_pool);
    } else {
      on_pool(static_cast<const scalar_t*>(nullptr));
    }
  });
  return out;
}
