// Every decoder layer of a Llama-family model for a batch of single-token decodes, in one native call: the Python
// between the kernels (about ten calls, views and attribute reads a layer) cost as much as a third of a step at one
// or two rows on GGUF blocks, and about a tenth at 48 rows on oneDNN-packed dense weights. The kernels and their
// order are exactly those of engine/models/llama.py, so both paths give the same numbers; only the dispatch moves.

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

namespace {

// oneDNN's packed linear, the op engine/layers/linear.py's packed_matmul calls, with the same arguments.
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& bias) {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x, packed, bias.numel() ? c10::IValue(bias) : c10::IValue(), std::string("none"),
                          c10::List<std::optional<c10::Scalar>>(), std::string("")};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// A linear as 4 tensors of the flat weight list: its GGUF blocks (codes, scales, mins) and bias, or its
// oneDNN-packed weight, two empty tensors and its bias. An empty tensor stands for "none" (mins: a Q8_0 matrix;
// bias: no bias).
struct LayerLinear {
  const at::Tensor &codes_or_packed, &scales, &mins, &bias;

  at::Tensor operator()(const at::Tensor& x) const {
    if (!scales.numel()) return packed_linear(x, codes_or_packed, bias);
    // As engine/layers/quantized.py's block_matmul: fp32 in and out of the kernel, the bias added in fp32.
    const auto x32 = x.scalar_type() == at::kFloat ? x : x.to(at::kFloat);
    auto y = matmul_blocks(x32, codes_or_packed, scales, mins);
    if (bias.numel()) y.add_(bias);
    return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
  }
};

constexpr int64_t kWeightsPerLayer = 20;  // the order of engine/models/llama.py's `_all_layers`

// Qwen3's per-head RMSNorm of q or k, in place on its columns of the merged projection, as llama.py's
// Attention._normalise_heads: the heads as rows of head_dim, normed, written back.
void normalise_heads(at::Tensor part, const at::Tensor& weight, int64_t head_dim, double eps) {
  auto normed = add_rms_norm(part.reshape({-1, head_dim}), c10::nullopt, weight, eps)[0];
  part.copy_(normed.view(part.sizes()));
}

}  // namespace

// hidden [B, hidden_size]: the token embeddings of B single-token decodes. Runs every layer (RMSNorm with
// the residual add, q/k/v, Qwen3's q/k norms, rotary, KV write, paged decode attention, o, RMSNorm, gate/up, SiLU-and-mul, down) and
// returns (hidden, residual) of the last layer, before the final norm. one_region: all in one OpenMP region
// (decode_region_cpu.cpp; an error where the weights do not allow it), else op by op as below.
std::vector<at::Tensor> decode_layers(at::Tensor hidden, std::vector<at::Tensor> weights,
                                      std::vector<at::Tensor> kv_caches, at::Tensor positions,
                                      at::Tensor cos, at::Tensor sin, at::Tensor slots,
                                      at::Tensor block_tables, at::Tensor context_lens, int64_t heads,
                                      int64_t kv_heads, int64_t head_dim, double eps, double scaling, bool one_region) {
  ReleaseGil no_gil;
  TORCH_CHECK(hidden.dim() == 2, "decode_layers takes hidden states [B, hidden]");
  const int64_t layers = static_cast<int64_t>(weights.size()) / kWeightsPerLayer;
  TORCH_CHECK(layers * kWeightsPerLayer == static_cast<int64_t>(weights.size()) && kv_caches.size() == 2 * layers);
  if (one_region) {
    auto out = decode_layers_in_region(hidden, weights, kv_caches, positions, cos, sin, slots, block_tables,
                                       context_lens, heads, kv_heads, head_dim, eps, scaling, kWeightsPerLayer);
    TORCH_CHECK(out, "one region takes interleaved GGUF blocks (an AVX-512 or AVX2 build), fp32 or bf16, head_dim 64 or 128, no q/k norms");
    return *out;
  }
  const int64_t batch = hidden.size(0), q_size = heads * head_dim, kv_size = kv_heads * head_dim;
  c10::optional<at::Tensor> residual;
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor* w = weights.data() + l * kWeightsPerLayer;
    const LayerLinear qkv_proj{w[1], w[2], w[3], w[4]}, o_proj{w[5], w[6], w[7], w[8]};
    const LayerLinear gate_up_proj{w[10], w[11], w[12], w[13]}, down_proj{w[14], w[15], w[16], w[17]};
    const auto& k_cache = kv_caches[2 * l];
    const auto& v_cache = kv_caches[2 * l + 1];

    auto normed = add_rms_norm(hidden, residual, w[0], eps);
    residual = normed[1];
    auto qkv = qkv_proj(normed[0]);
    if (w[18].numel()) {  // q_norm and k_norm (Qwen3); empty tensors elsewhere
      normalise_heads(qkv.narrow(1, 0, q_size), w[18], head_dim, eps);
      normalise_heads(qkv.narrow(1, q_size, kv_size), w[19], head_dim, eps);
    }
    rotary_inplace(qkv, positions, cos, sin, heads + kv_heads, head_dim);
    auto q = qkv.narrow(1, 0, q_size).view({batch, heads, head_dim});
    auto k = qkv.narrow(1, q_size, kv_size).view({batch, kv_heads, head_dim});
    auto v = qkv.narrow(1, q_size + kv_size, kv_size).view({batch, kv_heads, head_dim});
    write_kv(k_cache, v_cache, k, v, slots);
    auto attention = paged_decode(q, k_cache, v_cache, block_tables, context_lens, scaling);
    normed = add_rms_norm(o_proj(attention.view({batch, q_size})), residual, w[9], eps);
    residual = normed[1];
    hidden = down_proj(silu_and_mul(gate_up_proj(normed[0])));
  }
  return {hidden, *residual};
}
