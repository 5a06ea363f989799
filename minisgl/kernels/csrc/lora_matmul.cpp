// Multi-LoRA on CPU: out[t] += (x[t] A_s^T) B_s^T for each adapter token t of slot s, in one
// call per linear (layers.lora). Tokens come sorted by slot (`rows`, `ends`); a decode step
// gives each slot a few rows, so both products are written for small row counts:
//   h = x A^T: dot products over the input features (A's rows stream once per row block);
//   out += h B^T: per output block, axpy over the rank (B^T's [R, block] tile stays in L1
//   for all rows of the slot), so a rank of 16 costs no horizontal sums.
// A slot with more than kMaxKernelRows rows is compute-bound: ATen GEMMs.
// In bfloat16 on AVX-512 BF16 (MINISGL_VNNI) both products take tiles of up to 4 rows of a
// slot, for any row count: x A^T with vdpbf16ps (4 rows x 4 of A's rows, each loaded once for
// the tile), h B^T with B^T's rows widened once per tile; the same float32 sums in another
// order.
#include "aten.h"

#include "vec8.h"
#include "vnni.h"

#include <cstring>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kMaxKernelRows = 32;
constexpr int64_t kColBlock = 64;

template <typename T>
float dot(const T* a, const T* b, int64_t k) {
  v8 acc = {};
  int64_t i = 0;
  for (; i + 8 <= k; i += 8) acc += load8(a + i) * load8(b + i);
  float total = 0.f;
  for (int j = 0; j < 8; ++j) total += acc[j];
  for (; i < k; ++i) total += scalar(a, i) * scalar(b, i);
  return total;
}

template <typename T>
void lora_small(const T* x, T* out, const int64_t* rows, const std::vector<int64_t>& starts,
                const std::vector<int64_t>& stops, const std::vector<int64_t>& slots,
                const T* a, const std::vector<const T*>& bt, const std::vector<int64_t>& widths,
                const std::vector<int64_t>& offsets, int64_t in, int64_t out_stride,
                int64_t rank) {
  const int64_t parts = static_cast<int64_t>(bt.size()), pr = parts * rank;
  int64_t count = 0;
  std::vector<int64_t> first(starts.size());  // each group's first row in h
  for (size_t g = 0; g < starts.size(); ++g) {
    first[g] = count;
    count += stops[g] - starts[g];
  }
  std::vector<float> h(count * pr);
  std::vector<std::pair<int64_t, int64_t>> row_items;  // (group, row index in rows)
  for (size_t g = 0; g < starts.size(); ++g)
    for (int64_t r = starts[g]; r < stops[g]; ++r) row_items.emplace_back(g, r);
  at::parallel_for(0, static_cast<int64_t>(row_items.size()), 1, [&](int64_t b, int64_t e) {
    for (int64_t item = b; item < e; ++item) {
      const auto [g, r] = row_items[item];
      const T* xr = x + rows[r] * in;
      const T* as = a + slots[g] * pr * in;
      float* hr = h.data() + (first[g] + r - starts[g]) * pr;
      for (int64_t j = 0; j < pr; ++j) hr[j] = dot(xr, as + j * in, in);
    }
  });
  std::vector<std::pair<int64_t, int64_t>> col_items;  // (part, first column)
  for (int64_t p = 0; p < parts; ++p)
    for (int64_t c = 0; c < widths[p]; c += kColBlock) col_items.emplace_back(p, c);
  at::parallel_for(0, static_cast<int64_t>(col_items.size()), 1, [&](int64_t b, int64_t e) {
    float acc[kColBlock];
    for (int64_t item = b; item < e; ++item) {
      const auto [p, c0] = col_items[item];
      const int64_t n = std::min(kColBlock, widths[p] - c0), width = widths[p];
      for (size_t g = 0; g < starts.size(); ++g) {
        const T* bs = bt[p] + slots[g] * rank * width + c0;
        for (int64_t r = starts[g]; r < stops[g]; ++r) {
          const float* hr = h.data() + (first[g] + r - starts[g]) * pr + p * rank;
          T* o = out + rows[r] * out_stride + offsets[p] + c0;
          for (int64_t c = 0; c < n; ++c) acc[c] = scalar(o, c);
          for (int64_t j = 0; j < rank; ++j) {
            const float coef = hr[j];
            if (coef == 0.f) continue;  // NOTE: the rank's zero padding
            const T* bj = bs + j * width;
            int64_t c = 0;
            for (; c + 8 <= n; c += 8) {
              v8 v = load8(acc + c) + coef * load8(bj + c);
              std::memcpy(acc + c, &v, sizeof(v));
            }
            for (; c < n; ++c) acc[c] += coef * scalar(bj, c);
          }
          for (int64_t c = 0; c < n; ++c) o[c] = static_cast<T>(acc[c]);
        }
      }
    }
  });
}

#ifdef MINISGL_VNNI
constexpr int kTile = 4;  // rows of a slot per tile, and A's rows per inner block

inline __m512i load_pairs(const at::BFloat16* p, int64_t left) {  // 32 values, zero past left
  const __mmask32 mask = left >= 32 ? ~__mmask32(0) : (__mmask32(1) << left) - 1;
  return _mm512_maskz_loadu_epi16(mask, p);
}

// h[i][j] = x[rows[i]] . a[j] for i < R, j in [j_begin, j_end) (a's rows past pr: `zeros`).
template <int R>
void shrink_tile(const at::BFloat16* x, const int64_t* rows, const at::BFloat16* a,
                 const at::BFloat16* zeros, int64_t pr, int64_t in, float* h, int64_t j_begin,
                 int64_t j_end) {
  for (int64_t j0 = j_begin; j0 < j_end; j0 += kTile) {
    const at::BFloat16* arow[kTile];
    for (int j = 0; j < kTile; ++j) arow[j] = j0 + j < pr ? a + (j0 + j) * in : zeros;
    __m512 acc[R][kTile];
    for (int i = 0; i < R; ++i)
      for (int j = 0; j < kTile; ++j) acc[i][j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < in; k += 32) {
      __m512i xv[R];
      for (int i = 0; i < R; ++i) xv[i] = load_pairs(x + rows[i] * in + k, in - k);
      for (int j = 0; j < kTile; ++j) {
        const __m512bh av = (__m512bh)load_pairs(arow[j] + k, in - k);
        for (int i = 0; i < R; ++i)
          acc[i][j] = _mm512_dpbf16_ps(acc[i][j], av, (__m512bh)xv[i]);
      }
    }
    for (int i = 0; i < R; ++i)
      for (int j = 0; j < kTile && j0 + j < pr; ++j)
        h[i * pr + j0 + j] = _mm512_reduce_add_ps(acc[i][j]);
  }
}

// out[rows[i], cols c0 .. c0 + n) += h[i] . bt[:, those cols], n <= 64, for i < R.
template <int R>
void expand_tile(const float* h, int64_t pr, const at::BFloat16* bt, int64_t width,
                 int64_t rank, at::BFloat16* out, const int64_t* rows, int64_t out_stride,
                 int64_t n) {
  __mmask16 masks[4];
  for (int v = 0; v < 4; ++v) {
    const int64_t left = n - 16 * v;
    masks[v] = left >= 16 ? __mmask16(0xFFFF) : left > 0 ? __mmask16((1u << left) - 1) : 0;
  }
  __m512 acc[R][4];
  for (int i = 0; i < R; ++i)
    for (int v = 0; v < 4; ++v)
      acc[i][v] =
          widen_bf16(_mm256_maskz_loadu_epi16(masks[v], out + rows[i] * out_stride + 16 * v));
  for (int64_t j = 0; j < rank; ++j) {
    __m512 b[4];
    for (int v = 0; v < 4; ++v)
      b[v] = widen_bf16(_mm256_maskz_loadu_epi16(masks[v], bt + j * width + 16 * v));
    for (int i = 0; i < R; ++i) {
      const __m512 coef = _mm512_set1_ps(h[i * pr + j]);
      for (int v = 0; v < 4; ++v) acc[i][v] = _mm512_fmadd_ps(coef, b[v], acc[i][v]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int v = 0; v < 4; ++v)
      _mm256_mask_storeu_epi16(out + rows[i] * out_stride + 16 * v, masks[v],
                               (__m256i)_mm512_cvtneps_pbh(acc[i][v]));
}

template <typename F>
void by_rows(int64_t rows, F&& f) {  // f.template operator()<R>() for R = rows (1 .. 4)
  switch (rows) {
    case 1: f(std::integral_constant<int, 1>()); break;
    case 2: f(std::integral_constant<int, 2>()); break;
    case 3: f(std::integral_constant<int, 3>()); break;
    default: f(std::integral_constant<int, 4>()); break;
  }
}

// lora_small for bfloat16 on AVX-512 BF16: the same groups, products by tiles of rows.
void lora_small_bf16(const at::BFloat16* x, at::BFloat16* out, const int64_t* rows,
                     const std::vector<int64_t>& starts, const std::vector<int64_t>& stops,
                     const std::vector<int64_t>& slots, const at::BFloat16* a,
                     const std::vector<const at::BFloat16*>& bt,
                     const std::vector<int64_t>& widths, const std::vector<int64_t>& offsets,
                     int64_t in, int64_t out_stride, int64_t rank) {
  const int64_t parts = static_cast<int64_t>(bt.size()), pr = parts * rank;
  std::vector<int64_t> first(starts.size());
  std::vector<std::pair<int64_t, int64_t>> tiles;  // (group, first row index in rows)
  int64_t count = 0;
  for (size_t g = 0; g < starts.size(); ++g) {
    first[g] = count;
    count += stops[g] - starts[g];
    for (int64_t r = starts[g]; r < stops[g]; r += kTile) tiles.emplace_back(g, r);
  }
  std::vector<float> h(count * pr);
  const std::vector<at::BFloat16> zeros(in, at::BFloat16(0.f));
  // NOTE: A's rows split in chunks too, so a decode step's one or two tiles still stream A
  // (from memory: an adapter is read once a step) on every thread
  constexpr int64_t kRowsPerChunk = 2 * kTile;
  const int64_t chunks = (pr + kRowsPerChunk - 1) / kRowsPerChunk;
  at::parallel_for(0, static_cast<int64_t>(tiles.size()) * chunks, 1, [&](int64_t b, int64_t e) {
    for (int64_t item = b; item < e; ++item) {
      const auto [g, r] = tiles[item / chunks];
      const int64_t j_begin = item % chunks * kRowsPerChunk;
      float* hr = h.data() + (first[g] + r - starts[g]) * pr;
      by_rows(std::min<int64_t>(kTile, stops[g] - r), [&](auto n) {
        shrink_tile<decltype(n)::value>(x, rows + r, a + slots[g] * pr * in, zeros.data(), pr,
                                        in, hr, j_begin,
                                        std::min(pr, j_begin + kRowsPerChunk));
      });
    }
  });
  std::vector<std::tuple<int64_t, int64_t, int64_t>> items;  // (part, first column, tile)
  for (int64_t p = 0; p < parts; ++p)
    for (int64_t c = 0; c < widths[p]; c += kColBlock)
      for (size_t t = 0; t < tiles.size(); ++t) items.emplace_back(p, c, t);
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t b, int64_t e) {
    for (int64_t item = b; item < e; ++item) {
      const auto [p, c0, t] = items[item];
      const auto [g, r] = tiles[t];
      const int64_t width = widths[p], n = std::min(kColBlock, width - c0);
      const float* hr = h.data() + (first[g] + r - starts[g]) * pr + p * rank;
      by_rows(std::min<int64_t>(kTile, stops[g] - r), [&](auto k) {
        expand_tile<decltype(k)::value>(hr, pr, bt[p] + slots[g] * rank * width + c0, width,
                                        rank, out + offsets[p] + c0, rows + r, out_stride, n);
      });
    }
  });
}
#endif

}  // namespace

// x: [tokens, in]; out: [tokens, out] contiguous, updated in place; rows: int64, the adapter
// tokens sorted by slot; ends: int32 [slots], each slot's end in rows (a cumulative count);
// a: [all slots, parts * rank, in]; bt: per part [all slots, rank, width_p]; offsets: each
// part's first column in out. One dtype throughout: float32 or bfloat16.
void lora_add(at::Tensor x, at::Tensor out, at::Tensor rows, at::Tensor ends,
              at::Tensor a, std::vector<at::Tensor> bt, std::vector<int64_t> offsets) {
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && out.is_contiguous() && a.is_contiguous());
  TORCH_CHECK(x.scalar_type() == out.scalar_type() && x.scalar_type() == a.scalar_type());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16);
  TORCH_CHECK(rows.scalar_type() == at::kLong && ends.scalar_type() == at::kInt);
  TORCH_CHECK(bt.size() == offsets.size() && !bt.empty());
  const auto xc = x.contiguous();
  const int64_t in = xc.size(1), rank = bt[0].size(1);
  TORCH_CHECK(a.size(1) == static_cast<int64_t>(bt.size()) * rank && a.size(2) == in);
  std::vector<int64_t> widths;
  for (auto& b : bt) {
    TORCH_CHECK(b.is_contiguous() && b.scalar_type() == x.scalar_type() && b.size(1) == rank);
    widths.push_back(b.size(2));
  }
  int64_t max_kernel_rows = kMaxKernelRows;
#ifdef MINISGL_VNNI
  // NOTE: the tiles beat the per-slot GEMMs at a prefill's rows too (BENCHMARKS.md,
  // "Multi-LoRA")
  if (x.scalar_type() == at::kBFloat16) max_kernel_rows = rows.numel();
#endif
  const int32_t* end_of = ends.data_ptr<int32_t>();
  std::vector<int64_t> starts, stops, slots;
  int64_t start = 0;
  for (int64_t s = 0; s < ends.numel(); ++s) {
    const int64_t stop = end_of[s];
    TORCH_CHECK(stop >= start && stop <= rows.numel(), "ends must be a cumulative row count");
    if (stop - start > max_kernel_rows) {
      // NOTE: in float32 as the kernels sum (h rounded to bfloat16 would cost the term ~2^-8 of
      // its size per product), and without native bfloat16 GEMMs it is the faster one too
      const auto idx = rows.narrow(0, start, stop - start);
      const auto h = xc.index_select(0, idx).to(at::kFloat).mm(a[s].to(at::kFloat).t());
      auto sum = out.index_select(0, idx).to(at::kFloat);
      for (size_t p = 0; p < bt.size(); ++p)
        sum.narrow(1, offsets[p], widths[p]).add_(
            h.narrow(1, p * rank, rank).mm(bt[p][s].to(at::kFloat)));
      out.index_copy_(0, idx, sum.to(out.scalar_type()));
    } else if (stop > start) {
      starts.push_back(start);
      stops.push_back(stop);
      slots.push_back(s);
    }
    start = stop;
  }
  if (slots.empty()) return;
  const int64_t* row_ids = rows.data_ptr<int64_t>();
  if (x.scalar_type() == at::kFloat) {
    std::vector<const float*> bp;
    for (auto& b : bt) bp.push_back(b.data_ptr<float>());
    lora_small<float>(xc.data_ptr<float>(), out.data_ptr<float>(), row_ids, starts, stops,
                      slots, a.data_ptr<float>(), bp, widths, offsets, in, out.size(1), rank);
  } else {
    std::vector<const at::BFloat16*> bp;
    for (auto& b : bt) bp.push_back(b.data_ptr<at::BFloat16>());
#ifdef MINISGL_VNNI
    lora_small_bf16(xc.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), row_ids, starts,
                    stops, slots, a.data_ptr<at::BFloat16>(), bp, widths, offsets, in,
                    out.size(1), rank);
    return;
#endif
    lora_small<at::BFloat16>(xc.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(),
                             row_ids, starts, stops, slots, a.data_ptr<at::BFloat16>(), bp,
                             widths, offsets, in, out.size(1), rank);
  }
}
