// A small decode step's layers over interleaved GGUF blocks in one OpenMP parallel region, the way llama.cpp runs its
// graph: the threads split each matmul's row groups and each attention's KV heads, meet at a barrier between phases,
// and nothing in between allocates, dispatches or forks a team. Through ATen, op by op (decoder_cpu.cpp's loop), a
// one-row step of SmolLM2's Q4_1 blocks on 2 cores spent ~1.9 ms of its 4.6 ms of layers outside the matmuls, with
// the second thread idle half the step; in one region the step took 5.7 ms against 6.8 (AMX Xeon, BENCHMARKS.md).
// The arithmetic is that loop's, op for op (the same row functions and the same roundings, see decoder_cpu.cpp), so
// the two give the same numbers.
#include <omp.h>

namespace {

#if defined(INTERLEAVED_BLOCKS) && defined(PAGED_DECODE_VECTORS)

// One interleaved linear as the region reads it; m is null for Q8_0, bias null for none (fp32, see RegionStep).
struct RegionLinear {
  const uint8_t* codes;
  const c10::Half *d, *m;
  const float* bias;
  int64_t k, n;

  // Row groups of y [rows, n] = x W^T that thread `tid` of `threads` computes.
  void share(const Int16Rows& x, int64_t rows, float* y, int tid, int threads) const {
    const int64_t groups = n / kLanes, begin = groups * tid / threads, end = groups * (tid + 1) / threads;
    if (m) interleaved_groups<true>(codes, d, m, x, rows, k / kBlock, n, begin, end, y);
    else interleaved_groups<false>(codes, d, m, x, rows, k / kBlock, n, begin, end, y);
  }
};

// A linear's output row back in the model's dtype: + bias in fp32, then rounded (decoder_cpu.cpp's LayerLinear).
template <typename scalar_t>
inline void linear_out(const float* y, const float* bias, scalar_t* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<scalar_t>(bias ? y[i] + bias[i] : y[i]);
}

struct RegionLayer {
  const void *input_norm, *post_norm;  // scalar_t [hidden]
  RegionLinear qkv, o, gate_up, down;
  void *k_cache, *v_cache;
};

// Everything one step reads and writes, checked before the region (nothing inside may throw).
struct RegionStep {
  std::vector<RegionLayer> layers;
  std::vector<at::Tensor> float_biases;  // keeps the fp32 copies RegionLinear::bias points into
  int64_t batch, hidden, heads, kv_heads, inner, num_blocks, block_size, max_blocks;
  const int64_t *positions, *slots, *block_tables, *context_lens;
  const float *cos, *sin;
  float eps, scale;
};

// The rows' matmul input: x rounded to 16 bits per block (Int16Rows), from any dtype through fp32 as LayerLinear does.
struct RoundedRows {
  std::vector<float> x32, scales, sums;
  std::vector<int16_t> codes;
  RoundedRows(int64_t rows, int64_t widest) : x32(rows * widest), scales(rows * widest / kBlock),
                                               sums(rows * widest / kBlock), codes(rows * widest) {}
  // Values [first, first + count) of row r of a k-wide input; whole 32-value blocks.
  template <typename scalar_t>
  void round(const scalar_t* values, int64_t r, int64_t k, int64_t first, int64_t count) {
    float* x = x32.data() + r * k + first;
    for (int64_t i = 0; i < count; ++i) x[i] = static_cast<float>(values[i]);
    const int64_t block = (r * k + first) / kBlock;
    round_blocks(x, count / kBlock, codes.data() + block * kBlock, scales.data() + block, sums.data() + block);
  }
  Int16Rows rows(int64_t k) const { return {codes.data(), scales.data(), sums.data(), k}; }
};

template <typename scalar_t, int64_t kHeadDim>
void run_region(const RegionStep& s, const scalar_t* hidden_in, scalar_t* hidden, scalar_t* residual, int threads) {
  const int64_t B = s.batch, H = s.hidden, I = s.inner, group = s.heads / s.kv_heads;
  const int64_t q_size = s.heads * kHeadDim, kv_size = s.kv_heads * kHeadDim, qkv_n = q_size + 2 * kv_size;
  const int64_t pool_slots = s.num_blocks * s.block_size, half = kHeadDim / 2;
  RoundedRows rounded(B, std::max({H, q_size, I}));
  std::vector<float> y(B * std::max({qkv_n, H, 2 * I}));
  std::vector<scalar_t> normed(B * H), q(B * q_size), attention(B * q_size), gate_up(B * 2 * I), act(B * I), qkv(B * qkv_n);
  const DecodeSplit split(s.context_lens, B, s.kv_heads);  // the same for every layer
  std::vector<float> parts(split.any_split() ? split.items() * part_floats<kHeadDim>(group) : 0);
#pragma omp parallel num_threads(threads)
  {
    const int tid = omp_get_thread_num(), team = omp_get_num_threads();
    std::vector<float> norm_room(H);
    DecodeRoom room(group, kHeadDim);
    for (size_t l = 0; l < s.layers.size(); ++l) {
      const RegionLayer& layer = s.layers[l];
      // the previous layer's down projection, then this layer's input norm with the residual add
      for (int64_t r = tid; r < B; r += team) {
        if (l > 0) linear_out(y.data() + r * H, s.layers[l - 1].down.bias, hidden + r * H, H);
        add_rms_norm_row(l > 0 ? hidden + r * H : hidden_in + r * H, l > 0 ? residual + r * H : nullptr,
                         static_cast<const scalar_t*>(layer.input_norm), normed.data() + r * H, residual + r * H, H,
                         s.eps, norm_room.data());
        rounded.round(normed.data() + r * H, r, H, 0, H);
      }
#pragma omp barrier
      layer.qkv.share(rounded.rows(H), B, y.data(), tid, team);
#pragma omp barrier
      for (int64_t r = tid; r < B; r += team) {  // rotary on q and k, the new key and value into the pool
        scalar_t* row = qkv.data() + r * qkv_n;
        linear_out(y.data() + r * qkv_n, layer.qkv.bias, row, qkv_n);
        rotate_row(row, s.cos + s.positions[r] * half, s.sin + s.positions[r] * half, s.heads + s.kv_heads, kHeadDim);
        std::copy_n(row, q_size, q.data() + r * q_size);
        for (int64_t h = 0; h < s.kv_heads; ++h) {
          const int64_t slot = (h * pool_slots + s.slots[r]) * kHeadDim;
          std::copy_n(row + q_size + h * kHeadDim, kHeadDim, static_cast<scalar_t*>(layer.k_cache) + slot);
          std::copy_n(row + q_size + kv_size + h * kHeadDim, kHeadDim, static_cast<scalar_t*>(layer.v_cache) + slot);
        }
      }
#pragma omp barrier
      const DecodeArgs<scalar_t, scalar_t> args{q.data(), static_cast<const scalar_t*>(layer.k_cache),
                                      static_cast<const scalar_t*>(layer.v_cache), s.block_tables, s.context_lens,
                                      attention.data(), s.heads, s.kv_heads, s.num_blocks, s.block_size,
                                      s.max_blocks, s.scale};
      // a task's heads are whole blocks of the o projection's input: rounded as each is done, without a barrier
      const auto round_task = [&](int64_t task) {
        const int64_t r = task / s.kv_heads, first = (task % s.kv_heads) * group * kHeadDim;
        rounded.round(attention.data() + r * q_size + first, r, q_size, first, group * kHeadDim);
      };
      for (int64_t item = split.items() * tid / team; item < split.items() * (tid + 1) / team; ++item) {
        decode_item<scalar_t, scalar_t, kHeadDim>(item, split, args, parts.data(), room);
        if (const int64_t task = split.task_of(item); !split.split(task)) round_task(task);
      }
      if (split.any_split()) {
#pragma omp barrier
        for (int64_t task = split.tasks() * tid / team; task < split.tasks() * (tid + 1) / team; ++task) {
          if (!split.split(task)) continue;
          merge_parts<scalar_t, scalar_t, kHeadDim>(task, split, args, parts.data());
          round_task(task);
        }
      }
#pragma omp barrier
      layer.o.share(rounded.rows(q_size), B, y.data(), tid, team);
#pragma omp barrier
      for (int64_t r = tid; r < B; r += team) {
        scalar_t* o_row = q.data() + r * q_size;  // q is spent: room for the projection's H values (H <= q_size)
        linear_out(y.data() + r * H, layer.o.bias, o_row, H);
        add_rms_norm_row(o_row, residual + r * H, static_cast<const scalar_t*>(layer.post_norm), normed.data() + r * H,
                         residual + r * H, H, s.eps, norm_room.data());
        rounded.round(normed.data() + r * H, r, H, 0, H);
      }
#pragma omp barrier
      layer.gate_up.share(rounded.rows(H), B, y.data(), tid, team);
#pragma omp barrier
      for (int64_t r = tid; r < B; r += team) {
        scalar_t* gu = gate_up.data() + r * 2 * I;
        linear_out(y.data() + r * 2 * I, layer.gate_up.bias, gu, 2 * I);
        silu_and_mul_row(gu, gu + I, act.data() + r * I, I);
        rounded.round(act.data() + r * I, r, I, 0, I);
      }
#pragma omp barrier
      layer.down.share(rounded.rows(I), B, y.data(), tid, team);
#pragma omp barrier
    }
    for (int64_t r = tid; r < B; r += team) linear_out(y.data() + r * H, s.layers.back().down.bias, hidden + r * H, H);
  }
}

// w: a linear's 4 tensors (decoder_cpu.cpp's order); nullopt unless its codes are interleaved.
std::optional<RegionLinear> region_linear(const at::Tensor* w, int64_t k, int64_t n, RegionStep& step) {
  const at::Tensor &codes = w[0], &d = w[1], &m = w[2], &bias = w[3];
  if (codes.dim() != 3 || !d.numel() || k % kBlock) return std::nullopt;
  const bool q4 = m.numel() > 0;
  TORCH_CHECK((q4 ? interleaved_width<true>(k, codes, d, m) : interleaved_width<false>(k, codes, d, m)) == n,
              "a linear's blocks do not match the model's shape");
  const float* b = nullptr;
  if (bias.numel()) {
    TORCH_CHECK(bias.numel() == n, "a bias does not match its linear");
    step.float_biases.push_back(bias.to(at::kFloat).contiguous());
    b = step.float_biases.back().data_ptr<float>();
  }
  return RegionLinear{codes.data_ptr<uint8_t>(), d.data_ptr<c10::Half>(), q4 ? m.data_ptr<c10::Half>() : nullptr, b, k, n};
}

#endif

}  // namespace

// decode_layers' work in one region where every linear is interleaved blocks, the dtype fp32 or bf16 and head_dim 64
// or 128 (-> {hidden, residual}); nullopt otherwise, and decode_layers goes op by op.
std::optional<std::vector<at::Tensor>> decode_layers_in_region(
    const at::Tensor& hidden_in, const std::vector<at::Tensor>& weights, const std::vector<at::Tensor>& kv_caches,
    const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slots,
    const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t heads, int64_t kv_heads, int64_t head_dim,
    double eps, double scaling, int64_t weights_per_layer) {
#if defined(INTERLEAVED_BLOCKS) && defined(PAGED_DECODE_VECTORS)
  const auto dtype = hidden_in.scalar_type();
  if ((dtype != at::kFloat && dtype != at::kBFloat16) || (head_dim != 64 && head_dim != 128)) return std::nullopt;
  RegionStep step;
  step.float_biases.reserve(4 * weights.size() / weights_per_layer);  // 4 linears a layer: pointers stay valid
  step.batch = hidden_in.size(0);
  step.hidden = hidden_in.size(1);
  step.heads = heads;
  step.kv_heads = kv_heads;
  step.inner = weights[10].numel() && weights[10].dim() == 3 ? weights[10].size(0) * kLanes / 2 : 0;
  const int64_t q_size = heads * head_dim, kv_size = kv_heads * head_dim;
  for (size_t l = 0; l * weights_per_layer < weights.size(); ++l) {
    const at::Tensor* w = weights.data() + l * weights_per_layer;
    auto qkv = region_linear(w + 1, step.hidden, q_size + 2 * kv_size, step);
    auto o = region_linear(w + 5, q_size, step.hidden, step);
    auto gate_up = region_linear(w + 10, step.hidden, 2 * step.inner, step);
    auto down = region_linear(w + 14, step.inner, step.hidden, step);
    if (!qkv || !o || !gate_up || !down || w[18].numel()) return std::nullopt;  // w[18]: q/k norms (Qwen3), not here
    for (const at::Tensor* norm : {w, w + 9})
      TORCH_CHECK(norm->scalar_type() == dtype && norm->is_contiguous() && norm->numel() == step.hidden);
    const at::Tensor &k_cache = kv_caches[2 * l], &v_cache = kv_caches[2 * l + 1];
    TORCH_CHECK(k_cache.scalar_type() == dtype && k_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() &&
                v_cache.scalar_type() == dtype && v_cache.is_contiguous() && k_cache.dim() == 4 &&
                k_cache.size(0) == kv_heads && k_cache.size(3) == head_dim, "the KV pool does not match the model");
    step.layers.push_back({w[0].data_ptr(), w[9].data_ptr(), *qkv, *o, *gate_up, *down, k_cache.data_ptr(),
                           v_cache.data_ptr()});
  }
  TORCH_CHECK(hidden_in.dim() == 2 && hidden_in.is_contiguous() && q_size >= step.hidden && heads % kv_heads == 0);
  step.num_blocks = kv_caches[0].size(1);
  step.block_size = kv_caches[0].size(2);
  TORCH_CHECK(positions.scalar_type() == at::kLong && slots.scalar_type() == at::kLong && positions.is_contiguous() &&
              slots.is_contiguous() && positions.numel() == step.batch && slots.numel() == step.batch);
  TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.is_contiguous() && sin.is_contiguous() && cos.size(1) == head_dim / 2);
  const auto tables = block_tables.to(at::kLong).contiguous(), lens = context_lens.to(at::kLong).contiguous();
  TORCH_CHECK(tables.size(0) == step.batch && lens.numel() == step.batch, "one block table and length per row");
  check_block_tables(tables.data_ptr<int64_t>(), tables.size(1), lens.data_ptr<int64_t>(), step.batch,
                     step.num_blocks, step.block_size);
  step.positions = positions.data_ptr<int64_t>();
  step.slots = slots.data_ptr<int64_t>();
  for (int64_t r = 0; r < step.batch; ++r) {
    TORCH_CHECK(step.positions[r] >= 0 && step.positions[r] < cos.size(0), "position outside the rotary table");
    TORCH_CHECK(step.slots[r] >= 0 && step.slots[r] < step.num_blocks * step.block_size, "slot out of the pool");
  }
  step.block_tables = tables.data_ptr<int64_t>();
  step.context_lens = lens.data_ptr<int64_t>();
  step.max_blocks = tables.size(1);
  step.cos = cos.data_ptr<float>();
  step.sin = sin.data_ptr<float>();
  step.eps = static_cast<float>(eps);
  step.scale = static_cast<float>(scaling);
  auto hidden = at::empty_like(hidden_in), residual = at::empty_like(hidden_in);
  const int threads = at::get_num_threads();
  if (dtype == at::kFloat) {
    (head_dim == 64 ? run_region<float, 64> : run_region<float, 128>)(
        step, hidden_in.data_ptr<float>(), hidden.data_ptr<float>(), residual.data_ptr<float>(), threads);
  } else {
    (head_dim == 64 ? run_region<c10::BFloat16, 64> : run_region<c10::BFloat16, 128>)(
        step, hidden_in.data_ptr<c10::BFloat16>(), hidden.data_ptr<c10::BFloat16>(), residual.data_ptr<c10::BFloat16>(),
        threads);
  }
  return std::vector<at::Tensor>{hidden, residual};
#else
  return std::nullopt;
#endif
}
