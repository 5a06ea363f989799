#include "fused_layers.h"

#include <ATen/ops/cat.h>

// cpu_kernels.cpp
std::vector<at::Tensor> rms_norm(at::Tensor x, c10::optional<at::Tensor> residual,
                                 at::Tensor weight, double eps);
void rotary_(at::Tensor q, at::Tensor k, at::Tensor positions, at::Tensor cos,
             at::Tensor sin);
void store_kv_(at::Tensor k_cache, at::Tensor v_cache, at::Tensor locations, at::Tensor k,
               at::Tensor v);
at::Tensor decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                            at::Tensor locations, at::Tensor seq_lens, double scale,
                            c10::optional<at::Tensor> token_rows, double softcap);
at::Tensor silu_and_mul(at::Tensor x);
// block_matmul.cpp
at::Tensor block_matmul(at::Tensor x, at::Tensor codes, at::Tensor scales, at::Tensor subs,
                        int64_t bits, int64_t mode, int64_t terms);

FusedLayers::FusedLayers(int64_t heads, int64_t kv_heads, int64_t head_dim, double eps,
                         double scale, at::Tensor cos, at::Tensor sin)
    : heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), eps_(eps), scale_(scale),
      cos_(std::move(cos)), sin_(std::move(sin)) {}

void FusedLayers::add_layer(at::Tensor input_norm, at::Tensor post_norm,
                            std::vector<std::vector<at::Tensor>> linears,
                            std::vector<std::vector<int64_t>> kinds, at::Tensor k_cache,
                            at::Tensor v_cache) {
  TORCH_CHECK(linears.size() == 4 && kinds.size() == 4, "four linears a layer");
  Linear parsed[4];
  for (size_t i = 0; i < 4; ++i) {
    TORCH_CHECK(!linears[i].empty() && linears[i].size() % 3 == 0 &&
                kinds[i].size() == linears[i].size(), "three tensors and three kinds a part");
    for (size_t p = 0; p < linears[i].size() / 3; ++p)
      parsed[i].push_back({linears[i][3 * p], linears[i][3 * p + 1], linears[i][3 * p + 2],
                           kinds[i][3 * p], kinds[i][3 * p + 1], kinds[i][3 * p + 2]});
  }
  layers_.push_back({std::move(input_norm), std::move(post_norm), std::move(k_cache),
                     std::move(v_cache), std::move(parsed[0]), std::move(parsed[1]),
                     std::move(parsed[2]), std::move(parsed[3])});
}

at::Tensor FusedLayers::matmul(const at::Tensor& x, const Linear& linear) {
  const auto rows = x.contiguous();
  std::vector<at::Tensor> outs;
  for (const Part& p : linear)
    outs.push_back(block_matmul(rows, p.codes, p.scales, p.subs, p.bits, p.mode, p.terms));
  return outs.size() == 1 ? outs[0] : at::cat(outs, -1);
}

std::vector<at::Tensor> FusedLayers::run(at::Tensor x, at::Tensor positions,
                                         at::Tensor out_loc, at::Tensor locations,
                                         at::Tensor lens, at::Tensor rows) const {
  const int64_t tokens = x.size(0), q_size = heads_ * head_dim_,
                kv_size = kv_heads_ * head_dim_;
  c10::optional<at::Tensor> residual;
  for (const Layer& layer : layers_) {
    auto normed = rms_norm(x, residual, layer.input_norm, eps_);
    residual = normed[1];
    const auto qkv = matmul(normed[0], layer.qkv);
    auto q = qkv.narrow(-1, 0, q_size).view({tokens, heads_, head_dim_});
    auto k = qkv.narrow(-1, q_size, kv_size).view({tokens, kv_heads_, head_dim_});
    auto v = qkv.narrow(-1, q_size + kv_size, kv_size).view({tokens, kv_heads_, head_dim_});
    rotary_(q, k, positions, cos_, sin_);
    store_kv_(layer.k_cache, layer.v_cache, out_loc, k, v);
    const auto attended = decode_attention(q.contiguous(), layer.k_cache, layer.v_cache,
                                           locations, lens, scale_, rows, 0.0);
    const auto o = matmul(attended.view({tokens, -1}), layer.o);
    normed = rms_norm(o, residual, layer.post_norm, eps_);
    residual = normed[1];
    x = matmul(silu_and_mul(matmul(normed[0], layer.gate_up)), layer.down);
  }
  return {x, *residual};
}
