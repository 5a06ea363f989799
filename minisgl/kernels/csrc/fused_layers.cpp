#include "fused_layers.h"
#include "hybrid_state.h"

#include <ATen/ops/cat.h>
#include <ATen/ops/rms_norm.h>

// cpu_kernels.cpp
std::vector<at::Tensor> rms_norm(at::Tensor x, c10::optional<at::Tensor> residual,
                                 at::Tensor weight, double eps);
void rotary_(at::Tensor q, at::Tensor k, at::Tensor positions, at::Tensor cos,
             at::Tensor sin);
void store_kv_(at::Tensor k_cache, at::Tensor v_cache, at::Tensor locations, at::Tensor k,
               at::Tensor v);
at::Tensor decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                            at::Tensor locations, at::Tensor seq_lens, double scale,
                            c10::optional<at::Tensor> token_rows, double softcap,
                            c10::optional<at::Tensor> sinks);
at::Tensor silu_and_mul(at::Tensor x);
// block_matmul.cpp
at::Tensor block_matmul(at::Tensor x, at::Tensor codes, at::Tensor scales, at::Tensor subs,
                        int64_t bits, int64_t mode, int64_t terms);

FusedLayers::FusedLayers(int64_t heads, int64_t kv_heads, int64_t head_dim, double eps,
                         double scale, c10::optional<at::Tensor> cos,
                         c10::optional<at::Tensor> sin, double query_scale,
                         double residual_multiplier)
    : heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), eps_(eps), scale_(scale),
      query_scale_(query_scale), residual_multiplier_(residual_multiplier),
      cos_(std::move(cos)), sin_(std::move(sin)) {
  TORCH_CHECK(cos_.has_value() == sin_.has_value(), "both RoPE tables or neither");
}

std::vector<FusedLayers::Linear> FusedLayers::parsed(
    const std::vector<std::vector<at::Tensor>>& linears,
    const std::vector<std::vector<int64_t>>& kinds) {
  TORCH_CHECK(linears.size() == 4 && kinds.size() == 4, "four linears a layer");
  std::vector<Linear> out(4);
  for (size_t i = 0; i < 4; ++i) {
    TORCH_CHECK(!linears[i].empty() && linears[i].size() % 3 == 0 &&
                kinds[i].size() == linears[i].size(), "three tensors and three kinds a part");
    for (size_t p = 0; p < linears[i].size() / 3; ++p)
      out[i].push_back({linears[i][3 * p], linears[i][3 * p + 1], linears[i][3 * p + 2],
                        kinds[i][3 * p], kinds[i][3 * p + 1], kinds[i][3 * p + 2]});
  }
  return out;
}

FusedLayers::Layer FusedLayers::new_layer(at::Tensor input_norm, at::Tensor post_norm,
                                          const std::vector<std::vector<at::Tensor>>& linears,
                                          const std::vector<std::vector<int64_t>>& kinds,
                                          Mixer mixer) {
  auto parts = parsed(linears, kinds);
  return {std::move(input_norm), std::move(post_norm), std::move(parts[0]), std::move(parts[1]),
          std::move(parts[2]),   std::move(parts[3]),  mixer};
}

void FusedLayers::add_layer(at::Tensor input_norm, at::Tensor post_norm,
                            std::vector<std::vector<at::Tensor>> linears,
                            std::vector<std::vector<int64_t>> kinds, at::Tensor k_cache,
                            at::Tensor v_cache, c10::optional<at::Tensor> q_norm,
                            c10::optional<at::Tensor> k_norm, bool gated, bool rotary) {
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "both QK-norm weights or neither");
  Layer layer = new_layer(std::move(input_norm), std::move(post_norm), linears, kinds,
                          Mixer::attention);
  layer.k_cache = std::move(k_cache);
  layer.v_cache = std::move(v_cache);
  layer.q_norm = std::move(q_norm);
  layer.k_norm = std::move(k_norm);
  layer.gated = gated;
  layer.rotary = rotary;
  layers_.push_back(std::move(layer));
}

void FusedLayers::add_mamba2_layer(at::Tensor input_norm, at::Tensor post_norm,
                                   std::vector<std::vector<at::Tensor>> linears,
                                   std::vector<std::vector<int64_t>> kinds,
                                   at::Tensor conv_weight, c10::optional<at::Tensor> conv_bias,
                                   at::Tensor conv_states, at::Tensor ssm_states,
                                   at::Tensor dt_bias, at::Tensor log_a, at::Tensor D,
                                   at::Tensor norm_weight, int64_t groups, double dt_min,
                                   double dt_max, double norm_eps) {
  Layer layer = new_layer(std::move(input_norm), std::move(post_norm), linears, kinds,
                          Mixer::mamba2);
  layer.mamba2 = {std::move(conv_weight), std::move(conv_states), std::move(ssm_states),
                  std::move(dt_bias),     std::move(log_a),       std::move(D),
                  std::move(norm_weight), std::move(conv_bias),   groups,
                  dt_min,                 dt_max,                 norm_eps};
  layers_.push_back(std::move(layer));
}

void FusedLayers::add_delta_layer(at::Tensor input_norm, at::Tensor post_norm,
                                  std::vector<std::vector<at::Tensor>> linears,
                                  std::vector<std::vector<int64_t>> kinds,
                                  at::Tensor conv_weight, at::Tensor conv_states,
                                  at::Tensor ssm_states, at::Tensor dt_bias, at::Tensor log_a,
                                  at::Tensor norm_weight, int64_t num_k_heads, double norm_eps,
                                  bool tiled) {
  Layer layer = new_layer(std::move(input_norm), std::move(post_norm), linears, kinds,
                          Mixer::delta);
  layer.delta = {std::move(conv_weight), std::move(conv_states), std::move(ssm_states),
                 std::move(dt_bias),     std::move(log_a),       std::move(norm_weight),
                 num_k_heads,            norm_eps,               tiled};
  layers_.push_back(std::move(layer));
}

at::Tensor FusedLayers::matmul(const at::Tensor& x, const Linear& linear) {
  const auto rows = x.contiguous();
  std::vector<at::Tensor> outs;
  for (const Part& p : linear)
    outs.push_back(block_matmul(rows, p.codes, p.scales, p.subs, p.bits, p.mode, p.terms));
  return outs.size() == 1 ? outs[0] : at::cat(outs, -1);
}

// RMSNorm over the last dim without a residual, as layers.norm.RMSNorm.forward_plain runs it on
// CPU: the kernel where x is contiguous, else torch's.
static at::Tensor plain_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  if (x.is_contiguous()) return rms_norm(x, c10::nullopt, weight, eps)[0];
  return at::rms_norm(x, {weight.size(0)}, weight, eps);
}

at::Tensor FusedLayers::scaled(at::Tensor x) const {
  return residual_multiplier_ == 1.0 ? x : x.mul(residual_multiplier_);
}

at::Tensor FusedLayers::attention(const Layer& layer, const at::Tensor& x,
                                  const at::Tensor& positions, const at::Tensor& out_loc,
                                  const at::Tensor& locations, const at::Tensor& lens,
                                  const at::Tensor& rows) const {
  const int64_t tokens = x.size(0), d = head_dim_, q_width = (layer.gated ? 2 : 1) * heads_ * d,
                kv_size = kv_heads_ * d;
  const auto qkv = matmul(x, layer.mix_in);
  auto q = qkv.narrow(-1, 0, q_width).view({tokens, heads_, q_width / heads_});
  at::Tensor gate;
  if (layer.gated) {
    gate = q.narrow(-1, d, d);
    q = q.narrow(-1, 0, d);
  }
  auto k = qkv.narrow(-1, q_width, kv_size).view({tokens, kv_heads_, d});
  auto v = qkv.narrow(-1, q_width + kv_size, kv_size).view({tokens, kv_heads_, d});
  if (layer.q_norm.has_value()) {
    q = plain_norm(q.contiguous(), *layer.q_norm, eps_);
    k = plain_norm(k, *layer.k_norm, eps_);
  }
  if (layer.rotary && cos_.has_value()) rotary_(q, k, positions, *cos_, *sin_);
  if (query_scale_ != 1.0) q = q.mul(query_scale_);
  store_kv_(layer.k_cache, layer.v_cache, out_loc, k, v);
  auto attended = decode_attention(q.contiguous(), layer.k_cache, layer.v_cache, locations,
                                   lens, scale_, rows, 0.0, c10::nullopt)
                      .view({tokens, -1});
  if (layer.gated) attended = attended.mul(gate.reshape({tokens, -1}).sigmoid());
  return matmul(attended, layer.mix_out);
}

// in_proj's parts give q/k/v (the convolution's input), z, b and a.
at::Tensor FusedLayers::delta_net(const Layer& layer, const at::Tensor& x,
                                  const at::Tensor& state_rows,
                                  const at::Tensor& state_counts) const {
  const Delta& m = layer.delta;
  const int64_t nk = m.num_k_heads, nv = m.ssm_states.size(1), dk = m.ssm_states.size(2),
                dv = m.ssm_states.size(3), conv_dim = 2 * nk * dk + nv * dv;
  const auto proj = matmul(x, layer.mix_in);
  TORCH_CHECK(proj.size(1) == conv_dim + nv * dv + 2 * nv, "in_proj: q/k/v, z, b, a");
  return matmul(gated_delta_layer(proj.narrow(1, 0, conv_dim), proj.narrow(1, conv_dim, nv * dv),
                                  proj.narrow(1, conv_dim + nv * dv, nv),
                                  proj.narrow(1, conv_dim + nv * dv + nv, nv), m.conv_weight,
                                  m.conv_states, m.ssm_states, state_rows, state_counts,
                                  m.dt_bias, m.log_a, m.norm_weight, m.eps, nk, m.tiled),
                layer.mix_out);
}

std::vector<at::Tensor> FusedLayers::run(at::Tensor x, at::Tensor positions,
                                         at::Tensor out_loc, at::Tensor locations,
                                         at::Tensor lens, at::Tensor rows,
                                         at::Tensor state_rows, at::Tensor state_counts) const {
  c10::optional<at::Tensor> residual;
  for (const Layer& layer : layers_) {
    auto normed = rms_norm(x, residual, layer.input_norm, eps_);
    residual = normed[1];
    at::Tensor mixed;
    if (layer.mixer == Mixer::mamba2) {
      const Mamba2& m = layer.mamba2;
      mixed = matmul(
          mamba2_spans(matmul(normed[0], layer.mix_in), m.conv_weight, m.conv_bias,
                       m.conv_states, m.ssm_states, state_rows, state_counts, m.dt_bias,
                       m.log_a, m.D, m.norm_weight, m.groups, m.dt_min, m.dt_max, m.eps),
          layer.mix_out);
    } else if (layer.mixer == Mixer::delta) {
      mixed = delta_net(layer, normed[0], state_rows, state_counts);
    } else {
      mixed = attention(layer, normed[0], positions, out_loc, locations, lens, rows);
    }
    normed = rms_norm(scaled(mixed), residual, layer.post_norm, eps_);
    residual = normed[1];
    x = scaled(matmul(silu_and_mul(matmul(normed[0], layer.gate_up)), layer.down));
  }
  return {x, *residual};
}
