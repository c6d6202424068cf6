// y = x W^T with W kept in GGUF's block formats (32 weights per block), read at their own size and dequantized in
// registers to the exact fp32 value the file holds (q*d is exact in fp32; one rounding for +m, as in the reference).
//   q4: W[n, 32g + j] = q*d + m, q a nibble: byte j of a block holds element j (low) and element j + 16 (high).
//   q8: W[n, 32g + j] = q*d, q an int8.
// fp32 accumulation. AVX-512 and AVX2 intrinsics, chosen by the CPU it is built on (-march=native, see cpu_kernels.py),
// and a plain loop elsewhere; small row counts are where it runs: larger ones go to a dense matmul. These read the
// file's layout; on AVX-512 and AVX2, matrices of whole 16-row groups are interleaved at load and run by
// interleaved_matmul_cpu.cpp instead. The portable path and AVX-512 on the file's layout take fp32 activations (the
// dequantized fp32 matmul within fp32 rounding); the AVX2 path and the interleaved one round them to 16 bits per
// block (below), an error of at most 2^-16 of a block's largest activation.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlock = 32;
constexpr int kRowTile = 4;  // x rows sharing one dequantized block: 4 x 32 accumulators fit the registers

// f(std::integral_constant<int, r>{}) with r = rows (1..kMax): the row count of a tile as a compile-time constant,
// so a kernel's per-row accumulators stay in registers.
template <int kMax, typename F>
inline void with_rows(int64_t rows, F&& f) {
  if constexpr (kMax > 1) {
    if (rows < kMax) return with_rows<kMax - 1>(rows, std::forward<F>(f));
  }
  f(std::integral_constant<int, kMax>{});
}

struct Q4Block {
  static void dequantize(const uint8_t* q, float d, float m, float* w) {
#pragma omp simd
    for (int j = 0; j < 16; ++j) {
      w[j] = static_cast<float>(q[j] & 15) * d + m;
      w[j + 16] = static_cast<float>(q[j] >> 4) * d + m;
    }
  }
  static constexpr int64_t bytes = 16;
};

struct Q8Block {
  static void dequantize(const uint8_t* q, float d, float, float* w) {
    const int8_t* s = reinterpret_cast<const int8_t*>(q);
#pragma omp simd
    for (int j = 0; j < 32; ++j) w[j] = static_cast<float>(s[j]) * d;
  }
  static constexpr int64_t bytes = 32;
};

// fp32 activations, read in place (the portable and AVX-512 paths).
struct FloatRows {
  const float* x;
  int64_t k;
  FloatRows from(int64_t r0) const { return {x + r0 * k, k}; }
};

struct FloatActivations {
  at::Tensor x;
  explicit FloatActivations(const at::Tensor& x) : x(x) {}
  FloatRows rows() const { return {x.data_ptr<float>(), x.size(1)}; }
};

// One output row n against ROWS rows of x; ROWS is a compile-time constant so the accumulators stay in registers.
template <typename Block, int ROWS>
inline void row_dot(const uint8_t* q, const float* d, const float* m, const FloatRows& x, int64_t k, float* out,
                    int64_t out_stride) {
  float acc[ROWS][kBlock] = {};
  alignas(64) float w[kBlock];
  for (int64_t g = 0; g < k / kBlock; ++g) {
    Block::dequantize(q + g * Block::bytes, d[g], m ? m[g] : 0.f, w);
    for (int r = 0; r < ROWS; ++r) {
      const float* xr = x.x + r * k + g * kBlock;
#pragma omp simd
      for (int j = 0; j < kBlock; ++j) acc[r][j] += w[j] * xr[j];
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    float total = 0.f;
#pragma omp simd reduction(+ : total)
    for (int j = 0; j < kBlock; ++j) total += acc[r][j];
    out[r * out_stride] = total;
  }
}

#if defined(__AVX2__) && defined(__FMA__)
// Activations rounded to 16-bit integers per 32-element block (the AVX2 path below, and the AVX-512 path over
// interleaved rows): x = code * scale with scale = the block's largest |x| / 32767, so |error| <= scale / 2.
struct Int16Rows {
  const int16_t* codes;
  const float* scales;
  const float* sums;
  int64_t k;
  Int16Rows from(int64_t r0) const {
    return {codes + r0 * k, scales + r0 * (k / kBlock), sums + r0 * (k / kBlock), k};
  }
};

inline float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

inline float horizontal_max(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

// One 32-element block of x to int16 codes (round to nearest), its scale and its exact sum.
inline void round_block(const float* x, int16_t* codes, float* scale, float* sum) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 v[4], amax = _mm256_setzero_ps(), total = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
    total = _mm256_add_ps(total, v[i]);
  }
  const float top = horizontal_max(amax);
  *scale = top / 32767.f;
  *sum = horizontal_sum(total);
  const __m256 inverse = _mm256_set1_ps(top > 0.f ? 32767.f / top : 0.f);
  for (int i = 0; i < 4; i += 2) {
    const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inverse));
    const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(v[i + 1], inverse));
    // packs interleaves 128-bit lanes (a0-3 b0-3 a4-7 b4-7); the permute puts them back in order
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + 8 * i), packed);
  }
}

// `blocks` consecutive 32-element blocks of x rounded; block b's codes at codes + 32 b, its scale and sum at [b].
inline void round_blocks(const float* x, int64_t blocks, int16_t* codes, float* scales, float* sums) {
  for (int64_t b = 0; b < blocks; ++b) round_block(x + b * kBlock, codes + b * kBlock, scales + b, sums + b);
}

// Owns the rounded activations for one call (plain vectors: a torch allocation costs more, 211 calls a step).
struct Int16Activations {
  int64_t k;
  std::vector<int16_t> codes;
  std::vector<float> scales, sums;
  explicit Int16Activations(const at::Tensor& x)
      : k(x.size(1)), codes(x.numel()), scales(x.numel() / kBlock), sums(x.numel() / kBlock) {
    round_blocks(x.data_ptr<float>(), static_cast<int64_t>(scales.size()), codes.data(), scales.data(), sums.data());
  }
  Int16Rows rows() const { return {codes.data(), scales.data(), sums.data(), k}; }
};
#endif

#if defined(__AVX512F__)
// The same in AVX-512 registers: a block is two 16-lane vectors, dequantized once and shared by the ROWS rows.
struct Q4Vec {
  static inline void dequantize(const uint8_t* q, float d, float m, __m512& lo, __m512& hi) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
    const __m128i mask = _mm_set1_epi8(15);
    const __m512 vd = _mm512_set1_ps(d), vm = _mm512_set1_ps(m);
    lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(bytes, mask))), vd, vm);
    hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask))), vd, vm);
  }
};

struct Q8Vec {
  static inline void dequantize(const uint8_t* q, float d, float, __m512& lo, __m512& hi) {
    const __m512 vd = _mm512_set1_ps(d);
    lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)))), vd);
    hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16)))), vd);
  }
};

template <typename Block> struct VecOf;
template <> struct VecOf<Q4Block> { using type = Q4Vec; };
template <> struct VecOf<Q8Block> { using type = Q8Vec; };

template <typename Block, int ROWS>
inline void row_dot_avx512(const uint8_t* q, const float* d, const float* m, const FloatRows& x, int64_t k, float* out,
                           int64_t out_stride) {
  __m512 acc[ROWS][2];
  for (int r = 0; r < ROWS; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t g = 0; g < k / kBlock; ++g) {
    if (g + 8 < k / kBlock) _mm_prefetch(reinterpret_cast<const char*>(q + (g + 8) * Block::bytes), _MM_HINT_T0);
    __m512 lo, hi;
    VecOf<Block>::type::dequantize(q + g * Block::bytes, d[g], m ? m[g] : 0.f, lo, hi);
    for (int r = 0; r < ROWS; ++r) {
      const float* xr = x.x + r * k + g * kBlock;
      acc[r][0] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xr), acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xr + 16), acc[r][1]);
    }
  }
  for (int r = 0; r < ROWS; ++r) out[r * out_stride] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
}
using Activations = FloatActivations;
#define ROW_DOT row_dot_avx512
#elif defined(__AVX2__) && defined(__FMA__)
// AVX2 (CPUs without AVX-512): the weights stay exact, but the activations are rounded to 16-bit integers per
// 32-element block (x = code * amax/32767, |error| <= amax/65534), so a block is two integer multiply-adds
// (`vpmaddwd`) instead of four fp32 conversions and FMAs: 1.6x faster at one row on a Zen 1 EPYC, where 256-bit
// conversions are split in two (llama.cpp rounds them to 8 bits, which is faster still but a bf16-like error).
// Each block's exact fp32 sum of x carries Q4_1's `m` term: sum_j (q_j d + m) x_j = d sum_j q_j x_j + m sum_j x_j.

// A block's 32 weight codes as two vectors of 16 int16 (elements 0-15, 16-31), in x's order.
inline void q4_widen(const uint8_t* q, __m256i w[2]) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  const __m128i mask = _mm_set1_epi8(15);
  w[0] = _mm256_cvtepu8_epi16(_mm_and_si128(bytes, mask));
  w[1] = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask));
}

inline void q8_widen(const uint8_t* q, __m256i w[2]) {
  w[0] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
  w[1] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16)));
}

// |code products| sum to at most 4 * 128 * 32767 < 2^24 per lane: the int32 sum and its fp32 conversion are exact.
template <typename Block, int ROWS>
inline void row_dot_avx2(const uint8_t* q, const float* d, const float* m, const Int16Rows& x, int64_t k, float* out,
                         int64_t out_stride) {
  const int64_t groups = k / kBlock;
  __m256 acc[ROWS];
  for (int r = 0; r < ROWS; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256i w[2];
    if constexpr (Block::bytes == 16) q4_widen(q + g * Block::bytes, w);
    else q8_widen(q + g * Block::bytes, w);
    for (int r = 0; r < ROWS; ++r) {
      const int16_t* xr = x.codes + r * k + g * kBlock;
      const __m256i products = _mm256_add_epi32(
          _mm256_madd_epi16(w[0], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr))),
          _mm256_madd_epi16(w[1], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr + 16))));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(products), _mm256_set1_ps(d[g] * x.scales[r * groups + g]), acc[r]);
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    float mins = 0.f;
    if (m) {
      const float* sums = x.sums + r * groups;
#pragma omp simd reduction(+ : mins)
      for (int64_t g = 0; g < groups; ++g) mins += m[g] * sums[g];
    }
    out[r * out_stride] = horizontal_sum(acc[r]) + mins;
  }
}

using Activations = Int16Activations;
#define ROW_DOT row_dot_avx2
#else
using Activations = FloatActivations;
#define ROW_DOT row_dot
#endif

template <typename Block>
at::Tensor block_matmul(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
                        const c10::optional<at::Tensor>& mins) {
  TORCH_CHECK(q.scalar_type() == at::kByte && q.is_contiguous(), "q must be contiguous uint8");
  const int64_t m_rows = x.size(0), k = x.size(1), n = q.size(0);
  TORCH_CHECK(q.size(1) == k / kBlock * Block::bytes, "q must be [N, K/32 blocks]");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.size(1) == k / kBlock);
  const Activations activations(x.contiguous());
  const auto rows = activations.rows();
  auto y = at::empty({m_rows, n}, x.options());
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const float* dp = scales.data_ptr<float>();
  const float* mp = mins ? mins->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t groups = k / kBlock, row_bytes = groups * Block::bytes;
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      for (int64_t r0 = 0; r0 < m_rows; r0 += kRowTile) {
        with_rows<kRowTile>(std::min<int64_t>(kRowTile, m_rows - r0), [&](auto tile) {
          ROW_DOT<Block, decltype(tile)::value>(qp + row * row_bytes, dp + row * groups, mp ? mp + row * groups : nullptr,
                                                rows.from(r0), k, yp + r0 * n + row, n);
        });
      }
    }
  });
  return y;
}

}  // namespace
