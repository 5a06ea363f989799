// Paged decode attention for the CPU over the head-major KV pool ([kv_heads, locations, dim]).
// One pass over each request's K and V, read in place through its location row: no gathered
// copy, no padded batch matmuls. Parallel over (request, kv head) pairs with ATen's pool.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

template <typename T>
inline float load(const T* p, int64_t i) { return static_cast<float>(p[i]); }

template <>
inline float load<at::BFloat16>(const at::BFloat16* p, int64_t i) {
  // NOTE: a plain shift instead of c10's conversion lets the compiler vectorise the loops.
  uint32_t bits = static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(p)[i]) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

template <typename T>
void decode(const T* q, const T* k_cache, const T* v_cache, const int64_t* locations,
            const int64_t* seq_lens, T* out, int64_t batch, int64_t heads, int64_t kv_heads,
            int64_t pool, int64_t dim, int64_t max_len, float scale) {
  const int64_t group = heads / kv_heads;
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * dim), probs(group * max_len), acc(group * dim);
    std::vector<float> maxs(group), sums(group);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / kv_heads, h = task % kv_heads, len = seq_lens[b];
      const int64_t* loc = locations + b * max_len;
      const T* qh = q + (b * heads + h * group) * dim;
      for (int64_t i = 0; i < group * dim; ++i) qf[i] = load(qh, i) * scale;
      std::fill(maxs.begin(), maxs.end(), -std::numeric_limits<float>::infinity());
      for (int64_t t = 0; t < len; ++t) {
        const T* k = k_cache + (h * pool + loc[t]) * dim;
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = qf.data() + g * dim;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < dim; ++d) s += qg[d] * load(k, d);
          probs[g * max_len + t] = s;
          maxs[g] = std::max(maxs[g], s);
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float sum = 0.f;
        for (int64_t t = 0; t < len; ++t) {
          const float e = std::exp(probs[g * max_len + t] - maxs[g]);
          probs[g * max_len + t] = e;
          sum += e;
        }
        sums[g] = sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < len; ++t) {
        const T* v = v_cache + (h * pool + loc[t]) * dim;
        for (int64_t g = 0; g < group; ++g) {
          const float p = probs[g * max_len + t];
          float* ag = acc.data() + g * dim;
#pragma omp simd
          for (int64_t d = 0; d < dim; ++d) ag[d] += p * load(v, d);
        }
      }
      T* oh = out + (b * heads + h * group) * dim;
      for (int64_t g = 0; g < group; ++g)
        for (int64_t d = 0; d < dim; ++d)
          oh[g * dim + d] = static_cast<T>(acc[g * dim + d] / sums[g]);
    }
  });
}

}  // namespace

// q: [batch, heads, dim]; k_cache/v_cache: [kv_heads, pool, dim]; locations: [batch, max_len]
// int64 (entries past seq_len are not read); seq_lens: [batch] int64, each >= 1.
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                               torch::Tensor locations, torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous());
  TORCH_CHECK(locations.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong);
  auto out = torch::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "decode_attention",
                                  [&] {
    decode<scalar_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(),
                     v_cache.data_ptr<scalar_t>(), locations.contiguous().data_ptr<int64_t>(),
                     seq_lens.contiguous().data_ptr<int64_t>(), out.data_ptr<scalar_t>(),
                     q.size(0), q.size(1), k_cache.size(0), k_cache.size(1), q.size(2),
                     locations.size(1), static_cast<float>(scale));
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "paged decode attention (CPU)",
        py::call_guard<py::gil_scoped_release>());
}
