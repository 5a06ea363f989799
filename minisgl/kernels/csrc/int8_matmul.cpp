// W8A8: int8 weights with a scale per output feature x bfloat16 activations quantized to int8
// as they arrive, per row and group of `group` inputs (SGLang's w8a8_int8 quantizes per row;
// minisgl's layers pass groups of 32, as llama.cpp's Q8 activations, for logits closer to
// float32 at a small cost in time: BENCHMARKS.md), on AVX-512 VNNI.
// Per group the dot product is an integer one (vpdpbusd: 64 multiply-adds per instruction,
// twice a bfloat16 dot product's 32), added to a float sum with the group's activation scale;
// the weight scale is applied once at the end.
//
// Weight layout (minisgl/layers/w8a8.py packs it): output features in blocks of 16, and per block
// the codes over all inputs as 64-byte vectors, vector v holding at byte 4 * lane + j input
// 4v + j of output lane `lane`, stored as c + 128 (vpdpbusd multiplies unsigned by signed bytes):
//   sum_i w_i x_i = d * sum_g s_g * (sum_{i in g} (c_i + 128) q_i - 128 * sum_{i in g} q_i),
// with w = d * c per output feature and x ~ s_g * q per group.
#include "aten.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "vnni.h"

namespace {

constexpr int64_t kLanes = 16;
// 4 x 3 int32 dot products, 4 x 3 float sums, 3 weight vectors, 1 broadcast: 28 of the 32
// registers (measured: 3 x 4 and 4 x 2 run slower, 6 x 4 spills)
constexpr int kTileRows = 4;
constexpr int kTileBlocks = 3;
constexpr int64_t kRowBlock = 64;  // rows per task: a task's weight codes stay in L1 / L2

#ifdef MINISGL_VNNI

// Per group of `group` inputs, x ~ scale * q with scale = max |x| / 127; `offset` = 128 *
// sum over groups of scale * sum of q (what the codes' +128 adds).
void quantize_row(const at::BFloat16* x, int64_t k, int64_t group, int8_t* q, float* scale,
                  float* offset) {
  float total = 0.0f;
  for (int64_t g = 0; g < k / group; ++g) {
    const at::BFloat16* xg = x + g * group;
    __m512 amax = _mm512_setzero_ps();
    for (int64_t i = 0; i < group; i += 16)
      amax = _mm512_max_ps(amax, _mm512_abs_ps(load_bf16(xg + i)));
    const float s = _mm512_reduce_max_ps(amax) / 127.0f;
    const __m512 inv = _mm512_set1_ps(s > 0.0f ? 1.0f / s : 0.0f);
    __m512i sum = _mm512_setzero_si512();
    for (int64_t i = 0; i < group; i += 16) {
      __m512i c = _mm512_cvtps_epi32(_mm512_mul_ps(load_bf16(xg + i), inv));  // nearest even
      sum = _mm512_add_epi32(sum, c);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + g * group + i), _mm512_cvtsepi32_epi8(c));
    }
    scale[g] = s;
    total += s * static_cast<float>(_mm512_reduce_add_epi32(sum));
  }
  *offset = 128.0f * total;
}

struct Rows {  // quantized activations, from the first row of a tile
  const int8_t* q;
  const float* scale;   // [rows, k / group]
  const float* offset;  // [rows]
  int64_t k, group;
};

// ROWS rows times BLOCKS blocks of 16 output features: per group an integer dot product,
// added to a float one with the row's scale for the group.
template <int ROWS, int BLOCKS>
void tile(const Rows& a, const uint8_t* codes, const float* weight_scale, at::BFloat16* out,
          int64_t out_stride) {
  const int64_t quads = a.k / 4, groups = a.k / a.group, group_quads = a.group / 4;
  __m512 acc[ROWS][BLOCKS];
  for (int r = 0; r < ROWS; ++r)
    for (int b = 0; b < BLOCKS; ++b) acc[r][b] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i dot[ROWS][BLOCKS];
    for (int r = 0; r < ROWS; ++r)
      for (int b = 0; b < BLOCKS; ++b) dot[r][b] = _mm512_setzero_si512();
    for (int64_t v = g * group_quads; v < (g + 1) * group_quads; ++v) {
      __m512i w[BLOCKS];
      for (int b = 0; b < BLOCKS; ++b) w[b] = _mm512_loadu_si512(codes + (b * quads + v) * 64);
      for (int r = 0; r < ROWS; ++r) {
        int32_t quad;
        std::memcpy(&quad, a.q + r * a.k + 4 * v, sizeof(quad));
        const __m512i x = _mm512_set1_epi32(quad);
        for (int b = 0; b < BLOCKS; ++b) dpbusd(dot[r][b], w[b], x);
      }
    }
    for (int r = 0; r < ROWS; ++r) {
      const __m512 s = _mm512_set1_ps(a.scale[r * groups + g]);
      for (int b = 0; b < BLOCKS; ++b)
        acc[r][b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][b]), s, acc[r][b]);
    }
  }
  for (int b = 0; b < BLOCKS; ++b) {
    const __m512 d = _mm512_loadu_ps(weight_scale + b * kLanes);
    for (int r = 0; r < ROWS; ++r) {
      __m512 y = _mm512_mul_ps(_mm512_sub_ps(acc[r][b], _mm512_set1_ps(a.offset[r])), d);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * out_stride + b * kLanes),
                          reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(y)));
    }
  }
}

using TileFn = void (*)(const Rows&, const uint8_t*, const float*, at::BFloat16*, int64_t);
template <int ROWS>
constexpr TileFn kRowTiles[kTileBlocks] = {tile<ROWS, 1>, tile<ROWS, 2>, tile<ROWS, 3>};
constexpr const TileFn* kTiles[kTileRows] = {kRowTiles<1>, kRowTiles<2>, kRowTiles<3>,
                                             kRowTiles<4>};

#endif  // MINISGL_VNNI

}  // namespace

// x: [..., k] bfloat16; codes: [n / 16, k / 4, 64] uint8 (code + 128); scales: [n] float32;
// group: inputs per activation scale (a multiple of 16 dividing k; k: one scale per row).
// Returns [..., n] bfloat16.
at::Tensor int8_matmul(at::Tensor x, at::Tensor codes, at::Tensor scales,
                       int64_t group) {
#ifdef MINISGL_VNNI
  TORCH_CHECK(x.is_contiguous() && x.scalar_type() == at::kBFloat16);
  TORCH_CHECK(codes.is_contiguous() && codes.scalar_type() == at::kByte && codes.dim() == 3);
  TORCH_CHECK(scales.is_contiguous() && scales.scalar_type() == at::kFloat);
  const int64_t k = x.size(-1), rows = x.numel() / k, blocks = codes.size(0);
  const int64_t n = blocks * kLanes;
  TORCH_CHECK(k % 16 == 0 && codes.size(1) * 4 == k && codes.size(2) == 64 && scales.numel() == n);
  TORCH_CHECK(group % 16 == 0 && k % group == 0, "group must divide k in multiples of 16");
  const int64_t groups = k / group;
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = n;
  auto out = at::empty(sizes, x.options());
  std::vector<int8_t> q(rows * k);
  std::vector<float> scale(rows * groups), offset(rows);
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      quantize_row(xp + r * k, k, group, q.data() + r * k, &scale[r * groups], &offset[r]);
  });
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  const int64_t chunks = (blocks + kTileBlocks - 1) / kTileBlocks;
  const int64_t row_blocks = (rows + kRowBlock - 1) / kRowBlock;
  at::parallel_for(0, chunks * row_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t chunk = task % chunks, first = task / chunks * kRowBlock;
      const int64_t block = chunk * kTileBlocks, last = std::min(rows, first + kRowBlock);
      const int tile_blocks = static_cast<int>(std::min<int64_t>(kTileBlocks, blocks - block));
      for (int64_t r = first; r < last; r += kTileRows) {
        const int tile_rows = static_cast<int>(std::min<int64_t>(kTileRows, last - r));
        Rows a{q.data() + r * k, scale.data() + r * groups, offset.data() + r, k, group};
        kTiles[tile_rows - 1][tile_blocks - 1](a, cp + block * k * 16, sp + block * kLanes,
                                               op + r * n + block * kLanes, n);
      }
    }
  });
  return out;
#else
  TORCH_CHECK(false, "int8_matmul needs AVX-512 VNNI and BF16 (built with -march=native)");
#endif
}
