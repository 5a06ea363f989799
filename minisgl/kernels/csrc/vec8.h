// Eight-float vectors (GCC vector extensions, AVX2 width) and loads from float32 or bfloat16,
// shared by the kernels that multiply in float32 whatever the weights' dtype.
#pragma once

#include "aten.h"

#include <cstdint>
#include <cstring>

typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));
typedef uint16_t u16x8 __attribute__((vector_size(16), aligned(2)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));

inline v8 load8(const float* p) { return *reinterpret_cast<const v8u*>(p); }

inline v8 load8(const at::BFloat16* p) {
  const u32x8 wide = __builtin_convertvector(*reinterpret_cast<const u16x8*>(p), u32x8) << 16;
  v8 out;
  std::memcpy(&out, &wide, sizeof(out));
  return out;
}

inline float scalar(const float* p, int64_t i) { return p[i]; }
inline float scalar(const at::BFloat16* p, int64_t i) { return static_cast<float>(p[i]); }

inline void store8(float* p, v8 v) { *reinterpret_cast<v8u*>(p) = v; }

// Rounded to the nearest bfloat16, ties to even (as c10::BFloat16 rounds; no NaN expected).
inline void store8(at::BFloat16* p, v8 v) {
  u32x8 bits;
  std::memcpy(&bits, &v, sizeof(bits));
  const u32x8 rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  *reinterpret_cast<u16x8*>(p) = __builtin_convertvector(rounded, u16x8);
}

inline void put(float* p, int64_t i, float v) { p[i] = v; }
inline void put(at::BFloat16* p, int64_t i, float v) { p[i] = static_cast<at::BFloat16>(v); }
