// What the AVX-512 VNNI kernels (quant_matmul.cpp, int8_matmul.cpp) share: MINISGL_VNNI is
// defined where the compiler targets AVX-512 F / BW / VNNI / BF16 (-march=native on such a CPU).
#pragma once

#include "aten.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && \
    defined(__AVX512BF16__)
#define MINISGL_VNNI 1
#include <immintrin.h>

// acc += the 4-byte dot products of w (unsigned) and x (signed) per lane, in place.
// NOTE: GCC 12 wraps _mm512_dpbusd_epi32 on int8_matmul's array of accumulators in register
// copies (two moves per multiply-add; 300 vs 410 GMAC/s per core measured on a Zen 5 EPYC): the
// asm pins each accumulator to one register. (quant_matmul.cpp measured slower with it.)
inline void dpbusd(__m512i& acc, __m512i w, __m512i x) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(w), "v"(x));
}

// 16 bfloat16 values (their bits) widened to float32 (a bfloat16 is the top half of one).
inline __m512 widen_bf16(__m256i bits) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

inline __m512 load_bf16(const at::BFloat16* p) {
  return widen_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#endif
