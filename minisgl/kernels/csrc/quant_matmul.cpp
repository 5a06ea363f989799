// 4-bit and 8-bit block-quantized weights x bfloat16 activations on AVX-512 VNNI, the way
// llama.cpp runs Q4 / Q8 weights: activations quantized per group of 32 inputs, each group's dot
// product an integer one (vpdpbusd: unsigned codes times signed 8-bit activations), scaled once
// per group. Weights stay in their codes in memory and in registers: nothing is dequantized.
//
// Weight layout (minisgl/layers/quant.py packs it): output features in blocks of 16, input
// features in groups of 32, and per (block, group) the codes of 16 x 32 weights, as 64-byte
// vectors whose byte 4 * lane + j belongs to output lane `lane` and the j-th of 4 consecutive
// inputs (the 4 products one vpdpbusd lane sums):
//   4-bit: 4 vectors; vector p holds inputs 8p + j in its low nibbles, 8p + 4 + j in its high;
//   8-bit: 8 vectors; vector p holds inputs 4p + j.
// Then per (block, group) 16 float16 scales d and 16 float16 offsets m: w = d * code + m.
//
// A group's sum: sum_i w_i x_i = d * sum_i code_i x_i + m * sum_i x_i. The second sum is the
// exact float one. For the first, each activation is two int8 terms, x ~ s * q + (s / 254) * r
// (s = max |x| / 127; r quantizes what q leaves): about 15 bits, so the result is the dequantized
// weights' product up to float rounding. With `terms` 1 (--cpu-int8-activations) only q, as
// llama.cpp's Q8 activations: half the dot products, a larger logit error (BENCHMARKS.md).
#include "aten.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "row_kernels.h"
#include "vnni.h"

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kLanes = 16;
constexpr int kMaxTileRows = 4;

#ifdef MINISGL_VNNI

// One row: per group, the int8 term q (and with TERMS 2 the second one, r), the scale s and the
// exact float sum.
template <int TERMS>
[[gnu::noinline]] void quantize_row(const at::BFloat16* x, int64_t k, int8_t* q, int8_t* r,
                                    float* scale, float* sum) {
  for (int64_t g = 0; g < k / kGroup; ++g) {
    __m512 half[2] = {load_bf16(x + g * kGroup), load_bf16(x + g * kGroup + 16)};
    float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(half[0]),
                                                    _mm512_abs_ps(half[1])));
    float s = amax / 127.0f;
    __m512 inv = _mm512_set1_ps(s > 0.0f ? 1.0f / s : 0.0f);
    __m512 inv_fine = _mm512_set1_ps(s > 0.0f ? 254.0f / s : 0.0f);
    for (int h = 0; h < 2; ++h) {
      __m512i coarse = _mm512_cvtps_epi32(_mm512_mul_ps(half[h], inv));  // nearest even
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + g * kGroup + 16 * h),
                       _mm512_cvtsepi32_epi8(coarse));
      if (TERMS == 1) continue;
      __m512 rest = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(coarse), _mm512_set1_ps(s), half[h]);
      __m512i fine = _mm512_cvtps_epi32(_mm512_mul_ps(rest, inv_fine));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(r + g * kGroup + 16 * h),
                       _mm512_cvtsepi32_epi8(fine));
    }
    scale[g] = s;
    sum[g] = _mm512_reduce_add_ps(_mm512_add_ps(half[0], half[1]));
  }
}

constexpr int64_t kPrefetchBytes = 4096;  // how far ahead a tile prefetches its codes

inline __m512i broadcast_quad(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return _mm512_set1_epi32(v);
}

struct Activations {  // quantize_row's output for all rows
  const int8_t* q;
  const int8_t* r;
  const float* scale;
  const float* sum;
  int64_t k;
};

// ROWS activation rows times one block of 16 output features, over all groups.
// NOTE: vpdpbusd's latency is several cycles: with few rows, CHAINS independent accumulators
// per term and row (summed per group) keep the unit busy instead of waiting on one chain.
// NOTE: never inlined, nor is quantize_row: quant_row_blocks and quant_row_activations run the
// same code for one row (row_kernels.h).
// NOTE: a tile runs enough instructions per line of codes that too few of its loads are in
// flight to cover DRAM's latency, and on some hosts it streamed well below a plain read's
// bandwidth; prefetching the codes and scales kPrefetchBytes of codes ahead keeps the stream
// going (BENCHMARKS.md, "One stream at the bandwidth limit"). A block's codes and the next
// block's lie back to back; a later tile of rows over the same block finds them cached.
template <int ROWS, int BITS, int TERMS>
[[gnu::noinline]] void tile(const Activations& a, const uint8_t* codes, const at::Half* dm,
                            at::BFloat16* out, int64_t out_stride) {
  constexpr int CHAINS = ROWS >= 4 ? 1 : 2;
  constexpr int kVectors = BITS == 4 ? 4 : 8;  // 64-byte code vectors per (block, group)
  const int64_t groups = a.k / kGroup;
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  __m512 acc[ROWS], offset_acc[ROWS];
  for (int r = 0; r < ROWS; ++r) acc[r] = offset_acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* c = codes + g * kVectors * 64;
    const char* ahead = reinterpret_cast<const char*>(c) + kPrefetchBytes;
    for (int p = 0; p < kVectors; ++p) _mm_prefetch(ahead + p * 64, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(dm + g * 2 * kLanes) + kPrefetchBytes / kVectors,
                 _MM_HINT_T0);
    __m512i coarse[ROWS][CHAINS], fine[ROWS][CHAINS];
    for (int r = 0; r < ROWS; ++r)
      for (int h = 0; h < CHAINS; ++h) coarse[r][h] = fine[r][h] = _mm512_setzero_si512();
    // `w` holds the codes of the 4 inputs starting at `input` of the group, for every lane
    auto accumulate = [&](int h, __m512i w, int64_t input) {
      for (int r = 0; r < ROWS; ++r) {
        const int64_t at = r * a.k + g * kGroup + input;
        coarse[r][h] = _mm512_dpbusd_epi32(coarse[r][h], w, broadcast_quad(a.q + at));
        if (TERMS == 2) fine[r][h] = _mm512_dpbusd_epi32(fine[r][h], w, broadcast_quad(a.r + at));
      }
    };
    for (int p = 0; p < kVectors; ++p) {
      __m512i v = _mm512_loadu_si512(c + p * 64);
      if (BITS == 4) {
        accumulate(p % CHAINS, _mm512_and_si512(v, nibble), 8 * p);
        accumulate(p % CHAINS, _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble), 8 * p + 4);
      } else {
        accumulate(p % CHAINS, v, 4 * p);
      }
    }
    const __m256i* half = reinterpret_cast<const __m256i*>(dm + g * 2 * kLanes);
    __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(half));
    __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(half + 1));
    for (int r = 0; r < ROWS; ++r) {
      __m512i coarse_sum = coarse[r][0], fine_sum = fine[r][0];
      for (int h = 1; h < CHAINS; ++h) {
        coarse_sum = _mm512_add_epi32(coarse_sum, coarse[r][h]);
        fine_sum = _mm512_add_epi32(fine_sum, fine[r][h]);
      }
      __m512 dot = TERMS == 1 ? _mm512_cvtepi32_ps(coarse_sum)
                              : _mm512_fmadd_ps(_mm512_cvtepi32_ps(fine_sum),
                                                _mm512_set1_ps(1.0f / 254.0f),
                                                _mm512_cvtepi32_ps(coarse_sum));
      __m512 ds = _mm512_mul_ps(d, _mm512_set1_ps(a.scale[r * groups + g]));
      acc[r] = _mm512_fmadd_ps(dot, ds, acc[r]);
      offset_acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(a.sum[r * groups + g]), offset_acc[r]);
    }
  }
  for (int r = 0; r < ROWS; ++r)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * out_stride),
                        reinterpret_cast<__m256i>(
                            _mm512_cvtneps_pbh(_mm512_add_ps(acc[r], offset_acc[r]))));
}

// The weights of one (block, group), dequantized into rows g * 32 .. g * 32 + 31 of the
// transposed weight [k, n] (16 contiguous output features per input).
template <int BITS>
void dequantize_group(const uint8_t* codes, const at::Half* dm, at::BFloat16* out, int64_t n) {
  constexpr int kVectors = BITS == 4 ? 4 : 8;
  const __m256i* half = reinterpret_cast<const __m256i*>(dm);
  __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(half));
  __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(half + 1));
  const __m512i mask = _mm512_set1_epi32((1 << BITS) - 1);
  for (int p = 0; p < kVectors; ++p) {
    __m512i v = _mm512_loadu_si512(codes + p * 64);
    for (int shift = 0; shift < 8; shift += BITS) {
      for (int j = 0; j < 4; ++j) {
        const int64_t input = BITS == 4 ? 8 * p + (shift ? 4 : 0) + j : 4 * p + j;
        __m512i code = _mm512_and_si512(_mm512_srli_epi32(v, 8 * j + shift), mask);
        __m512 w = _mm512_fmadd_ps(_mm512_cvtepi32_ps(code), d, m);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + input * n),
                            reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(w)));
      }
    }
  }
}

using TileFn = void (*)(const Activations&, const uint8_t*, const at::Half*, at::BFloat16*,
                        int64_t);
template <int BITS, int TERMS>
constexpr TileFn kTiles[kMaxTileRows + 1] = {nullptr, tile<1, BITS, TERMS>, tile<2, BITS, TERMS>,
                                             tile<3, BITS, TERMS>, tile<4, BITS, TERMS>};

// The tiles for activations of `terms` int8 terms times codes of 8 bits (else 4).
const TileFn* tiles_for(int64_t terms, bool eight_bit) {
  return terms == 1 ? (eight_bit ? kTiles<8, 1> : kTiles<4, 1>)
                    : (eight_bit ? kTiles<8, 2> : kTiles<4, 2>);
}

#endif  // MINISGL_VNNI

}  // namespace

void quant_row_activations(const at::BFloat16* x, int64_t k, int64_t terms, int8_t* q,
                           int8_t* r, float* scale, float* sum) {
#ifdef MINISGL_VNNI
  (terms == 1 ? quantize_row<1> : quantize_row<2>)(x, k, q, r, scale, sum);
#endif
}

void quant_row_blocks(const int8_t* q, const int8_t* r, const float* scale, const float* sum,
                      int64_t k, int64_t terms, const uint8_t* codes, const at::Half* dm,
                      int64_t block_bytes, int64_t begin, int64_t end, at::BFloat16* out) {
#ifdef MINISGL_VNNI
  const TileFn one_row = tiles_for(terms, block_bytes == kGroup * kLanes)[1];
  const int64_t groups = k / kGroup;
  const Activations a{q, r, scale, sum, k};
  for (int64_t b = begin; b < end; ++b)
    one_row(a, codes + b * groups * block_bytes, dm + b * groups * 2 * kLanes, out + b * kLanes,
            0);
#endif
}

bool vnni_available() {
#ifdef MINISGL_VNNI
  return true;
#else
  return false;
#endif
}

// x: [..., k] bfloat16; codes: [n / 16, k / 32, 256 (4-bit) or 512 (8-bit)] uint8;
// dm: [n / 16, k / 32, 2, 16] float16. Returns [..., n] bfloat16.
// The transposed weight [k, n] bfloat16 that codes and dm encode (large batches multiply it
// with a GEMM: past a few hundred rows that beats quant_matmul's integer dot products).
at::Tensor quant_dequantize_t(at::Tensor codes, at::Tensor dm) {
#ifdef MINISGL_VNNI
  TORCH_CHECK(codes.is_contiguous() && codes.scalar_type() == at::kByte && codes.dim() == 3);
  TORCH_CHECK(dm.is_contiguous() && dm.scalar_type() == at::kHalf);
  const int64_t blocks = codes.size(0), groups = codes.size(1), block_bytes = codes.size(2);
  const int64_t n = blocks * kLanes;
  auto out = at::empty({groups * kGroup, n}, codes.options().dtype(at::kBFloat16));
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const at::Half* dp = dm.data_ptr<at::Half>();
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* c = cp + (b * groups + g) * block_bytes;
        const at::Half* h = dp + (b * groups + g) * 2 * kLanes;
        at::BFloat16* o = op + g * kGroup * n + b * kLanes;
        if (block_bytes == kGroup * kLanes) dequantize_group<8>(c, h, o, n);
        else dequantize_group<4>(c, h, o, n);
      }
  });
  return out;
#else
  TORCH_CHECK(false, "quant_dequantize_t needs AVX-512 VNNI and BF16");
#endif
}

// The weight's rows `rows` (output features) as float32 [len, k], read from the layout: a
// vocabulary table held in it is looked up here (the embedding).
at::Tensor quant_rows(at::Tensor codes, at::Tensor dm, at::Tensor rows) {
  TORCH_CHECK(codes.is_contiguous() && codes.scalar_type() == at::kByte && codes.dim() == 3);
  TORCH_CHECK(dm.is_contiguous() && dm.scalar_type() == at::kHalf);
  const int64_t blocks = codes.size(0), groups = codes.size(1), block_bytes = codes.size(2);
  const int64_t n = blocks * kLanes, k = groups * kGroup;
  const bool eight = block_bytes == kGroup * kLanes;
  TORCH_CHECK(eight || block_bytes == kGroup * kLanes / 2, "codes of 4 or 8 bits");
  const at::Tensor picked = rows.to(at::kLong).contiguous();
  TORCH_CHECK(picked.numel() == 0 || (picked.min().item<int64_t>() >= 0 &&
                                      picked.max().item<int64_t>() < n), "row out of range");
  auto out = at::empty({picked.numel(), k}, codes.options().dtype(at::kFloat));
  const int64_t* index = picked.data_ptr<int64_t>();
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const at::Half* dp = dm.data_ptr<at::Half>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, picked.numel(), 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t block = index[r] / kLanes, lane = index[r] % kLanes;
      for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* c = cp + (block * groups + g) * block_bytes + 4 * lane;
        const at::Half* h = dp + (block * groups + g) * 2 * kLanes + lane;
        const float d = h[0], m = h[kLanes];
        float* o = op + r * k + g * kGroup;
        for (int i = 0; i < kGroup; ++i) {
          const int code = eight ? c[(i / 4) * 64 + i % 4]
                                 : (c[(i / 8) * 64 + i % 4] >> (i % 8 / 4 * 4)) & 15;
          o[i] = d * code + m;
        }
      }
    }
  });
  return out;
}

at::Tensor quant_matmul(at::Tensor x, at::Tensor codes, at::Tensor dm, int64_t terms) {
#ifdef MINISGL_VNNI
  TORCH_CHECK(x.is_contiguous() && x.scalar_type() == at::kBFloat16);
  TORCH_CHECK(codes.is_contiguous() && codes.scalar_type() == at::kByte && codes.dim() == 3);
  TORCH_CHECK(dm.is_contiguous() && dm.scalar_type() == at::kHalf);
  const int64_t k = x.size(-1), rows = x.numel() / k, blocks = codes.size(0);
  const int64_t groups = k / kGroup, block_bytes = codes.size(2);
  TORCH_CHECK(k % kGroup == 0 && codes.size(1) == groups);
  TORCH_CHECK(block_bytes == kGroup * kLanes / 2 || block_bytes == kGroup * kLanes);
  TORCH_CHECK(terms == 1 || terms == 2, "quant_matmul: activations are 1 or 2 int8 terms");
  const int64_t n = blocks * kLanes;
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = n;
  auto out = at::empty(sizes, x.options());
  std::vector<int8_t> q(rows * k), fine(terms == 2 ? rows * k : 0);
  std::vector<float> scale(rows * groups), sum(rows * groups);
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  auto fine_row = [&](int64_t r) { return terms == 2 ? fine.data() + r * k : nullptr; };
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      (terms == 1 ? quantize_row<1> : quantize_row<2>)(xp + r * k, k, q.data() + r * k,
                                                       fine_row(r), scale.data() + r * groups,
                                                       sum.data() + r * groups);
  });
  const bool eight_bit = block_bytes == kGroup * kLanes;
  const TileFn* tiles = tiles_for(terms, eight_bit);
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const at::Half* dp = dm.data_ptr<at::Half>();
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  // NOTE: blocks outer, rows inner: a block's codes stay in L1 while every tile of rows
  // passes over them.
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t r = 0; r < rows; r += kMaxTileRows) {
        const int tile_rows = static_cast<int>(std::min<int64_t>(kMaxTileRows, rows - r));
        Activations a{q.data() + r * k, fine_row(r), scale.data() + r * groups,
                      sum.data() + r * groups, k};
        tiles[tile_rows](a, cp + b * groups * block_bytes, dp + b * groups * 2 * kLanes,
                         op + r * n + b * kLanes, n);
      }
    }
  });
  return out;
#else
  TORCH_CHECK(false, "quant_matmul needs AVX-512 VNNI and BF16 (built with -march=native)");
#endif
}
