// y = x W^T with W kept in GGUF's block formats (32 weights per block), read at their own size and dequantized in
// registers to the exact fp32 value the file holds (q*d is exact in fp32; one rounding for +m, as in the reference).
//   q4: W[n, 32g + j] = q*d + m, q a nibble: byte j of a block holds element j (low) and element j + 16 (high).
//   q8: W[n, 32g + j] = q*d, q an int8.
// fp32 activations and accumulation. AVX-512 and AVX2 intrinsics, chosen by the CPU it is built on (-march=native,
// see cpu_kernels.py), and a plain loop elsewhere; small row counts are where it runs: larger ones go to a dense matmul.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kRowTile = 4;  // x rows sharing one dequantized block: 4 x 32 accumulators fit the registers

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

// One output row n against ROWS rows of x; ROWS is a compile-time constant so the accumulators stay in registers.
template <typename Block, int ROWS>
inline void row_dot(const uint8_t* q, const float* d, const float* m, const float* x, int64_t k, float* out,
                    int64_t out_stride) {
  float acc[ROWS][kBlock] = {};
  alignas(64) float w[kBlock];
  for (int64_t g = 0; g < k / kBlock; ++g) {
    Block::dequantize(q + g * Block::bytes, d[g], m ? m[g] : 0.f, w);
    for (int r = 0; r < ROWS; ++r) {
      const float* xr = x + r * k + g * kBlock;
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
inline void row_dot_avx512(const uint8_t* q, const float* d, const float* m, const float* x, int64_t k, float* out,
                           int64_t out_stride) {
  __m512 acc[ROWS][2];
  for (int r = 0; r < ROWS; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t g = 0; g < k / kBlock; ++g) {
    if (g + 8 < k / kBlock) _mm_prefetch(reinterpret_cast<const char*>(q + (g + 8) * Block::bytes), _MM_HINT_T0);
    __m512 lo, hi;
    VecOf<Block>::type::dequantize(q + g * Block::bytes, d[g], m ? m[g] : 0.f, lo, hi);
    for (int r = 0; r < ROWS; ++r) {
      const float* xr = x + r * k + g * kBlock;
      acc[r][0] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xr), acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xr + 16), acc[r][1]);
    }
  }
  for (int r = 0; r < ROWS; ++r) out[r * out_stride] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
}
#define ROW_DOT row_dot_avx512
#elif defined(__AVX2__) && defined(__FMA__)
// AVX2 (CPUs without AVX-512): a block is four 8-lane vectors; the same arithmetic, so the same values.
inline void q4_dequantize8(const uint8_t* q, float d, float m, __m256 w[4]) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  const __m128i mask = _mm_set1_epi8(15);
  const __m128i lo = _mm_and_si128(bytes, mask), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
  const __m256 vd = _mm256_set1_ps(d), vm = _mm256_set1_ps(m);
  const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
  for (int i = 0; i < 4; ++i) w[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[i])), vd, vm);
}

inline void q8_dequantize8(const uint8_t* q, float d, float, __m256 w[4]) {
  const __m256 vd = _mm256_set1_ps(d);
  for (int i = 0; i < 4; ++i) {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * i));
    w[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), vd);
  }
}

template <typename Block, int ROWS>
inline void row_dot_avx2(const uint8_t* q, const float* d, const float* m, const float* x, int64_t k, float* out,
                         int64_t out_stride) {
  __m256 acc[ROWS][2];
  for (int r = 0; r < ROWS; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < k / kBlock; ++g) {
    __m256 w[4];
    if constexpr (Block::bytes == 16) q4_dequantize8(q + g * Block::bytes, d[g], m[g], w);
    else q8_dequantize8(q + g * Block::bytes, d[g], 0.f, w);
    for (int r = 0; r < ROWS; ++r) {
      const float* xr = x + r * k + g * kBlock;
      acc[r][0] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xr), acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xr + 8), acc[r][1]);
      acc[r][0] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xr + 16), acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xr + 24), acc[r][1]);
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, _mm256_add_ps(acc[r][0], acc[r][1]));
    float total = 0.f;
    for (float lane : lanes) total += lane;
    out[r * out_stride] = total;
  }
}
#define ROW_DOT row_dot_avx2
#else
#define ROW_DOT row_dot
#endif

template <typename Block>
inline void row_dot_any(int64_t rows, const uint8_t* q, const float* d, const float* m, const float* x, int64_t k,
                        float* out, int64_t out_stride) {
  switch (rows) {
    case 1: return ROW_DOT<Block, 1>(q, d, m, x, k, out, out_stride);
    case 2: return ROW_DOT<Block, 2>(q, d, m, x, k, out, out_stride);
    case 3: return ROW_DOT<Block, 3>(q, d, m, x, k, out, out_stride);
    default: return ROW_DOT<Block, 4>(q, d, m, x, k, out, out_stride);
  }
}

template <typename Block>
torch::Tensor block_matmul(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scales,
                           const c10::optional<torch::Tensor>& mins) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat, "x must be [M, K] float32");
  TORCH_CHECK(q.scalar_type() == torch::kUInt8 && q.is_contiguous(), "q must be contiguous uint8");
  const int64_t m_rows = x.size(0), k = x.size(1), n = q.size(0);
  TORCH_CHECK(k % kBlock == 0 && q.size(1) == k / kBlock * Block::bytes, "q must be [N, K/32 blocks]");
  TORCH_CHECK(scales.scalar_type() == torch::kFloat && scales.is_contiguous() && scales.size(1) == k / kBlock);
  auto xc = x.contiguous();
  auto y = torch::empty({m_rows, n}, x.options());
  const float* xp = xc.data_ptr<float>();
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const float* dp = scales.data_ptr<float>();
  const float* mp = mins ? mins->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t groups = k / kBlock, row_bytes = groups * Block::bytes;
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      for (int64_t r0 = 0; r0 < m_rows; r0 += kRowTile) {
        row_dot_any<Block>(std::min(kRowTile, m_rows - r0), qp + row * row_bytes, dp + row * groups,
                           mp ? mp + row * groups : nullptr, xp + r0 * k, k, yp + r0 * n + row, n);
      }
    }
  });
  return y;
}

}  // namespace

torch::Tensor q4_matmul(torch::Tensor x, torch::Tensor q, torch::Tensor scales, torch::Tensor mins) {
  pybind11::gil_scoped_release no_gil;
  return block_matmul<Q4Block>(x, q, scales, mins);
}

torch::Tensor q8_matmul(torch::Tensor x, torch::Tensor q, torch::Tensor scales) {
  pybind11::gil_scoped_release no_gil;
  return block_matmul<Q8Block>(x, q, scales, c10::nullopt);
}
