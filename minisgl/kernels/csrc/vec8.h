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
