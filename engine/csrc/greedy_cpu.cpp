// Greedy decoding's pick on CPU: each row's argmax (the first on ties, as torch's max), or `invalid` where any of its
// values is NaN or infinite (sampler.py's greedy_and_finite reads a row twice and takes four torch ops: 63 against
// 6 us for one fp32 row of SmolLM2's 49,152, 1.8 against 0.19 ms for 64 bf16 rows).
// Two passes, on AVX-512 and AVX2 alike: the row's maximum (and its exponents') over independent chains, then the
// first column holding it, which stops early, the row (192 KB in fp32) still in cache. One pass carrying each lane's
// column waits on a compare and a blend every vector. One fp32 row, one thread, an AMX Xeon running the AVX2 build:
// 61 us in the scalar loop AVX2 CPUs ran before, 11 in one pass over four chains, 5-6 in these two (BENCHMARKS.md,
// 2026-12-02). Finiteness is read from the exponent bits: the unit is built with -ffast-math, under which
// isfinite() may fold.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstring>
#include <limits>

namespace {

constexpr uint32_t kExponent = 0x7f800000u;

inline bool finite_bits(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  return (bits & kExponent) != kExponent;
}

#if defined(PAGED_DECODE_VECTORS)
// Over paged_attention_cpu.cpp's float lanes (16 on AVX-512, 8 on AVX2).
#if defined(__AVX512F__)
using vbits = __m512i;
static inline vfloat vmax(vfloat a, vfloat b) { return _mm512_max_ps(a, b); }
static inline vbits no_bits() { return _mm512_setzero_si512(); }
static inline vbits max_exponent(vbits seen, vfloat v) {
  return _mm512_max_epu32(seen, _mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(kExponent)));
}
static inline vbits vmax_bits(vbits a, vbits b) { return _mm512_max_epu32(a, b); }
static inline void vstore_bits(uint32_t* p, vbits v) { _mm512_store_si512(p, v); }
static inline uint32_t equal_lanes(vfloat v, vfloat x) { return _mm512_cmp_ps_mask(v, x, _CMP_EQ_OQ); }
#else
using vbits = __m256i;
static inline vfloat vmax(vfloat a, vfloat b) { return _mm256_max_ps(a, b); }
static inline vbits no_bits() { return _mm256_setzero_si256(); }
static inline vbits max_exponent(vbits seen, vfloat v) {
  return _mm256_max_epu32(seen, _mm256_and_si256(_mm256_castps_si256(v), _mm256_set1_epi32(kExponent)));
}
static inline vbits vmax_bits(vbits a, vbits b) { return _mm256_max_epu32(a, b); }
static inline void vstore_bits(uint32_t* p, vbits v) { _mm256_store_si256(reinterpret_cast<__m256i*>(p), v); }
static inline uint32_t equal_lanes(vfloat v, vfloat x) { return _mm256_movemask_ps(_mm256_cmp_ps(v, x, _CMP_EQ_OQ)); }
#endif

constexpr int kRunningMaxima = 4;  // independent chains: one would wait on max's latency every vector

// The maximum of row[0, vectors) (vectors a multiple of kFloatLanes), and whether every value there is finite.
template <typename scalar_t>
float vector_max(const scalar_t* row, int64_t vectors, bool& finite) {
  vfloat best[kRunningMaxima];
  vbits exponents[kRunningMaxima];
  for (int c = 0; c < kRunningMaxima; ++c) {
    best[c] = vset1(std::numeric_limits<float>::lowest());
    exponents[c] = no_bits();
  }
  int64_t i = 0;
  for (; i + kRunningMaxima * kFloatLanes <= vectors; i += kRunningMaxima * kFloatLanes) {
    for (int c = 0; c < kRunningMaxima; ++c) {
      const vfloat v = load_lanes(row + i + c * kFloatLanes);
      best[c] = vmax(best[c], v);
      exponents[c] = max_exponent(exponents[c], v);
    }
  }
  for (; i < vectors; i += kFloatLanes) {
    const vfloat v = load_lanes(row + i);
    best[0] = vmax(best[0], v);
    exponents[0] = max_exponent(exponents[0], v);
  }
  for (int c = 1; c < kRunningMaxima; ++c) {
    best[0] = vmax(best[0], best[c]);
    exponents[0] = vmax_bits(exponents[0], exponents[c]);
  }
  alignas(64) float values[kFloatLanes];
  alignas(64) uint32_t exponent[kFloatLanes];
  vstore_aligned(values, best[0]);
  vstore_bits(exponent, exponents[0]);
  finite = std::find(exponent, exponent + kFloatLanes, kExponent) == exponent + kFloatLanes;
  return *std::max_element(values, values + kFloatLanes);
}

// The first column of row[0, vectors) holding x, one of its values (0 where none is).
template <typename scalar_t>
int64_t first_equal(const scalar_t* row, int64_t vectors, float x) {
  const vfloat target = vset1(x);
  for (int64_t i = 0; i < vectors; i += kFloatLanes) {
    if (const uint32_t lanes = equal_lanes(load_lanes(row + i), target)) return i + __builtin_ctz(lanes);
  }
  return 0;
}
#endif

template <typename scalar_t>
int64_t row_greedy(const scalar_t* row, int64_t n, int64_t invalid) {
  float best = std::numeric_limits<float>::lowest();
  int64_t vectors = 0;
  bool finite = true;
#if defined(PAGED_DECODE_VECTORS)
  if constexpr (!std::is_same_v<scalar_t, double>) {  // fp32, bf16 and fp16 widen to float lanes
    vectors = n / kFloatLanes * kFloatLanes;
    if (vectors) best = vector_max(row, vectors, finite);
  }
#endif
  int64_t tail_at = -1;  // a column past the vectors wins only over a strictly lower maximum
  for (int64_t i = vectors; i < n; ++i) {
    const float v = static_cast<float>(row[i]);
    finite = finite && finite_bits(v);
    if (v > best) {
      best = v;
      tail_at = i;
    }
  }
  if (!finite) return invalid;
  if (tail_at >= 0) return tail_at;
#if defined(PAGED_DECODE_VECTORS)
  if constexpr (!std::is_same_v<scalar_t, double>) {
    if (vectors) return first_equal(row, vectors, best);
  }
#endif
  return 0;  // every value the lowest float
}

}  // namespace

// logits [rows, vocab] (fp32, bf16 or fp16, rows dense) -> int64 [rows]: each row's argmax, or `invalid`.
at::Tensor greedy_or_invalid_cpu(at::Tensor logits, int64_t invalid) {
  ReleaseGil no_gil;
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 && logits.stride(1) == 1, "logits must be [rows, vocab] on CPU, rows dense");
  const int64_t rows = logits.size(0), n = logits.size(1), stride = logits.stride(0);
  auto out = at::empty({rows}, logits.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "greedy_or_invalid_cpu", [&] {
    const scalar_t* base = logits.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) o[r] = n ? row_greedy(base + r * stride, n, invalid) : invalid;
    });
  });
  return out;
}
