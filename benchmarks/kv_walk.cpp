// The decode kernel's memory traffic with none of its arithmetic: every (sequence, KV head) task's K and V rows,
// read through its block table in the kernel's order (K rows then V rows), or K and V of one key together, with the
// kernel's software prefetch. Each row's words are summed, so nothing is optimized away and both orders
// return the same checksum. What the kernel could reach on this pool layout (benchmarks/decode_attention.py).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include "python_bindings.h"  // the engine's: pybind11's tensor casters, without all of torch/extension.h
#include <cstdint>
#include <cstring>
#include <vector>

constexpr int64_t kPrefetchRows = 32;  // the decode kernel's distance

static inline void prefetch(const char* row, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(row + b, 0, 3);
}

// the row's 8-byte words added (mod 2^64, so any order gives the same sum); vectorized by the compiler
static inline uint64_t add_row(uint64_t acc, const char* row, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 8) {
    uint64_t word;
    std::memcpy(&word, row + b, 8);
    acc += word;
  }
  return acc;
}

// caches [kv_heads, num_blocks, block_size, D] of any dtype whose rows are whole cache lines; one_pass: K and V of a
// key together
int64_t kv_walk(at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables, at::Tensor context_lens,
                bool one_pass) {
  const int64_t kv_heads = k_cache.size(0), num_blocks = k_cache.size(1), block_size = k_cache.size(2);
  const int64_t row_bytes = k_cache.size(3) * k_cache.element_size(), head_bytes = num_blocks * block_size * row_bytes;
  TORCH_CHECK(row_bytes % 64 == 0, "rows of whole cache lines");
  const int64_t batch = block_tables.size(0), width = block_tables.size(1);
  const char *k = static_cast<const char*>(k_cache.data_ptr()), *v = static_cast<const char*>(v_cache.data_ptr());
  const int64_t *tables = block_tables.data_ptr<int64_t>(), *lens = context_lens.data_ptr<int64_t>();
  std::vector<uint64_t> sums(batch * kv_heads);
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> rows;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / kv_heads, len = lens[b];
      rows.resize(len);
      for (int64_t t = 0; t < len; ++t)
        rows[t] = (task % kv_heads) * head_bytes + (tables[b * width + t / block_size] * block_size + t % block_size) * row_bytes;
      uint64_t acc = 0;
      if (one_pass) {
        for (int64_t t = 0; t < len; ++t) {
          if (t + kPrefetchRows < len) prefetch(k + rows[t + kPrefetchRows], row_bytes), prefetch(v + rows[t + kPrefetchRows], row_bytes);
          acc = add_row(add_row(acc, k + rows[t], row_bytes), v + rows[t], row_bytes);
        }
      } else {
        for (const char* pool : {k, v})
          for (int64_t t = 0; t < len; ++t) {
            if (t + kPrefetchRows < len) prefetch(pool + rows[t + kPrefetchRows], row_bytes);
            acc = add_row(acc, pool + rows[t], row_bytes);
          }
      }
      sums[task] = acc;
    }
  });
  uint64_t total = 0;
  for (uint64_t s : sums) total += s;
  return static_cast<int64_t>(total);
}
