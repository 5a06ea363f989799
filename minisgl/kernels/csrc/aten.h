// The part of ATen the kernel sources use. torch/extension.h (pybind11, the whole C++ API)
// costs most of a source's compile time; only cpu_kernels.cpp, which binds, includes it.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
