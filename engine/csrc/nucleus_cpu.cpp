// Top-p on CPU: each row's nucleus threshold, the least probability the nucleus keeps, and the row's tokens below it
// zeroed in place while the row is still in cache (a separate compare and masked_fill cost as much again). A token
// is kept when the mass above it is at most top_p, and so are its ties: the threshold is the largest value t in the
// row with mass(p >= t) > top_p, as in the Triton kernel (kernels/triton/nucleus.py).
//
// No sort of the vocabulary: tokens below (1 - top_p) / (2 * vocab) hold less than (1 - top_p) / 2 together, so the
// threshold is above all of them, and most of a language model's vocabulary is that unlikely. The rest (a few
// hundred values, a few thousand for a flat row) go through a selection by mass: partition around a pivot, keep the
// side that holds the threshold, until a short run is left to sort. Masses add in double.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <vector>

namespace nucleus_detail {

constexpr int64_t kSortBelow = 32;

inline uint32_t bits_of(float x) {
  uint32_t b;
  std::memcpy(&b, &x, sizeof b);
  return b;
}

// Three-way partition of c[lo, hi) around pivot: [lo, gt) > pivot, [gt, lt) == pivot, [lt, hi) < pivot; returns the
// mass of the first part.
inline double partition(float* c, int64_t lo, int64_t hi, float pivot, int64_t& gt, int64_t& lt) {
  double heavier = 0.0;
  gt = lo;
  lt = hi;
  for (int64_t i = lo; i < lt;) {
    const float x = c[i];
    if (x > pivot) {
      heavier += x;
      std::swap(c[i++], c[gt++]);
    } else if (x < pivot) {
      std::swap(c[i], c[--lt]);
    } else {
      ++i;
    }
  }
  return heavier;
}

inline float median_of_three(float a, float b, float c) {
  return std::max(std::min(a, b), std::min(std::max(a, b), c));
}

// The threshold of one row of `vocab` probabilities; `c` is room for `vocab` floats.
inline float row_threshold(const float* row, int64_t vocab, float top_p, float* c) {
  // Candidates by bit pattern, which orders non-negative floats as integers: NaN, inf and negative values (a row the
  // sampler marks invalid anyway) never enter, so every comparison below is between finite numbers.
  const uint32_t floor_bits = bits_of((1.f - top_p) / (2.f * static_cast<float>(vocab)));
  const uint32_t inf_bits = 0x7f800000u;
  int64_t n = 0;
  for (int64_t i = 0; i < vocab; ++i) {
    const uint32_t b = bits_of(row[i]);
    c[n] = row[i];
    n += (b >= floor_bits) & (b < inf_bits);
  }
  double above = 0.0;  // the mass of the candidates above every one in [lo, hi); never more than top_p
  int64_t lo = 0, hi = n;
  while (hi - lo > kSortBelow) {
    const float pivot = median_of_three(c[lo], c[lo + (hi - lo) / 2], c[hi - 1]);
    int64_t gt, lt;
    const double heavier = above + partition(c, lo, hi, pivot, gt, lt);
    const double through_pivot = heavier + static_cast<double>(pivot) * static_cast<double>(lt - gt);
    if (heavier > top_p) {
      hi = gt;  // the threshold is above the pivot
    } else if (through_pivot > top_p) {
      return pivot;
    } else {
      above = through_pivot;
      lo = lt;
    }
  }
  std::sort(c + lo, c + hi, std::greater<float>());
  for (int64_t i = lo; i < hi; ++i) {
    above += c[i];
    if (above > top_p) return c[i];
  }
  return 0.f;  // the whole row is within top_p (rounding): it keeps everything
}

}  // namespace nucleus_detail

// probs [rows, vocab] float32 (each row summing to 1), top_p [rows] -> threshold [rows, 1]; what is below a row's
// threshold is zeroed in probs.
at::Tensor nucleus_mask_(at::Tensor probs, at::Tensor top_p) {
  ReleaseGil no_gil;
  TORCH_CHECK(probs.dim() == 2 && probs.is_contiguous() && probs.scalar_type() == at::kFloat,
              "probs must be a contiguous float32 [rows, vocab]");
  TORCH_CHECK(top_p.is_contiguous() && top_p.scalar_type() == at::kFloat && top_p.numel() == probs.size(0),
              "top_p must hold one float32 a row");
  const int64_t rows = probs.size(0), vocab = probs.size(1);
  auto threshold = at::empty({rows, 1}, probs.options());
  float* p = probs.data_ptr<float>();
  const float* nucleus = top_p.data_ptr<float>();
  float* out = threshold.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> candidates(vocab);
    for (int64_t r = begin; r < end; ++r) {
      float* row = p + r * vocab;
      const float least = nucleus_detail::row_threshold(row, vocab, nucleus[r], candidates.data());
      out[r] = least;
      for (int64_t i = 0; i < vocab; ++i) row[i] = row[i] < least ? 0.f : row[i];
    }
  });
  return threshold;
}
