// The one-row program: a decode step of one token (one stream) through the fused layers in a
// single parallel region, on buffers allocated once, without ATen between the kernels.
//
// Why: at one row each kernel's work is a few microseconds, and run()'s ATen glue around it
// (an output allocated per op, views, reference counts, a parallel region forked per linear)
// runs serially on the engine thread while the other threads wait (BENCHMARKS.md, "One stream
// at the bandwidth limit"). Here the threads stay in one region and meet at a barrier after
// each linear and after the attention: 5 a layer.
//
// Every value is computed by the same row kernels run() reaches (row_kernels.h), from the same
// inputs, so the step's outputs equal run()'s to the bit. A linear's output blocks, and the
// attention's KV heads, are split over the threads; the row-sized work before a linear (the
// norm, silu(gate) * up, the activations' quantization) each thread repeats for itself, which
// costs less than a barrier. The residual alternates between two buffers so that one thread
// can write the new one while the others still read the old. A linear's parts are in
// quant_matmul's layout or block_matmul's (any GGUF block type), one linear's in either or both.
#include "fused_layers.h"
#include "row_kernels.h"

#include <omp.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

using bf16 = at::BFloat16;

namespace {

// A linear's part: in quant_matmul's layout (blocks of 16 outputs, `block_bytes` of codes per
// group of 32 inputs) or, `block`, in block_matmul's (BlockWeight's blocks of 8).
struct RowPart {
  const uint8_t* codes;
  const at::Half* dm;
  int64_t blocks, block_bytes;
  bool block;
  BlockWeight weight;
  int64_t codes_per_block;  // bytes, every group's
  int64_t outputs() const { return blocks * (block ? 8 : 16); }
};

struct RowLinear {
  std::vector<RowPart> parts;
  std::vector<BlockWeight> block_weights;  // the block parts' (what their input is quantized for)
  int64_t k, n;  // inputs, outputs (the parts' together)
  bool quant_parts = false;
};

struct RowSublayer {
  bool attention;
  const bf16* norm;
  RowLinear in, out;
  void* k_cache = nullptr;  // [kv_heads, pool, dim], bfloat16 or int8 (with scales)
  void* v_cache = nullptr;
  float* k_scales = nullptr;
  float* v_scales = nullptr;
  bool rotary = false;
};

// Each thread's own: the norm's carried residual and output, one linear's input quantized,
// silu(gate) * up, the attention's scratch.
struct RowScratch {
  std::vector<bf16> carry, normed, act;
  std::vector<int8_t> q, r;
  std::vector<float> scale, sum, norm_row, probs, maxima, sums;
  BlockRowActivations block;  // the block parts' input
};

// x ([k]) quantized into the thread's activations, as `linear`'s parts read them.
void quantize(RowScratch& own, const bf16* x, const RowLinear& linear, int64_t terms) {
  if (linear.quant_parts)
    quant_row_activations(x, linear.k, terms, own.q.data(), own.r.data(), own.scale.data(),
                          own.sum.data());
  if (!linear.block_weights.empty())
    own.block.quantize(x, linear.k, terms, linear.block_weights.data(),
                       static_cast<int64_t>(linear.block_weights.size()));
}

// One KV head's new K and V row into its pages (int8 ones with their scales), then its
// query heads' attention over the token's locations.
template <typename C>
void attend_kv_head(const RowSublayer& layer, int64_t h, int64_t pool, int64_t slot,
                    const bf16* q, const bf16* k, const bf16* v, const int64_t* loc,
                    int64_t len, int64_t group, int64_t d, float scale, RowScratch& own,
                    bf16* out) {
  C* k_pages = static_cast<C*>(layer.k_cache) + h * pool * d;
  C* v_pages = static_cast<C*>(layer.v_cache) + h * pool * d;
  const float* k_scales = nullptr;
  const float* v_scales = nullptr;
  if constexpr (std::is_same_v<C, int8_t>) {
    int8_kv_row<bf16>(k, k_pages + slot * d, layer.k_scales + h * pool + slot, d);
    int8_kv_row<bf16>(v, v_pages + slot * d, layer.v_scales + h * pool + slot, d);
    k_scales = layer.k_scales + h * pool;
    v_scales = layer.v_scales + h * pool;
  } else {
    std::memcpy(k_pages + slot * d, k, d * sizeof(bf16));
    std::memcpy(v_pages + slot * d, v, d * sizeof(bf16));
  }
  decode_row_task<C>(q, k_pages, v_pages, k_scales, v_scales, loc, len, group, d, scale,
                     own.probs.data(), own.maxima.data(), own.sums.data(), out);
}

// This thread's share of a linear's output blocks, by weight bytes whatever part they are in:
// fn(part, begin, end, the part's first output) for each part.
template <typename Fn>
void for_share(const RowLinear& linear, int thread, int threads, Fn fn) {
  int64_t total = 0;
  for (const RowPart& p : linear.parts) total += p.blocks * p.codes_per_block;
  const int64_t from = total * thread / threads, to = total * (thread + 1) / threads;
  int64_t start = 0, first_output = 0;
  for (const RowPart& p : linear.parts) {
    const int64_t per_block = p.codes_per_block;
    // the blocks whose first byte lies in [from, to)
    const auto first_at = [&](int64_t byte) {
      return std::clamp<int64_t>((byte - start + per_block - 1) / per_block, 0, p.blocks);
    };
    fn(p, first_at(from), first_at(to), first_output);
    start += p.blocks * per_block;
    first_output += p.outputs();
  }
}

// A linear of the row `a` quantized: this thread's share, written to out ([n]).
void row_linear(const RowLinear& linear, const RowScratch& a, int64_t terms, int thread,
                int threads, bf16* out) {
  for_share(linear, thread, threads, [&](const RowPart& p, int64_t begin, int64_t end,
                                         int64_t first_output) {
    if (p.block)
      a.block.blocks(p.weight, terms, begin, end, out + first_output);
    else
      quant_row_blocks(a.q.data(), a.r.data(), a.scale.data(), a.sum.data(), linear.k, terms,
                       p.codes, p.dm, p.block_bytes, begin, end, out + first_output);
  });
}

}  // namespace

bool vnni_available();     // quant_matmul.cpp
bool block_kernel_vnni();  // block_matmul.cpp

struct FusedLayers::RowPlan {
  std::vector<RowSublayer> sublayers;
  int64_t hidden = 0, terms = 0, pool = 0;
  int64_t widest_k = 0, widest_act = 0;  // a linear's input, silu(gate) * up
  bool int8_pages = false;
  // shared: the sublayer's output, the residual (two, in turn), q/k/v, the attention's
  // output, (gate/)up
  std::vector<bf16> x, residual[2], qkv, attended, up;
  std::vector<RowScratch> scratch;  // a thread's each
};

namespace {

// The index a [1] int32 or int64 tensor holds.
int64_t only_index(const at::Tensor& t) {
  return t.scalar_type() == at::kLong ? t.data_ptr<int64_t>()[0] : t.data_ptr<int32_t>()[0];
}

}  // namespace

FusedLayers::RowPlan* FusedLayers::row_plan() const {
  if (row_plan_for_ == sublayers_.size()) return row_plan_.get();
  row_plan_for_ = sublayers_.size();
  row_plan_.reset();
  if (!vnni_available() || sublayers_.empty() || (head_dim_ != 64 && head_dim_ != 128) ||
      heads_ % kv_heads_ != 0 || query_scale_ != 1.0 || residual_multiplier_ != 1.0 ||
      (cos_.has_value() && (cos_->scalar_type() != at::kFloat || !cos_->is_contiguous() ||
                            !sin_->is_contiguous() || 2 * cos_->size(1) > head_dim_)))
    return nullptr;
  auto plan = std::make_shared<RowPlan>();
  // every part in quant_matmul's layout or block_matmul's, one input width and one `terms`,
  // else nullopt
  const auto row_linear_of = [&](const Linear& parts) -> c10::optional<RowLinear> {
    RowLinear linear{{}, {}, 0, 0};
    for (const Part& p : parts) {
      const bool block = p.mode != kQuantLayout;
      if (p.codes.scalar_type() != at::kByte || p.codes.dim() != 3 ||
          !p.codes.is_contiguous() || p.scales.scalar_type() != at::kHalf ||
          !p.scales.is_contiguous() || (p.terms != 1 && p.terms != 2) ||
          (plan->terms != 0 && p.terms != plan->terms) || (block && !block_kernel_vnni()) ||
          (!block && p.codes.size(2) != 256 && p.codes.size(2) != 512))
        return c10::nullopt;
      plan->terms = p.terms;
      const int64_t k = p.codes.size(1) * 32;
      if (linear.k != 0 && k != linear.k) return c10::nullopt;
      linear.k = k;
      RowPart part{p.codes.data_ptr<uint8_t>(), p.scales.data_ptr<at::Half>(), p.codes.size(0),
                   p.codes.size(2), block, {}, p.codes.size(1) * p.codes.size(2)};
      if (block) {
        part.weight = block_weight(p.codes, p.scales, p.subs, p.bits, p.mode);
        linear.block_weights.push_back(part.weight);
      }
      linear.quant_parts = linear.quant_parts || !block;
      linear.n += part.outputs();
      linear.parts.push_back(part);
    }
    return linear;
  };
  const int64_t q_width = heads_ * head_dim_, kv_width = kv_heads_ * head_dim_;
  int64_t widest_in = 0;
  for (const Sublayer& layer : sublayers_) {
    const bool attention = layer.kind == Kind::attention;
    if ((!attention && (layer.kind != Kind::mlp || layer.relu2)) ||
        (attention && (layer.gated || layer.q_norm.has_value())) ||
        layer.norm.scalar_type() != at::kBFloat16 || !layer.norm.is_contiguous() ||
        (plan->hidden != 0 && layer.norm.numel() != plan->hidden))
      return nullptr;
    plan->hidden = layer.norm.numel();
    auto in = row_linear_of(layer.in), out = row_linear_of(layer.out);
    if (!in || !out || in->k != plan->hidden || out->n != plan->hidden) return nullptr;
    RowSublayer row{attention, layer.norm.data_ptr<bf16>(), *in, *out};
    if (attention) {
      const bool int8 = layer.k_cache.scalar_type() == at::kChar;
      for (const auto& cache : {layer.k_cache, layer.v_cache})
        if (!cache.is_contiguous() || cache.dim() != 3 || cache.size(0) != kv_heads_ ||
            cache.size(2) != head_dim_ || cache.scalar_type() != layer.k_cache.scalar_type() ||
            (!int8 && cache.scalar_type() != at::kBFloat16) ||
            (plan->pool != 0 && cache.size(1) != plan->pool) ||
            (plan->pool != 0 && int8 != plan->int8_pages))
          return nullptr;
      if (int8 != (layer.k_scales.has_value() && layer.v_scales.has_value()) ||
          in->n != q_width + 2 * kv_width || out->k != q_width)
        return nullptr;
      plan->pool = layer.k_cache.size(1);
      plan->int8_pages = int8;
      row.k_cache = layer.k_cache.data_ptr();
      row.v_cache = layer.v_cache.data_ptr();
      if (int8) {
        for (const auto& s : {*layer.k_scales, *layer.v_scales})
          if (s.scalar_type() != at::kFloat || !s.is_contiguous() ||
              s.numel() != kv_heads_ * plan->pool)
            return nullptr;
        row.k_scales = layer.k_scales->data_ptr<float>();
        row.v_scales = layer.v_scales->data_ptr<float>();
      }
      row.rotary = layer.rotary && cos_.has_value();
    } else {
      if (in->n != 2 * out->k) return nullptr;
      plan->widest_act = std::max(plan->widest_act, out->k);
    }
    widest_in = std::max(widest_in, in->n);
    plan->widest_k = std::max({plan->widest_k, in->k, out->k});
    plan->sublayers.push_back(std::move(row));
  }
  if (plan->pool == 0) return nullptr;  // no attention layer
  for (auto* buffer : {&plan->x, &plan->residual[0], &plan->residual[1]})
    buffer->resize(plan->hidden);
  plan->qkv.resize(q_width + 2 * kv_width);
  plan->attended.resize(q_width);
  plan->up.resize(widest_in);
  row_plan_ = plan;
  return row_plan_.get();
}

bool FusedLayers::one_row_applies() const { return row_plan() != nullptr; }

c10::optional<std::vector<at::Tensor>> FusedLayers::run_one_row(
    const at::Tensor& x, const at::Tensor& positions, const at::Tensor& out_loc,
    const at::Tensor& locations, const at::Tensor& lens, const at::Tensor& rows) const {
  RowPlan* plan = row_plan();
  const auto index = [](const at::Tensor& t) {
    return t.numel() == 1 && (t.scalar_type() == at::kLong || t.scalar_type() == at::kInt);
  };
  if (plan == nullptr || x.scalar_type() != at::kBFloat16 || !x.is_contiguous() ||
      x.dim() != 2 || x.size(0) != 1 || x.size(1) != plan->hidden ||
      locations.scalar_type() != at::kLong || !locations.is_contiguous() ||
      locations.dim() != 2 || !index(positions) || !index(out_loc) || !index(lens) ||
      (rows.numel() != 0 && !index(rows)))
    return c10::nullopt;
  const int64_t position = only_index(positions), slot = only_index(out_loc),
                len = only_index(lens), row = rows.numel() == 0 ? 0 : only_index(rows),
                max_len = locations.size(1);
  TORCH_CHECK(slot >= 0 && slot < plan->pool, "KV location out of range");
  TORCH_CHECK(row >= 0 && row < locations.size(0) && len >= 1 && len <= max_len,
              "a decode row's locations out of range");
  TORCH_CHECK(!cos_.has_value() || (position >= 0 && position < cos_->size(0)),
              "a position past the RoPE tables");
  const int64_t d = head_dim_, group = heads_ / kv_heads_, hidden = plan->hidden,
                q_width = heads_ * d, kv_width = kv_heads_ * d, terms = plan->terms;
  const int64_t* loc = locations.data_ptr<int64_t>() + row * max_len;
  const int64_t half = cos_.has_value() ? cos_->size(1) : 0;
  const float* cos = cos_.has_value() ? cos_->data_ptr<float>() + position * half : nullptr;
  const float* sin = cos_.has_value() ? sin_->data_ptr<float>() + position * half : nullptr;
  const int threads = std::max(1, at::get_num_threads());
  if (plan->scratch.size() < static_cast<size_t>(threads)) plan->scratch.resize(threads);
  const int64_t probs = group * ((len + 15) / 16 * 16);
  for (RowScratch& s : plan->scratch) {
    if (s.carry.size() != static_cast<size_t>(hidden)) {
      s.carry.resize(hidden);
      s.normed.resize(hidden);
      s.norm_row.resize(hidden);
      s.act.resize(plan->widest_act);
      s.q.resize(plan->widest_k);
      s.r.resize(plan->widest_k);
      s.scale.resize(plan->widest_k / 32);
      s.sum.resize(plan->widest_k / 32);
      s.maxima.resize(group);
      s.sums.resize(group);
    }
    if (s.probs.size() < static_cast<size_t>(probs)) s.probs.resize(probs);
  }
  std::memcpy(plan->residual[0].data(), x.data_ptr(), hidden * sizeof(bf16));
  const float eps = static_cast<float>(eps_), scale = static_cast<float>(scale_);

#pragma omp parallel num_threads(threads)
  {
    const int thread = omp_get_thread_num(), team = omp_get_num_threads();
    RowScratch& own = plan->scratch[thread];
    int residual = 0;
    bool first = true;
    // this sublayer's norm into own.normed, quantized into own's activations
    const auto norm = [&](const RowSublayer& layer) {
      if (first) {  // the embeddings: the residual as it is
        norm_row<bf16>(plan->residual[0].data(), nullptr, nullptr,
                       layer.norm, own.normed.data(), hidden, eps, own.norm_row.data());
        first = false;
      } else {
        bf16* carry = thread == 0 ? plan->residual[residual ^ 1].data() : own.carry.data();
        norm_row<bf16>(plan->x.data(), plan->residual[residual].data(), carry, layer.norm,
                       own.normed.data(), hidden, eps, own.norm_row.data());
        residual ^= 1;
      }
      quantize(own, own.normed.data(), layer.in, terms);
    };
    for (const RowSublayer& layer : plan->sublayers) {
      norm(layer);
      if (layer.attention) {
        row_linear(layer.in, own, terms, thread, team, plan->qkv.data());
#pragma omp barrier
        // KV heads in contiguous shares, as decode_attention's tasks
        const int64_t share = (kv_heads_ + team - 1) / team;
        for (int64_t h = thread * share; h < std::min(kv_heads_, (thread + 1) * share); ++h) {
          bf16* q = plan->qkv.data() + h * group * d;
          bf16* k = plan->qkv.data() + q_width + h * d;
          const bf16* v = plan->qkv.data() + q_width + kv_width + h * d;
          if (layer.rotary) {
            rotate_row(q, group, d, 2 * half, cos, sin);
            rotate_row(k, 1, d, 2 * half, cos, sin);
          }
          bf16* out = plan->attended.data() + h * group * d;
          if (plan->int8_pages)
            attend_kv_head<int8_t>(layer, h, plan->pool, slot, q, k, v, loc, len, group, d,
                                   scale, own, out);
          else
            attend_kv_head<bf16>(layer, h, plan->pool, slot, q, k, v, loc, len, group, d,
                                 scale, own, out);
        }
#pragma omp barrier
        quantize(own, plan->attended.data(), layer.out, terms);
        row_linear(layer.out, own, terms, thread, team, plan->x.data());
#pragma omp barrier
      } else {
        row_linear(layer.in, own, terms, thread, team, plan->up.data());
#pragma omp barrier
        const int64_t width = layer.out.k;
        silu_mul_row(static_cast<const bf16*>(plan->up.data()), own.act.data(), width);
        quantize(own, own.act.data(), layer.out, terms);
        row_linear(layer.out, own, terms, thread, team, plan->x.data());
#pragma omp barrier
      }
    }
  }
  ++one_row_steps_;
  auto out = at::empty(x.sizes(), x.options()), carried = at::empty(x.sizes(), x.options());
  std::memcpy(out.data_ptr(), plan->x.data(), hidden * sizeof(bf16));
  // every sublayer after the first swaps the residual's buffer
  const size_t last = (plan->sublayers.size() - 1) % 2;
  std::memcpy(carried.data_ptr(), plan->residual[last].data(), hidden * sizeof(bf16));
  return std::vector<at::Tensor>{out, carried};
}
