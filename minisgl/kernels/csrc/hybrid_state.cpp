// A hybrid model's linear layers (Gated DeltaNet, Mamba2) over spans of tokens, a span being one
// request's consecutive tokens (a decode row's one, a prefill chunk's many), its state updated
// in place in the state pool (kvcache/state_pool.py) token by token:
// 1. per (span, block of channels): the convolution window shifts in each new input (in the
//    model's dtype), the depthwise convolution (+ bias) and SiLU, in float32;
// 2. per (span, head): the recurrent state's steps, float32. The state stays in cache across
//    the span's tokens, so a prefill chunk costs its tokens' arithmetic and one read and write
//    of the state; on a CPU that beats the chunked (matrix) form, whose decay matrices and
//    per-head products cost more than they save. A Gated DeltaNet head's state S (dk x dv)
//    goes through in column blocks kept in L1: a column's recall (S^T k) needs only that
//    column, so one sweep reads the block and a second updates it and reads it out. A Mamba2
//    head's state needs one sweep.
// Heads that share a key head (DeltaNet) or a group's B and C (Mamba2) read them in place.
#include "aten.h"
#include "vec8.h"
#include "hybrid_state.h"
#include "vnni.h"

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kConvBlock = 512;  // channels per work item of the convolution
constexpr float kNormEps = 1e-6f;    // the l2 norm's, as models.qwen3_next.l2_normalized
// A Gated DeltaNet state's columns per block: dk x 32 floats (16 KB at dk 128) stay in L1
// between the block's two sweeps.
constexpr int kColumns = 32;

inline float silu(float x) { return x / (1.f + std::exp(-x)); }

// Spans of consecutive tokens: span s has counts[s] tokens from first[s], its state in table row
// rows[s].
struct Spans {
  const int64_t* rows;
  const int64_t* counts;
  std::vector<int64_t> first;
  int64_t tokens = 0;

  Spans(const int64_t* rows_, const int64_t* counts_, int64_t n) : rows(rows_), counts(counts_) {
    for (int64_t s = 0; s < n; ++s) {
      first.push_back(tokens);
      tokens += counts[s];
    }
  }
  int64_t size() const { return static_cast<int64_t>(first.size()); }
};

// out[token][c] = silu(sum_t w[c][t] window[c][t] + bias[c]) over window = (state, x): each
// span's table row of the windows [rows of the pool, channels, K - 1] shifts in its tokens of
// x [tokens, channels], one by one. Per (span, block of channels) the window and the inputs go
// into one float32 [K - 1 + count, block] buffer, so each output row is a vector sum over
// channels (summed in the window's order), and its last K - 1 rows are the new window.
template <typename T>
void conv_step(const T* x, int64_t x_stride, const T* weight, const T* bias, T* states,
               const Spans& spans, float* out, int64_t channels, int64_t kernel) {
  const int64_t blocks = (channels + kConvBlock - 1) / kConvBlock, keep = kernel - 1;
  std::vector<float> taps(kernel * channels), biases(channels);  // [K, channels] and [channels]
  for (int64_t c = 0; c < channels; ++c) {
    for (int64_t t = 0; t < kernel; ++t)
      taps[t * channels + c] = static_cast<float>(weight[c * kernel + t]);
    biases[c] = bias != nullptr ? static_cast<float>(bias[c]) : 0.f;
  }
  at::parallel_for(0, spans.size() * blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buffer;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / blocks, c0 = task % blocks * kConvBlock;
      const int64_t width = std::min(channels, c0 + kConvBlock) - c0, count = spans.counts[s];
      T* window = states + spans.rows[s] * channels * keep + c0 * keep;
      buffer.resize((keep + count) * width);
      for (int64_t c = 0; c < width; ++c)
        for (int64_t t = 0; t < keep; ++t)
          buffer[t * width + c] = static_cast<float>(window[c * keep + t]);
      for (int64_t t = 0; t < count; ++t) {
        const T* xr = x + (spans.first[s] + t) * x_stride + c0;
        float* row = buffer.data() + (keep + t) * width;
        for (int64_t c = 0; c < width; ++c) row[c] = static_cast<float>(xr[c]);
      }
      for (int64_t t = 0; t < count; ++t) {
        float* o = out + (spans.first[s] + t) * channels + c0;
        std::copy_n(biases.data() + c0, width, o);
        for (int64_t k = 0; k < kernel; ++k) {
          const float *tap = taps.data() + k * channels + c0,
                      *in = buffer.data() + (t + k) * width;
#pragma omp simd
          for (int64_t c = 0; c < width; ++c) o[c] += tap[c] * in[c];
        }
        // NOTE: a loop of its own so that expf is vectorised (libmvec, -ffast-math)
#pragma omp simd
        for (int64_t c = 0; c < width; ++c) o[c] = silu(o[c]);
      }
      for (int64_t c = 0; c < width; ++c)
        for (int64_t t = 0; t < keep; ++t)
          window[c * keep + t] = static_cast<T>(buffer[(count + t) * width + c]);
    }
  });
}

// Columns [j0, j0 + W) of one head's delta rule step, S (dk x dv, row stride dv; float32 or
// bfloat16, the math float32) in place: recall = S^T k; delta = beta (v - g recall);
// S <- g S + k delta^T; out = S^T q.
template <int W, typename S_t>
inline void delta_columns(S_t* S, int64_t dk, int64_t dv, int64_t j0, const float* q,
                          const float* k, const float* v, float g, float beta, float* out) {
  float acc[W] = {};
  for (int64_t i = 0; i < dk; ++i) {
    const S_t* row = S + i * dv + j0;
    const float ki = k[i];
#pragma omp simd
    for (int j = 0; j < W; ++j) acc[j] += ki * scalar(row, j);
  }
  float delta[W], o[W] = {};
#pragma omp simd
  for (int j = 0; j < W; ++j) delta[j] = beta * (v[j0 + j] - g * acc[j]);
#pragma GCC ivdep
  for (int64_t i = 0; i < dk; ++i) {
    S_t* row = S + i * dv + j0;
    const float ki = k[i], qi = q[i];
#pragma omp simd
    for (int j = 0; j < W; ++j) {
      const float s = g * scalar(row, j) + ki * delta[j];
      put(row, j, s);
      o[j] += qi * s;
    }
  }
#pragma omp simd
  for (int j = 0; j < W; ++j) out[j0 + j] = o[j];
}

#ifdef MINISGL_VNNI
// The same 32 columns of a bfloat16 state, 16 lanes at a time: widened by a shift, rounded back
// to the nearest (ties to even) by one instruction (AVX-512 BF16); out uses the unrounded sums.
template <>
inline void delta_columns<32, at::BFloat16>(at::BFloat16* S, int64_t dk, int64_t dv,
                                            int64_t j0, const float* q, const float* k,
                                            const float* v, float g, float beta, float* out) {
  __m512 recall[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
  for (int64_t i = 0; i < dk; ++i) {
    const at::BFloat16* row = S + i * dv + j0;
    const __m512 ki = _mm512_set1_ps(k[i]);
    for (int h = 0; h < 2; ++h)
      recall[h] = _mm512_fmadd_ps(ki, load_bf16(row + 16 * h), recall[h]);
  }
  const __m512 decay = _mm512_set1_ps(g), rate = _mm512_set1_ps(beta);
  __m512 delta[2], o[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
  for (int h = 0; h < 2; ++h)
    delta[h] = _mm512_mul_ps(
        rate, _mm512_sub_ps(_mm512_loadu_ps(v + j0 + 16 * h), _mm512_mul_ps(decay, recall[h])));
  for (int64_t i = 0; i < dk; ++i) {
    at::BFloat16* row = S + i * dv + j0;
    const __m512 ki = _mm512_set1_ps(k[i]), qi = _mm512_set1_ps(q[i]);
    for (int h = 0; h < 2; ++h) {
      const __m512 s =
          _mm512_fmadd_ps(ki, delta[h], _mm512_mul_ps(decay, load_bf16(row + 16 * h)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + 16 * h),
                          reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(s)));
      o[h] = _mm512_fmadd_ps(qi, s, o[h]);
    }
  }
  for (int h = 0; h < 2; ++h) _mm512_storeu_ps(out + j0 + 16 * h, o[h]);
}
#endif

// One l2-normalized (and scaled) copy of a head's dk values.
inline void normalized(const float* x, int64_t d, float scale, float* out) {
  float squares = 0.f;
#pragma omp simd reduction(+ : squares)
  for (int64_t i = 0; i < d; ++i) squares += x[i] * x[i];
  const float factor = scale / std::sqrt(squares + kNormEps);
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) out[i] = x[i] * factor;
}

// conv: [tokens, 2 nk dk + nv dv] (q, k, v) after the convolution; states [pool rows, nv, dk,
// dv].
template <typename S_t>
void delta_step(const float* conv, S_t* states, const Spans& spans, const float* decay,
                const float* beta, float* out, int64_t nk, int64_t nv, int64_t dk, int64_t dv) {
  const int64_t group = nv / nk, conv_dim = 2 * nk * dk + nv * dv;
  const float q_scale = 1.f / std::sqrt(static_cast<float>(dk));
  at::parallel_for(0, spans.size() * nv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(dk), k(dk);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / nv, h = task % nv, kh = h / group;
      S_t* S = states + (spans.rows[s] * nv + h) * dk * dv;
      for (int64_t r = spans.first[s]; r < spans.first[s] + spans.counts[s]; ++r) {
        const float* c = conv + r * conv_dim;
        normalized(c + kh * dk, dk, q_scale, q.data());
        normalized(c + (nk + kh) * dk, dk, 1.f, k.data());
        const float* v = c + 2 * nk * dk + h * dv;
        const float g = std::exp(decay[r * nv + h]), b = beta[r * nv + h];
        float* o = out + (r * nv + h) * dv;
        const float *qn = q.data(), *kn = k.data();
        int64_t j = 0;
        for (; j + kColumns <= dv; j += kColumns)
          delta_columns<kColumns>(S, dk, dv, j, qn, kn, v, g, b, o);
        for (; j + 8 <= dv; j += 8) delta_columns<8>(S, dk, dv, j, qn, kn, v, g, b, o);
        for (; j < dv; ++j) delta_columns<1>(S, dk, dv, j, qn, kn, v, g, b, o);
      }
    }
  });
}

// Rows [p, p + R) of one Mamba2 head's state (row stride N) through one token: h <- g h +
// dt x_p B^T, y_p = h C. R rows at once: R independent sums where one would wait on its adds.
template <int R, typename S_t>
inline void mamba2_rows(S_t* H, int64_t N, float g, float dt, const float* x, const float* B,
                        const float* C, float* y) {
  float u[R];
  v8 sums[R];
  for (int j = 0; j < R; ++j) {
    u[j] = dt * x[j];
    sums[j] = v8{};
  }
  int64_t i = 0;
  for (; i + 8 <= N; i += 8) {
    const v8 b = load8(B + i), c = load8(C + i);
    for (int j = 0; j < R; ++j) {
      S_t* at = H + j * N + i;
      const v8 v = g * load8(at) + u[j] * b;
      store8(at, v);
      sums[j] += v * c;
    }
  }
  for (int j = 0; j < R; ++j) {
    float sum = 0.f;
    for (int l = 0; l < 8; ++l) sum += sums[j][l];
#pragma omp simd reduction(+ : sum)
    for (int64_t t = i; t < N; ++t) {
      const float v = g * scalar(H, j * N + t) + u[j] * B[t];
      put(H, j * N + t, v);
      sum += v * C[t];
    }
    y[j] = sum;
  }
}

#ifdef MINISGL_VNNI
// The same rows of a bfloat16 state, 16 lanes at a time: widened by a shift, rounded back to
// the nearest (ties to even) by one instruction (AVX-512 BF16).
template <int R>
inline void mamba2_rows(at::BFloat16* H, int64_t N, float g, float dt, const float* x,
                        const float* B, const float* C, float* y) {
  __m512 u[R], sums[R];
  const __m512 decay = _mm512_set1_ps(g);
  for (int j = 0; j < R; ++j) {
    u[j] = _mm512_set1_ps(dt * x[j]);
    sums[j] = _mm512_setzero_ps();
  }
  int64_t i = 0;
  for (; i + 16 <= N; i += 16) {
    const __m512 b = _mm512_loadu_ps(B + i), c = _mm512_loadu_ps(C + i);
    for (int j = 0; j < R; ++j) {
      at::BFloat16* at = H + j * N + i;
      const __m512 v = _mm512_fmadd_ps(u[j], b, _mm512_mul_ps(decay, load_bf16(at)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(at),
                          reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
      sums[j] = _mm512_fmadd_ps(v, c, sums[j]);
    }
  }
  for (int j = 0; j < R; ++j) {
    float sum = _mm512_reduce_add_ps(sums[j]);
    const float uj = dt * x[j];
    for (int64_t t = i; t < N; ++t) {
      const float v = g * scalar(H, j * N + t) + uj * B[t];
      put(H, j * N + t, v);
      sum += v * C[t];
    }
    y[j] = sum;
  }
}
#endif

// conv: [tokens, heads P + 2 groups N] (x, B, C) after the convolution; states [pool rows,
// heads, P, N]. Per (span, head), token by token: h <- exp(dt a) h + dt x B^T; y = h C.
template <typename S_t>
void mamba2_state_step(const float* conv, S_t* states, const Spans& spans, const float* dt,
                       const float* log_a, float* y, int64_t heads, int64_t groups, int64_t P,
                       int64_t N) {
  const int64_t per_group = heads / groups, conv_dim = heads * P + 2 * groups * N;
  at::parallel_for(0, spans.size() * heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / heads, h = task % heads, grp = h / per_group;
      S_t* H = states + (spans.rows[s] * heads + h) * P * N;
      for (int64_t r = spans.first[s]; r < spans.first[s] + spans.counts[s]; ++r) {
        const float* x = conv + r * conv_dim + h * P;
        const float* B = conv + r * conv_dim + heads * P + grp * N;
        const float* C = B + groups * N;
        const float step = dt[r * heads + h], g = std::exp(step * log_a[h]);
        float* o = y + (r * heads + h) * P;
        int64_t p = 0;
        for (; p + 4 <= P; p += 4) mamba2_rows<4>(H + p * N, N, g, step, x + p, B, C, o + p);
        for (; p < P; ++p) mamba2_rows<1>(H + p * N, N, g, step, x + p, B, C, o + p);
      }
    }
  });
}

// The convolution over the spans' windows, into a float32 [tokens, channels].
at::Tensor conv_window_step(const at::Tensor& x, const at::Tensor& weight,
                            const c10::optional<at::Tensor>& bias, at::Tensor& conv_states,
                            const Spans& spans) {
  const int64_t n = x.size(0), channels = x.size(1), kernel = weight.size(-1);
  TORCH_CHECK(n == spans.tokens, "the spans' tokens are the inputs' rows");
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
  if (x.scalar_type() == at::kBFloat16) {
    using T = at::BFloat16;
    conv_step<T>(x.data_ptr<T>(), x.stride(0), weight.data_ptr<T>(),
                 bias.has_value() ? bias->data_ptr<T>() : nullptr, conv_states.data_ptr<T>(),
                 spans, out.data_ptr<float>(), channels, kernel);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "float32 or bfloat16 windows");
    conv_step<float>(x.data_ptr<float>(), x.stride(0), weight.data_ptr<float>(),
                     bias.has_value() ? bias->data_ptr<float>() : nullptr,
                     conv_states.data_ptr<float>(), spans, out.data_ptr<float>(), channels,
                     kernel);
  }
  return out;
}

// The recurrent states (float32 or bfloat16 [pool rows, heads, ., .], as many rows as the conv
// windows'),
// and the spans: each its table row in them (no two the same) and its count of the n tokens.
Spans checked_spans(const at::Tensor& ssm_states, const at::Tensor& conv_states,
                    const at::Tensor& rows, const at::Tensor& counts, int64_t n) {
  TORCH_CHECK((ssm_states.scalar_type() == at::kFloat ||
               ssm_states.scalar_type() == at::kBFloat16) && ssm_states.is_contiguous() &&
              ssm_states.dim() == 4 && ssm_states.size(0) == conv_states.size(0));
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.is_contiguous() &&
              counts.scalar_type() == at::kLong && counts.is_contiguous() &&
              counts.numel() == rows.numel(), "int64 rows and counts, one each a span");
  const int64_t pool = ssm_states.size(0), spans = rows.numel();
  const int64_t *r = rows.data_ptr<int64_t>(), *c = counts.data_ptr<int64_t>();
  std::vector<bool> seen(pool);
  for (int64_t i = 0; i < spans; ++i) {
    TORCH_CHECK(r[i] >= 0 && r[i] < pool, "state row out of range");
    TORCH_CHECK(!seen[r[i]], "a state row in two spans");
    TORCH_CHECK(c[i] > 0, "a span of no tokens");
    seen[r[i]] = true;
  }
  Spans checked(r, c, spans);
  TORCH_CHECK(checked.tokens == n, "the spans' counts sum to the tokens");
  return checked;
}

void check_per_head(const at::Tensor& t, int64_t n, int64_t heads) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == n * heads,
              "float32 [rows, heads]");
}

}  // namespace

namespace {

// The convolution and the delta rule over checked spans; decay and beta: [tokens, nv] float32.
at::Tensor delta_rule(const at::Tensor& mixed, const at::Tensor& conv_weight,
                      at::Tensor& conv_states, at::Tensor& ssm_states, const Spans& spans,
                      const float* decay, const float* beta, int64_t num_k_heads) {
  const int64_t n = mixed.size(0), nv = ssm_states.size(1), dk = ssm_states.size(2),
                dv = ssm_states.size(3);
  TORCH_CHECK(num_k_heads > 0 && nv % num_k_heads == 0 &&
              mixed.size(1) == 2 * num_k_heads * dk + nv * dv, "conv_dim = 2 nk dk + nv dv");
  const auto conv = conv_window_step(mixed, conv_weight, c10::nullopt, conv_states, spans);
  auto out = at::empty({n, nv, dv}, conv.options());
  const auto step = [&](auto* states) {
    delta_step(conv.data_ptr<float>(), states, spans, decay, beta, out.data_ptr<float>(),
               num_k_heads, nv, dk, dv);
  };
  if (ssm_states.scalar_type() == at::kBFloat16)
    step(ssm_states.data_ptr<at::BFloat16>());
  else
    step(ssm_states.data_ptr<float>());
  return out;
}

inline float softplus(float x) { return x > 20.f ? x : std::log1p(std::exp(x)); }

// Per (token, value head): rmsnorm(y) weight silu(z), float32, rounded once, at the head's
// place in out_proj's input: value head j of key head h at h * group + j, or tiled at
// j * nk + h.
template <typename T>
void delta_gated_norm(const float* y, const T* z, int64_t z_stride, const float* weight, T* out,
                      int64_t n, int64_t nk, int64_t nv, int64_t dv, float eps, bool tiled) {
  const int64_t group = nv / nk;
  at::parallel_for(0, n * nv, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> gate(dv);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / nv, h = task % nv;
      const float* yh = y + task * dv;
      const T* zh = z + r * z_stride + h * dv;
      float squares = 0.f;
#pragma omp simd reduction(+ : squares)
      for (int64_t i = 0; i < dv; ++i) squares += yh[i] * yh[i];
      const float factor = 1.f / std::sqrt(squares / static_cast<float>(dv) + eps);
      for (int64_t i = 0; i < dv; ++i) gate[i] = static_cast<float>(zh[i]);
#pragma omp simd
      for (int64_t i = 0; i < dv; ++i) gate[i] = silu(gate[i]);
      T* o = out + (r * nv + (tiled ? (h % group) * nk + h / group : h)) * dv;
      // NOTE: `omp simd` on loops that mix buffers: without it the compiler vectorises them
      // behind a run-time overlap check, and the scalar copy it runs when the allocator put
      // two buffers close rounds otherwise (fast math): the bits would depend on addresses
#pragma omp simd
      for (int64_t i = 0; i < dv; ++i)
        o[i] = static_cast<T>(yh[i] * factor * weight[i] * gate[i]);
    }
  });
}

void check_rows(const at::Tensor& t, int64_t n, int64_t width, const at::Tensor& like) {
  TORCH_CHECK(t.dim() == 2 && t.size(0) == n && t.size(1) == width && t.stride(1) == 1 &&
              t.scalar_type() == like.scalar_type(), "[tokens, width] rows in the model's dtype");
}

}  // namespace

// Spans of tokens (table rows `rows`, `counts` tokens each, in order) through a Gated DeltaNet
// layer's convolution and delta rule. mixed: [tokens, conv_dim] (q, k, v of nk, nk and nv heads
// before the convolution); conv_weight: [conv_dim, 1, K]; conv_states: [pool rows, conv_dim,
// K - 1], all three in the model's dtype; ssm_states: [pool rows, nv, dk, dv], float32 or
// bfloat16 (the math float32 either way); decay (the log of the gate) and beta: [tokens, nv]
// float32. Both states are updated in place. Returns [tokens, nv, dv].
at::Tensor gated_delta_spans(at::Tensor mixed, at::Tensor conv_weight, at::Tensor conv_states,
                             at::Tensor ssm_states, at::Tensor rows, at::Tensor counts,
                             at::Tensor decay, at::Tensor beta, int64_t num_k_heads) {
  const int64_t n = mixed.size(0);
  const Spans spans = checked_spans(ssm_states, conv_states, rows, counts, n);
  check_per_head(decay, n, ssm_states.size(1));
  check_per_head(beta, n, ssm_states.size(1));
  return delta_rule(mixed, conv_weight, conv_states, ssm_states, spans, decay.data_ptr<float>(),
                    beta.data_ptr<float>(), num_k_heads);
}

// The same spans through the whole layer between its input projections and out_proj: mixed
// as above, z [tokens, nv dv], b and a [tokens, nv] (rows of any stride, the model's dtype);
// beta = sigmoid(b), decay = log_a softplus(a + dt_bias) (dt_bias, log_a = -exp(A_log): [nv]
// float32); the rule; then rmsnorm(out) norm_weight silu(z) per value head, in float32 (eps;
// norm_weight [dv]), the heads in out_proj's order (`tiled`: delta_gated_norm's). Returns
// [tokens, nv dv] in the model's dtype.
at::Tensor gated_delta_layer(at::Tensor mixed, at::Tensor z, at::Tensor b, at::Tensor a,
                             at::Tensor conv_weight, at::Tensor conv_states,
                             at::Tensor ssm_states, at::Tensor rows, at::Tensor counts,
                             at::Tensor dt_bias, at::Tensor log_a, at::Tensor norm_weight,
                             double eps, int64_t num_k_heads, bool tiled) {
  const int64_t n = mixed.size(0);
  const Spans spans = checked_spans(ssm_states, conv_states, rows, counts, n);
  const int64_t nv = ssm_states.size(1), dv = ssm_states.size(3);
  check_rows(z, n, nv * dv, mixed);
  check_rows(b, n, nv, mixed);
  check_rows(a, n, nv, mixed);
  check_per_head(dt_bias, 1, nv);
  check_per_head(log_a, 1, nv);
  TORCH_CHECK(norm_weight.numel() == dv, "norm_weight: [dv]");
  const auto weight = norm_weight.to(at::kFloat).contiguous();
  auto gates = at::empty({2, n, nv}, mixed.options().dtype(at::kFloat));
  float *decay = gates.data_ptr<float>(), *beta = decay + n * nv;
  auto out = at::empty({n, nv * dv}, mixed.options());
  const auto run = [&](auto* model_dtype) {
    using T = std::remove_pointer_t<decltype(model_dtype)>;
    const T *bs = b.data_ptr<T>(), *as = a.data_ptr<T>();
    const float *bias = dt_bias.data_ptr<float>(), *log = log_a.data_ptr<float>();
    for (int64_t r = 0; r < n; ++r)
      for (int64_t h = 0; h < nv; ++h) {
        beta[r * nv + h] = 1.f / (1.f + std::exp(-static_cast<float>(bs[r * b.stride(0) + h])));
        decay[r * nv + h] =
            log[h] * softplus(static_cast<float>(as[r * a.stride(0) + h]) + bias[h]);
      }
    const auto y = delta_rule(mixed, conv_weight, conv_states, ssm_states, spans, decay, beta,
                              num_k_heads);
    delta_gated_norm(y.data_ptr<float>(), z.data_ptr<T>(), z.stride(0),
                     weight.data_ptr<float>(), out.data_ptr<T>(), n, num_k_heads, nv, dv,
                     static_cast<float>(eps), tiled);
  };
  if (mixed.scalar_type() == at::kBFloat16) {
    run(static_cast<at::BFloat16*>(nullptr));
  } else {
    TORCH_CHECK(mixed.scalar_type() == at::kFloat, "float32 or bfloat16");
    run(static_cast<float*>(nullptr));
  }
  return out;
}

namespace {

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
      const T* z = proj + r * proj_stride + c0;
      for (int64_t at = 0; at < width; at += P) {  // the group's heads
        const float skip = D[(c0 + at) / P];
        const float *yh = y + r * inner + c0 + at, *xh = conv + r * conv_dim + c0 + at;
#pragma omp simd
        for (int64_t i = 0; i < P; ++i) gated[at + i] = yh[i] + xh[i] * skip;
      }
      float squares = 0.f;
#pragma omp simd reduction(+ : squares)
      for (int64_t i = 0; i < width; ++i) {
        const float v = gated[i] * silu(static_cast<float>(z[i]));
        gated[i] = v;
        squares += v * v;
      }
      const float factor = 1.f / std::sqrt(squares / static_cast<float>(width) + eps);
      T* o = out + r * inner + c0;
#pragma omp simd
      for (int64_t i = 0; i < width; ++i)
        o[i] = static_cast<T>(static_cast<float>(weight[c0 + i]) *
                              static_cast<float>(static_cast<T>(gated[i] * factor)));
    }
  });
}

}  // namespace

// Spans of tokens (table rows `rows`, `counts` tokens each, in order) through a Mamba2 layer,
// from its in_proj's output to its out_proj's input. proj [tokens, inner + conv_dim + heads]:
// z, then x, B and C before the convolution, then dt, in the model's dtype; conv_weight
// [conv_dim, 1, K], conv_bias [conv_dim] and conv_states [pool rows, conv_dim, K - 1] in the
// model's dtype; ssm_states [pool rows, heads, P, N], float32 or bfloat16 (the math float32
// either way). dt = clamp(softplus(dt + dt_bias), dt_min, dt_max); the convolution; the scan
// (h <- exp(dt a) h + dt x B^T; y = h C, log_a = log a < 0); both states in place; then the D
// skip, the gate silu(z) and the gated group norm (norm_weight [inner], eps). dt_bias, log_a,
// D: [heads] float32. Returns [tokens, inner] in the model's dtype.
at::Tensor mamba2_spans(at::Tensor proj, at::Tensor conv_weight,
                        c10::optional<at::Tensor> conv_bias, at::Tensor conv_states,
                        at::Tensor ssm_states, at::Tensor rows, at::Tensor counts,
                        at::Tensor dt_bias, at::Tensor log_a, at::Tensor D,
                        at::Tensor norm_weight, int64_t groups, double dt_min, double dt_max,
                        double eps) {
  const int64_t n = proj.size(0);
  const Spans spans = checked_spans(ssm_states, conv_states, rows, counts, n);
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
                                     conv_states, spans);
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
    const auto step = [&](auto* states) {
      mamba2_state_step(conv.data_ptr<float>(), states, spans, dts, log_a.data_ptr<float>(),
                        y.data_ptr<float>(), heads, groups, P, N);
    };
    if (ssm_states.scalar_type() == at::kBFloat16)
      step(ssm_states.data_ptr<at::BFloat16>());
    else
      step(ssm_states.data_ptr<float>());
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
