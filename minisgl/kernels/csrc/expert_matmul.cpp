// Mixture-of-experts matmul on CPU: rows grouped by expert, each group times its expert's
// weight. A decode batch gives an expert a few rows (a token's k choices spread over E
// experts), and a GEMM library's kernels for 2-16 rows read the weight at a fraction of the
// memory bandwidth their one-row (GEMV) kernel reaches (BENCHMARKS.md, "Mixture of experts").
// Here each expert's weight is streamed once per group: a block of its output rows is dotted
// with up to kRowTile activation rows at a time (held in cache, in float32), parallel over
// (expert, output block). A group of more than kMaxKernelRows rows is compute-bound: at::mm.
#include "aten.h"

#include "vec8.h"

#include <cstring>
#include <vector>

namespace {

constexpr int64_t kMaxKernelRows = 32;
constexpr int kRowTile = 4;
constexpr int64_t kOutBlock = 8;  // weight rows per work item: 8 x K floats stay in L2

inline float sum8(v8 v) {
  float total = 0.f;
  for (int i = 0; i < 8; ++i) total += v[i];
  return total;
}

// out[r][j] = x[r] . w[j] for R activation rows (float32, stride k) and two weight rows.
template <typename T, int R>
inline void tile(const float* x, const T* w0, const T* w1, int64_t k, float (*out)[2]) {
  v8 acc[R][2] = {};
  int64_t i = 0;
  for (; i + 8 <= k; i += 8) {
    const v8 b0 = load8(w0 + i), b1 = load8(w1 + i);
    for (int r = 0; r < R; ++r) {
      const v8 a = load8(x + r * k + i);
      acc[r][0] += a * b0;
      acc[r][1] += a * b1;
    }
  }
  for (int r = 0; r < R; ++r) {
    out[r][0] = sum8(acc[r][0]);
    out[r][1] = sum8(acc[r][1]);
    for (int64_t j = i; j < k; ++j) {
      out[r][0] += x[r * k + j] * scalar(w0, j);
      out[r][1] += x[r * k + j] * scalar(w1, j);
    }
  }
}

template <typename T, int R>
void rows_times_block(const float* x, const T* w, int64_t k, int64_t n, int64_t first,
                      int64_t last, T* out) {
  float dots[R][2];
  for (int64_t j = first; j < last; j += 2) {
    const T* w1 = w + (j + 1 < last ? j + 1 : j) * k;
    tile<T, R>(x, w + j * k, w1, k, dots);
    for (int r = 0; r < R; ++r) {
      out[r * n + j] = static_cast<T>(dots[r][0]);
      if (j + 1 < last) out[r * n + j + 1] = static_cast<T>(dots[r][1]);
    }
  }
}

template <typename T>
void small_groups(const float* x, const T* w, const std::vector<int64_t>& starts,
                  const std::vector<int64_t>& ends, const std::vector<int64_t>& experts,
                  int64_t k, int64_t n, T* out) {
  const int64_t blocks = (n + kOutBlock - 1) / kOutBlock;
  const int64_t items = static_cast<int64_t>(experts.size()) * blocks;
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t g = item / blocks, first = item % blocks * kOutBlock;
      const int64_t last = std::min(first + kOutBlock, n);
      const T* we = w + experts[g] * n * k;
      for (int64_t row = starts[g]; row < ends[g]; row += kRowTile) {
        const float* xr = x + row * k;
        T* o = out + row * n;
        switch (std::min<int64_t>(kRowTile, ends[g] - row)) {
          case 4: rows_times_block<T, 4>(xr, we, k, n, first, last, o); break;
          case 3: rows_times_block<T, 3>(xr, we, k, n, first, last, o); break;
          case 2: rows_times_block<T, 2>(xr, we, k, n, first, last, o); break;
          default: rows_times_block<T, 1>(xr, we, k, n, first, last, o);
        }
      }
    }
  });
}

}  // namespace

// x: [rows, k], sorted by expert; weight: [experts, n, k] contiguous, x's dtype (float32 or
// bfloat16); ends: [experts] int32, the end row of each expert's group (a cumulative sum).
// Returns [rows, n]: each group's rows times its expert's weight, transposed.
at::Tensor expert_matmul(at::Tensor x, at::Tensor weight, at::Tensor ends) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 3 && weight.is_contiguous());
  TORCH_CHECK(x.scalar_type() == weight.scalar_type() && x.size(1) == weight.size(2));
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16);
  TORCH_CHECK(ends.scalar_type() == at::kInt && ends.numel() == weight.size(0));
  const int64_t k = x.size(1), n = weight.size(1);
  auto out = at::empty({x.size(0), n}, x.options());
  const auto x_float = x.to(at::kFloat).contiguous();
  const auto group_ends = ends.contiguous();
  const int32_t* end_of = group_ends.data_ptr<int32_t>();
  std::vector<int64_t> starts, stops, experts;
  int64_t start = 0;
  for (int64_t e = 0; e < weight.size(0); ++e) {
    const int64_t stop = end_of[e];
    TORCH_CHECK(stop >= start && stop <= x.size(0), "ends must be a cumulative row count");
    if (stop - start > kMaxKernelRows) {
      out.narrow(0, start, stop - start).copy_(
          x.narrow(0, start, stop - start).mm(weight[e].t()));
    } else if (stop > start) {
      starts.push_back(start);
      stops.push_back(stop);
      experts.push_back(e);
    }
    start = stop;
  }
  TORCH_CHECK(start == x.size(0), "ends must cover every row");
  if (experts.empty()) return out;
  if (x.scalar_type() == at::kFloat) {
    small_groups<float>(x_float.data_ptr<float>(), weight.data_ptr<float>(), starts, stops,
                        experts, k, n, out.data_ptr<float>());
  } else {
    small_groups<at::BFloat16>(x_float.data_ptr<float>(), weight.data_ptr<at::BFloat16>(),
                               starts, stops, experts, k, n, out.data_ptr<at::BFloat16>());
  }
  return out;
}
