// CPU kernels where torch's composite ops cost several passes over memory:
// - paged decode attention over the head-major KV pool ([kv_heads, locations, dim]): one pass
//   over each request's K and V, read in place through its location row (no gathered copy, no
//   padded batch matmuls), parallel over (request, kv head) pairs, from pages in the compute
//   dtype, int8 (a scale per row) or float8; bfloat16 at head dims 64 and 128 takes
//   decode_bf16.cpp's AVX-512 BF16 path instead (bfloat16 or int8 pages);
// - residual add + RMSNorm in one pass per row (float32 math, one rounding);
// - silu(gate) * up over a merged [rows, 2 * d] projection, one pass (float32 math);
// - rotary embedding ("rotate half") of q and k in place, one pass (float32 math);
// - each row's argmax (greedy sampling over the vocabulary; torch's CPU argmax is scalar);
// - a read of a buffer at the machine's streaming bandwidth (bench.bandwidth's probe);
// - 4- and 8-bit block-quantized weight matmuls (quant_matmul.cpp), the W8A8 int8 one
//   (int8_matmul.cpp), the mixture-of-experts one (expert_matmul.cpp) and multi-LoRA's
//   (lora_matmul.cpp);
// - a Llama-family or Granite 4.0-H model's decoder layers in GGUF blocks as one call
//   (fused_layers.cpp; a step of one decode row: fused_one_row.cpp);
// - a hybrid model's Gated DeltaNet and Mamba2 layers over spans of tokens, their states
//   updated in place (hybrid_state.cpp).
#include <ATen/Dispatch.h>
#include <ATen/ops/empty_like.h>
#include <torch/csrc/utils/pybind.h>

#include "aten.h"
#include "fused_layers.h"
#include "hybrid_state.h"
#include "row_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

// Tokens in the order 0, n - 1, 1, n - 2, ...: a parallel loop's contiguous halves then get
// equal work when a prompt's tokens attend to ever more keys.
int64_t balanced_token(int64_t i, int64_t n) { return i % 2 == 0 ? i / 2 : n - 1 - i / 2; }

namespace {

template <typename T>
inline float load(const T* p, int64_t i) { return static_cast<float>(p[i]); }

// float8 KV pages: each code's exact value, from a table of the 256 codes.
template <typename F>
const float* float8_table() {
  static const std::vector<float> table = [] {
    std::vector<float> t(256);
    for (int code = 0; code < 256; ++code)
      t[code] = static_cast<float>(F(static_cast<uint8_t>(code), F::from_bits()));
    return t;
  }();
  return table.data();
}

template <>
inline float load<c10::Float8_e4m3fn>(const c10::Float8_e4m3fn* p, int64_t i) {
  return float8_table<c10::Float8_e4m3fn>()[p[i].x];
}

template <>
inline float load<c10::Float8_e5m2>(const c10::Float8_e5m2* p, int64_t i) {
  return float8_table<c10::Float8_e5m2>()[p[i].x];
}

template <>
inline float load<at::BFloat16>(const at::BFloat16* p, int64_t i) {
  // NOTE: a plain shift instead of c10's conversion lets the compiler vectorise the loops.
  uint32_t bits = static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(p)[i]) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// NOTE: a request's locations are scattered over the pool (pages are handed out as they
// free up), which defeats the hardware prefetcher: fetch the row kPrefetch tokens ahead.
constexpr int64_t kPrefetch = 16;

template <typename T>
inline void prefetch_row(const T* row, int64_t dim) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t offset = 0; offset < dim * static_cast<int64_t>(sizeof(T)); offset += 64)
    __builtin_prefetch(p + offset);
}

template <typename T>
inline void store(T* p, int64_t i, float v) { p[i] = static_cast<T>(v); }

template <>
inline void store<at::BFloat16>(at::BFloat16* p, int64_t i, float v) {
  // NOTE: round to nearest even like c10, as integer ops the compiler vectorises (finite v).
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  reinterpret_cast<uint16_t*>(p)[i] = static_cast<uint16_t>(bits >> 16);
}

// C: the pages' type, T or an 8-bit one; k_scales / v_scales ([kv_heads, pool]): int8 pages'
// scale per row, else null.
template <typename T, typename C>
void decode(const T* q, const C* k_cache, const C* v_cache, const int64_t* locations,
            const int64_t* seq_lens, const int64_t* token_rows, T* out, int64_t batch,
            int64_t heads, int64_t kv_heads, int64_t pool, int64_t dim, int64_t max_len,
            float scale, float softcap, const float* sinks, int64_t vdim, int64_t v_row,
            int64_t v_head, const float* k_scales, const float* v_scales) {
  const int64_t group = heads / kv_heads;
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * dim), probs(group * max_len), acc(group * vdim);
    std::vector<float> maxs(group), sums(group);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = balanced_token(task / kv_heads, batch), h = task % kv_heads;
      const int64_t len = seq_lens[b];
      const int64_t* loc = locations + (token_rows ? token_rows[b] : b) * max_len;
      const T* qh = q + (b * heads + h * group) * dim;
      for (int64_t i = 0; i < group * dim; ++i) qf[i] = load(qh, i) * scale;
      std::fill(maxs.begin(), maxs.end(), -std::numeric_limits<float>::infinity());
      for (int64_t t = 0; t < len; ++t) {
        const C* k = k_cache + (h * pool + loc[t]) * dim;
        const float k_scale = k_scales ? k_scales[h * pool + loc[t]] : 1.f;
        if (t + kPrefetch < len)
          prefetch_row(k_cache + (h * pool + loc[t + kPrefetch]) * dim, dim);
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = qf.data() + g * dim;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < dim; ++d) s += qg[d] * load(k, d);
          s *= k_scale;
          if (softcap > 0.f) s = softcap * std::tanh(s / softcap);
          probs[g * max_len + t] = s;
          maxs[g] = std::max(maxs[g], s);
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* pg = probs.data() + g * max_len;
        const float sink = sinks ? sinks[h * group + g] : -std::numeric_limits<float>::infinity();
        const float m = std::max(maxs[g], sink);
        float sum = sinks ? std::exp(sink - m) : 0.f;
        // NOTE: a separate simd loop so that expf is vectorised (libmvec, -ffast-math).
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < len; ++t) {
          pg[t] = std::exp(pg[t] - m);
          sum += pg[t];
        }
        sums[g] = sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < len; ++t) {
        const C* v = v_cache + h * v_head + loc[t] * v_row;
        const float v_scale = v_scales ? v_scales[h * pool + loc[t]] : 1.f;
        if (t + kPrefetch < len)
          prefetch_row(v_cache + h * v_head + loc[t + kPrefetch] * v_row, vdim);
        for (int64_t g = 0; g < group; ++g) {
          const float p = probs[g * max_len + t] * v_scale;
          float* ag = acc.data() + g * vdim;
#pragma omp simd
          for (int64_t d = 0; d < vdim; ++d) ag[d] += p * load(v, d);
        }
      }
      T* oh = out + (b * heads + h * group) * vdim;
      for (int64_t g = 0; g < group; ++g)
        // NOTE: `omp simd`, or the loop is vectorised behind a run-time check that acc and
        // out do not overlap, whose scalar copy rounds otherwise (the bits would follow the
        // addresses)
#pragma omp simd
        for (int64_t d = 0; d < vdim; ++d)
          store(oh, g * vdim + d, acc[g * vdim + d] / sums[g]);
    }
  });
}

template <typename T>
void add_rms_norm(T* x, T* residual, const T* weight, T* out, int64_t rows, int64_t hidden,
                  float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(hidden);
    for (int64_t r = begin; r < end; ++r) {
      T* res = residual != nullptr ? residual + r * hidden : nullptr;
      norm_row(x + r * hidden, res, res, weight, out + r * hidden, hidden, eps, row.data());
    }
  });
}

template <typename T>
void silu_and_mul_rows(const T* x, T* out, int64_t rows, int64_t d) {
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) silu_mul_row(x + r * 2 * d, out + r * d, d);
  });
}

template <typename T>
void rotate_half(T* x, int64_t tokens, int64_t heads, int64_t token_stride, int64_t head_stride,
                 int64_t dim, const int64_t* positions, const float* cos, const float* sin) {
  const int64_t half = dim / 2;
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      rotate_row(x + t * token_stride, heads, head_stride, dim, cos + positions[t] * half,
                 sin + positions[t] * half);
  });
}

// The first index of a row's largest value. NOTE: the max reductions vectorise (-ffast-math);
// the scan for the first occurrence tests 64 values at a time. NaN is found from the bits
// (-ffast-math's float comparisons do not see it): a row holding one gets its first NaN, as
// torch.argmax returns.
inline uint32_t magnitude_bits(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  return bits & 0x7FFFFFFFu;
}

constexpr uint32_t kInfinityBits = 0x7F800000u;  // magnitude bits above it: NaN

template <typename T>
int64_t argmax_row(const T* p, int64_t n) {
  float best = -std::numeric_limits<float>::infinity();
  uint32_t largest_bits = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float v = load(p, i);
    best = std::max(best, v);
    largest_bits = std::max(largest_bits, magnitude_bits(v));
  }
  if (largest_bits > kInfinityBits) {
    for (int64_t i = 0; i < n; ++i)
      if (magnitude_bits(load(p, i)) > kInfinityBits) return i;
  }
  constexpr int64_t kChunk = 64;
  for (int64_t start = 0; start < n; start += kChunk) {
    const int64_t end = std::min(n, start + kChunk);
    bool hit = false;
    for (int64_t i = start; i < end; ++i) hit |= load(p, i) == best;
    if (hit)
      for (int64_t i = start; i < end; ++i)
        if (load(p, i) == best) return i;
  }
  return 0;
}

}  // namespace

template <typename T>
[[gnu::noinline]] void norm_row(const T* x, const T* residual, T* carry_out, const T* weight,
                                T* out, int64_t hidden, float eps, float* row) {
  const T* carry = x;
  if (residual != nullptr) {  // the carried residual is rounded like torch's `x + res`
#pragma omp simd
    for (int64_t i = 0; i < hidden; ++i) store(carry_out, i, load(x, i) + load(residual, i));
    carry = carry_out;
  }
  float squares = 0.f;
#pragma omp simd reduction(+ : squares)
  for (int64_t i = 0; i < hidden; ++i) {
    row[i] = load(carry, i);
    squares += row[i] * row[i];
  }
  const float inv = 1.f / std::sqrt(squares / static_cast<float>(hidden) + eps);
#pragma omp simd
  for (int64_t i = 0; i < hidden; ++i) store(out, i, row[i] * inv * load(weight, i));
}

template <typename T>
[[gnu::noinline]] void silu_mul_row(const T* gate_up, T* out, int64_t d) {
  const T* up = gate_up + d;
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) {
    const float g = load(gate_up, i);
    store(out, i, g / (1.f + std::exp(-g)) * load(up, i));
  }
}

template <typename T>
[[gnu::noinline]] void rotate_row(T* x, int64_t heads, int64_t head_stride, int64_t dim,
                                  const float* cos, const float* sin) {
  const int64_t half = dim / 2;
  for (int64_t h = 0; h < heads; ++h) {
    T* xh = x + h * head_stride;
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = load(xh, i), x2 = load(xh, i + half);
      store(xh, i, x1 * cos[i] - x2 * sin[i]);
      store(xh, i + half, x2 * cos[i] + x1 * sin[i]);
    }
  }
}

template <typename T>
[[gnu::noinline]] void int8_kv_row(const T* x, int8_t* codes, float* scale, int64_t dim) {
  float largest = 0.f;
  for (int64_t d = 0; d < dim; ++d) largest = std::max(largest, std::fabs(load(x, d)));
  *scale = largest / 127.f;
  const float inverse = largest > 0.f ? 127.f / largest : 0.f;
  for (int64_t d = 0; d < dim; ++d)
    codes[d] = static_cast<int8_t>(std::nearbyint(load(x, d) * inverse));
}

#define MINISGL_ROW_KERNELS(T)                                                                 \
  template void norm_row<T>(const T*, const T*, T*, const T*, T*, int64_t, float, float*);    \
  template void silu_mul_row<T>(const T*, T*, int64_t);                                       \
  template void rotate_row<T>(T*, int64_t, int64_t, int64_t, const float*, const float*);     \
  template void int8_kv_row<T>(const T*, int8_t*, float*, int64_t);
MINISGL_ROW_KERNELS(float)
MINISGL_ROW_KERNELS(at::BFloat16)
MINISGL_ROW_KERNELS(at::Half)
#undef MINISGL_ROW_KERNELS

// q: [tokens, heads, dim], k: [tokens, kv_heads, dim], each with contiguous heads (a token
// stride of their own: views into the fused QKV output); cos/sin: [positions, dim / 2] float32.
void rotary_(at::Tensor q, at::Tensor k, at::Tensor positions, at::Tensor cos,
             at::Tensor sin) {
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous());
  TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.is_contiguous() && sin.is_contiguous());
  for (const auto& x : {q, k}) {
    // NOTE: the first 2 * cos.size(1) of each head's dims rotate (all of them but with a
    // partial rotary factor), the rest pass through
    TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2) &&
                x.size(0) == positions.size(0) && x.size(2) >= 2 * cos.size(1));
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rotary", [&] {
      rotate_half<scalar_t>(x.data_ptr<scalar_t>(), x.size(0), x.size(1), x.stride(0),
                            x.stride(1), 2 * cos.size(1), positions.data_ptr<int64_t>(),
                            cos.data_ptr<float>(), sin.data_ptr<float>());
    });
  }
}

// One row into a float8 page, saturated at the format's largest finite value.
template <typename T, typename F>
void float8_row(const T* x, F* codes, int64_t dim) {
  const float largest = static_cast<float>(std::numeric_limits<F>::max());
  for (int64_t d = 0; d < dim; ++d)
    codes[d] = F(std::min(largest, std::max(-largest, load(x, d))));
}

// k / v: [tokens, kv_heads, dim], contiguous rows (views into the fused QKV output);
// k_cache / v_cache: [kv_heads, locations, dim]; locations: [tokens]. One row copy per
// (token, head), where index_copy_ of the transposed views costs ~16 us per call. Pages of
// another dtype than k / v's are 8-bit: int8 ones with k_scales / v_scales ([kv_heads,
// locations] float32, each row's scale written beside it), or float8.
void store_kv_(at::Tensor k_cache, at::Tensor v_cache, at::Tensor locations,
               at::Tensor k, at::Tensor v, c10::optional<at::Tensor> k_scales,
               c10::optional<at::Tensor> v_scales) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous());
  const auto where = locations.to(at::kLong).contiguous();
  const int64_t tokens = where.numel(), pool = k_cache.size(1);
  const int64_t* loc = where.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(loc[t] >= 0 && loc[t] < pool, "KV location out of range");
  const bool int8 = k_cache.scalar_type() == at::kChar;
  TORCH_CHECK(int8 == (k_scales.has_value() && v_scales.has_value()),
              "int8 pages, and only they, take scales");
  using Half = std::tuple<at::Tensor, at::Tensor, c10::optional<at::Tensor>>;
  for (const auto& [cache, x, scales] : {Half{k_cache, k, k_scales}, Half{v_cache, v, v_scales}}) {
    TORCH_CHECK(x.dim() == 3 && x.size(0) == tokens && x.stride(2) == 1 &&
                x.size(1) == cache.size(0) && x.size(2) == cache.size(2));
    const int64_t heads = x.size(1), dim = x.size(2);
    if (x.scalar_type() == cache.scalar_type()) {
      const int64_t row = dim * x.element_size();
      const char* src = static_cast<const char*>(x.data_ptr());
      char* dst = static_cast<char*>(cache.data_ptr());
      at::parallel_for(0, tokens, 256, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
          for (int64_t h = 0; h < heads; ++h)
            std::memcpy(dst + (h * pool + loc[t]) * row,
                        src + (t * x.stride(0) + h * x.stride(1)) * x.element_size(), row);
        }
      });
      continue;
    }
    if (int8)
      TORCH_CHECK(scales->scalar_type() == at::kFloat && scales->is_contiguous() &&
                  scales->size(0) == heads && scales->size(1) == pool);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "store_kv", [&] {
      const scalar_t* src = x.data_ptr<scalar_t>();
      at::parallel_for(0, tokens * heads, 64, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
          const int64_t t = i / heads, h = i % heads, at_row = h * pool + loc[t];
          const scalar_t* row = src + t * x.stride(0) + h * x.stride(1);
          switch (cache.scalar_type()) {
            case at::kChar:
              int8_kv_row(row, cache.data_ptr<int8_t>() + at_row * dim,
                           scales->data_ptr<float>() + at_row, dim);
              break;
            case at::kFloat8_e4m3fn:
              float8_row(row, cache.data_ptr<c10::Float8_e4m3fn>() + at_row * dim, dim);
              break;
            case at::kFloat8_e5m2:
              float8_row(row, cache.data_ptr<c10::Float8_e5m2>() + at_row * dim, dim);
              break;
            default:
              TORCH_CHECK(false, "KV pages in ", cache.scalar_type(), " for ", x.scalar_type());
          }
        }
      });
    });
  }
}

at::Tensor silu_and_mul(at::Tensor x) {
  TORCH_CHECK(x.is_contiguous() && x.size(-1) % 2 == 0);
  const int64_t d = x.size(-1) / 2;
  auto sizes = x.sizes().vec();
  sizes.back() = d;
  auto out = at::empty(sizes, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_and_mul", [&] {
    silu_and_mul_rows<scalar_t>(x.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                                x.numel() / (2 * d), d);
  });
  return out;
}

// x: [rows, n] float32 or bfloat16, contiguous -> [rows] int64.
at::Tensor argmax_rows(at::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) > 0);
  const int64_t rows = x.size(0), n = x.size(1);
  auto out = at::empty({rows}, x.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16 || x.scalar_type() == at::kFloat, "argmax_rows takes float32 or bfloat16");
  const void* xp = x.data_ptr();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      op[r] = bf16 ? argmax_row(static_cast<const at::BFloat16*>(xp) + r * n, n)
                   : argmax_row(static_cast<const float*>(xp) + r * n, n);
  });
  return out;
}

// Every byte of x (contiguous, a multiple of 256 bytes, 64-byte aligned) read once with the
// widest loads the build has, each thread one contiguous share, as the decode kernels stream a
// weight. Returns the bytes xor-ed together in 8-byte words, so that no load can be dropped.
int64_t stream_read(const at::Tensor& x) {
  using Line = int64_t __attribute__((vector_size(64)));
  TORCH_CHECK(x.is_contiguous() && x.nbytes() % 256 == 0 &&
              reinterpret_cast<uintptr_t>(x.data_ptr()) % 64 == 0,
              "stream_read takes a contiguous buffer of 256-byte lines, 64-byte aligned");
  const Line* lines = static_cast<const Line*>(x.data_ptr());
  const int64_t quads = static_cast<int64_t>(x.nbytes() / 256);
  const int threads = std::max(1, at::get_num_threads());
  std::vector<int64_t> words(threads, 0);
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      Line acc[4] = {};
      for (int64_t i = quads * t / threads; i < quads * (t + 1) / threads; ++i)
        for (int j = 0; j < 4; ++j) acc[j] ^= lines[4 * i + j];
      const Line all = acc[0] ^ acc[1] ^ acc[2] ^ acc[3];
      for (int j = 0; j < 8; ++j) words[t] ^= all[j];
    }
  });
  int64_t word = 0;
  for (int64_t w : words) word ^= w;
  return word;
}

// Returns (normed, carry). With a residual: carry = x + residual, written into `residual` in
// place (the caller owns that buffer); without: carry = x.
std::vector<at::Tensor> rms_norm(at::Tensor x, c10::optional<at::Tensor> residual,
                                 at::Tensor weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous());
  auto out = at::empty_like(x);
  at::Tensor carry = x;
  if (residual.has_value()) {
    TORCH_CHECK(residual->is_contiguous() && residual->sizes() == x.sizes());
    carry = *residual;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    add_rms_norm<scalar_t>(x.data_ptr<scalar_t>(),
                           residual.has_value() ? residual->data_ptr<scalar_t>() : nullptr,
                           weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                           x.numel() / x.size(-1), x.size(-1), static_cast<float>(eps));
  });
  return {out, carry};
}

// decode_bf16.cpp
bool decode_attention_bf16(const at::Tensor& q, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& locations,
                           const at::Tensor& seq_lens, const int64_t* token_rows,
                           at::Tensor& out, double scale, const float* sinks,
                           const float* k_scales, const float* v_scales);

// q: [tokens, heads, dim]; k_cache/v_cache: [kv_heads, pool, dim]; locations: [rows, max_len]
// int64 (entries past a token's length are not read); seq_lens: [tokens] int64, each >= 1: the
// keys token i attends to are the first seq_lens[i] of its row, token_rows[i] (by default row
// i: a decode batch; a prefill or mixed batch passes each token's request row, and its position
// + 1 as its length, so causality comes from the lengths). softcap > 0: each score s becomes
// softcap * tanh(s / softcap) (Gemma 2's attention logit soft-capping). sinks: [heads] float32,
// a logit per query head that joins the softmax's denominator and adds nothing to the output
// (gpt-oss's attention sinks). v_cache may be a view of rows of its own pitch and size
// ([kv_heads, pool, vdim], unit stride in the last dimension): latent attention's values are
// the first dims of its keys, read in place; the output is then [tokens, heads, vdim].
// K/V pages of another dtype than q's are 8-bit (see store_kv_): int8 ones read with their
// k_scales / v_scales, float8 ones exactly.
at::Tensor decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                            at::Tensor locations, at::Tensor seq_lens, double scale,
                            c10::optional<at::Tensor> token_rows, double softcap,
                            c10::optional<at::Tensor> sinks, c10::optional<at::Tensor> k_scales,
                            c10::optional<at::Tensor> v_scales) {
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.stride(2) == 1 &&
              v_cache.size(1) == k_cache.size(1) && v_cache.size(0) == k_cache.size(0));
  TORCH_CHECK(locations.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong);
  TORCH_CHECK(seq_lens.numel() == q.size(0));
  const auto where = locations.contiguous(), lens = seq_lens.contiguous();
  const auto rows = token_rows.has_value() ? token_rows->to(at::kLong).contiguous()
                                           : at::Tensor();
  TORCH_CHECK(!rows.defined() || rows.numel() == q.size(0));
  const int64_t* row_of = rows.defined() ? rows.data_ptr<int64_t>() : nullptr;
  const auto sink = sinks.has_value() ? sinks->to(at::kFloat).contiguous() : at::Tensor();
  TORCH_CHECK(!sink.defined() || sink.numel() == q.size(1), "one sink logit per query head");
  const float* sink_of = sink.defined() ? sink.data_ptr<float>() : nullptr;
  const auto pages = k_cache.scalar_type();
  TORCH_CHECK(v_cache.scalar_type() == pages);
  const bool int8 = pages == at::kChar;
  TORCH_CHECK(int8 == (k_scales.has_value() && v_scales.has_value()),
              "int8 pages, and only they, take scales");
  TORCH_CHECK(int8 || pages == q.scalar_type() || pages == at::kFloat8_e4m3fn ||
              pages == at::kFloat8_e5m2, "KV pages in ", pages, " for ", q.scalar_type());
  const float* k_scale = nullptr;
  const float* v_scale = nullptr;
  if (int8) {
    for (const auto& s : {*k_scales, *v_scales})
      TORCH_CHECK(s.scalar_type() == at::kFloat && s.is_contiguous() &&
                  s.size(0) == k_cache.size(0) && s.size(1) == k_cache.size(1));
    k_scale = k_scales->data_ptr<float>();
    v_scale = v_scales->data_ptr<float>();
  }
  auto out = at::empty({q.size(0), q.size(1), v_cache.size(2)}, q.options());
  if (softcap <= 0 && v_cache.is_contiguous() && v_cache.size(2) == q.size(2) &&
      decode_attention_bf16(q, k_cache, v_cache, where, lens, row_of, out, scale, sink_of,
                            k_scale, v_scale))
    return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "decode_attention",
                                  [&] {
    const auto run = [&](const auto* k_pages, const auto* v_pages) {
      decode(q.data_ptr<scalar_t>(), k_pages, v_pages, where.data_ptr<int64_t>(),
             lens.data_ptr<int64_t>(), row_of, out.data_ptr<scalar_t>(), q.size(0), q.size(1),
             k_cache.size(0), k_cache.size(1), q.size(2), where.size(1),
             static_cast<float>(scale), static_cast<float>(softcap), sink_of, v_cache.size(2),
             v_cache.stride(1), v_cache.stride(0), k_scale, v_scale);
    };
    switch (pages) {
      case at::kChar:
        return run(k_cache.data_ptr<int8_t>(), v_cache.data_ptr<int8_t>());
      case at::kFloat8_e4m3fn:
        return run(k_cache.data_ptr<c10::Float8_e4m3fn>(),
                   v_cache.data_ptr<c10::Float8_e4m3fn>());
      case at::kFloat8_e5m2:
        return run(k_cache.data_ptr<c10::Float8_e5m2>(), v_cache.data_ptr<c10::Float8_e5m2>());
      default:
        return run(k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>());
    }
  });
  return out;
}

// quant_matmul.cpp
bool vnni_available();
at::Tensor quant_matmul(at::Tensor x, at::Tensor codes, at::Tensor dm, int64_t terms);
at::Tensor quant_dequantize_t(at::Tensor codes, at::Tensor dm);
at::Tensor quant_rows(at::Tensor codes, at::Tensor dm, at::Tensor rows);
// int8_matmul.cpp
at::Tensor int8_matmul(at::Tensor x, at::Tensor codes, at::Tensor scales,
                       int64_t group);
// expert_matmul.cpp
at::Tensor expert_matmul(at::Tensor x, at::Tensor weight, at::Tensor ends);
// lora_matmul.cpp
void lora_add(at::Tensor x, at::Tensor out, at::Tensor rows, at::Tensor ends,
              at::Tensor a, std::vector<at::Tensor> bt, std::vector<int64_t> offsets);
// block_matmul.cpp
bool block_kernel_available();
bool block_kernel_vnni();
at::Tensor block_matmul(at::Tensor x, at::Tensor codes, at::Tensor scales,
                        at::Tensor subs, int64_t bits, int64_t mode, int64_t terms);
at::Tensor block_matmul_grouped(at::Tensor x, std::vector<at::Tensor> codes,
                                std::vector<at::Tensor> scales, std::vector<at::Tensor> subs,
                                int64_t bits, int64_t mode, int64_t terms,
                                std::vector<int64_t> counts);
at::Tensor block_dequantize(at::Tensor codes, at::Tensor scales, at::Tensor subs,
                            int64_t bits, int64_t mode, at::Tensor rows);
at::Tensor block_dequantize_t(at::Tensor codes, at::Tensor scales, at::Tensor subs,
                              int64_t bits, int64_t mode, bool bf16);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention,
        "paged attention of tokens over their requests' cached K/V (CPU)", py::arg("q"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("locations"), py::arg("seq_lens"),
        py::arg("scale"), py::arg("token_rows") = py::none(), py::arg("softcap") = 0.0,
        py::arg("sinks") = py::none(), py::arg("k_scales") = py::none(),
        py::arg("v_scales") = py::none(), py::call_guard<py::gil_scoped_release>());
  m.def("stream_read", &stream_read, "every byte of a buffer read once, for its bandwidth",
        py::call_guard<py::gil_scoped_release>());
  m.def("argmax_rows", &argmax_rows, "each row's first index of its largest value (CPU)",
        py::call_guard<py::gil_scoped_release>());
  m.def("rms_norm", &rms_norm, "residual add + RMSNorm (CPU)",
        py::call_guard<py::gil_scoped_release>());
  m.def("rotary_", &rotary_, "rotary embedding of q and k, in place (CPU)",
        py::call_guard<py::gil_scoped_release>());
  m.def("store_kv_", &store_kv_, "new tokens' K and V into the head-major pool (CPU)",
        py::arg("k_cache"), py::arg("v_cache"), py::arg("locations"), py::arg("k"),
        py::arg("v"), py::arg("k_scales") = py::none(), py::arg("v_scales") = py::none(),
        py::call_guard<py::gil_scoped_release>());
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up of a merged projection (CPU)",
        py::call_guard<py::gil_scoped_release>());
  m.def("vnni_available", &vnni_available,
        "whether quant_matmul was built (AVX-512 VNNI and BF16)");
  m.def("quant_dequantize_t", &quant_dequantize_t, "a quant_matmul weight as bf16 [k, n]",
        py::call_guard<py::gil_scoped_release>());
  m.def("quant_rows", &quant_rows, "rows of a quant_matmul weight as float32",
        py::call_guard<py::gil_scoped_release>());
  m.def("quant_matmul", &quant_matmul, "4/8-bit block weights x bfloat16 activations (CPU)",
        py::call_guard<py::gil_scoped_release>());
  m.def("int8_matmul", &int8_matmul, "int8 weights x per-row int8 activations (CPU, W8A8)",
        py::call_guard<py::gil_scoped_release>());
  m.def("block_kernel_available", &block_kernel_available,
        "whether block_matmul was built (AVX2, FMA, F16C)");
  m.def("block_kernel_vnni", &block_kernel_vnni,
        "whether block_matmul's dot products run on AVX-512 VNNI (else AVX2's int16 ones)");
  m.def("block_matmul", &block_matmul, "GGUF block weights of any type x activations (AVX2)",
        py::call_guard<py::gil_scoped_release>());
  m.def("block_matmul_grouped", &block_matmul_grouped,
        "rows grouped by expert x each expert's GGUF block weight, one call (AVX2)",
        py::call_guard<py::gil_scoped_release>());
  m.def("block_dequantize", &block_dequantize, "rows of a block_matmul weight as float32",
        py::call_guard<py::gil_scoped_release>());
  m.def("block_dequantize_t", &block_dequantize_t,
        "a block_matmul weight as float32 or bfloat16 [k, n]",
        py::call_guard<py::gil_scoped_release>());
  m.def("expert_matmul", &expert_matmul, "rows grouped by expert x each expert's weight (CPU)",
        py::call_guard<py::gil_scoped_release>());
  m.def("lora_add", &lora_add, "each adapter token's LoRA term added to its row (CPU)",
        py::call_guard<py::gil_scoped_release>());
  m.def("gated_delta_spans", &gated_delta_spans,
        "spans of tokens through a Gated DeltaNet layer, its states updated in place (CPU)",
        py::call_guard<py::gil_scoped_release>());
  m.def("gated_delta_layer", &gated_delta_layer,
        "spans of tokens through a Gated DeltaNet layer from its input projections' outputs to "
        "out_proj's input, its states updated in place (CPU)",
        py::call_guard<py::gil_scoped_release>());
  m.def("mamba2_spans", &mamba2_spans,
        "spans of tokens through a Mamba2 layer from in_proj's output to out_proj's input, "
        "its states updated in place (CPU)",
        py::call_guard<py::gil_scoped_release>());
  py::class_<FusedLayers>(m, "FusedLayers", "a decoder's GGUF-block layers as one call (CPU)")
      .def(py::init<int64_t, int64_t, int64_t, double, double, c10::optional<at::Tensor>,
                    c10::optional<at::Tensor>, double, double>())
      .def("add_attention", &FusedLayers::add_attention)
      .def("add_mamba2", &FusedLayers::add_mamba2)
      .def("add_delta_net", &FusedLayers::add_delta_net)
      .def("add_mlp", &FusedLayers::add_mlp)
      .def("add_moe", &FusedLayers::add_moe)
      .def("run", &FusedLayers::run, py::call_guard<py::gil_scoped_release>())
      .def("one_row_applies", &FusedLayers::one_row_applies)
      .def("one_row_steps", &FusedLayers::one_row_steps);
}
