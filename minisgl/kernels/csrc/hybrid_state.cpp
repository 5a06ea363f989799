// The decode step of a hybrid model's linear layers (Gated DeltaNet, Mamba2) with each request's
// state updated in place in the state pool (kvcache/state_pool.py), read and written once:
// 1. per (row, block of channels): the convolution window shifts in the new input (in the
//    model's dtype), the depthwise convolution's last position (+ bias) and SiLU, in float32;
// 2. per (row, head): the recurrent state's step, float32. A Gated DeltaNet head's state S
//    (dk x dv) goes through in column blocks kept in L1: a column's recall (S^T k) needs only
//    that column, so one sweep reads the block and a second updates it and reads it out. A
//    Mamba2 head's state needs one sweep.
// Heads that share a key head (DeltaNet) or a group's B and C (Mamba2) read them in place.
#include "aten.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

constexpr int64_t kConvBlock = 512;  // channels per work item of the convolution
constexpr float kNormEps = 1e-6f;    // the l2 norm's, as models.qwen3_next.l2_normalized
// A Gated DeltaNet state's columns per block: dk x 32 floats (16 KB at dk 128) stay in L1
// between the block's two sweeps.
constexpr int kColumns = 32;

inline float silu(float x) { return x / (1.f + std::exp(-x)); }

// out[row][c] = silu(sum_t w[c][t] window[c][t] + bias[c]) over window = (state, x): the state
// [rows of the pool, channels, K - 1] of each batch row's table row shifts in x [n, channels].
template <typename T>
void conv_step(const T* x, int64_t x_stride, const T* weight, const T* bias, T* states,
               const int64_t* rows, float* out, int64_t n, int64_t channels, int64_t kernel) {
  const int64_t blocks = (channels + kConvBlock - 1) / kConvBlock, keep = kernel - 1;
  at::parallel_for(0, n * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / blocks, c0 = task % blocks * kConvBlock;
      const int64_t c1 = std::min(channels, c0 + kConvBlock);
      T* state = states + rows[r] * channels * keep;
      const T* xr = x + r * x_stride;
      float* o = out + r * channels;
      for (int64_t c = c0; c < c1; ++c) {
        T* s = state + c * keep;
        const T* w = weight + c * kernel;
        const T newest = xr[c];
        float acc = bias != nullptr ? static_cast<float>(bias[c]) : 0.f;
        for (int64_t t = 0; t < keep; ++t)
          acc += static_cast<float>(w[t]) * static_cast<float>(s[t]);
        acc += static_cast<float>(w[keep]) * static_cast<float>(newest);
        for (int64_t t = 0; t + 1 < keep; ++t) s[t] = s[t + 1];
        if (keep > 0) s[keep - 1] = newest;
        o[c] = silu(acc);
      }
    }
  });
}

// Columns [j0, j0 + W) of one head's delta rule step, S (dk x dv, row stride dv) in place:
// recall = S^T k; delta = beta (v - g recall); S <- g S + k delta^T; out = S^T q.
template <int W>
inline void delta_columns(float* S, int64_t dk, int64_t dv, int64_t j0, const float* q,
                          const float* k, const float* v, float g, float beta, float* out) {
  float acc[W] = {};
  for (int64_t i = 0; i < dk; ++i) {
    const float* row = S + i * dv + j0;
    const float ki = k[i];
#pragma omp simd
    for (int j = 0; j < W; ++j) acc[j] += ki * row[j];
  }
  float delta[W], o[W] = {};
#pragma omp simd
  for (int j = 0; j < W; ++j) delta[j] = beta * (v[j0 + j] - g * acc[j]);
  for (int64_t i = 0; i < dk; ++i) {
    float* row = S + i * dv + j0;
    const float ki = k[i], qi = q[i];
#pragma omp simd
    for (int j = 0; j < W; ++j) {
      const float s = g * row[j] + ki * delta[j];
      row[j] = s;
      o[j] += qi * s;
    }
  }
#pragma omp simd
  for (int j = 0; j < W; ++j) out[j0 + j] = o[j];
}

// One l2-normalized (and scaled) copy of a head's dk values.
inline void normalized(const float* x, int64_t d, float scale, float* out) {
  float squares = 0.f;
#pragma omp simd reduction(+ : squares)
  for (int64_t i = 0; i < d; ++i) squares += x[i] * x[i];
  const float factor = scale / std::sqrt(squares + kNormEps);
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) out[i] = x[i] * factor;
}

// conv: [n, 2 nk dk + nv dv] (q, k, v) after the convolution; states [pool rows, nv, dk, dv].
void delta_step(const float* conv, float* states, const int64_t* rows, const float* decay,
                const float* beta, float* out, int64_t n, int64_t nk, int64_t nv, int64_t dk,
                int64_t dv) {
  const int64_t group = nv / nk, conv_dim = 2 * nk * dk + nv * dv;
  const float q_scale = 1.f / std::sqrt(static_cast<float>(dk));
  at::parallel_for(0, n * nv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(dk), k(dk);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / nv, h = task % nv, kh = h / group;
      const float* c = conv + r * conv_dim;
      normalized(c + kh * dk, dk, q_scale, q.data());
      normalized(c + (nk + kh) * dk, dk, 1.f, k.data());
      const float* v = c + 2 * nk * dk + h * dv;
      float* S = states + (rows[r] * nv + h) * dk * dv;
      const float g = std::exp(decay[r * nv + h]), b = beta[r * nv + h];
      float* o = out + (r * nv + h) * dv;
      const float *qn = q.data(), *kn = k.data();
      int64_t j = 0;
      for (; j + kColumns <= dv; j += kColumns)
        delta_columns<kColumns>(S, dk, dv, j, qn, kn, v, g, b, o);
      for (; j + 8 <= dv; j += 8) delta_columns<8>(S, dk, dv, j, qn, kn, v, g, b, o);
      for (; j < dv; ++j) delta_columns<1>(S, dk, dv, j, qn, kn, v, g, b, o);
    }
  });
}

// conv: [n, heads P + 2 groups N] (x, B, C) after the convolution; states [pool rows, heads,
// P, N]. Per (row, head): h <- exp(dt a) h + dt x B^T; y = h C.
void mamba2_state_step(const float* conv, float* states, const int64_t* rows, const float* dt,
                       const float* log_a, float* y, int64_t n, int64_t heads, int64_t groups,
                       int64_t P, int64_t N) {
  const int64_t per_group = heads / groups, conv_dim = heads * P + 2 * groups * N;
  at::parallel_for(0, n * heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / heads, h = task % heads, grp = h / per_group;
      const float* x = conv + r * conv_dim + h * P;
      const float* B = conv + r * conv_dim + heads * P + grp * N;
      const float* C = B + groups * N;
      const float step = dt[r * heads + h], g = std::exp(step * log_a[h]);
      float* H = states + (rows[r] * heads + h) * P * N;
      float* o = y + (r * heads + h) * P;
      for (int64_t p = 0; p < P; ++p) {
        float* row = H + p * N;
        const float u = step * x[p];
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < N; ++i) {
          const float s = g * row[i] + u * B[i];
          row[i] = s;
          sum += s * C[i];
        }
        o[p] = sum;
      }
    }
  });
}

// The convolution's step over the batch rows' windows, into a float32 [n, channels].
at::Tensor conv_window_step(const at::Tensor& x, const at::Tensor& weight,
                            const c10::optional<at::Tensor>& bias, at::Tensor& conv_states,
                            const at::Tensor& rows) {
  const int64_t n = x.size(0), channels = x.size(1), kernel = weight.size(-1);
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "the inputs' channels contiguous");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == channels * kernel);
  TORCH_CHECK(conv_states.is_contiguous() && conv_states.dim() == 3 &&
              conv_states.size(1) == channels && conv_states.size(2) == kernel - 1);
  TORCH_CHECK(x.scalar_type() == conv_states.scalar_type() &&
              weight.scalar_type() == conv_states.scalar_type(),
              "inputs, conv weight and windows in one dtype");
  TORCH_CHECK(!bias.has_value() || (bias->is_contiguous() && bias->numel() == channels &&
                                    bias->scalar_type() == weight.scalar_type()));
  auto out = at::empty({n, channels}, x.options().dtype(at::kFloat));
  const int64_t* r = rows.data_ptr<int64_t>();
  if (x.scalar_type() == at::kBFloat16) {
    using T = at::BFloat16;
    conv_step<T>(x.data_ptr<T>(), x.stride(0), weight.data_ptr<T>(),
                 bias.has_value() ? bias->data_ptr<T>() : nullptr, conv_states.data_ptr<T>(),
                 r, out.data_ptr<float>(), n, channels, kernel);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "float32 or bfloat16 windows");
    conv_step<float>(x.data_ptr<float>(), x.stride(0), weight.data_ptr<float>(),
                     bias.has_value() ? bias->data_ptr<float>() : nullptr,
                     conv_states.data_ptr<float>(), r, out.data_ptr<float>(), n, channels,
                     kernel);
  }
  return out;
}

// The recurrent states (float32 [pool rows, heads, ., .], as many rows as the conv windows')
// and the n batch rows' table rows in them.
void check_states(const at::Tensor& ssm_states, const at::Tensor& conv_states,
                  const at::Tensor& rows, int64_t n) {
  TORCH_CHECK(ssm_states.scalar_type() == at::kFloat && ssm_states.is_contiguous() &&
              ssm_states.dim() == 4 && ssm_states.size(0) == conv_states.size(0));
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.is_contiguous() && rows.numel() == n);
  const int64_t pool = ssm_states.size(0);
  const int64_t* r = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(r[i] >= 0 && r[i] < pool, "state row out of range");
}

void check_per_head(const at::Tensor& t, int64_t n, int64_t heads) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == n * heads,
              "float32 [rows, heads]");
}

}  // namespace

// One token of each of n requests through a Gated DeltaNet layer's decode step. mixed: [n,
// conv_dim] (q, k, v of nk, nk and nv heads before the convolution); conv_weight: [conv_dim,
// 1, K]; conv_states: [pool rows, conv_dim, K - 1], all three in the model's dtype; ssm_states:
// [pool rows, nv, dk, dv] float32; rows: [n] the batch rows' table rows; decay (the log of the
// gate) and beta: [n, nv] float32. Both states are updated in place. Returns [n, nv, dv].
at::Tensor gated_delta_step(at::Tensor mixed, at::Tensor conv_weight, at::Tensor conv_states,
                            at::Tensor ssm_states, at::Tensor rows, at::Tensor decay,
                            at::Tensor beta, int64_t num_k_heads) {
  const int64_t n = mixed.size(0);
  check_states(ssm_states, conv_states, rows, n);
  const int64_t nv = ssm_states.size(1), dk = ssm_states.size(2), dv = ssm_states.size(3);
  TORCH_CHECK(num_k_heads > 0 && nv % num_k_heads == 0 &&
              mixed.size(1) == 2 * num_k_heads * dk + nv * dv, "conv_dim = 2 nk dk + nv dv");
  check_per_head(decay, n, nv);
  check_per_head(beta, n, nv);
  const auto conv = conv_window_step(mixed, conv_weight, c10::nullopt, conv_states, rows);
  auto out = at::empty({n, nv, dv}, conv.options());
  delta_step(conv.data_ptr<float>(), ssm_states.data_ptr<float>(), rows.data_ptr<int64_t>(),
             decay.data_ptr<float>(), beta.data_ptr<float>(), out.data_ptr<float>(), n,
             num_k_heads, nv, dk, dv);
  return out;
}

// One token of each of n requests through a Mamba2 layer's decode step. xbc: [n, conv_dim]
// (x of heads * P channels, then B and C of groups * N each, before the convolution);
// conv_weight [conv_dim, 1, K], conv_bias [conv_dim] and conv_states [pool rows, conv_dim,
// K - 1] in the model's dtype; ssm_states [pool rows, heads, P, N] float32; dt [n, heads] and
// log_a [heads] (a < 0) float32. Both states are updated in place. Returns (y [n, heads, P]
// without the D skip, x [n, heads, P]: the convolution's x), float32.
std::vector<at::Tensor> mamba2_step(at::Tensor xbc, at::Tensor conv_weight,
                                    c10::optional<at::Tensor> conv_bias, at::Tensor conv_states,
                                    at::Tensor ssm_states, at::Tensor rows, at::Tensor dt,
                                    at::Tensor log_a, int64_t groups) {
  const int64_t n = xbc.size(0);
  check_states(ssm_states, conv_states, rows, n);
  const int64_t heads = ssm_states.size(1), P = ssm_states.size(2), N = ssm_states.size(3);
  TORCH_CHECK(groups > 0 && heads % groups == 0 && xbc.size(1) == heads * P + 2 * groups * N,
              "conv_dim = heads P + 2 groups N");
  check_per_head(dt, n, heads);
  check_per_head(log_a, 1, heads);
  const auto conv = conv_window_step(xbc, conv_weight, conv_bias, conv_states, rows);
  auto y = at::empty({n, heads, P}, conv.options());
  mamba2_state_step(conv.data_ptr<float>(), ssm_states.data_ptr<float>(),
                    rows.data_ptr<int64_t>(), dt.data_ptr<float>(), log_a.data_ptr<float>(),
                    y.data_ptr<float>(), n, heads, groups, P, N);
  return {y, conv.narrow(1, 0, heads * P).view({n, heads, P})};
}

namespace {

inline float softplus(float x) { return x > 20.f ? x : std::log1p(std::exp(x)); }

// Per row: y <- (y + x D) silu(z), then the gated group norm, times its weight (the model's
// dtype, rounded as the torch path rounds: the normalized value, then the product).
template <typename T>
void mamba2_gated_norm(const float* y, const float* conv, const T* proj, int64_t proj_stride,
                       const float* D, const T* weight, T* out, int64_t n, int64_t heads,
                       int64_t P, int64_t groups, int64_t conv_dim, float eps) {
  const int64_t inner = heads * P, width = inner / groups;
  at::parallel_for(0, n * groups, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> gated(width);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / groups, c0 = task % groups * width;
      const T* z = proj + r * proj_stride;
      float squares = 0.f;
      for (int64_t i = 0; i < width; ++i) {
        const int64_t c = c0 + i;
        const float v = (y[r * inner + c] + conv[r * conv_dim + c] * D[c / P]) *
                        silu(static_cast<float>(z[c]));
        gated[i] = v;
        squares += v * v;
      }
      const float factor = 1.f / std::sqrt(squares / static_cast<float>(width) + eps);
      T* o = out + r * inner + c0;
      for (int64_t i = 0; i < width; ++i)
        o[i] = static_cast<T>(static_cast<float>(weight[c0 + i]) *
                              static_cast<float>(static_cast<T>(gated[i] * factor)));
    }
  });
}

}  // namespace

// A Mamba2 layer's whole decode step between its two projections, for n requests that each
// take one token: proj [n, inner + conv_dim + heads] is in_proj's output (z, then x, B and C
// before the convolution, then dt), in the model's dtype; dt = clamp(softplus(dt + dt_bias),
// dt_min, dt_max); the convolution and the scan as mamba2_step (states in place); then the D
// skip, the gate silu(z) and the gated group norm (norm_weight [inner], eps). dt_bias, log_a,
// D: [heads] float32. Returns [n, inner] in the model's dtype: out_proj's input.
at::Tensor mamba2_decode(at::Tensor proj, at::Tensor conv_weight,
                         c10::optional<at::Tensor> conv_bias, at::Tensor conv_states,
                         at::Tensor ssm_states, at::Tensor rows, at::Tensor dt_bias,
                         at::Tensor log_a, at::Tensor D, at::Tensor norm_weight, int64_t groups,
                         double dt_min, double dt_max, double eps) {
  const int64_t n = proj.size(0);
  check_states(ssm_states, conv_states, rows, n);
  const int64_t heads = ssm_states.size(1), P = ssm_states.size(2), N = ssm_states.size(3);
  const int64_t inner = heads * P, conv_dim = inner + 2 * groups * N;
  TORCH_CHECK(groups > 0 && heads % groups == 0, "whole heads per group");
  TORCH_CHECK(proj.dim() == 2 && proj.stride(1) == 1 && proj.size(1) == inner + conv_dim + heads,
              "proj = z, x B C, dt");
  TORCH_CHECK(norm_weight.is_contiguous() && norm_weight.numel() == inner &&
              norm_weight.scalar_type() == proj.scalar_type());
  check_per_head(dt_bias, 1, heads);
  check_per_head(log_a, 1, heads);
  check_per_head(D, 1, heads);
  auto dt = at::empty({n, heads}, proj.options().dtype(at::kFloat));
  const auto conv = conv_window_step(proj.narrow(1, inner, conv_dim), conv_weight, conv_bias,
                                     conv_states, rows);
  auto y = at::empty({n, heads, P}, conv.options());
  auto out = at::empty({n, inner}, proj.options());
  const auto lo = static_cast<float>(dt_min), hi = static_cast<float>(dt_max);
  auto run = [&](auto* p, auto* weight, auto* o) {
    const float* bias = dt_bias.data_ptr<float>();
    float* dts = dt.data_ptr<float>();
    for (int64_t r = 0; r < n; ++r)
      for (int64_t h = 0; h < heads; ++h) {
        const float raw = static_cast<float>(p[r * proj.stride(0) + inner + conv_dim + h]);
        dts[r * heads + h] = std::min(hi, std::max(lo, softplus(raw + bias[h])));
      }
    mamba2_state_step(conv.data_ptr<float>(), ssm_states.data_ptr<float>(),
                      rows.data_ptr<int64_t>(), dts, log_a.data_ptr<float>(),
                      y.data_ptr<float>(), n, heads, groups, P, N);
    mamba2_gated_norm(y.data_ptr<float>(), conv.data_ptr<float>(), p, proj.stride(0),
                      D.data_ptr<float>(), weight, o, n, heads, P, groups, conv_dim,
                      static_cast<float>(eps));
  };
  if (proj.scalar_type() == at::kBFloat16) {
    using T = at::BFloat16;
    run(proj.data_ptr<T>(), norm_weight.data_ptr<T>(), out.data_ptr<T>());
  } else {
    TORCH_CHECK(proj.scalar_type() == at::kFloat, "float32 or bfloat16");
    run(proj.data_ptr<float>(), norm_weight.data_ptr<float>(), out.data_ptr<float>());
  }
  return out;
}
