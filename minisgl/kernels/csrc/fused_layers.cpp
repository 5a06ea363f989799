#include "fused_layers.h"
#include "hybrid_state.h"

#include <ATen/ops/argsort.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/rms_norm.h>
#include <ATen/ops/sigmoid.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>

#include <limits>

// cpu_kernels.cpp
std::vector<at::Tensor> rms_norm(at::Tensor x, c10::optional<at::Tensor> residual,
                                 at::Tensor weight, double eps);
void rotary_(at::Tensor q, at::Tensor k, at::Tensor positions, at::Tensor cos,
             at::Tensor sin);
void store_kv_(at::Tensor k_cache, at::Tensor v_cache, at::Tensor locations, at::Tensor k,
               at::Tensor v, c10::optional<at::Tensor> k_scales,
               c10::optional<at::Tensor> v_scales);
at::Tensor decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                            at::Tensor locations, at::Tensor seq_lens, double scale,
                            c10::optional<at::Tensor> token_rows, double softcap,
                            c10::optional<at::Tensor> sinks, c10::optional<at::Tensor> k_scales,
                            c10::optional<at::Tensor> v_scales);
at::Tensor silu_and_mul(at::Tensor x);
// block_matmul.cpp
at::Tensor block_matmul(at::Tensor x, at::Tensor codes, at::Tensor scales, at::Tensor subs,
                        int64_t bits, int64_t mode, int64_t terms);
at::Tensor block_matmul_grouped(at::Tensor x, std::vector<at::Tensor> codes,
                                std::vector<at::Tensor> scales, std::vector<at::Tensor> subs,
                                int64_t bits, int64_t mode, int64_t terms,
                                std::vector<int64_t> counts);
// quant_matmul.cpp
at::Tensor quant_matmul(at::Tensor x, at::Tensor codes, at::Tensor dm, int64_t terms);

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
  TORCH_CHECK(kinds.size() == linears.size(), "a kind per linear");
  std::vector<Linear> out(linears.size());
  for (size_t i = 0; i < linears.size(); ++i) {
    TORCH_CHECK(!linears[i].empty() && linears[i].size() % 3 == 0 &&
                kinds[i].size() == linears[i].size(), "three tensors and three kinds a part");
    for (size_t p = 0; p < linears[i].size() / 3; ++p)
      out[i].push_back({linears[i][3 * p], linears[i][3 * p + 1], linears[i][3 * p + 2],
                        kinds[i][3 * p], kinds[i][3 * p + 1], kinds[i][3 * p + 2]});
  }
  return out;
}

FusedLayers::Grouped FusedLayers::grouped(const std::vector<at::Tensor>& tensors,
                                          const std::vector<int64_t>& kinds) {
  TORCH_CHECK(!tensors.empty() && tensors.size() % 3 == 0 && kinds.size() == 3,
              "each expert's three tensors, one kind for them all");
  Grouped g{{}, {}, {}, kinds[0], kinds[1], kinds[2]};
  for (size_t e = 0; e < tensors.size(); e += 3) {
    g.codes.push_back(tensors[e]);
    g.scales.push_back(tensors[e + 1]);
    g.subs.push_back(tensors[e + 2]);
  }
  return g;
}

FusedLayers::Sublayer FusedLayers::sublayer(Kind kind, at::Tensor norm,
                                            const std::vector<std::vector<at::Tensor>>& linears,
                                            const std::vector<std::vector<int64_t>>& kinds) {
  auto parts = parsed(linears, kinds);
  TORCH_CHECK(parts.size() == 2, "a sublayer's two linears");
  Sublayer layer;
  layer.norm = std::move(norm);
  layer.kind = kind;
  layer.in = std::move(parts[0]);
  layer.out = std::move(parts[1]);
  return layer;
}

void FusedLayers::add_attention(at::Tensor norm, std::vector<std::vector<at::Tensor>> linears,
                                std::vector<std::vector<int64_t>> kinds, at::Tensor k_cache,
                                at::Tensor v_cache, c10::optional<at::Tensor> k_scales,
                                c10::optional<at::Tensor> v_scales,
                                c10::optional<at::Tensor> q_norm,
                                c10::optional<at::Tensor> k_norm, bool gated, bool rotary) {
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "both QK-norm weights or neither");
  Sublayer layer = sublayer(Kind::attention, std::move(norm), linears, kinds);
  layer.k_cache = std::move(k_cache);
  layer.v_cache = std::move(v_cache);
  layer.k_scales = std::move(k_scales);
  layer.v_scales = std::move(v_scales);
  layer.q_norm = std::move(q_norm);
  layer.k_norm = std::move(k_norm);
  layer.gated = gated;
  layer.rotary = rotary;
  sublayers_.push_back(std::move(layer));
}

void FusedLayers::add_mamba2(at::Tensor norm, std::vector<std::vector<at::Tensor>> linears,
                             std::vector<std::vector<int64_t>> kinds, at::Tensor conv_weight,
                             c10::optional<at::Tensor> conv_bias, at::Tensor conv_states,
                             at::Tensor ssm_states, at::Tensor dt_bias, at::Tensor log_a,
                             at::Tensor D, at::Tensor norm_weight, int64_t groups,
                             double dt_min, double dt_max, double norm_eps) {
  Sublayer layer = sublayer(Kind::mamba2, std::move(norm), linears, kinds);
  layer.mamba2 = {std::move(conv_weight), std::move(conv_states), std::move(ssm_states),
                  std::move(dt_bias),     std::move(log_a),       std::move(D),
                  std::move(norm_weight), std::move(conv_bias),   groups,
                  dt_min,                 dt_max,                 norm_eps};
  sublayers_.push_back(std::move(layer));
}

void FusedLayers::add_delta_net(at::Tensor norm, std::vector<std::vector<at::Tensor>> linears,
                                std::vector<std::vector<int64_t>> kinds,
                                at::Tensor conv_weight, at::Tensor conv_states,
                                at::Tensor ssm_states, at::Tensor dt_bias, at::Tensor log_a,
                                at::Tensor norm_weight, int64_t num_k_heads, double norm_eps,
                                bool tiled) {
  Sublayer layer = sublayer(Kind::delta, std::move(norm), linears, kinds);
  layer.delta = {std::move(conv_weight), std::move(conv_states), std::move(ssm_states),
                 std::move(dt_bias),     std::move(log_a),       std::move(norm_weight),
                 num_k_heads,            norm_eps,               tiled};
  sublayers_.push_back(std::move(layer));
}

void FusedLayers::add_mlp(at::Tensor norm, std::vector<std::vector<at::Tensor>> linears,
                          std::vector<std::vector<int64_t>> kinds, bool relu2) {
  Sublayer layer = sublayer(Kind::mlp, std::move(norm), linears, kinds);
  layer.relu2 = relu2;
  sublayers_.push_back(std::move(layer));
}

void FusedLayers::add_moe(at::Tensor norm, at::Tensor router_weight,
                          c10::optional<at::Tensor> router_bias, bool softmax, int64_t top_k,
                          int64_t groups, int64_t top_groups, bool renormalize, double scale,
                          std::vector<std::vector<at::Tensor>> experts,
                          std::vector<std::vector<int64_t>> expert_kinds, bool relu2,
                          std::vector<std::vector<at::Tensor>> shared,
                          std::vector<std::vector<int64_t>> shared_kinds,
                          c10::optional<at::Tensor> shared_gate) {
  TORCH_CHECK(experts.size() == 2 && expert_kinds.size() == 2, "the experts' up and down");
  TORCH_CHECK(router_weight.dim() == 2 &&
              experts[0].size() == 3 * static_cast<size_t>(router_weight.size(0)),
              "a router weight with a row per expert");
  TORCH_CHECK(softmax || (router_weight.scalar_type() == at::kFloat && router_bias.has_value()),
              "a grouped sigmoid router: a float32 weight and a correction bias");
  Sublayer layer;
  if (shared.empty()) {
    layer.norm = std::move(norm);
    layer.kind = Kind::moe;
  } else {
    layer = sublayer(Kind::moe, std::move(norm), shared, shared_kinds);
  }
  layer.relu2 = relu2;
  layer.moe = {std::move(router_weight), std::move(router_bias), std::move(shared_gate),
               softmax, top_k, groups, top_groups, renormalize, scale,
               grouped(experts[0], expert_kinds[0]), grouped(experts[1], expert_kinds[1]),
               !shared.empty()};
  sublayers_.push_back(std::move(layer));
}

at::Tensor FusedLayers::matmul(const at::Tensor& x, const Linear& linear) {
  const auto rows = x.contiguous();
  std::vector<at::Tensor> outs;
  for (const Part& p : linear)
    outs.push_back(p.mode == kQuantLayout
                       ? quant_matmul(rows, p.codes, p.scales, p.terms)
                       : block_matmul(rows, p.codes, p.scales, p.subs, p.bits, p.mode, p.terms));
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

at::Tensor FusedLayers::attention(const Sublayer& layer, const at::Tensor& x,
                                  const at::Tensor& positions, const at::Tensor& out_loc,
                                  const at::Tensor& locations, const at::Tensor& lens,
                                  const at::Tensor& rows) const {
  const int64_t tokens = x.size(0), d = head_dim_, q_width = (layer.gated ? 2 : 1) * heads_ * d,
                kv_size = kv_heads_ * d;
  const auto qkv = matmul(x, layer.in);
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
  store_kv_(layer.k_cache, layer.v_cache, out_loc, k, v, layer.k_scales, layer.v_scales);
  auto attended = decode_attention(q.contiguous(), layer.k_cache, layer.v_cache, locations,
                                   lens, scale_, rows, 0.0, c10::nullopt, layer.k_scales,
                                   layer.v_scales)
                      .view({tokens, -1});
  if (layer.gated) attended = attended.mul(gate.reshape({tokens, -1}).sigmoid());
  return matmul(attended, layer.out);
}

// in_proj's parts give q/k/v (the convolution's input), z, b and a.
at::Tensor FusedLayers::delta_net(const Sublayer& layer, const at::Tensor& x,
                                  const at::Tensor& state_rows,
                                  const at::Tensor& state_counts) const {
  const Delta& m = layer.delta;
  const int64_t nk = m.num_k_heads, nv = m.ssm_states.size(1), dk = m.ssm_states.size(2),
                dv = m.ssm_states.size(3), conv_dim = 2 * nk * dk + nv * dv;
  const auto proj = matmul(x, layer.in);
  TORCH_CHECK(proj.size(1) == conv_dim + nv * dv + 2 * nv, "in_proj: q/k/v, z, b, a");
  return matmul(gated_delta_layer(proj.narrow(1, 0, conv_dim), proj.narrow(1, conv_dim, nv * dv),
                                  proj.narrow(1, conv_dim + nv * dv, nv),
                                  proj.narrow(1, conv_dim + nv * dv + nv, nv), m.conv_weight,
                                  m.conv_states, m.ssm_states, state_rows, state_counts,
                                  m.dt_bias, m.log_a, m.norm_weight, m.eps, nk, m.tiled),
                layer.out);
}

// relu² in place, as models.nemotron_h.ReluSquared
static at::Tensor relu_squared(at::Tensor x) { return x.relu_().square_(); }

at::Tensor FusedLayers::mlp(const Sublayer& layer, const at::Tensor& x) {
  const auto up = matmul(x, layer.in);
  return matmul(layer.relu2 ? relu_squared(up) : silu_and_mul(up), layer.out);
}

// TopKRouter's or GroupedSigmoidRouter's forward.
std::pair<at::Tensor, at::Tensor> FusedLayers::route(const Moe& m, const at::Tensor& x) {
  if (m.softmax) {
    const auto probs = at::softmax(at::linear(x, m.router_weight, m.router_bias).to(at::kFloat),
                                   -1);
    auto [weights, ids] = probs.topk(m.top_k, -1);
    if (m.renormalize) weights = weights.div(weights.sum(-1, true));
    return {weights.to(x.scalar_type()), ids};
  }
  const int64_t tokens = x.size(0);
  const auto scores = at::sigmoid(at::linear(x.to(at::kFloat), m.router_weight));
  auto biased = scores.add(*m.router_bias);
  if (m.top_groups < m.groups) {
    const auto by_group = biased.view({tokens, m.groups, -1});
    const auto best = std::get<0>(by_group.topk(2, -1)).sum(-1);
    const auto kept = at::zeros_like(best, best.options().dtype(at::kBool))
                          .scatter_(1, std::get<1>(best.topk(m.top_groups, -1)), true);
    biased = by_group.masked_fill(kept.unsqueeze(2).logical_not(),
                                  -std::numeric_limits<float>::infinity())
                 .view({tokens, -1});
  }
  const auto ids = std::get<1>(biased.topk(m.top_k, -1));
  auto weights = scores.gather(1, ids);
  if (m.renormalize) weights = weights.div(weights.sum(-1, true).add(1e-20));
  return {weights.mul(m.scale).to(x.scalar_type()), ids};
}

// SparseMoE's forward (Experts': the rows grouped by expert, one block_matmul_grouped per
// part, weighted and summed back per token), plus the shared expert (times its gate).
at::Tensor FusedLayers::experts(const Sublayer& layer, const at::Tensor& x) {
  const Moe& m = layer.moe;
  const auto [weights, ids] = route(m, x);
  const auto choices = ids.flatten();
  const auto order = at::argsort(choices, /*stable=*/true);
  std::vector<int64_t> counts(m.router_weight.size(0), 0);
  const auto host_choices = choices.contiguous();
  const int64_t* choice = host_choices.data_ptr<int64_t>();
  for (int64_t i = 0; i < choices.numel(); ++i) ++counts[choice[i]];
  const auto rows = order.div(m.top_k, "floor");
  const auto rows_in = x.index_select(0, rows).contiguous();
  const auto up = block_matmul_grouped(rows_in, m.up.codes, m.up.scales, m.up.subs, m.up.bits,
                                       m.up.mode, m.up.terms, counts);
  auto out = block_matmul_grouped(layer.relu2 ? relu_squared(up) : silu_and_mul(up),
                                  m.down.codes, m.down.scales, m.down.subs, m.down.bits,
                                  m.down.mode, m.down.terms, counts);
  out = out.mul(weights.flatten().index_select(0, order).unsqueeze(1));
  const auto routed = at::zeros_like(x).index_add_(0, rows, out);
  if (!m.shared) return routed;
  auto shared = mlp(layer, x);
  if (m.shared_gate.has_value())
    shared = shared.mul(at::sigmoid(at::linear(x, *m.shared_gate)));
  return routed.add(shared);
}

std::vector<at::Tensor> FusedLayers::run(at::Tensor x, at::Tensor positions,
                                         at::Tensor out_loc, at::Tensor locations,
                                         at::Tensor lens, at::Tensor rows,
                                         at::Tensor state_rows, at::Tensor state_counts) const {
  if (x.dim() == 2 && x.size(0) == 1)
    if (auto one_row = run_one_row(x, positions, out_loc, locations, lens, rows))
      return *one_row;
  c10::optional<at::Tensor> residual;
  for (const Sublayer& layer : sublayers_) {
    const auto normed = rms_norm(x, residual, layer.norm, eps_);
    residual = normed[1];
    at::Tensor out;
    switch (layer.kind) {
      case Kind::mamba2: {
        const Mamba2& m = layer.mamba2;
        out = matmul(mamba2_spans(matmul(normed[0], layer.in), m.conv_weight, m.conv_bias,
                                  m.conv_states, m.ssm_states, state_rows, state_counts,
                                  m.dt_bias, m.log_a, m.D, m.norm_weight, m.groups, m.dt_min,
                                  m.dt_max, m.eps),
                     layer.out);
        break;
      }
      case Kind::delta:
        out = delta_net(layer, normed[0], state_rows, state_counts);
        break;
      case Kind::attention:
        out = attention(layer, normed[0], positions, out_loc, locations, lens, rows);
        break;
      case Kind::mlp:
        out = mlp(layer, normed[0]);
        break;
      case Kind::moe:
        out = experts(layer, normed[0]);
        break;
    }
    x = scaled(out);
  }
  return {x, *residual};
}
