// A decoder's layers, every linear in GGUF blocks (block_matmul.cpp), run as one call over a
// batch: the same kernels, in the same order, as the Python modules call them one by one
// (models.fused_layers), so the result is the same to the bit. The program is a list of
// sublayers, each an RMSNorm with the residual add and then one operation whose output (times
// the residual multiplier) feeds the next: a token mixer (attention: Llama's, Granite's and
// Nemotron-H's without RoPE, Qwen3.5's with QK-norm and an output gate; or a linear layer over
// the state pool, hybrid_state.cpp's spans: Mamba2, Gated DeltaNet), an MLP (silu(gate) * up,
// or Nemotron-H's relu² of up), or a mixture of experts (a softmax or grouped sigmoid router,
// the experts in one grouped call per part, a shared expert or none). A Llama layer is a mixer
// and an MLP or a mixture; a Nemotron-H block is one sublayer.
#pragma once

#include "aten.h"

#include <cstdint>
#include <memory>
#include <vector>

class FusedLayers {
 public:
  // cos / sin: the RoPE tables, or none (no positions); query_scale: q's factor before
  // attention (1: none); residual_multiplier: each sublayer's output's (1: none).
  FusedLayers(int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, double scale,
              c10::optional<at::Tensor> cos, c10::optional<at::Tensor> sin, double query_scale,
              double residual_multiplier);

  // A part's mode that is not a block_matmul layout's: its weight is quant_matmul.cpp's (the
  // codes, the scales and offsets as `scales`, `subs` unused).
  static constexpr int64_t kQuantLayout = -1;

  // Each add_* appends one sublayer: `norm` (its RMSNorm's weight), then its operation.
  // linears: the operation's two, each as its parts' (codes, scales, subs) in row order (their
  // outputs concatenated); kinds: each part's (bits, mode, activation terms).
  //
  // Attention: linears q/k/v and o; caches: the layer's K and V in the head-major pool (and
  // their scales, int8 pages);
  // q_norm / k_norm: per-head RMSNorm weights (QK-norm), or none; gated: q/k/v's q holds each
  // head's query then its gate, and the attention's output is scaled by sigmoid(gate) before
  // o; rotary: whether the RoPE tables apply to this layer (false: a NoPE layer among rotary
  // ones, SmolLM3's).
  void add_attention(at::Tensor norm, std::vector<std::vector<at::Tensor>> linears,
                     std::vector<std::vector<int64_t>> kinds, at::Tensor k_cache,
                     at::Tensor v_cache, c10::optional<at::Tensor> k_scales,
                     c10::optional<at::Tensor> v_scales, c10::optional<at::Tensor> q_norm,
                     c10::optional<at::Tensor> k_norm, bool gated, bool rotary);

  // A Mamba2 layer: linears in_proj, out_proj; the rest as mamba2_spans takes them
  // (conv_states / ssm_states: the layer's in the state pool).
  void add_mamba2(at::Tensor norm, std::vector<std::vector<at::Tensor>> linears,
                  std::vector<std::vector<int64_t>> kinds, at::Tensor conv_weight,
                  c10::optional<at::Tensor> conv_bias, at::Tensor conv_states,
                  at::Tensor ssm_states, at::Tensor dt_bias, at::Tensor log_a, at::Tensor D,
                  at::Tensor norm_weight, int64_t groups, double dt_min, double dt_max,
                  double norm_eps);

  // A Gated DeltaNet layer (Qwen3.5's): linears in_proj (q/k/v, z, b, a as one linear's
  // parts), out_proj; the rest as gated_delta_layer takes them.
  void add_delta_net(at::Tensor norm, std::vector<std::vector<at::Tensor>> linears,
                     std::vector<std::vector<int64_t>> kinds, at::Tensor conv_weight,
                     at::Tensor conv_states, at::Tensor ssm_states, at::Tensor dt_bias,
                     at::Tensor log_a, at::Tensor norm_weight, int64_t num_k_heads,
                     double norm_eps, bool tiled);

  // An MLP: linears (gate/)up and down; relu2: relu² of up, else silu(gate) * up.
  void add_mlp(at::Tensor norm, std::vector<std::vector<at::Tensor>> linears,
               std::vector<std::vector<int64_t>> kinds, bool relu2);

  // A mixture of experts, as layers.moe.SparseMoE and its kin run it. The router: softmax
  // (TopKRouter: its weight in the activations' dtype, a bias or none; the top k, renormalised
  // or not) or grouped sigmoid (Nemotron-H's GroupedSigmoidRouter: a float32 weight and its
  // correction bias as router_bias, the best top_groups of groups kept, scaled by `scale`).
  // experts: each expert's (gate/)up and down (codes, scales, subs), one type and shape per
  // part, with their (bits, mode, terms); relu2: relu² of up (else silu(gate) * up) in the
  // experts and the shared expert. shared: the shared expert's two linears, or
  // none; shared_gate: its sigmoid gate's weight [1, hidden] (Qwen3.5's), or none.
  void add_moe(at::Tensor norm, at::Tensor router_weight, c10::optional<at::Tensor> router_bias,
               bool softmax, int64_t top_k, int64_t groups, int64_t top_groups,
               bool renormalize, double scale, std::vector<std::vector<at::Tensor>> experts,
               std::vector<std::vector<int64_t>> expert_kinds, bool relu2,
               std::vector<std::vector<at::Tensor>> shared,
               std::vector<std::vector<int64_t>> shared_kinds,
               c10::optional<at::Tensor> shared_gate);

  // x: [tokens, hidden], the embeddings; locations / lens / rows: decode_attention's;
  // state_rows / state_counts: the batch's spans for the linear layers (the span kernels'; any
  // where there are none). Returns the last layer's (output, residual), as the modules do.
  // NOTE: one caller at a time (the engine thread): a one-row step writes the program's own
  // buffers.
  std::vector<at::Tensor> run(at::Tensor x, at::Tensor positions, at::Tensor out_loc,
                              at::Tensor locations, at::Tensor lens, at::Tensor rows,
                              at::Tensor state_rows, at::Tensor state_counts) const;

  // Whether a one-token step takes the one-row program (fused_one_row.cpp): Llama layers
  // (attention without a gate or QK-norm, a silu MLP), every linear in quant_matmul's layout or
  // block_matmul's (AVX-512 VNNI), bfloat16 or int8 KV pages, head dim 64 or 128, no query or
  // residual factor; and how many steps took it.
  bool one_row_applies() const;
  int64_t one_row_steps() const { return one_row_steps_; }

 private:
  struct Part {
    at::Tensor codes, scales, subs;
    int64_t bits, mode, terms;
  };
  using Linear = std::vector<Part>;
  // one part of every expert (block_matmul_grouped's operands)
  struct Grouped {
    std::vector<at::Tensor> codes, scales, subs;
    int64_t bits, mode, terms;
  };
  struct Mamba2 {
    at::Tensor conv_weight, conv_states, ssm_states, dt_bias, log_a, D, norm_weight;
    c10::optional<at::Tensor> conv_bias;
    int64_t groups;
    double dt_min, dt_max, eps;
  };
  struct Delta {
    at::Tensor conv_weight, conv_states, ssm_states, dt_bias, log_a, norm_weight;
    int64_t num_k_heads;
    double eps;
    bool tiled;
  };
  struct Moe {
    at::Tensor router_weight;
    c10::optional<at::Tensor> router_bias, shared_gate;
    bool softmax;
    int64_t top_k, groups, top_groups;
    bool renormalize;
    double scale;
    Grouped up, down;
    bool shared;
  };
  enum class Kind { attention, mamba2, delta, mlp, moe };
  struct Sublayer {
    at::Tensor norm;
    Kind kind;
    // attention: qkv, o; a linear layer: in_proj, out_proj; an MLP: (gate/)up, down; the
    // mixture's shared expert: (gate/)up, down
    Linear in, out;
    at::Tensor k_cache, v_cache;
    c10::optional<at::Tensor> k_scales, v_scales, q_norm, k_norm;
    bool gated = false, rotary = true, relu2 = false;
    Mamba2 mamba2;
    Delta delta;
    Moe moe;
  };

  static at::Tensor matmul(const at::Tensor& x, const Linear& linear);
  static std::vector<Linear> parsed(const std::vector<std::vector<at::Tensor>>& linears,
                                    const std::vector<std::vector<int64_t>>& kinds);
  static Grouped grouped(const std::vector<at::Tensor>& tensors,
                         const std::vector<int64_t>& kinds);
  // A sublayer of `kind` with its norm and two linears; the caller fills in the rest.
  static Sublayer sublayer(Kind kind, at::Tensor norm,
                           const std::vector<std::vector<at::Tensor>>& linears,
                           const std::vector<std::vector<int64_t>>& kinds);
  at::Tensor attention(const Sublayer& layer, const at::Tensor& x, const at::Tensor& positions,
                       const at::Tensor& out_loc, const at::Tensor& locations,
                       const at::Tensor& lens, const at::Tensor& rows) const;
  at::Tensor delta_net(const Sublayer& layer, const at::Tensor& x, const at::Tensor& state_rows,
                       const at::Tensor& state_counts) const;
  static at::Tensor mlp(const Sublayer& layer, const at::Tensor& x);
  // (weights in x's dtype, expert ids), [tokens, top_k] each
  static std::pair<at::Tensor, at::Tensor> route(const Moe& m, const at::Tensor& x);
  static at::Tensor experts(const Sublayer& layer, const at::Tensor& x);
  at::Tensor scaled(at::Tensor x) const;

  struct RowPlan;
  // One token through every sublayer in one parallel region on preallocated buffers, the same
  // row kernels (row_kernels.h) as run() calls through ATen; nullopt where the call's tensors
  // are not the program's (its dtype, shapes, index dtypes), for run() to take instead.
  c10::optional<std::vector<at::Tensor>> run_one_row(const at::Tensor& x,
                                                     const at::Tensor& positions,
                                                     const at::Tensor& out_loc,
                                                     const at::Tensor& locations,
                                                     const at::Tensor& lens,
                                                     const at::Tensor& rows) const;
  RowPlan* row_plan() const;

  int64_t heads_, kv_heads_, head_dim_;
  double eps_, scale_, query_scale_, residual_multiplier_;
  c10::optional<at::Tensor> cos_, sin_;
  std::vector<Sublayer> sublayers_;
  // built on the first one-token step (null: the program does not apply) and again when
  // sublayers were added since (row_plan_for_: how many there were)
  mutable std::shared_ptr<RowPlan> row_plan_;
  mutable size_t row_plan_for_ = SIZE_MAX;
  mutable int64_t one_row_steps_ = 0;
};
