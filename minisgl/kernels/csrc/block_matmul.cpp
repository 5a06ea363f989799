// GGUF block-quantized weights (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) x float32 or
// bfloat16 activations on AVX2, every block type in one layout, the codes never dequantized:
// activations are quantized per group of 32 inputs and each group's dot product is an integer
// one (codes times int16 activations: vpmaddwd; or, where AVX-512 VNNI is built, unsigned codes
// times signed 8-bit activations: vpdpbusd), scaled once per group.
//
// Layout (minisgl/layers/gguf_weight.py packs it): output features in blocks of 8 lanes, input
// features in groups of 32; per (block, group) 32-byte vectors whose byte 4 * lane + j belongs
// to lane `lane` and the j-th of 4 consecutive inputs ("a quad"):
//   4 nibble vectors: vector p, low nibbles = the low 4 bits of quad 2p, high = of quad 2p + 1;
//   5-bit codes add 1 vector: bit t = bit 4 of quad t's code;
//   6-bit codes add 2 vectors: vector 4 + h, bits 2u, 2u + 1 = bits 4, 5 of quad 4h + u's code;
//   8-bit codes (Q8_0): 8 vectors of signed codes, vector t = quad t.
// Scales (`mode`):
//   kFlat (Q4_1, Q5_1): per (block, group) 8 float16 scales d and 8 float16 offsets m;
//   kSymmetric (Q4_0, Q5_0, Q8_0): kFlat's, with m = -o d for the type's fixed o (8, 16, 0);
//   kMins (Q4_K, Q5_K; int4 checkpoints' groups of 32-128 as sc = 1, mn = zero point): per
//     (block, super-block of 256 or the checkpoint's group) 8 float16 d and 8 float16 -dmin,
//     per (block, group) 8 uint8 sub-scales sc and 8 uint8 mins mn: d' = d sc, m' = -dmin mn;
//   kSixBit (Q6_K): per (block, super-block) 8 float16 d, then 8 unused; per (block, group) the
//     int8 sub-scales of its two halves of 16 inputs, 8 each: d' = d sc, m' = -32 d'.
// A weight is w = d' * code + m', so a group's sum_i w_i x_i = d' sum_i code_i x_i + m' sum_i x_i.
// Activations keep ~15 bits. With VNNI, as in quant_matmul.cpp, each is two int8 terms,
// x ~ s q + (s / 254) r, or one (`terms` 1: llama.cpp's numerics, x ~ s q); on plain AVX2 each
// is one int16 term, x ~ s q (s = max |x| / 32767), and the codes are widened to int16 for
// vpmaddwd. With one term, where m' = -o d' (kSymmetric, and kSixBit's o = 32) the offset
// folds into the integer dot product, d' s sum_i (code_i - o) q_i: the whole weight times the
// rounded activations, as llama.cpp computes these types, and one float sum fewer per group.
#include "aten.h"
#include "row_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define MINISGL_AVX2 1
#include <immintrin.h>
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define MINISGL_BLOCK_VNNI 1  // the same layout, the dot products through 256-bit vpdpbusd
#endif
#endif

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kLanes = 8;
constexpr int kMaxTileRows = 4;
// VNNI, one term: from kDecodedMinRows rows a span's codes are decoded once (DecodedSpan), its
// tiles kSpanTileRows rows. (With two terms the dot products, not the decode, are the bound.)
constexpr int kSpanTileRows = 8;
constexpr int64_t kDecodedMinRows = 5;
constexpr int64_t kActivationBlockBytes = 256 << 10;  // a block of rows' int8 activations
enum Mode : int64_t { kFlat = 0, kMins = 1, kSixBit = 2, kSymmetric = 3, kLut = 4 };

constexpr bool flat_scales(int64_t mode) {
  return mode == kFlat || mode == kSymmetric || mode == kLut;
}

// kLut (MXFP4): a 4-bit code is an e2m1 value, twice which is an integer in [-12, 12]; the
// kernel reads it as that integer plus 12, so that d' = half the block's power of two and
// m' = -12 d', a symmetric weight of offset 12.
constexpr uint8_t kLutCodes[16] = {12, 13, 14, 15, 16, 18, 20, 24,
                                   12, 11, 10, 9, 8, 6, 4, 0};
constexpr int kLutOffset = 12;

// The o of m' = -o d' that one term folds into the dot product; -1 where m' is the weight's own.
constexpr int code_offset(int64_t bits, int64_t mode) {
  return mode == kSixBit ? 32 : mode == kLut ? kLutOffset
       : mode != kSymmetric ? -1 : bits == 8 ? 0 : 1 << (bits - 1);
}

int64_t group_bytes(int64_t bits) {
  return bits == 8 ? 256 : 128 + (bits - 4) * 32;
}

// ---- the reference: one weight of the layout, scalar ----------------------------------------

using Weight = BlockWeight;  // row_kernels.h

int code_at(const Weight& w, int64_t block, int64_t g, int lane, int i) {
  const uint8_t* c = w.codes + (block * w.groups + g) * group_bytes(w.bits);
  const int t = i / 4, j = i % 4;
  if (w.bits == 8) return static_cast<int8_t>(c[t * 32 + 4 * lane + j]);
  const uint8_t byte = c[(t / 2) * 32 + 4 * lane + j];
  int q = (t & 1) ? byte >> 4 : byte & 15;
  if (w.mode == kLut) return kLutCodes[q];
  if (w.bits == 5) q |= ((c[128 + 4 * lane + j] >> t) & 1) << 4;
  if (w.bits == 6) q |= ((c[128 + (t / 4) * 32 + 4 * lane + j] >> (2 * (t % 4))) & 3) << 4;
  return q;
}

// d' and m' of (block, group g, lane) for input i of the group
void scale_at(const Weight& w, int64_t block, int64_t g, int lane, int i, float& d, float& m) {
  if (flat_scales(w.mode)) {
    const at::Half* p = w.scales + (block * w.groups + g) * 2 * kLanes;
    d = p[lane];
    m = p[kLanes + lane];
    return;
  }
  const int64_t supers = w.groups / w.groups_per_super;
  const at::Half* p = w.scales + (block * supers + g / w.groups_per_super) * 2 * kLanes;
  const uint8_t* s = w.subs + (block * w.groups + g) * 2 * kLanes;
  if (w.mode == kMins) {
    d = static_cast<float>(p[lane]) * s[lane];
    m = static_cast<float>(p[kLanes + lane]) * s[kLanes + lane];
  } else {
    d = static_cast<float>(p[lane]) * static_cast<int8_t>(s[(i / 16) * kLanes + lane]);
    m = -32.0f * d;
  }
}

Weight weight_of(const at::Tensor& codes, const at::Tensor& scales,
                 const at::Tensor& subs, int64_t bits, int64_t mode) {
  TORCH_CHECK(codes.is_contiguous() && codes.scalar_type() == at::kByte && codes.dim() == 3);
  TORCH_CHECK(scales.is_contiguous() && scales.scalar_type() == at::kHalf);
  TORCH_CHECK(bits == 4 || bits == 5 || bits == 6 || bits == 8);
  TORCH_CHECK(codes.size(2) == group_bytes(bits), "codes do not match the bit width");
  const int64_t groups = codes.size(1), supers = scales.size(1);
  TORCH_CHECK(scales.size(0) == codes.size(0) && supers > 0 && groups % supers == 0);
  TORCH_CHECK(mode >= kFlat && mode <= kLut, "unknown scale mode");
  TORCH_CHECK(mode != kLut || bits == 4, "a lookup table takes 4-bit codes");
  TORCH_CHECK(flat_scales(mode) ? supers == groups
                            : subs.is_contiguous() && subs.scalar_type() == at::kByte);
  return {codes.data_ptr<uint8_t>(), scales.data_ptr<at::Half>(),
          flat_scales(mode) ? nullptr : subs.data_ptr<uint8_t>(), groups, bits, mode,
          groups / supers, codes.size(0)};
}

#ifdef MINISGL_AVX2

// ---- activations ----------------------------------------------------------------------------

// v sized for at least n values: buffers reused across calls only grow, so a call does not
// zero rows * k bytes (std::vector's resize would) on the engine thread while the others wait.
// Each call writes every value it reads.
template <typename T>
void grow(std::vector<T>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(n);
}

// What one call's tiles read besides the int8 terms and their scales.
struct Reads {
  bool signed_copy;    // a.q (every tile but a folding weight's decoded spans)
  bool exact_sums;     // a.sum: the offset term of a weight whose offset is its own
  bool q_sums;         // a.q_sum: the 4-row tiles' folded offset
  bool unsigned_copy;  // a.u: the decoded spans' folded offset
};

struct Activations {
  std::vector<int8_t> q, r;     // [rows, k]: the int8 terms (VNNI; r unused with one)
  std::vector<int16_t> q16;     // [rows, k]: the one int16 term (plain AVX2)
  std::vector<float> scale;     // [rows, groups]: s / 254 (two terms: the dot is 254 q + r), or s
  std::vector<float> sum;       // [rows, 2 * groups]: exact sums of each half group
  // one term: the integer sums of q's half groups, and q + 128 where a decoded span of a folding
  // weight reads it (the unsigned operand of vpdpbusd, the codes made signed)
  std::vector<int32_t> q_sum;   // [rows, 2 * groups]
  std::vector<uint8_t> u;       // [rows, k]
  int64_t rows, k;
};

inline __m256 load_float8(const float* p) { return _mm256_loadu_ps(p); }

inline __m256 load_float8(const at::BFloat16* p) {  // a bfloat16 is a float32's top half
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

inline void store_float8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }

inline void store_float8(at::BFloat16* p, __m256 v) {  // rounded to nearest even
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(
      _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(rounded),
                                          _mm256_extracti128_si256(rounded, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}

// 32 int32 values (4 vectors) saturated to 32 int8 bytes in order.
inline __m256i pack_int8x32(const __m256i (&v)[4]) {
  const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]),
                                            _mm256_packs_epi32(v[2], v[3]));
  return _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

inline void store32(void* out, __m256i bytes) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), bytes);
}

inline int32_t horizontal_sum(__m256i v) {
  const __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  const __m128i t = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
  return _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, 1)));
}

inline float horizontal_sum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

inline float horizontal_max(__m256 v) {
  const __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(t, _mm_movehdup_ps(t)));
}

// Per group of 32 inputs of every row: its 32 values and their largest magnitude to `group`,
// which quantizes them and returns their scale, and (`exact_sums`) the exact sums of both halves.
template <typename T, typename GroupFn>
void quantize_rows(const T* x, int64_t rows, int64_t k, bool exact_sums, Activations& a,
                   GroupFn group) {
  const int64_t groups = k / kGroup;
  a.k = k;
  a.rows = rows;
  grow(a.scale, rows * groups);
  if (exact_sums) grow(a.sum, rows * groups * 2);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    const __m256 sign_bit = _mm256_set1_ps(-0.0f);
    for (int64_t row = begin; row < end; ++row)
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t at = row * k + g * kGroup;
        __m256 v[4], amax = _mm256_setzero_ps();
        for (int i = 0; i < 4; ++i) {
          v[i] = load_float8(x + at + 8 * i);
          amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign_bit, v[i]));
        }
        a.scale[row * groups + g] = group(v, horizontal_max(amax), at);
        if (!exact_sums) continue;
        a.sum[(row * groups + g) * 2] = horizontal_sum(_mm256_add_ps(v[0], v[1]));
        a.sum[(row * groups + g) * 2 + 1] = horizontal_sum(_mm256_add_ps(v[2], v[3]));
      }
  });
}

#ifdef MINISGL_BLOCK_VNNI
// One term: q only where a tile reads it (a folding weight's decoded spans read u alone).
// NOTE: never inlined: block_matmul and the one-row program (BlockRowActivations) run the same
// code for a row, and so get the same bits.
template <int TERMS, typename T>
[[gnu::noinline]] void quantize_activations(const T* x, int64_t rows, int64_t k, Reads reads,
                                            Activations& a) {
  if (reads.signed_copy) grow(a.q, rows * k);
  if (TERMS == 2) grow(a.r, rows * k);
  if (reads.q_sums) grow(a.q_sum, rows * k / kGroup * 2);
  if (reads.unsigned_copy) grow(a.u, rows * k);
  int8_t* const q = reads.signed_copy ? a.q.data() : nullptr;
  int8_t* const r = TERMS == 2 ? a.r.data() : nullptr;
  int32_t* const q_sum = reads.q_sums ? a.q_sum.data() : nullptr;
  uint8_t* const u = reads.unsigned_copy ? a.u.data() : nullptr;
  quantize_rows(x, rows, k, reads.exact_sums, a,
                [=](const __m256 (&v)[4], float amax, int64_t at) {
    const float s = amax / 127.0f, inv = s > 0.0f ? 1.0f / s : 0.0f;
    __m256i coarse[4];
    __m256 rounded[4];
    for (int i = 0; i < 4; ++i) {  // cvtps rounds to nearest even
      rounded[i] = _mm256_round_ps(_mm256_mul_ps(v[i], _mm256_set1_ps(inv)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      coarse[i] = _mm256_cvtps_epi32(rounded[i]);
    }
    const __m256i bytes = pack_int8x32(coarse);
    if (q != nullptr) store32(q + at, bytes);
    if (TERMS == 1) {
      if (q_sum != nullptr) {
        q_sum[at / kGroup * 2] = horizontal_sum(_mm256_add_epi32(coarse[0], coarse[1]));
        q_sum[at / kGroup * 2 + 1] = horizontal_sum(_mm256_add_epi32(coarse[2], coarse[3]));
      }
      if (u != nullptr) store32(u + at, _mm256_xor_si256(bytes, _mm256_set1_epi8(-128)));
      return s;
    }
    __m256i fine[4];
    for (int i = 0; i < 4; ++i) {
      const __m256 rest = _mm256_fnmadd_ps(rounded[i], _mm256_set1_ps(s), v[i]);
      fine[i] = _mm256_cvtps_epi32(_mm256_mul_ps(rest, _mm256_set1_ps(inv * 254.0f)));
    }
    store32(r + at, pack_int8x32(fine));
    return s / 254.0f;
  });
}

template <typename T>
void quantize_activations(const T* x, int64_t rows, int64_t k, int64_t terms, Reads reads,
                          Activations& a) {
  if (terms == 1) quantize_activations<1>(x, rows, k, reads, a);
  else quantize_activations<2>(x, rows, k, reads, a);
}
#else
template <typename T>
void quantize_activations(const T* x, int64_t rows, int64_t k, int64_t, Reads, Activations& a) {
  grow(a.q16, rows * k);
  quantize_rows(x, rows, k, true, a, [&](const __m256 (&v)[4], float amax, int64_t at) {
    const float s = amax / 32767.0f, inv = s > 0.0f ? 1.0f / s : 0.0f;
    __m256i q[4];  // cvtps rounds to nearest even
    for (int i = 0; i < 4; ++i)
      q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inv)));
    const __m256i order = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);  // packs works per half
    for (int i = 0; i < 2; ++i)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.q16.data() + at + 16 * i),
                          _mm256_permutevar8x32_epi32(_mm256_packs_epi32(q[2 * i], q[2 * i + 1]),
                                                      order));
    return s;
  });
}
#endif

// ---- the integer dot products ---------------------------------------------------------------

// Byte operations on 32 bytes (a block's 8 lanes) or, with AVX-512, 64 (a span's two blocks).
inline __m256i bits_and(__m256i a, __m256i b) { return _mm256_and_si256(a, b); }
inline __m256i bits_or(__m256i a, __m256i b) { return _mm256_or_si256(a, b); }
inline __m256i shift16(__m256i v, int left) {  // each 16-bit lane shifted left (right if < 0)
  return left >= 0 ? _mm256_slli_epi16(v, left) : _mm256_srli_epi16(v, -left);
}
inline __m256i byte_of(__m256i, int8_t b) { return _mm256_set1_epi8(b); }
inline __m256i lut_of(__m256i codes) {  // each byte (a code < 16) through kLutCodes
  return _mm256_shuffle_epi8(
      _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kLutCodes))),
      codes);
}
#ifdef MINISGL_BLOCK_VNNI
inline __m512i bits_and(__m512i a, __m512i b) { return _mm512_and_si512(a, b); }
inline __m512i bits_or(__m512i a, __m512i b) { return _mm512_or_si512(a, b); }
inline __m512i shift16(__m512i v, int left) {
  return left >= 0 ? _mm512_slli_epi16(v, left) : _mm512_srli_epi16(v, -left);
}
inline __m512i byte_of(__m512i, int8_t b) { return _mm512_set1_epi8(b); }
inline __m512i lut_of(__m512i codes) {
  return _mm512_shuffle_epi8(
      _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kLutCodes))),
      codes);
}
#endif

// The codes of quad t (inputs 4t .. 4t + 3 of the group) for the 8 lanes of each block whose
// group `load(offset)` reads (the offset in the group's bytes); kLut: through its table.
template <int BITS, int MODE, typename Load>
inline auto quad_codes(Load load, int t) {
  if (BITS == 8) return load(t * 32);
  const auto v = load((t / 2) * 32), low4 = byte_of(v, 0x0F);
  auto q = bits_and(t & 1 ? shift16(v, -4) : v, low4);
  if (MODE == kLut) return lut_of(q);
  if (BITS == 5)  // bit t of the high-bit vector to bit 4
    q = bits_or(q, bits_and(shift16(load(128), 4 - t), byte_of(v, 0x10)));
  if (BITS == 6)  // bits 2u, 2u + 1 of vector t / 4 to bits 4, 5
    q = bits_or(q, bits_and(shift16(load(128 + (t / 4) * 32), 4 - 2 * (t % 4)),
                            byte_of(v, 0x30)));
  return q;
}

template <int BITS, int MODE>
inline __m256i quad_codes(const uint8_t* c, int t) {
  return quad_codes<BITS, MODE>([c](int64_t at) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + at));
  }, t);
}

inline __m256i broadcast_quad(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return _mm256_set1_epi32(v);
}

inline __m256 load_half8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline __m256 bytes_to_float(const uint8_t* p, bool is_signed) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
}

// d' and m' of the 8 lanes of (block, group g), half h of the group for kSixBit.
template <int MODE>
inline void group_scales(const Weight& w, int64_t block, int64_t g, int h, __m256& d, __m256& m) {
  if (flat_scales(MODE)) {
    const at::Half* p = w.scales + (block * w.groups + g) * 2 * kLanes;
    d = load_half8(p);
    m = load_half8(p + kLanes);
    return;
  }
  const at::Half* p = w.scales + (block * (w.groups / w.groups_per_super) +
                                  g / w.groups_per_super) * 2 * kLanes;
  const uint8_t* s = w.subs + (block * w.groups + g) * 2 * kLanes;
  d = _mm256_mul_ps(load_half8(p), bytes_to_float(s + h * kLanes, MODE == kSixBit));
  m = MODE == kMins ? _mm256_mul_ps(load_half8(p + kLanes), bytes_to_float(s + kLanes, false))
                    : _mm256_mul_ps(d, _mm256_set1_ps(-32.0f));
  // NOTE: -ffast-math would otherwise fold a one-row tile's d' s into d (sc s), another rounding
  // than wider tiles': every batch size must give a row the same result to the bit.
  asm("" : "+x"(d), "+x"(m));
}

// acc + one group's (or half group's, HALVES == 2) integer dot `dot` of activation row `row`
// (254 q + r terms) times d' s, plus m' times the row's exact sum of those inputs.
template <int HALVES>
inline __m256 add_group(__m256 acc, __m256i dot, __m256 d, __m256 m, const Activations& a,
                        int64_t row, int64_t groups, int64_t g, int h) {
  const int64_t at = row * groups + g;
  const float* halves = a.sum.data() + 2 * at;
  const float sum = HALVES == 2 ? halves[h] : halves[0] + halves[1];
  acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(d, _mm256_set1_ps(a.scale[at])),
                        acc);
  return _mm256_fmadd_ps(m, _mm256_set1_ps(sum), acc);
}

// One term, m' = -OFFSET d' folded: acc + d' s times the integer dot of the codes less OFFSET
// with the row's q, sum_i code_i q_i - OFFSET sum_i q_i.
template <int HALVES, int OFFSET>
inline __m256 add_folded_group(__m256 acc, __m256i dot, __m256 d, const Activations& a,
                               int64_t row, int64_t groups, int64_t g, int h) {
  const int64_t at = row * groups + g;
  if (OFFSET != 0) {
    const int32_t* halves = a.q_sum.data() + 2 * at;
    const int32_t sum = HALVES == 2 ? halves[h] : halves[0] + halves[1];
    dot = _mm256_sub_epi32(dot, _mm256_set1_epi32(OFFSET * sum));
  }
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(d, _mm256_set1_ps(a.scale[at])),
                         acc);
}

// ROWS activation rows times one block of 8 output features, over all groups, into out_f32.
#ifdef MINISGL_BLOCK_VNNI
// vpdpbusd sums the 4 products of a quad straight into int32 (no saturation, no widening), and
// AVX-512's 32 registers hold a tile of ROWS rows times BLOCKS blocks (16 lanes: each broadcast
// activation quad serves both blocks) into out[ROWS][BLOCKS * 8].
// NOTE: vpdpbusd's latency is several cycles: with few accumulators, CHAINS independent ones
// per term keep the unit busy instead of waiting on one chain.
template <int ROWS, int BITS, int MODE, int BLOCKS, int TERMS>
void tile(const Activations& a, int64_t row0, const Weight& w, int64_t block, float* out) {
  constexpr int HALVES = MODE == kSixBit ? 2 : 1;  // sub-groups with their own scale
  constexpr int CHAINS = ROWS * BLOCKS >= 3 ? 1 : 2;
  const int64_t groups = w.groups, k = a.k, gb = group_bytes(BITS);
  __m256 acc[ROWS][BLOCKS];
  for (int r = 0; r < ROWS; ++r)
    for (int b = 0; b < BLOCKS; ++b) acc[r][b] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* c[BLOCKS];
    for (int b = 0; b < BLOCKS; ++b) c[b] = w.codes + ((block + b) * groups + g) * gb;
    if (ROWS == 1) {  // the next block's group g: one row's tiles wait on memory, not compute
      const char* next = reinterpret_cast<const char*>(c[BLOCKS - 1] + groups * gb);
      for (int64_t at = 0; at < gb; at += 64) _mm_prefetch(next + at, _MM_HINT_T0);
    }
    __m256i coarse[ROWS][BLOCKS][CHAINS], fine[ROWS][BLOCKS][CHAINS];
    for (int r = 0; r < ROWS; ++r)
      for (int b = 0; b < BLOCKS; ++b)
        for (int i = 0; i < CHAINS; ++i) coarse[r][b][i] = fine[r][b][i] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int t = 0; t < 8; ++t) {
      __m256i codes[BLOCKS], sign_source[BLOCKS];
      for (int b = 0; b < BLOCKS; ++b) {
        codes[b] = sign_source[b] = quad_codes<BITS, MODE>(c[b], t);
        if (BITS == 8) codes[b] = _mm256_sign_epi8(codes[b], codes[b]);  // x takes the sign
      }
      const int chain = t % CHAINS;
      for (int r = 0; r < ROWS; ++r) {
        const int64_t at = (row0 + r) * k + g * kGroup + 4 * t;
        const __m256i xq = broadcast_quad(a.q.data() + at);
        const __m256i xr = TERMS == 2 ? broadcast_quad(a.r.data() + at) : xq;
        for (int b = 0; b < BLOCKS; ++b) {
          const __m256i q = BITS == 8 ? _mm256_sign_epi8(xq, sign_source[b]) : xq;
          coarse[r][b][chain] = _mm256_dpbusd_epi32(coarse[r][b][chain], codes[b], q);
          if (TERMS == 1) continue;
          const __m256i f = BITS == 8 ? _mm256_sign_epi8(xr, sign_source[b]) : xr;
          fine[r][b][chain] = _mm256_dpbusd_epi32(fine[r][b][chain], codes[b], f);
        }
      }
      if (t != 7 && !(HALVES == 2 && t == 3)) continue;
      const int h = HALVES == 2 ? t / 4 : 0;
      for (int b = 0; b < BLOCKS; ++b) {
        __m256 d, m;
        group_scales<MODE>(w, block + b, g, h, d, m);
        for (int r = 0; r < ROWS; ++r) {
          __m256i cs = coarse[r][b][0], fs = fine[r][b][0];
          for (int i = 1; i < CHAINS; ++i) {
            cs = _mm256_add_epi32(cs, coarse[r][b][i]);
            fs = _mm256_add_epi32(fs, fine[r][b][i]);
          }
          for (int i = 0; i < CHAINS; ++i) coarse[r][b][i] = fine[r][b][i] = _mm256_setzero_si256();
          const __m256i dot = TERMS == 1 ? cs
              : _mm256_add_epi32(_mm256_mullo_epi32(cs, _mm256_set1_epi32(254)), fs);
          if constexpr (TERMS == 1 && code_offset(BITS, MODE) >= 0)
            acc[r][b] = add_folded_group<HALVES, code_offset(BITS, MODE)>(acc[r][b], dot, d, a,
                                                                         row0 + r, groups, g, h);
          else
            acc[r][b] = add_group<HALVES>(acc[r][b], dot, d, m, a, row0 + r, groups, g, h);
        }
      }
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int b = 0; b < BLOCKS; ++b) _mm256_storeu_ps(out + (r * BLOCKS + b) * kLanes, acc[r][b]);
}

// Past a few rows a span's codes are decoded once into bytes (and its scales into float32 d' and
// m'), and every tile of rows reads those: the 4-row tiles above decode a group's codes again for
// each 4 rows. Byte 4 * lane + j of vector (g, t) is input 4t + j of group g for output lane
// `lane` of the span's 16 (two blocks of 8; where the span has one, its codes twice and zero
// scales for the second).
// A folding weight's codes are decoded less their offset, as signed bytes, and its tiles take
// the activations as unsigned ones, q + 128: each group's (or half group's) dot product starts
// at -128 times the sum of its codes, so it ends at sum_i (code_i - o) q_i exactly.
// The float operations per row are the tiles' own, in their order: the same result to the bit.
struct DecodedSpan {  // vectors of 64 bytes, aligned: no load splits a cache line
  std::vector<__m512i> codes;  // [groups, 8 quads]
  std::vector<__m512> d, m;    // [groups, halves]: 16 lanes each (m: non-folding weights)
  std::vector<__m512i> start;  // folding: [groups * halves + 1], the dot products' start (0 last)
};

constexpr int kSpanLanes = 2 * kLanes;

template <int BITS, int MODE>
void decode_span(const Weight& w, int64_t block, int width, DecodedSpan& s) {
  constexpr int HALVES = MODE == kSixBit ? 2 : 1, OFFSET = code_offset(BITS, MODE);
  const int64_t groups = w.groups, gb = group_bytes(BITS);
  grow(s.codes, groups * 8);
  grow(s.d, groups * HALVES);
  if (OFFSET < 0) grow(s.m, groups * HALVES);
  if (OFFSET >= 0) {
    grow(s.start, groups * HALVES + 1);
    s.start[groups * HALVES] = _mm512_setzero_si512();
  }
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* c0 = w.codes + (block * groups + g) * gb;
    const uint8_t* c1 = width == 2 ? c0 + groups * gb : c0;
    auto load = [c0, c1](int64_t at) {
      return _mm512_inserti64x4(
          _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c0 + at))),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c1 + at)), 1);
    };
    __m512i code_sums[HALVES] = {};  // 128 times each lane's codes, per half
#pragma GCC unroll 8
    for (int t = 0; t < 8; ++t) {
      __m512i codes = quad_codes<BITS, MODE>(load, t);
      if (OFFSET > 0) codes = _mm512_sub_epi8(codes, _mm512_set1_epi8(OFFSET));
      if (OFFSET >= 0)
        code_sums[t * HALVES / 8] = _mm512_dpbusd_epi32(code_sums[t * HALVES / 8],
                                                        _mm512_set1_epi8(-128), codes);
      s.codes[g * 8 + t] = codes;
    }
    if (OFFSET >= 0)
      for (int h = 0; h < HALVES; ++h)
        s.start[g * HALVES + h] = _mm512_sub_epi32(_mm512_setzero_si512(), code_sums[h]);
    for (int b = 0; b < 2; ++b)
      for (int h = 0; h < HALVES; ++h) {
        __m256 d = _mm256_setzero_ps(), m = _mm256_setzero_ps();
        if (b < width) group_scales<MODE>(w, block + b, g, h, d, m);
        _mm256_storeu_ps(reinterpret_cast<float*>(&s.d[g * HALVES + h]) + kLanes * b, d);
        if (OFFSET < 0)
          _mm256_storeu_ps(reinterpret_cast<float*>(&s.m[g * HALVES + h]) + kLanes * b, m);
      }
  }
}

// ROWS rows (one int8 term each) times a decoded span's 16 lanes into out[ROWS][16]; HALVES 2:
// each half group has its own scale (Q6_K); FOLD: the span's weight folds its offset.
template <int ROWS, int HALVES, bool FOLD>
void decoded_tile(const Activations& a, int64_t row0, const DecodedSpan& s, int64_t groups,
                  float* out) {
  const int64_t k = a.k;
  const void* x = FOLD ? static_cast<const void*>(a.u.data()) : a.q.data();
  __m512 acc[ROWS];
  __m512i dot[ROWS];
  for (int r = 0; r < ROWS; ++r) {
    acc[r] = _mm512_setzero_ps();
    dot[r] = FOLD ? s.start[0] : _mm512_setzero_si512();
  }
  for (int64_t g = 0; g < groups; ++g) {
#pragma GCC unroll 8
    for (int t = 0; t < 8; ++t) {
      const __m512i codes = s.codes[g * 8 + t];
      for (int r = 0; r < ROWS; ++r) {
        int32_t quad;
        std::memcpy(&quad, static_cast<const char*>(x) + (row0 + r) * k + g * kGroup + 4 * t,
                    sizeof(quad));
        dot[r] = FOLD ? _mm512_dpbusd_epi32(dot[r], _mm512_set1_epi32(quad), codes)
                      : _mm512_dpbusd_epi32(dot[r], codes, _mm512_set1_epi32(quad));
      }
      if (t != 7 && !(HALVES == 2 && t == 3)) continue;
      const int h = HALVES == 2 ? t / 4 : 0;
      const __m512 d = s.d[g * HALVES + h];
      const __m512i next = FOLD ? s.start[g * HALVES + h + 1] : _mm512_setzero_si512();
      for (int r = 0; r < ROWS; ++r) {  // add_group's (add_folded_group's) operations, in order
        const int64_t at = (row0 + r) * groups + g;
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]),
                                 _mm512_mul_ps(d, _mm512_set1_ps(a.scale[at])), acc[r]);
        if (!FOLD) {
          const float* halves = a.sum.data() + 2 * at;
          const float sum = HALVES == 2 ? halves[h] : halves[0] + halves[1];
          acc[r] = _mm512_fmadd_ps(s.m[g * HALVES + h], _mm512_set1_ps(sum), acc[r]);
        }
        dot[r] = next;
      }
    }
  }
  for (int r = 0; r < ROWS; ++r) _mm512_storeu_ps(out + r * kSpanLanes, acc[r]);
}

using DecodeSpanFn = void (*)(const Weight&, int64_t, int, DecodedSpan&);
using DecodedTileFn = void (*)(const Activations&, int64_t, const DecodedSpan&, int64_t,
                               float*);

DecodeSpanFn pick_decode_span(int64_t bits, int64_t mode) {
  if (mode == kSixBit) return decode_span<6, kSixBit>;
  if (mode == kLut) return decode_span<4, kLut>;
  if (mode == kMins) return bits == 4 ? decode_span<4, kMins> : decode_span<5, kMins>;
  if (mode == kSymmetric)
    return bits == 4 ? decode_span<4, kSymmetric>
                     : bits == 5 ? decode_span<5, kSymmetric> : decode_span<8, kSymmetric>;
  return bits == 4 ? decode_span<4, kFlat> : decode_span<5, kFlat>;
}

template <int HALVES, bool FOLD>
DecodedTileFn decoded_tile_for(int rows) {
  switch (rows) {
    case 1: return decoded_tile<1, HALVES, FOLD>;
    case 2: return decoded_tile<2, HALVES, FOLD>;
    case 3: return decoded_tile<3, HALVES, FOLD>;
    case 4: return decoded_tile<4, HALVES, FOLD>;
    case 5: return decoded_tile<5, HALVES, FOLD>;
    case 6: return decoded_tile<6, HALVES, FOLD>;
    case 7: return decoded_tile<7, HALVES, FOLD>;
    default: return decoded_tile<8, HALVES, FOLD>;
  }
}
#else
// The codes of quad t widened to int16: lo holds lanes 0, 1 | 4, 5 and hi lanes 2, 3 | 6, 7
// (unpacking works per 128-bit half), a lane's 4 codes as 4 int16 in one 64-bit element.
template <int BITS, int MODE>
inline void quad_codes16(const uint8_t* c, int t, __m256i& lo, __m256i& hi) {
  const __m256i q = quad_codes<BITS, MODE>(c, t);
  const __m256i high = BITS == 8 ? _mm256_cmpgt_epi8(_mm256_setzero_si256(), q)
                                 : _mm256_setzero_si256();
  lo = _mm256_unpacklo_epi8(q, high);
  hi = _mm256_unpackhi_epi8(q, high);
}

inline __m256i broadcast_quad16(const int16_t* p) {
  int64_t v;
  std::memcpy(&v, p, sizeof(v));
  return _mm256_set1_epi64x(v);
}

// vpmaddwd multiplies a lane's codes by the broadcast quad and sums pairs: lo / hi collect the
// two half-quad sums of each of their lanes, and one vphaddd per group adds them into lane order.
template <int ROWS, int BITS, int MODE, int BLOCKS, int TERMS>
void tile(const Activations& a, int64_t row0, const Weight& w, int64_t block, float* out) {
  static_assert(BLOCKS == 1 && TERMS == 2, "AVX2: tiles of one block, one int16 term");
  constexpr int HALVES = MODE == kSixBit ? 2 : 1;  // sub-groups with their own scale
  const int64_t groups = w.groups, k = a.k, gb = group_bytes(BITS);
  const int16_t* x = a.q16.data() + row0 * k;
  __m256 acc[ROWS];
  for (int r = 0; r < ROWS; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* c = w.codes + (block * groups + g) * gb;
    if (ROWS == 1) {  // the next block's group g: one row's tiles wait on memory, not compute
      const char* next = reinterpret_cast<const char*>(c + groups * gb);
      for (int64_t at = 0; at < gb; at += 64) _mm_prefetch(next + at, _MM_HINT_T0);
    }
    __m256i lo_dot[ROWS], hi_dot[ROWS];
    for (int r = 0; r < ROWS; ++r) lo_dot[r] = hi_dot[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int t = 0; t < 8; ++t) {
      __m256i lo, hi;
      quad_codes16<BITS, MODE>(c, t, lo, hi);
      for (int r = 0; r < ROWS; ++r) {
        const __m256i xq = broadcast_quad16(x + r * k + g * kGroup + 4 * t);
        lo_dot[r] = _mm256_add_epi32(lo_dot[r], _mm256_madd_epi16(lo, xq));
        hi_dot[r] = _mm256_add_epi32(hi_dot[r], _mm256_madd_epi16(hi, xq));
        // NOTE: without this GCC computes all the group's products first and spills them
        asm("" : "+x"(lo_dot[r]), "+x"(hi_dot[r]));
      }
      if (t != 7 && !(HALVES == 2 && t == 3)) continue;
      const int h = HALVES == 2 ? t / 4 : 0;
      __m256 d, m;
      group_scales<MODE>(w, block, g, h, d, m);
      for (int r = 0; r < ROWS; ++r) {
        const __m256i dot = _mm256_hadd_epi32(lo_dot[r], hi_dot[r]);
        acc[r] = add_group<HALVES>(acc[r], dot, d, m, a, row0 + r, groups, g, h);
        lo_dot[r] = hi_dot[r] = _mm256_setzero_si256();
      }
    }
  }
  for (int r = 0; r < ROWS; ++r) _mm256_storeu_ps(out + r * kLanes, acc[r]);
}
#endif

using TileFn = void (*)(const Activations&, int64_t, const Weight&, int64_t, float*);

#ifdef MINISGL_BLOCK_VNNI
constexpr int kTileBlocks = 2;  // blocks a tile spans (the last of an odd count: 1)
#else
constexpr int kTileBlocks = 1;
#endif

template <int BITS, int MODE, int BLOCKS, int TERMS>
TileFn tile_for(int rows) {
  switch (rows) {
    case 1: return tile<1, BITS, MODE, BLOCKS, TERMS>;
    case 2: return tile<2, BITS, MODE, BLOCKS, TERMS>;
    case 3: return tile<3, BITS, MODE, BLOCKS, TERMS>;
    default: return tile<4, BITS, MODE, BLOCKS, TERMS>;
  }
}

template <int BLOCKS, int TERMS>
TileFn pick_tile(int64_t bits, int64_t mode, int rows) {
  if (mode == kSixBit) return tile_for<6, kSixBit, BLOCKS, TERMS>(rows);
  if (mode == kLut) return tile_for<4, kLut, BLOCKS, TERMS>(rows);
  if constexpr (TERMS == 1) {
    if (mode == kSymmetric)
      return bits == 4 ? tile_for<4, kSymmetric, BLOCKS, TERMS>(rows)
                       : bits == 5 ? tile_for<5, kSymmetric, BLOCKS, TERMS>(rows)
                                   : tile_for<8, kSymmetric, BLOCKS, TERMS>(rows);
  }  // with two terms kSymmetric is kFlat
  if (mode == kMins) return bits == 4 ? tile_for<4, kMins, BLOCKS, TERMS>(rows)
                                      : tile_for<5, kMins, BLOCKS, TERMS>(rows);
  switch (bits) {
    case 4: return tile_for<4, kFlat, BLOCKS, TERMS>(rows);
    case 5: return tile_for<5, kFlat, BLOCKS, TERMS>(rows);
    default: return tile_for<8, kFlat, BLOCKS, TERMS>(rows);
  }
}

template <int TERMS>
TileFn pick_tile(int64_t bits, int64_t mode, int rows, int blocks) {
  return blocks == kTileBlocks ? pick_tile<kTileBlocks, TERMS>(bits, mode, rows)
                               : pick_tile<1, TERMS>(bits, mode, rows);
}

TileFn pick_tile(int64_t bits, int64_t mode, int rows, int blocks, int64_t terms) {
#ifdef MINISGL_BLOCK_VNNI
  if (terms == 1) return pick_tile<1>(bits, mode, rows, blocks);
#endif
  return pick_tile<2>(bits, mode, rows, blocks);
}

// One block's weights into columns block * 8 .. + 7 of the transposed weight [k, n].
template <int BITS, int MODE, typename T>
void dequantize_block_t(const Weight& w, int64_t block, T* out, int64_t n) {
  const int64_t gb = group_bytes(BITS);
  for (int64_t g = 0; g < w.groups; ++g) {
    const uint8_t* c = w.codes + (block * w.groups + g) * gb;
    __m256 d[2], m[2];
    group_scales<MODE>(w, block, g, 0, d[0], m[0]);
    if (MODE == kSixBit) group_scales<MODE>(w, block, g, 1, d[1], m[1]);
#pragma GCC unroll 8
    for (int t = 0; t < 8; ++t) {
      const __m256i codes = quad_codes<BITS, MODE>(c, t);
      const int h = MODE == kSixBit ? t / 4 : 0;
      for (int j = 0; j < 4; ++j) {
        const __m256i code = BITS == 8
            ? _mm256_srai_epi32(_mm256_slli_epi32(codes, 24 - 8 * j), 24)
            : _mm256_and_si256(_mm256_srli_epi32(codes, 8 * j), _mm256_set1_epi32(0xFF));
        store_float8(out + (g * kGroup + 4 * t + j) * n + block * kLanes,
                     _mm256_fmadd_ps(_mm256_cvtepi32_ps(code), d[h], m[h]));
      }
    }
  }
}

template <typename T>
using DequantizeFn = void (*)(const Weight&, int64_t, T*, int64_t);

template <typename T>
DequantizeFn<T> pick_dequantize(int64_t bits, int64_t mode) {  // kSymmetric: as kFlat
  if (mode == kSixBit) return dequantize_block_t<6, kSixBit, T>;
  if (mode == kLut) return dequantize_block_t<4, kLut, T>;
  if (mode == kMins) return bits == 4 ? dequantize_block_t<4, kMins, T>
                                      : dequantize_block_t<5, kMins, T>;
  return bits == 4 ? dequantize_block_t<4, kFlat, T>
                   : bits == 5 ? dequantize_block_t<5, kFlat, T> : dequantize_block_t<8, kFlat, T>;
}

template <typename T>
void dequantize_all_t(const Weight& w, T* out) {
  const DequantizeFn<T> fn = pick_dequantize<T>(w.bits, w.mode);
  at::parallel_for(0, w.blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) fn(w, b, out, w.blocks * kLanes);
  });
}

// `rows` rows of a tile's float32 output (`stride` floats apart) into out (`n` apart), its
// first `width` blocks of lanes, in out's dtype.
template <typename T>
void store_rows(const float* from, int64_t stride, int rows, int width, T* out, int64_t n) {
  for (int i = 0; i < rows; ++i)
    for (int j = 0; j < width * kLanes; j += kLanes)
      store_float8(out + i * n + j, load_float8(from + i * stride + j));
}

// Rows first .. last - 1 of the span of `width` blocks from block b, in 4-row tiles.
template <typename T>
void tiled_span_rows(const Activations& a, const Weight& w, int64_t terms, int64_t b, int width,
                     int64_t first, int64_t last, T* out, int64_t n) {
  float tile_out[kMaxTileRows * kTileBlocks * kLanes];
  for (int64_t r = first; r < last; r += kMaxTileRows) {
    const int tile_rows = static_cast<int>(std::min<int64_t>(kMaxTileRows, last - r));
    pick_tile(w.bits, w.mode, tile_rows, width, terms)(a, r, w, b, tile_out);
    store_rows(tile_out, width * kLanes, tile_rows, width, out + r * n + b * kLanes, n);
  }
}

#ifdef MINISGL_BLOCK_VNNI
// The same rows with one term, the span decoded once into `codes`. The next span's codes (a
// step's weights come from DRAM) go towards L2 meanwhile, a share with each tile: a span is too
// short a run for the hardware prefetcher to get ahead of, and a burst of prefetches at once
// gains little (BENCHMARKS.md, "One int8 activation term").
template <typename T>
void decoded_span_rows(const Activations& a, const Weight& w, DecodedSpan& codes, int64_t b,
                       int width, int64_t first, int64_t last, T* out, int64_t n) {
  pick_decode_span(w.bits, w.mode)(w, b, width, codes);
  float tile_out[kSpanTileRows * kSpanLanes];
  const int64_t block_bytes = w.groups * group_bytes(w.bits);
  const char* next = reinterpret_cast<const char*>(w.codes + (b + width) * block_bytes);
  const int64_t next_bytes = std::clamp<int64_t>(w.blocks - b - width, 0, kTileBlocks) *
                             block_bytes;
  const int64_t tiles = (last - first + kSpanTileRows - 1) / kSpanTileRows;
  const int64_t per_tile = (next_bytes / 64 + tiles - 1) / tiles * 64;
  int64_t fetched = 0;
  for (int64_t r = first; r < last; r += kSpanTileRows) {
    for (const int64_t upto = std::min(next_bytes, fetched + per_tile); fetched < upto;
         fetched += 64)
      _mm_prefetch(next + fetched, _MM_HINT_T1);
    const int tile_rows = static_cast<int>(std::min<int64_t>(kSpanTileRows, last - r));
    const DecodedTileFn tile = w.mode == kSixBit ? decoded_tile_for<2, true>(tile_rows)
        : code_offset(w.bits, w.mode) >= 0 ? decoded_tile_for<1, true>(tile_rows)
                               : decoded_tile_for<1, false>(tile_rows);
    tile(a, r, codes, w.groups, tile_out);
    store_rows(tile_out, kSpanLanes, tile_rows, width, out + r * n + b * kLanes, n);
  }
}
#endif

// Whether run_tiles decodes each span once (one term, past a few rows).
bool decodes_spans(const Weight& w, int64_t rows, int64_t terms) {
#ifdef MINISGL_BLOCK_VNNI
  return terms == 1 && rows >= kDecodedMinRows && (w.bits != 8 || w.mode == kSymmetric);
#else
  return false;
#endif
}

#ifndef MINISGL_BLOCK_VNNI
struct DecodedSpan {};  // spans are decoded with VNNI only
#endif

// What a call's tiles read besides the int8 terms and their scales; `tiled` / `decoded`:
// whether some of its rows run 4-row tiles over the codes / decoded spans.
Reads reads_for(int64_t bits, int64_t mode, int64_t terms, bool tiled, bool decoded) {
  const bool folds = terms == 1 && code_offset(bits, mode) >= 0;
  return {!folds || tiled, !folds, folds && tiled && code_offset(bits, mode) > 0,
          folds && decoded};
}

// x's rows into `a`, as `reads` says.
void quantize_input(const at::Tensor& x, int64_t rows, int64_t k, int64_t terms, Reads reads,
                    Activations& a) {
  if (x.scalar_type() == at::kFloat)
    quantize_activations(x.data_ptr<float>(), rows, k, terms, reads, a);
  else
    quantize_activations(x.data_ptr<at::BFloat16>(), rows, k, terms, reads, a);
}

// Blocks of output features per span of a call of `rows` rows. NOTE: one row reads each block
// once whatever the tile: tiles of one block stream the weight best.
int64_t blocks_per_span(int64_t rows) { return rows == 1 ? 1 : kTileBlocks; }

// Rows per block of rows of a call of `rows` rows. NOTE: past a few hundred rows, rows in
// blocks whose activations stay in L2 while every span passes over them (each span decoded
// once per block).
int64_t rows_per_block(bool decoded, int64_t rows, int64_t k) {
  return decoded ? std::max<int64_t>(kSpanTileRows,
                                     kActivationBlockBytes / k / kSpanTileRows * kSpanTileRows)
                 : rows;
}

// Rows first .. last - 1 of the span of `width` blocks from block b: decoded once (`decoded`,
// into `codes`) or in 4-row tiles over the codes.
template <typename T>
void span_rows(const Activations& a, const Weight& w, int64_t terms, bool decoded,
               DecodedSpan& codes, int64_t b, int width, int64_t first, int64_t last, T* out,
               int64_t n) {
#ifdef MINISGL_BLOCK_VNNI
  if (decoded) {
    decoded_span_rows(a, w, codes, b, width, first, last, out, n);
    return;
  }
#endif
  tiled_span_rows(a, w, terms, b, width, first, last, out, n);
}

// Every tile of out = activations x weight ([rows, n]), written in out's dtype.
// `decoded`: decodes_spans's answer for this call.
template <typename T>
void run_tiles(const Activations& a, const Weight& w, int64_t terms, bool decoded, T* out) {
  const int64_t rows = a.rows, blocks = w.blocks;
  const int64_t n = blocks * kLanes;
  // NOTE: blocks outer, rows inner: a block's codes stay in L1 while every tile passes over them
  const int64_t per_span = blocks_per_span(rows);
  const int64_t spans = (blocks + per_span - 1) / per_span;
  const int64_t row_block = rows_per_block(decoded, rows, a.k);
  for (int64_t first = 0; first < rows; first += row_block) {
    const int64_t last = std::min(rows, first + row_block);
    at::parallel_for(0, spans, 1, [&](int64_t begin, int64_t end) {
      static thread_local DecodedSpan codes;
      for (int64_t span = begin; span < end; ++span) {
        const int64_t b = span * per_span;
        span_rows(a, w, terms, decoded, codes, b,
                  static_cast<int>(std::min<int64_t>(per_span, blocks - b)), first, last, out, n);
      }
    });
  }
}

#endif  // MINISGL_AVX2

}  // namespace

bool block_kernel_available() {
#ifdef MINISGL_AVX2
  return true;
#else
  return false;
#endif
}

bool block_kernel_vnni() {
#ifdef MINISGL_BLOCK_VNNI
  return true;
#else
  return false;
#endif
}

// x: [..., k] float32 or bfloat16; codes [n / 8, k / 32, bytes]; scales float16; subs uint8
// (kFlat: ignored); terms: the activations' int8 terms with VNNI (1 or 2; 2 without VNNI).
// Returns x @ w.T as [..., n] in x's dtype.
at::Tensor block_matmul(at::Tensor x, at::Tensor codes, at::Tensor scales,
                        at::Tensor subs, int64_t bits, int64_t mode, int64_t terms) {
#ifdef MINISGL_AVX2
  TORCH_CHECK(x.is_contiguous() && (x.scalar_type() == at::kFloat ||
                                    x.scalar_type() == at::kBFloat16));
  TORCH_CHECK(terms == 2 || (terms == 1 && block_kernel_vnni()),
              "block_matmul: one-term activations need AVX-512 VNNI");
  const Weight w = weight_of(codes, scales, subs, bits, mode);
  const int64_t k = x.size(-1), rows = x.numel() / k, blocks = codes.size(0);
  TORCH_CHECK(k == w.groups * kGroup, "activations do not match the weight's input features");
  const int64_t n = blocks * kLanes;
  static thread_local Activations a;  // reused: see grow
  const bool decoded = decodes_spans(w, rows, terms);
  quantize_input(x, rows, k, terms, reads_for(bits, mode, terms, !decoded, decoded), a);
  auto result = at::empty({rows, n}, x.options());
  if (x.scalar_type() == at::kFloat) run_tiles(a, w, terms, decoded, result.data_ptr<float>());
  else run_tiles(a, w, terms, decoded, result.data_ptr<at::BFloat16>());
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = n;
  return result.view(sizes);
#else
  TORCH_CHECK(false, "block_matmul needs AVX2, FMA and F16C (built with -march=native)");
#endif
}

BlockWeight block_weight(const at::Tensor& codes, const at::Tensor& scales,
                         const at::Tensor& subs, int64_t bits, int64_t mode) {
  return weight_of(codes, scales, subs, bits, mode);
}

struct BlockRowActivations::Buffers {
#ifdef MINISGL_AVX2
  Activations a;
#endif
};

BlockRowActivations::BlockRowActivations() : buffers_(std::make_unique<Buffers>()) {}
BlockRowActivations::BlockRowActivations(BlockRowActivations&&) noexcept = default;
BlockRowActivations::~BlockRowActivations() = default;

// As block_matmul quantizes one row for each weight in turn: the values do not depend on what
// a weight's tiles read, so one quantization with every weight's reads serves them all.
void BlockRowActivations::quantize(const at::BFloat16* x, int64_t k, int64_t terms,
                                   const BlockWeight* weights, int64_t count) {
#ifdef MINISGL_BLOCK_VNNI
  Reads reads{false, false, false, false};
  for (int64_t i = 0; i < count; ++i) {
    const Reads r = reads_for(weights[i].bits, weights[i].mode, terms, true, false);
    reads = {reads.signed_copy || r.signed_copy, reads.exact_sums || r.exact_sums,
             reads.q_sums || r.q_sums, false};
  }
  quantize_activations(x, 1, k, terms, reads, buffers_->a);
#else
  TORCH_CHECK(false, "the one-row block kernel needs AVX-512 VNNI");
#endif
}

void BlockRowActivations::blocks(const BlockWeight& w, int64_t terms, int64_t begin,
                                 int64_t end, at::BFloat16* out) const {
#ifdef MINISGL_BLOCK_VNNI
  for (int64_t b = begin; b < end; ++b)
    tiled_span_rows(buffers_->a, w, terms, b, 1, 0, 1, out, w.blocks * kLanes);
#endif
}

// Rows grouped by expert times each expert's weight, one call for every group (a mixture's
// experts, all of one block type and shape): x [rows, k] float32 or bfloat16, group e its
// counts[e] rows in order; codes / scales / subs: each expert's, as block_matmul's. The
// activations are quantized once for all rows, and one parallel loop runs every (group, row
// block, span) as block_matmul runs a group alone, so each row's output is that call's to the
// bit; a decode step's few rows per expert no longer cost a thread team's start-up each.
// Returns [rows, n] in x's dtype.
at::Tensor block_matmul_grouped(at::Tensor x, std::vector<at::Tensor> codes,
                                std::vector<at::Tensor> scales, std::vector<at::Tensor> subs,
                                int64_t bits, int64_t mode, int64_t terms,
                                std::vector<int64_t> counts) {
#ifdef MINISGL_AVX2
  TORCH_CHECK(x.is_contiguous() && x.dim() == 2 && (x.scalar_type() == at::kFloat ||
                                                    x.scalar_type() == at::kBFloat16));
  TORCH_CHECK(terms == 2 || (terms == 1 && block_kernel_vnni()),
              "block_matmul_grouped: one-term activations need AVX-512 VNNI");
  const size_t experts = counts.size();
  TORCH_CHECK(codes.size() == experts && scales.size() == experts && subs.size() == experts,
              "one weight per group");
  std::vector<Weight> weights;
  for (size_t e = 0; e < experts; ++e) {
    weights.push_back(weight_of(codes[e], scales[e], subs[e], bits, mode));
    TORCH_CHECK(weights[e].blocks == weights[0].blocks && weights[e].groups == weights[0].groups,
                "every expert's weight has one shape");
  }
  const int64_t k = x.size(1), rows = x.size(0);
  TORCH_CHECK(experts > 0 && k == weights[0].groups * kGroup,
              "activations do not match the weights' input features");
  const int64_t blocks = weights[0].blocks, n = blocks * kLanes;
  // (expert, first row, last row, spans of it): a group's rows in block_matmul's row blocks
  struct Task {
    int64_t expert, first, last, per_span, spans;
    bool decoded;
  };
  std::vector<Task> tasks;
  bool any_decoded = false, any_tiled = false;
  int64_t start = 0;
  for (size_t e = 0; e < experts; ++e) {
    const int64_t count = counts[e];
    TORCH_CHECK(count >= 0 && start + count <= rows, "counts must cover the rows");
    if (count == 0) continue;
    const bool decoded = decodes_spans(weights[e], count, terms);
    (decoded ? any_decoded : any_tiled) = true;
    const int64_t per_span = blocks_per_span(count), row_block = rows_per_block(decoded, count, k);
    for (int64_t first = start; first < start + count; first += row_block)
      tasks.push_back({static_cast<int64_t>(e), first, std::min(start + count, first + row_block),
                       per_span, (blocks + per_span - 1) / per_span, decoded});
    start += count;
  }
  TORCH_CHECK(start == rows, "counts must cover the rows");
  auto result = at::empty({rows, n}, x.options());
  if (tasks.empty()) return result;
  static thread_local Activations mine;  // reused: see grow
  // NOTE: the workers read this thread's buffers: a thread_local named in the loop's lambda
  // would be each worker's own
  Activations& a = mine;
  quantize_input(x, rows, k, terms, reads_for(bits, mode, terms, any_tiled, any_decoded), a);
  std::vector<int64_t> item_ends;  // each task's items end here in the flat loop
  int64_t items = 0;
  for (const Task& t : tasks) item_ends.push_back(items += t.spans);
  auto run = [&](auto* out) {
    at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
      static thread_local DecodedSpan codes;
      size_t t = std::upper_bound(item_ends.begin(), item_ends.end(), begin) - item_ends.begin();
      for (int64_t item = begin; item < end; ++item) {
        while (item >= item_ends[t]) ++t;
        const Task& task = tasks[t];
        const int64_t b = (item - (item_ends[t] - task.spans)) * task.per_span;
        span_rows(a, weights[task.expert], terms, task.decoded, codes, b,
                  static_cast<int>(std::min<int64_t>(task.per_span, blocks - b)), task.first,
                  task.last, out, n);
      }
    });
  };
  if (x.scalar_type() == at::kFloat) run(result.data_ptr<float>());
  else run(result.data_ptr<at::BFloat16>());
  return result;
#else
  TORCH_CHECK(false, "block_matmul_grouped needs AVX2, FMA and F16C (built with -march=native)");
#endif
}

// The weight's rows `rows` (output features; all of them when `rows` is empty) as float32
// [len, k], from the layout alone: the reference the tests hold the kernel to, the embedding
// lookup, and the large-batch path's dense weight.
at::Tensor block_dequantize(at::Tensor codes, at::Tensor scales, at::Tensor subs,
                            int64_t bits, int64_t mode, at::Tensor rows) {
  const Weight w = weight_of(codes, scales, subs, bits, mode);
  const int64_t n = codes.size(0) * kLanes, k = w.groups * kGroup;
  at::Tensor picked = rows.numel() ? rows.to(at::kLong).contiguous()
                                   : at::arange(n, codes.options().dtype(at::kLong));
  TORCH_CHECK(picked.numel() == 0 || (picked.min().item<int64_t>() >= 0 &&
                                      picked.max().item<int64_t>() < n), "row out of range");
  auto out = at::empty({picked.numel(), k}, codes.options().dtype(at::kFloat));
  const int64_t* index = picked.data_ptr<int64_t>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, picked.numel(), 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t block = index[i] / kLanes;
      const int lane = static_cast<int>(index[i] % kLanes);
      for (int64_t g = 0; g < w.groups; ++g)
        for (int j = 0; j < kGroup; ++j) {
          float d, m;
          scale_at(w, block, g, lane, j, d, m);
          o[i * k + g * kGroup + j] = d * code_at(w, block, g, lane, j) + m;
        }
    }
  });
  return out;
}

// The whole weight transposed, [k, n] float32 or bfloat16 (large batches multiply it with a
// GEMM).
at::Tensor block_dequantize_t(at::Tensor codes, at::Tensor scales, at::Tensor subs,
                              int64_t bits, int64_t mode, bool bf16) {
#ifdef MINISGL_AVX2
  const Weight w = weight_of(codes, scales, subs, bits, mode);
  auto out = at::empty({w.groups * kGroup, w.blocks * kLanes},
                       codes.options().dtype(bf16 ? at::kBFloat16 : at::kFloat));
  if (bf16) dequantize_all_t(w, out.data_ptr<at::BFloat16>());
  else dequantize_all_t(w, out.data_ptr<float>());
  return out;
#else
  TORCH_CHECK(false, "block_dequantize_t needs AVX2, FMA and F16C (built with -march=native)");
#endif
}
