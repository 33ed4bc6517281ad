// Row-exact ops (see docs/kernels.md for the contract). CPU faces live in csrc/*.cpp,
// CUDA faces in csrc/cuda/, Metal faces in metal/.
#pragma once

#include <nanobind/nanobind.h>

namespace tensorfold {
void register_row_ops(nanobind::module_& m);
} // namespace tensorfold
