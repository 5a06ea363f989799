// A Llama-family model's decoder layers, every linear in GGUF blocks (block_matmul.cpp), run as
// one call over a batch: the same kernels, in the same order, as the Python modules call them
// one by one (models.fused_layers), so the result is the same to the bit.
#pragma once

#include "aten.h"

#include <vector>

class FusedLayers {
 public:
  FusedLayers(int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, double scale,
              at::Tensor cos, at::Tensor sin);

  // linears: q/k/v, o, gate/up, down, each as its parts' (codes, scales, subs) in row order;
  // kinds: each part's (bits, mode, activation terms); caches: the layer's K and V in the
  // head-major pool.
  void add_layer(at::Tensor input_norm, at::Tensor post_norm,
                 std::vector<std::vector<at::Tensor>> linears,
                 std::vector<std::vector<int64_t>> kinds, at::Tensor k_cache,
                 at::Tensor v_cache);

  // x: [tokens, hidden], the embeddings; locations / lens / rows: decode_attention's. Returns
  // the last layer's (output, residual), as DecoderLayer returns them.
  std::vector<at::Tensor> run(at::Tensor x, at::Tensor positions, at::Tensor out_loc,
                              at::Tensor locations, at::Tensor lens, at::Tensor rows) const;

 private:
  struct Part {
    at::Tensor codes, scales, subs;
    int64_t bits, mode, terms;
  };
  using Linear = std::vector<Part>;
  struct Layer {
    at::Tensor input_norm, post_norm, k_cache, v_cache;
    Linear qkv, o, gate_up, down;
  };

  static at::Tensor matmul(const at::Tensor& x, const Linear& linear);

  int64_t heads_, kv_heads_, head_dim_;
  double eps_, scale_;
  at::Tensor cos_, sin_;
  std::vector<Layer> layers_;
};
