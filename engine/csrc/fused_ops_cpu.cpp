// The small per-layer ops of a decoder, one call each instead of the 5 to 15 torch ops (each a dispatch) that
// spell them: at a decode batch of one, those dispatches cost more than the matmuls of a 4-bit model.
// Rounding follows transformers' Llama code: the residual sum and every op's output are in the model's dtype; the
// norm's statistics and each op's arithmetic are in fp32.
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

template <typename scalar_t>
inline scalar_t round_to(float v) { return static_cast<scalar_t>(v); }

// One row: sum = x + residual (x alone without one), normed = weight * norm(sum); s is fp32 room for `hidden` values.
template <typename scalar_t>
inline void add_rms_norm_row(const scalar_t* x, const scalar_t* residual, const scalar_t* weight, scalar_t* normed,
                             scalar_t* sum, int64_t hidden, float eps, float* s) {
  float squares = 0.f;
  for (int64_t i = 0; i < hidden; ++i) {
    const scalar_t total = residual ? round_to<scalar_t>(static_cast<float>(x[i]) + static_cast<float>(residual[i])) : x[i];
    sum[i] = total;
    s[i] = static_cast<float>(total);
    squares += s[i] * s[i];
  }
  const float inv = 1.f / std::sqrt(squares / static_cast<float>(hidden) + eps);
  for (int64_t i = 0; i < hidden; ++i) {
    const float n = static_cast<float>(round_to<scalar_t>(s[i] * inv));
    normed[i] = round_to<scalar_t>(n * static_cast<float>(weight[i]));
  }
}

template <typename scalar_t>
void add_rms_norm_rows(const scalar_t* x, const scalar_t* residual, const scalar_t* weight, scalar_t* normed,
                       scalar_t* sum, int64_t rows, int64_t hidden, float eps) {
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> s(hidden);
    for (int64_t r = begin; r < end; ++r) {
      add_rms_norm_row(x + r * hidden, residual ? residual + r * hidden : nullptr, weight, normed + r * hidden,
                       sum + r * hidden, hidden, eps, s.data());
    }
  });
}

// Rotates the first `rotated_heads` heads of one token's row in place at its position (see rotary_inplace).
template <typename scalar_t>
inline void rotate_row(scalar_t* row, const float* cos_at, const float* sin_at, int64_t rotated_heads, int64_t head_dim) {
  const int64_t half = head_dim / 2;
  for (int64_t h = 0; h < rotated_heads; ++h) {
    scalar_t* x = row + h * head_dim;
    for (int64_t i = 0; i < half; ++i) {
      // the table in the model's dtype first, as HF casts cos/sin before multiplying
      const float ci = static_cast<float>(round_to<scalar_t>(cos_at[i])), si = static_cast<float>(round_to<scalar_t>(sin_at[i]));
      const float x1 = static_cast<float>(x[i]), x2 = static_cast<float>(x[i + half]);
      x[i] = round_to<scalar_t>(x1 * ci - x2 * si);
      x[i + half] = round_to<scalar_t>(x2 * ci + x1 * si);
    }
  }
}

// SiLU(gate) * up for one token: gate and up are `inner` values each.
template <typename scalar_t>
inline void silu_and_mul_row(const scalar_t* gate, const scalar_t* up, scalar_t* out, int64_t inner) {
  for (int64_t i = 0; i < inner; ++i) {
    const float g = static_cast<float>(gate[i]);
    const float act = static_cast<float>(round_to<scalar_t>(g / (1.f + std::exp(-g))));
    out[i] = round_to<scalar_t>(act * static_cast<float>(up[i]));
  }
}

}  // namespace

// -> (weight * norm(x + residual), x + residual); residual may be undefined (the first layer).
std::vector<at::Tensor> add_rms_norm(at::Tensor x, c10::optional<at::Tensor> residual, at::Tensor weight,
                                     double eps) {
  ReleaseGil no_gil;
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && weight.scalar_type() == x.scalar_type());
  const bool has_residual = residual.has_value() && residual->defined();
  if (has_residual) TORCH_CHECK(residual->is_contiguous() && residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type());
  auto normed = at::empty_like(x);
  auto sum = has_residual ? at::empty_like(x) : x;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    if (has_residual) {
      add_rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), residual->data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(),
                                  normed.data_ptr<scalar_t>(), sum.data_ptr<scalar_t>(), x.size(0), x.size(1), static_cast<float>(eps));
    } else {
      // no residual: the sum is x itself, written back unchanged
      add_rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), nullptr, weight.data_ptr<scalar_t>(), normed.data_ptr<scalar_t>(),
                                  x.data_ptr<scalar_t>(), x.size(0), x.size(1), static_cast<float>(eps));
    }
  });
  return {normed, sum};
}

// Rotates the first `rotated_heads` heads of each row of qkv [T, heads_total * D] in place (q then k, in the halves
// convention of HF's rotate_half), at each token's position in the fp32 cos/sin tables [max_position, D / 2].
void rotary_inplace(at::Tensor qkv, at::Tensor positions, at::Tensor cos, at::Tensor sin,
                    int64_t rotated_heads, int64_t head_dim) {
  ReleaseGil no_gil;
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && positions.scalar_type() == at::kLong);
  TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.is_contiguous() && sin.is_contiguous() && cos.size(1) == head_dim / 2);
  const int64_t tokens = qkv.size(0), row_stride = qkv.stride(0), half = head_dim / 2;
  const int64_t* pos = positions.data_ptr<int64_t>();
  TORCH_CHECK(positions.numel() == tokens && positions.is_contiguous(), "one position per row");
  for (int64_t t = 0; t < tokens; ++t)  // the tables are read at each position: one past them is another buffer
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0), "position ", pos[t], " outside the rotary table");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rotary_inplace", [&] {
    scalar_t* base = qkv.data_ptr<scalar_t>();
    at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        rotate_row(base + t * row_stride, cos.data_ptr<float>() + pos[t] * half, sin.data_ptr<float>() + pos[t] * half,
                   rotated_heads, head_dim);
      }
    });
  });
}

// SiLU(gate) * up over the merged gate/up output [T, 2 * I] -> [T, I].
at::Tensor silu_and_mul(at::Tensor gate_up) {
  ReleaseGil no_gil;
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous());
  const int64_t tokens = gate_up.size(0), inner = gate_up.size(1) / 2;
  auto out = at::empty({tokens, inner}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* in = gate_up.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, tokens, 8, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        silu_and_mul_row(in + t * 2 * inner, in + t * 2 * inner + inner, o + t * inner, inner);
      }
    });
  });
  return out;
}

// Writes each new token's key and value [T, kv_heads, D] (rows may be strided views of the merged projection) into
// its pool slot of the caches [kv_heads, num_blocks, block_size, D].
namespace {

// One fp8 format (kv_cache_dtype) as the write rounds to it: mantissa bits, smallest normal, largest finite value.
struct Fp8Format {
  int mantissa;
  float min_normal, largest;
};

// n values to fp8 bytes: rounded to nearest even, saturated at the largest finite value; the bytes of torch's
// saturated cast (and of the Triton write, engine/kernels/triton/common.py's round_to_fp8, which this mirrors).
template <typename scalar_t>
void to_fp8(const scalar_t* src, uint8_t* dst, int64_t n, const Fp8Format& f, bool e4m3) {
  int64_t i = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  if constexpr (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, c10::BFloat16>) {
    const int dropped = 23 - f.mantissa;
    const __m512i half_ulp = _mm512_set1_epi32((1 << (dropped - 1)) - 1), keep = _mm512_set1_epi32(-(1 << dropped));
    const __m512 min_normal = _mm512_set1_ps(f.min_normal), largest = _mm512_set1_ps(f.largest);
    const __m512i magnitude_bits = _mm512_set1_epi32(0x7FFFFFFF);
    for (; i + 16 <= n; i += 16) {
      __m512 x;
      if constexpr (std::is_same_v<scalar_t, float>) {
        x = _mm512_loadu_ps(src + i);
      } else {
        x = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))), 16));
      }
      const __m512i sign = _mm512_andnot_si512(magnitude_bits, _mm512_castps_si512(x));
      const __m512 magnitude = _mm512_min_ps(_mm512_abs_ps(x), largest);
      // subnormals sit on a grid of min_normal * 2^-mantissa: shifted up by min_normal, it is their ulp
      const __mmask16 small = _mm512_cmp_ps_mask(magnitude, min_normal, _CMP_LT_OQ);
      const __m512i bits = _mm512_castps_si512(_mm512_mask_add_ps(magnitude, small, magnitude, min_normal));
      const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, dropped), _mm512_set1_epi32(1));
      const __m512i up = _mm512_add_epi32(_mm512_add_epi32(bits, half_ulp), odd);  // ties to even
      __m512 rounded = _mm512_castsi512_ps(_mm512_and_si512(up, keep));
      rounded = _mm512_mask_sub_ps(rounded, small, rounded, min_normal);
      // exactly representable now: e5m2 is fp16's top byte; e4m3 times 2^-8 is fp16 with e4m3's bits in its places
      if (e4m3) rounded = _mm512_mul_ps(rounded, _mm512_set1_ps(1.f / 256.f));
      const __m256i half = _mm256_or_si256(_mm512_cvtps_ph(rounded, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                                           _mm512_cvtepi32_epi16(_mm512_srli_epi32(sign, 16)));
      const __m256i byte = e4m3 ? _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(half, 7), _mm256_set1_epi16(0x7F)),
                                                  _mm256_and_si256(_mm256_srli_epi16(half, 8), _mm256_set1_epi16(0x80)))
                                : _mm256_srli_epi16(half, 8);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), _mm256_cvtepi16_epi8(byte));
    }
  }
#endif
  for (; i < n; ++i) {  // c10's conversions round to nearest even; e5m2's overflows to inf, hence the clamp first
    const float x = std::clamp(static_cast<float>(src[i]), -f.largest, f.largest);
    dst[i] = e4m3 ? c10::Float8_e4m3fn(x).x : c10::Float8_e5m2(x).x;
  }
}

}  // namespace

// New K/V rows into their pool slots: a copy where the pool has their dtype, a rounding to one byte a value where
// the pool is fp8 (kv_cache_dtype).
void write_kv(at::Tensor k_cache, at::Tensor v_cache, at::Tensor key, at::Tensor value, at::Tensor slots) {
  ReleaseGil no_gil;
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && slots.scalar_type() == at::kLong);
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() && key.scalar_type() == value.scalar_type());
  const bool e4m3 = k_cache.scalar_type() == at::kFloat8_e4m3fn;
  const bool fp8 = e4m3 || k_cache.scalar_type() == at::kFloat8_e5m2;
  TORCH_CHECK(fp8 || key.scalar_type() == k_cache.scalar_type(),
              "K/V rows and pool must share a dtype, or the pool be fp8");
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1, "key and value rows must be dense in head_dim");
  const int64_t tokens = key.size(0), kv_heads = key.size(1), head_dim = key.size(2);
  const int64_t pool_slots = k_cache.size(1) * k_cache.size(2);
  const int64_t* slot = slots.data_ptr<int64_t>();
  const Fp8Format format = e4m3 ? Fp8Format{3, 0.015625f, 448.f} : Fp8Format{2, 6.103515625e-05f, 57344.f};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, key.scalar_type(), "write_kv", [&] {
    auto put = [&](const scalar_t* row, const at::Tensor& cache, int64_t dst) {
      if (fp8) return to_fp8(row, static_cast<uint8_t*>(cache.data_ptr()) + dst, head_dim, format, e4m3);
      std::copy_n(row, head_dim, cache.data_ptr<scalar_t>() + dst);
    };
    for (int64_t t = 0; t < tokens; ++t) {
      TORCH_CHECK(slot[t] >= 0 && slot[t] < pool_slots, "slot out of the pool");
      for (int64_t h = 0; h < kv_heads; ++h) {
        const int64_t dst = (h * pool_slots + slot[t]) * head_dim;
        put(key.data_ptr<scalar_t>() + t * key.stride(0) + h * key.stride(1), k_cache, dst);
        put(value.data_ptr<scalar_t>() + t * value.stride(0) + h * value.stride(1), v_cache, dst);
      }
    }
  });
}
