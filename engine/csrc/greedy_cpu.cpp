// Greedy decoding's pick on CPU in one pass over the logits: each row's argmax (the first on ties, as torch's max),
// or `invalid` where any of its values is NaN or infinite (sampler.py's greedy_and_finite reads a row twice and
// takes four torch ops: 63 against 6 us for one fp32 row of SmolLM2's 49,152, 1.8 against 0.19 ms for 64 bf16 rows).
// Finiteness is read from the exponent bits: the unit is built with -ffast-math, under which isfinite() may fold.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <cstring>
#include <limits>

namespace {

inline bool finite_bits(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  return (bits & 0x7f800000u) != 0x7f800000u;
}

template <typename scalar_t>
int64_t row_greedy(const scalar_t* row, int64_t n, int64_t invalid) {
  float best = std::numeric_limits<float>::lowest();
  int64_t at = 0, i = 0;
  bool finite = true;
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, c10::BFloat16>) {
    const __m512i exponent = _mm512_set1_epi32(0x7f800000);
    __m512 lane_best = _mm512_set1_ps(best);
    __m512i lane_at = _mm512_setzero_si512(), index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __mmask16 bad = 0;
    for (; i + 16 <= n; i += 16) {
      __m512 v;
      if constexpr (std::is_same_v<scalar_t, float>) {
        v = _mm512_loadu_ps(row + i);
      } else {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + i));
        v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
      }
      bad |= _mm512_cmpeq_epi32_mask(_mm512_and_si512(_mm512_castps_si512(v), exponent), exponent);
      const __mmask16 higher = _mm512_cmp_ps_mask(v, lane_best, _CMP_GT_OQ);  // strictly: a lane keeps its first
      lane_best = _mm512_mask_mov_ps(lane_best, higher, v);
      lane_at = _mm512_mask_mov_epi32(lane_at, higher, index);
      index = _mm512_add_epi32(index, _mm512_set1_epi32(16));
    }
    finite = bad == 0;
    alignas(64) float values[16];
    alignas(64) int32_t where[16];
    _mm512_store_ps(values, lane_best);
    _mm512_store_si512(where, lane_at);
    for (int lane = 0; lane < 16; ++lane) {  // the highest value, and of its ties the first column
      if (values[lane] > best || (values[lane] == best && where[lane] < at)) {
        best = values[lane];
        at = where[lane];
      }
    }
  }
#endif
  for (; i < n; ++i) {
    const float v = static_cast<float>(row[i]);
    finite = finite && finite_bits(v);
    if (v > best) {
      best = v;
      at = i;
    }
  }
  return finite ? at : invalid;
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
