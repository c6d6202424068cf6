// GGUF blocks of 16 output rows interleaved, for AVX-512 and AVX2: the vector lanes are 16 output rows (AVX2: two
// vectors of 8), so a block's scale and min are one vector load (not a broadcast), and nothing is summed across
// lanes until the row is done.
// Activations are rounded to 16 bits per 32-element block (as the AVX2 path does, quantized_matmul_cpu.cpp), and a
// pair of them multiplies a pair of weights of all 16 rows in one `vpdpwssd` (AVX2: `vpmaddwd` and an add per 8
// rows). Both give the same numbers: exact integer sums, then the same fp32 operations per row. The weights stay the file's exact
// values; the layout is built once at load (engine/layers/quantized.py's `interleave`).
//
// Layout, row group R (rows 16R..16R+15), block g; ek is element 8c+k (Q4) or 4c+k (Q8) of row 16R+i:
//   Q4: codes [N/16, K/32, 256]: 4 chunks of 64 bytes, dword i of chunk c = bytes {e0|e4<<4, e2|e6<<4, e1|e5<<4,
//       e3|e7<<4}, so masking and shifting the chunk's 16-bit words gives the pairs (e0,e1) (e2,e3) (e4,e5) (e6,e7).
//   Q8: codes [N/16, K/32, 512]: 8 chunks, dword i of chunk c = bytes {e0, e2, e1, e3}: sign-extending the low and
//       the high byte of each word gives the pairs (e0,e1) and (e2,e3).
//   scales d (and Q4 mins m): [N/16, K/32, 16] fp16, the file's own values.
// |products| of a block sum to at most 32 * 128 * 32767 < 2^31: the int32 sums cannot overflow.

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <cstring>

namespace {

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX2__) && defined(__FMA__)
#define INTERLEAVED_BLOCKS 1
constexpr int64_t kLanes = 16;
constexpr int kInterleavedRowTile = 8;  // x rows sharing one load of a block: 8 rows at once took 4.3 ms a sweep, 4 at a time 5.7
// blocks ahead of the one being read (8 KB of Q4): one-row sweeps of 30 layers over cold weights took 2.1 ms at 32,
// 2.7 at 2 (2 threads; 3.6 against 7.1 on one), the same in cache; 64 no better (AMX Xeon, 2026-11-29)
constexpr int64_t kPrefetchBlocks = 32;

inline __m512i pair_dot(__m512i sum, __m512i weights, const int16_t* x_pair) {
  int32_t pair;
  std::memcpy(&pair, x_pair, sizeof(pair));
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(sum, weights, _mm512_set1_epi32(pair));
#else
  return _mm512_add_epi32(sum, _mm512_madd_epi16(weights, _mm512_set1_epi32(pair)));
#endif
}

// Independent integer sums per x row: one chain of 16 dependent `vpdpwssd`s a block left a one-row sweep waiting on
// their latency (one thread, 30 layers in cache: 3.5 ms, 3.15 with four chains). Integer sums are exact: the same y.
template <int ROWS>
constexpr int kChains = ROWS == 1 ? 4 : ROWS == 2 ? 2 : 1;

// One row group against ROWS rows of x: out[r * out_stride + i] for the group's 16 rows i.
template <bool kQ4, int ROWS>
inline void group_dot(const uint8_t* codes, const c10::Half* d, const c10::Half* m, const Int16Rows& x, int64_t groups,
                      float* out, int64_t out_stride) {
  constexpr int64_t bytes = kQ4 ? 256 : 512;
  constexpr int chains = kChains<ROWS>;
  const __m512i nibble = _mm512_set1_epi16(15);
  __m512 acc[ROWS];
  for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* q = codes + g * bytes;
    for (int64_t line = 0; line < bytes; line += 64) {  // past the end is harmless: a prefetch never faults
      _mm_prefetch(reinterpret_cast<const char*>(q + kPrefetchBlocks * bytes + line), _MM_HINT_T0);
    }
    __m512i dot[ROWS][chains];
    for (int r = 0; r < ROWS; ++r)
      for (int j = 0; j < chains; ++j) dot[r][j] = _mm512_setzero_si512();
    if constexpr (kQ4) {
      for (int c = 0; c < 4; ++c) {
        const __m512i v = _mm512_loadu_si512(q + 64 * c);
        const __m512i pairs[4] = {_mm512_and_si512(v, nibble), _mm512_and_si512(_mm512_srli_epi16(v, 8), nibble),
                                  _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble), _mm512_srli_epi16(v, 12)};
        for (int r = 0; r < ROWS; ++r) {
          const int16_t* xr = x.codes + r * x.k + g * kBlock + 8 * c;
          for (int p = 0; p < 4; ++p) dot[r][p % chains] = pair_dot(dot[r][p % chains], pairs[p], xr + 2 * p);
        }
      }
    } else {
      for (int c = 0; c < 8; ++c) {
        const __m512i v = _mm512_loadu_si512(q + 64 * c);
        const __m512i even = _mm512_srai_epi16(_mm512_slli_epi16(v, 8), 8), odd = _mm512_srai_epi16(v, 8);
        for (int r = 0; r < ROWS; ++r) {
          const int16_t* xr = x.codes + r * x.k + g * kBlock + 4 * c;
          const int j = (2 * c) % chains, k = (2 * c + 1) % chains;
          dot[r][j] = pair_dot(dot[r][j], even, xr);
          dot[r][k] = pair_dot(dot[r][k], odd, xr + 2);
        }
      }
    }
    const __m512 vd = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d + g * kLanes)));
    for (int r = 0; r < ROWS; ++r) {
      __m512i total = dot[r][0];
      for (int j = 1; j < chains; ++j) total = _mm512_add_epi32(total, dot[r][j]);
      const __m512 scale = _mm512_mul_ps(vd, _mm512_set1_ps(x.scales[r * groups + g]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), scale, acc[r]);
    }
    if constexpr (kQ4) {
      const __m512 vm = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(m + g * kLanes)));
      for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_fmadd_ps(vm, _mm512_set1_ps(x.sums[r * groups + g]), acc[r]);
    }
  }
  for (int r = 0; r < ROWS; ++r) _mm512_storeu_ps(out + r * out_stride, acc[r]);
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define INTERLEAVED_BLOCKS 1
constexpr int64_t kLanes = 16;  // the layout's rows a group, as on AVX-512: here two halves of 8
// x rows a pass over a group: each holds 4 accumulators (2 halves, fp32 and int32) of the 16 registers, beside the
// chunk's two halves, their pairs and the broadcast x pair
constexpr int kInterleavedRowTile = 2;
constexpr int64_t kPrefetchBlocks = 32;

// One x row's two int32 sums (chains) a half for one row, one for two: as on AVX-512, independent chains where a
// lone row would wait on `vpaddd` latency.
template <int ROWS>
constexpr int kChains = ROWS == 1 ? 2 : 1;

// One row group against ROWS rows of x: out[r * out_stride + i] for the group's 16 rows i; half h of each 64-byte
// chunk holds rows 8h..8h+7.
template <bool kQ4, int ROWS>
inline void group_dot(const uint8_t* codes, const c10::Half* d, const c10::Half* m, const Int16Rows& x, int64_t groups,
                      float* out, int64_t out_stride) {
  constexpr int64_t bytes = kQ4 ? 256 : 512;
  constexpr int chains = kChains<ROWS>;
  const __m256i nibble = _mm256_set1_epi16(15);
  __m256 acc[ROWS][2];
  for (int r = 0; r < ROWS; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* q = codes + g * bytes;
    for (int64_t line = 0; line < bytes; line += 64) {  // past the end is harmless: a prefetch never faults
      _mm_prefetch(reinterpret_cast<const char*>(q + kPrefetchBlocks * bytes + line), _MM_HINT_T0);
    }
    __m256i dot[ROWS][2][chains];
    for (int r = 0; r < ROWS; ++r)
      for (int h = 0; h < 2; ++h)
        for (int j = 0; j < chains; ++j) dot[r][h][j] = _mm256_setzero_si256();
    // weights w[h] (a pair of 16-bit codes a row) times the x pair at xr, into chain j of every row
    const auto multiply = [&](const __m256i* w, int64_t x_offset, int j) {
      for (int r = 0; r < ROWS; ++r) {
        int32_t pair;
        std::memcpy(&pair, x.codes + r * x.k + g * kBlock + x_offset, sizeof(pair));
        const __m256i xp = _mm256_set1_epi32(pair);
        for (int h = 0; h < 2; ++h) dot[r][h][j] = _mm256_add_epi32(dot[r][h][j], _mm256_madd_epi16(w[h], xp));
      }
    };
    if constexpr (kQ4) {
      for (int c = 0; c < 4; ++c) {
        const __m256i v[2] = {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 64 * c)),
                              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 64 * c + 32))};
        for (int p = 0; p < 4; ++p) {  // the pairs (e0,e1) (e2,e3) (e4,e5) (e6,e7): shifts 0, 8, 4, 12
          const int shift = p == 0 ? 0 : p == 1 ? 8 : p == 2 ? 4 : 12;
          const __m256i w[2] = {_mm256_and_si256(_mm256_srli_epi16(v[0], shift), nibble),
                                _mm256_and_si256(_mm256_srli_epi16(v[1], shift), nibble)};
          multiply(w, 8 * c + 2 * p, p % chains);
        }
      }
    } else {
      for (int c = 0; c < 8; ++c) {
        const __m256i v[2] = {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 64 * c)),
                              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 64 * c + 32))};
        const __m256i even[2] = {_mm256_srai_epi16(_mm256_slli_epi16(v[0], 8), 8),
                                 _mm256_srai_epi16(_mm256_slli_epi16(v[1], 8), 8)};
        const __m256i odd[2] = {_mm256_srai_epi16(v[0], 8), _mm256_srai_epi16(v[1], 8)};
        multiply(even, 4 * c, (2 * c) % chains);
        multiply(odd, 4 * c + 2, (2 * c + 1) % chains);
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 vd = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + g * kLanes + 8 * h)));
      for (int r = 0; r < ROWS; ++r) {
        __m256i total = dot[r][h][0];
        for (int j = 1; j < chains; ++j) total = _mm256_add_epi32(total, dot[r][h][j]);
        const __m256 scale = _mm256_mul_ps(vd, _mm256_set1_ps(x.scales[r * groups + g]));
        acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), scale, acc[r][h]);
      }
      if constexpr (kQ4) {
        const __m256 vm = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m + g * kLanes + 8 * h)));
        for (int r = 0; r < ROWS; ++r) acc[r][h] = _mm256_fmadd_ps(vm, _mm256_set1_ps(x.sums[r * groups + g]), acc[r][h]);
      }
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(out + r * out_stride + 8 * h, acc[r][h]);
}
#endif

#if defined(INTERLEAVED_BLOCKS)
// Row groups [begin, end) of y [m_rows, n] fp32 = x W^T, x given rounded (see Int16Rows).
template <bool kQ4>
inline void interleaved_groups(const uint8_t* codes, const c10::Half* d, const c10::Half* m, const Int16Rows& rows,
                               int64_t m_rows, int64_t groups, int64_t n, int64_t begin, int64_t end, float* y) {
  constexpr int64_t bytes = kQ4 ? 256 : 512;
  for (int64_t group = begin; group < end; ++group) {
    const int64_t scale_offset = group * groups * kLanes;
    for (int64_t r0 = 0; r0 < m_rows; r0 += kInterleavedRowTile) {
      with_rows<kInterleavedRowTile>(std::min<int64_t>(kInterleavedRowTile, m_rows - r0), [&](auto tile) {
        group_dot<kQ4, decltype(tile)::value>(codes + group * groups * bytes, d + scale_offset,
                                              m ? m + scale_offset : nullptr, rows.from(r0), groups,
                                              y + r0 * n + group * kLanes, n);
      });
    }
  }
}

// Checks an interleaved matrix's codes, scales and mins for x with k columns -> its output width.
template <bool kQ4>
int64_t interleaved_width(int64_t k, const at::Tensor& codes, const at::Tensor& d, const at::Tensor& m) {
  constexpr int64_t bytes = kQ4 ? 256 : 512;
  const int64_t row_groups = codes.size(0), groups = k / kBlock;
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.dim() == 3 && codes.size(1) == groups &&
              codes.size(2) == bytes, "interleaved codes must be [N/16, K/32, ", bytes, "] uint8");
  TORCH_CHECK(d.scalar_type() == at::kHalf && d.is_contiguous() && d.numel() == row_groups * groups * kLanes);
  TORCH_CHECK(!kQ4 || (m.scalar_type() == at::kHalf && m.is_contiguous() && m.numel() == d.numel()));
  return row_groups * kLanes;
}

template <bool kQ4>
at::Tensor interleaved_matmul(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d,
                              const at::Tensor& m) {
  const int64_t m_rows = x.size(0), k = x.size(1), groups = k / kBlock;
  const int64_t n = interleaved_width<kQ4>(k, codes, d, m);
  const Int16Activations activations(x.contiguous());
  const auto rows = activations.rows();
  auto y = at::empty({m_rows, n}, x.options());
  const uint8_t* qp = codes.data_ptr<uint8_t>();
  const c10::Half* dp = d.data_ptr<c10::Half>();
  const c10::Half* mp = kQ4 ? m.data_ptr<c10::Half>() : nullptr;
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, n / kLanes, 1, [&](int64_t begin, int64_t end) {
    interleaved_groups<kQ4>(qp, dp, mp, rows, m_rows, groups, n, begin, end, yp);
  });
  return y;
}
#endif

// Either layout: interleaved codes are 3-D, the file's 2-D. `mins` is empty for Q8_0.
at::Tensor matmul_blocks(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                         const at::Tensor& mins) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) % kBlock == 0,
              "x must be [M, K] float32 with K a multiple of 32");
  const bool q4 = mins.numel() > 0;
  if (codes.dim() == 3) {
#if defined(INTERLEAVED_BLOCKS)
    return q4 ? interleaved_matmul<true>(x, codes, scales, mins) : interleaved_matmul<false>(x, codes, scales, mins);
#else
    TORCH_CHECK(false, "interleaved GGUF blocks need an AVX-512 or AVX2 build (see interleaved_rows())");
#endif
  }
  return q4 ? block_matmul<Q4Block>(x, codes, scales, mins) : block_matmul<Q8Block>(x, codes, scales, c10::nullopt);
}

}  // namespace

// How many output rows the kernels want interleaved (engine/layers/quantized.py packs them so); 0: the file's layout.
int64_t interleaved_rows() {
#if defined(INTERLEAVED_BLOCKS)
  return kLanes;
#else
  return 0;
#endif
}

at::Tensor q4_matmul(at::Tensor x, at::Tensor q, at::Tensor scales, at::Tensor mins) {
  ReleaseGil no_gil;
  return matmul_blocks(x, q, scales, mins);
}

at::Tensor q8_matmul(at::Tensor x, at::Tensor q, at::Tensor scales) {
  ReleaseGil no_gil;
  return matmul_blocks(x, q, scales, at::Tensor());
}
