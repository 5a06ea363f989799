// A hybrid model's linear layers over spans of tokens (hybrid_state.cpp, where each is
// described), for the bindings (cpu_kernels.cpp) and the fused layers (fused_layers.cpp).
#pragma once

#include "aten.h"

at::Tensor gated_delta_spans(at::Tensor mixed, at::Tensor conv_weight, at::Tensor conv_states,
                             at::Tensor ssm_states, at::Tensor rows, at::Tensor counts,
                             at::Tensor decay, at::Tensor beta, int64_t num_k_heads);
at::Tensor gated_delta_layer(at::Tensor mixed, at::Tensor z, at::Tensor b, at::Tensor a,
                             at::Tensor conv_weight, at::Tensor conv_states,
                             at::Tensor ssm_states, at::Tensor rows, at::Tensor counts,
                             at::Tensor dt_bias, at::Tensor log_a, at::Tensor norm_weight,
                             double eps, int64_t num_k_heads, bool tiled);
at::Tensor mamba2_spans(at::Tensor proj, at::Tensor conv_weight,
                        c10::optional<at::Tensor> conv_bias, at::Tensor conv_states,
                        at::Tensor ssm_states, at::Tensor rows, at::Tensor counts,
                        at::Tensor dt_bias, at::Tensor log_a, at::Tensor D,
                        at::Tensor norm_weight, int64_t groups, double dt_min, double dt_max,
                        double eps);
