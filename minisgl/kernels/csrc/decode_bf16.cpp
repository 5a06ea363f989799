// Paged attention in bfloat16 (the dtype minisgl serves in on CPU) with AVX-512 BF16, for head
// dims 64 and 128; cpu_kernels.cpp's generic loop takes every other case. One task is one
// token and KV head over the first `len` locations of the token's row: a decode token, or a
// prefill token (len = position + 1 gives causality), to beat SDPA's fused CPU kernel there.
//
// Scores: tiles of 16 tokens. Per query head each token's q.k is one float vector of partial
// sums (vdpbf16ps: 32 bfloat16 products per instruction, exact products, float32 sums); one
// transposing reduction turns the tile's 16 vectors into one vector of 16 scores (45 shuffles
// and adds, where a horizontal sum per token costs ~8 each and stalls on its own chain).
// Values: each V row is widened once and added into every query head's float32 accumulators,
// which stay in registers for the whole sequence.
// int8 pages (a float32 scale per row): a tile's K rows are widened to bfloat16 once (exact:
// an int8 value fits bfloat16's significand) into a scratch tile, and each token's score is
// scaled by its row's scale; V rows are widened to float32, and each token's probability
// carries its row's scale.
#include "aten.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "row_kernels.h"
#include "vnni.h"

namespace {

#ifdef MINISGL_VNNI

constexpr int kTile = 16;
constexpr int kValueAccumulators = 16;  // float vectors per V pass chunk (of 32 registers)

// acc += pairwise bfloat16 dot products of a and b per float lane, in place (see dpbusd).
inline void dpbf16(__m512& acc, __m512i a, __m512i b) {
  asm("vdpbf16ps %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
}

// Lane j of the result is the sum of the 16 lanes of v[s] for s = kSlot[j].
inline __m512 transpose_sum(const __m512 (&v)[kTile]) {
  __m512 s[8], u[4], w[2];
  for (int i = 0; i < 8; ++i)
    s[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)
    u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(u[2 * i], u[2 * i + 1]),
                         _mm512_unpackhi_ps(u[2 * i], u[2 * i + 1]));
  return _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], 0x44), _mm512_shuffle_ps(w[0], w[1], 0xEE));
}

// The reduction above leaves slot s's sum in lane (s % 4) * 4 + s / 4 (a 4 x 4 transpose, its
// own inverse): slot s scores token kSlot[s] of the tile, so token j lands in lane j.
constexpr int kSlot[kTile] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};

using bf16 = at::BFloat16;

// C: the pages' type, bfloat16 or int8.
template <typename C>
struct Task {
  const bf16* q;   // [group, dim]: the query heads of one KV head
  const C* k;      // this KV head's rows of the pool, [pool, dim]
  const C* v;
  const float* k_scale;  // int8 pages' codes: this KV head's row scales, [pool] (else null)
  const float* v_scale;
  const int64_t* loc;
  int64_t len, group;
  float scale;
  float* probs;    // [group, stride]
  int64_t stride;  // len rounded up to kTile
  bf16* out;       // [group, dim]
  const float* sinks;  // [group]: each query head's sink logit, or none
  int64_t ahead = 0;              // rows to prefetch ahead (see prefetch_stream)
  const C* next_k = nullptr;  // the K rows of this thread's next task, if any
  const int64_t* next_loc = nullptr;
  int64_t next_len = 0;
};

// The rows a task reads, in order, continued into the next task's: K rows [0, len), V rows
// [len, 2 len), the next task's K rows [2 len, 2 len + next_len). In decode, prefetching
// a few tiles ahead along it (the distance: scripts/bench_attention.py) keeps misses in
// flight across the K -> V and task boundaries, where a request's pages (2 KiB runs per head
// at 16 tokens) start cold: the KV of a decode batch comes from DRAM. A prefill's comes from
// cache, where one tile without the continuation is the faster distance.
// NOTE: into L2, not L1: the L1's few miss buffers cap how many lines are in flight, far
// below what DRAM can deliver; the tile's rows move from L2 to L1 on their own (BENCHMARKS.md,
// "Decode attention").
constexpr int64_t kDecodeAhead = 4 * kTile, kPrefillAhead = kTile;

// NOTE: inlined by force: a call in the value pass would spill its register accumulators
// (every zmm register is caller-saved).
template <int DIM, typename C>
[[gnu::always_inline]] inline void prefetch_stream(const Task<C>& a, int64_t from, int64_t to) {
  for (int64_t i = from; i < to; ++i) {
    const C* row;
    const float* scale = nullptr;  // int8 pages: the row's scale is read too
    if (i < a.len) {
      row = a.k + a.loc[i] * DIM;
      if constexpr (std::is_same_v<C, int8_t>) scale = a.k_scale + a.loc[i];
    } else if (i < 2 * a.len) {
      row = a.v + a.loc[i - a.len] * DIM;
      if constexpr (std::is_same_v<C, int8_t>) scale = a.v_scale + a.loc[i - a.len];
    } else if (i < 2 * a.len + a.next_len) {
      row = a.next_k + a.next_loc[i - 2 * a.len] * DIM;
    } else {
      return;
    }
    for (int offset = 0; offset < DIM * static_cast<int>(sizeof(C)); offset += 64)
      __builtin_prefetch(reinterpret_cast<const char*>(row) + offset, 0, 2);  // T1: L2
    // NOTE: once per 16 rows (a line of scales where pages hold 16 tokens): a prefetch per
    // row cost more than the misses it saved
    if (scale != nullptr && (i & 15) == 0) __builtin_prefetch(scale, 0, 2);
  }
}

// One int8 row as bfloat16 into `out`: exact, or (`scale` given) times its scale, rounded.
template <int DIM>
inline void int8_row_as_bf16(const int8_t* row, bf16* out, const float* scale = nullptr) {
  for (int n = 0; n < DIM / 32; ++n) {
    __m512 low = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 32 * n))));
    __m512 high = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 32 * n + 16))));
    if (scale != nullptr) {
      low = _mm512_mul_ps(_mm512_set1_ps(*scale), low);
      high = _mm512_mul_ps(_mm512_set1_ps(*scale), high);
    }
    _mm512_storeu_si512(out + 32 * n, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(high, low)));
  }
}

// probs[g][t] = scale * q_g . k_t, lanes past len set to -inf; returns each head's maximum.
template <int DIM, typename C>
void scores(const Task<C>& a, float* maxima) {
  constexpr bool kInt8 = std::is_same_v<C, int8_t>;
  alignas(64) bf16 widened[kInt8 ? kTile * DIM : 1];
  constexpr int kVectors = DIM / 32;  // bfloat16 vectors per row
  std::fill(maxima, maxima + a.group, -std::numeric_limits<float>::infinity());
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512 scale = _mm512_set1_ps(a.scale);
  for (int64_t start = 0; start < a.len; start += kTile) {
    const bf16* rows[kTile];
    __m512 row_scales = scale;
    for (int s = 0; s < kTile; ++s) {  // past the end: the last row again (read, then masked)
      const C* row = a.k + a.loc[std::min(start + kSlot[s], a.len - 1)] * DIM;
      if constexpr (kInt8) {
        int8_row_as_bf16<DIM>(row, widened + s * DIM);
        rows[s] = widened + s * DIM;
      } else {
        rows[s] = row;
      }
    }
    if (a.k_scale != nullptr) {
      alignas(64) float tile_scales[kTile];
      for (int j = 0; j < kTile; ++j)
        tile_scales[j] = a.k_scale[a.loc[std::min(start + j, a.len - 1)]];
      row_scales = _mm512_mul_ps(scale, _mm512_load_ps(tile_scales));
    }
    prefetch_stream<DIM>(a, start + a.ahead, start + a.ahead + kTile);
    const __mmask16 valid = a.len - start >= kTile ? 0xFFFF : (1u << (a.len - start)) - 1;
    for (int64_t g = 0; g < a.group; ++g) {
      __m512i q[kVectors];
      for (int n = 0; n < kVectors; ++n) q[n] = _mm512_loadu_si512(a.q + g * DIM + 32 * n);
      __m512 dot[kTile];
      for (int s = 0; s < kTile; ++s) {
        dot[s] = _mm512_setzero_ps();
        for (int n = 0; n < kVectors; ++n) dpbf16(dot[s], q[n], _mm512_loadu_si512(rows[s] + 32 * n));
      }
      const __m512 tile = _mm512_mask_blend_ps(valid, minus_inf,
                                               _mm512_mul_ps(transpose_sum(dot), row_scales));
      _mm512_storeu_ps(a.probs + g * a.stride + start, tile);
      maxima[g] = std::max(maxima[g], _mm512_reduce_max_ps(tile));
    }
  }
}

// out[g0 + h] = sum_t probs[g0 + h][t] * v_t / sums[g0 + h] for HEADS query heads.
template <int DIM, int HEADS, typename C>
void values(const Task<C>& a, int64_t g0, const float* sums) {
  constexpr int kVectors = DIM / 16;  // float vectors per row
  __m512 acc[HEADS][kVectors];
  for (int h = 0; h < HEADS; ++h)
    for (int n = 0; n < kVectors; ++n) acc[h][n] = _mm512_setzero_ps();
  for (int64_t t = 0; t < a.len; ++t) {
    const C* row = a.v + a.loc[t] * DIM;
    if (g0 == 0) prefetch_stream<DIM>(a, a.len + t + a.ahead, a.len + t + a.ahead + 1);
    __m512 v[kVectors];
    for (int n = 0; n < kVectors; ++n) {
      if constexpr (std::is_same_v<C, int8_t>)
        v[n] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * n))));
      else
        v[n] = load_bf16(row + 16 * n);
    }
    for (int h = 0; h < HEADS; ++h) {
      const __m512 p = _mm512_set1_ps(a.probs[(g0 + h) * a.stride + t]);
      for (int n = 0; n < kVectors; ++n) acc[h][n] = _mm512_fmadd_ps(p, v[n], acc[h][n]);
    }
  }
  for (int h = 0; h < HEADS; ++h) {
    const __m512 inv = _mm512_set1_ps(1.0f / sums[g0 + h]);
    for (int n = 0; n < kVectors; ++n)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.out + (g0 + h) * DIM + 16 * n),
                          reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(
                              _mm512_mul_ps(acc[h][n], inv))));
  }
}

template <int DIM, typename C>
void values_chunk(const Task<C>& a, int64_t g0, int heads, const float* sums) {
  constexpr int kMostHeads = kValueAccumulators / (DIM / 16);  // 4 at dim 64, 2 at 128
  static_assert(kMostHeads == 4 || kMostHeads == 2);
  switch (heads) {
    case 1: return values<DIM, 1>(a, g0, sums);
    case 2: return values<DIM, 2>(a, g0, sums);
    case 3: if constexpr (kMostHeads >= 3) return values<DIM, 3>(a, g0, sums); break;
    case 4: if constexpr (kMostHeads >= 4) return values<DIM, 4>(a, g0, sums); break;
  }
}

// NOTE: never inlined: decode_row_task runs the same code (row_kernels.h).
template <int DIM, typename C>
[[gnu::noinline]] void attend(const Task<C>& a, float* maxima, float* sums) {
  prefetch_stream<DIM>(a, 0, a.ahead);  // NOTE: in flight already, but for a thread's first task
  scores<DIM>(a, maxima);
  for (int64_t g = 0; g < a.group; ++g) {
    float* p = a.probs + g * a.stride;
    const float m = a.sinks ? std::max(maxima[g], a.sinks[g]) : maxima[g];
    float sum = a.sinks ? std::exp(a.sinks[g] - m) : 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < a.len; ++t) {
      p[t] = std::exp(p[t] - m);
      sum += p[t];
    }
    sums[g] = sum;
  }
  if (a.v_scale != nullptr) {  // each token's probabilities carry its V row's scale
    for (int64_t t = 0; t < a.len; ++t) {
      const float v_scale = a.v_scale[a.loc[t]];
      for (int64_t g = 0; g < a.group; ++g) a.probs[g * a.stride + t] *= v_scale;
    }
  }
  constexpr int kMostHeads = kValueAccumulators / (DIM / 16);
  for (int64_t g0 = 0; g0 < a.group; g0 += kMostHeads)
    values_chunk<DIM>(a, g0, static_cast<int>(std::min<int64_t>(kMostHeads, a.group - g0)), sums);
}

// attend at the task's head dim, 64 or 128
template <typename C>
void attend_task(const Task<C>& a, int64_t dim, float* maxima, float* sums) {
  if (dim == 64)
    attend<64>(a, maxima, sums);
  else
    attend<128>(a, maxima, sums);
}

#endif  // MINISGL_VNNI

}  // namespace

int64_t balanced_token(int64_t i, int64_t n);  // cpu_kernels.cpp

namespace {

#ifdef MINISGL_VNNI
// The tasks of `count` tokens (token i is q's row tokens[i], or i without a list).
template <typename C>
void run_tasks(const at::Tensor& q, const C* kp, const C* vp, const float* k_scales,
               const float* v_scales, int64_t pool, int64_t kv_heads, const int64_t* loc,
               const int64_t* lens, int64_t max_len, const int64_t* token_rows, bool decode,
               bf16* op, double scale, const float* sinks, const int64_t* tokens,
               int64_t count) {
  const int64_t dim = q.size(2), heads = q.size(1), group = heads / kv_heads;
  const bf16* qp = q.data_ptr<bf16>();
  const int64_t stride = (max_len + kTile - 1) / kTile * kTile;
  // NOTE: as many rows ahead as bfloat16 pages' bytes
  const int64_t ahead = (decode ? kDecodeAhead : kPrefillAhead) *
                        static_cast<int64_t>(sizeof(bf16) / sizeof(C));
  at::parallel_for(0, count * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> probs(group * stride), maxima(group), sums(group);
    const auto task_at = [&](int64_t task) {
      const int64_t i = balanced_token(task / kv_heads, count), h = task % kv_heads;
      const int64_t b = tokens ? tokens[i] : i;
      const int64_t first = (b * heads + h * group) * dim;
      const int64_t* row = loc + (token_rows ? token_rows[b] : b) * max_len;
      return Task<C>{qp + first, kp + h * pool * dim, vp + h * pool * dim,
                     k_scales ? k_scales + h * pool : nullptr,
                     v_scales ? v_scales + h * pool : nullptr, row, lens[b], group,
                     static_cast<float>(scale), probs.data(), stride, op + first,
                     sinks ? sinks + h * group : nullptr, ahead};
    };
    Task<C> next = task_at(begin);
    for (int64_t task = begin; task < end; ++task) {
      Task<C> a = next;
      if (task + 1 < end) {
        next = task_at(task + 1);
        if (decode) a.next_k = next.k, a.next_loc = next.loc, a.next_len = next.len;
      }
      attend_task(a, dim, maxima.data(), sums.data());
    }
  });
}

// int8 pages in a batch with rows of several tokens (prefill, mixed): where each token would
// widen every K row it reads, the rows of such requests are dequantized once into bfloat16
// copies that their tokens read instead (one bfloat16 rounding more, as bfloat16 pages have);
// a row of one token (a decode row) reads the pages themselves.
void run_int8_batch(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                    const float* k_scales, const float* v_scales, const at::Tensor& locations,
                    const int64_t* lens, const int64_t* token_rows, bf16* op, double scale,
                    const float* sinks) {
  const int64_t tokens = q.size(0), rows = locations.size(0), max_len = locations.size(1);
  const int64_t kv_heads = k_cache.size(0), pool = k_cache.size(1), dim = k_cache.size(2);
  const int64_t* loc = locations.data_ptr<int64_t>();
  std::vector<int64_t> per_row(rows, 0), reach(rows, 0), first(rows, -1);
  for (int64_t b = 0; b < tokens; ++b) {
    const int64_t r = token_rows ? token_rows[b] : b;
    ++per_row[r];
    reach[r] = std::max(reach[r], lens[b]);
  }
  std::vector<int64_t> single, several;
  int64_t copied = 0;
  for (int64_t r = 0; r < rows; ++r)
    if (per_row[r] > 1) first[r] = copied, copied += reach[r];
  for (int64_t b = 0; b < tokens; ++b)
    (per_row[token_rows ? token_rows[b] : b] > 1 ? several : single).push_back(b);
  const int8_t* kp = k_cache.data_ptr<int8_t>();
  const int8_t* vp = v_cache.data_ptr<int8_t>();
  if (!single.empty())
    run_tasks(q, kp, vp, k_scales, v_scales, pool, kv_heads, loc, lens, max_len, token_rows,
              false, op, scale, sinks, single.data(), static_cast<int64_t>(single.size()));
  if (several.empty()) return;
  const auto copies = at::empty({2, kv_heads, copied, dim}, q.options());
  bf16* keys = copies.data_ptr<bf16>();
  bf16* values = keys + kv_heads * copied * dim;
  std::vector<int64_t> copy_loc(rows * max_len, 0);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t t = 0; first[r] >= 0 && t < reach[r]; ++t)
      copy_loc[r * max_len + t] = first[r] + t;
  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / kv_heads, h = task % kv_heads;
      for (int64_t t = 0; first[r] >= 0 && t < reach[r]; ++t) {
        const int64_t from = h * pool + loc[r * max_len + t], to = h * copied + first[r] + t;
        if (dim == 64) {
          int8_row_as_bf16<64>(kp + from * dim, keys + to * dim, k_scales + from);
          int8_row_as_bf16<64>(vp + from * dim, values + to * dim, v_scales + from);
        } else {
          int8_row_as_bf16<128>(kp + from * dim, keys + to * dim, k_scales + from);
          int8_row_as_bf16<128>(vp + from * dim, values + to * dim, v_scales + from);
        }
      }
    }
  });
  run_tasks(q, keys, values, nullptr, nullptr, copied, kv_heads, copy_loc.data(), lens,
            max_len, token_rows, false, op, scale, sinks, several.data(),
            static_cast<int64_t>(several.size()));
}
#endif

}  // namespace

template <typename C>
void decode_row_task(const at::BFloat16* q, const C* k, const C* v, const float* k_scales,
                     const float* v_scales, const int64_t* loc, int64_t len, int64_t group,
                     int64_t dim, float scale, float* probs, float* maxima, float* sums,
                     at::BFloat16* out) {
#ifdef MINISGL_VNNI
  const int64_t ahead = kDecodeAhead * static_cast<int64_t>(sizeof(at::BFloat16) / sizeof(C));
  const int64_t stride = (len + kTile - 1) / kTile * kTile;
  const Task<C> a{q, k, v, k_scales, v_scales, loc, len, group, scale, probs, stride, out,
                  nullptr, ahead};
  attend_task(a, dim, maxima, sums);
#endif
}

#define MINISGL_ROW_TASK(C)                                                                    \
  template void decode_row_task<C>(const at::BFloat16*, const C*, const C*, const float*,     \
                                   const float*, const int64_t*, int64_t, int64_t, int64_t,   \
                                   float, float*, float*, float*, at::BFloat16*);
MINISGL_ROW_TASK(at::BFloat16)
MINISGL_ROW_TASK(int8_t)
#undef MINISGL_ROW_TASK

// The shapes of cpu_kernels.cpp's decode_attention. Returns false (and writes nothing) where
// this path does not apply: not bfloat16, pages neither bfloat16 nor int8, a head dim other
// than 64 / 128, no AVX-512 BF16.
bool decode_attention_bf16(const at::Tensor& q, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& locations,
                           const at::Tensor& seq_lens, const int64_t* token_rows,
                           at::Tensor& out, double scale, const float* sinks,
                           const float* k_scales, const float* v_scales) {
#ifdef MINISGL_VNNI
  const int64_t dim = q.size(2);
  const auto pages = k_cache.scalar_type();
  if (q.scalar_type() != at::kBFloat16 || (dim != 64 && dim != 128) ||
      (pages != at::kBFloat16 && pages != at::kChar))
    return false;
  const int64_t pool = k_cache.size(1), kv_heads = k_cache.size(0), max_len = locations.size(1);
  const int64_t* loc = locations.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const bool decode = q.size(0) == locations.size(0);  // as many tokens as rows: one each
  bf16* op = out.data_ptr<bf16>();
  if (pages == at::kChar && !decode)
    run_int8_batch(q, k_cache, v_cache, k_scales, v_scales, locations, lens, token_rows, op,
                   scale, sinks);
  else if (pages == at::kChar)
    run_tasks(q, k_cache.data_ptr<int8_t>(), v_cache.data_ptr<int8_t>(), k_scales, v_scales,
              pool, kv_heads, loc, lens, max_len, token_rows, true, op, scale, sinks, nullptr,
              q.size(0));
  else
    run_tasks(q, k_cache.data_ptr<bf16>(), v_cache.data_ptr<bf16>(), nullptr, nullptr, pool,
              kv_heads, loc, lens, max_len, token_rows, decode, op, scale, sinks, nullptr,
              q.size(0));
  return true;
#else
  return false;
#endif
}
