// One row's (one token's) kernels, each defined once and never inlined: the batched kernels
// loop over them, and the one-row decode program (fused_one_row.cpp) calls them directly, so
// that the two run the same machine code and give the same bits (-ffast-math lets a compiler
// vectorise a reduction or contract a multiply-add differently in each place it inlines one).
#pragma once

#include "aten.h"

#include <memory>

// cpu_kernels.cpp. T: float, at::BFloat16 or at::Half.
// out = RMSNorm(carry) * weight, where carry = x + residual (rounded to T, written to
// carry_out: the residual's own buffer in place, or another) or, without a residual, x.
// `row`: hidden floats of scratch.
template <typename T>
void norm_row(const T* x, const T* residual, T* carry_out, const T* weight, T* out,
              int64_t hidden, float eps, float* row);
// out[i] = silu(gate_up[i]) * gate_up[d + i], i < d.
template <typename T>
void silu_mul_row(const T* gate_up, T* out, int64_t d);
// "Rotate half" RoPE of one token's heads in place: the first `dim` of each head's values,
// heads `head_stride` apart; cos / sin: the token's position's rows (dim / 2 each).
template <typename T>
void rotate_row(T* x, int64_t heads, int64_t head_stride, int64_t dim, const float* cos,
                const float* sin);
// One row into an int8 KV page: codes and the row's scale (its largest magnitude / 127).
template <typename T>
void int8_kv_row(const T* x, int8_t* codes, float* scale, int64_t dim);

// quant_matmul.cpp: one row through its layout. quant_row_activations quantizes x ([k]) into
// q and, with 2 terms, r ([k] int8 each), scale and sum ([k / 32] each); quant_row_blocks then
// writes output blocks [begin, end) of a weight (codes of `block_bytes` per (block, group))
// to out[16 * begin, 16 * end).
void quant_row_activations(const at::BFloat16* x, int64_t k, int64_t terms, int8_t* q,
                           int8_t* r, float* scale, float* sum);
void quant_row_blocks(const int8_t* q, const int8_t* r, const float* scale, const float* sum,
                      int64_t k, int64_t terms, const uint8_t* codes, const at::Half* dm,
                      int64_t block_bytes, int64_t begin, int64_t end, at::BFloat16* out);

// decode_bf16.cpp: one decode token's attention over one KV head (head dim 64 or 128), as
// decode_attention runs each of its tasks. q / out: the head's `group` query heads; k / v: the
// KV head's rows of the pool (bfloat16, or int8 with k_scales / v_scales per row); loc: the
// token's `len` locations. probs: group * round_up(len, 16) floats; maxima / sums: group each.
template <typename C>
void decode_row_task(const at::BFloat16* q, const C* k, const C* v, const float* k_scales,
                     const float* v_scales, const int64_t* loc, int64_t len, int64_t group,
                     int64_t dim, float scale, float* probs, float* maxima, float* sums,
                     at::BFloat16* out);

// block_matmul.cpp: one row through its layout (every GGUF block type). A weight as its kernel
// reads it: blocks of 8 output features, `groups` groups of 32 inputs each.
struct BlockWeight {
  const uint8_t* codes;
  const at::Half* scales;
  const uint8_t* subs;
  int64_t groups;
  int64_t bits;
  int64_t mode;
  int64_t groups_per_super;  // kMins / kSixBit: groups sharing one d (and dmin)
  int64_t blocks;
};
// The operands block_matmul takes, checked as it checks them.
BlockWeight block_weight(const at::Tensor& codes, const at::Tensor& scales,
                         const at::Tensor& subs, int64_t bits, int64_t mode);

// One row's activations as a one-row block_matmul call quantizes them: quantize() for a linear
// whose parts are `weights` (one quantization that serves each of them), then blocks() writes
// output blocks [begin, end) of one of those weights to out[8 * begin, 8 * end).
class BlockRowActivations {
 public:
  BlockRowActivations();
  BlockRowActivations(BlockRowActivations&&) noexcept;
  ~BlockRowActivations();
  void quantize(const at::BFloat16* x, int64_t k, int64_t terms, const BlockWeight* weights,
                int64_t count);
  void blocks(const BlockWeight& w, int64_t terms, int64_t begin, int64_t end,
              at::BFloat16* out) const;

 private:
  struct Buffers;
  std::unique_ptr<Buffers> buffers_;
};
