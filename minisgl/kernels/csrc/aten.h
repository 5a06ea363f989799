// The part of ATen the kernel sources use, in place of torch/extension.h (pybind11 and torch's
// whole C++ API), which took most of each source's compile time. cpu_kernels.cpp, which binds,
// adds only torch's pybind11 type casters.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>
