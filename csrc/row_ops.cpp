// Python bindings of the row-exact kernels' CPU primitives (tensorfold._ext.row_*).
// The Python wrappers in tensorfold.kernels pick the CUDA / Metal / CPU face.
#include "row_ops.h"

#include "cpu_common.h"
#include "row_kernels.h"

namespace nb = nanobind;
using namespace nb::literals;
namespace mx = mlx::core;

namespace tensorfold {

void register_row_ops(nanobind::module_& m) {
  m.def("row_quantized_matmul", &row_quantized_matmul, "x"_a, "w"_a, "scales"_a, "biases"_a,
        "group_size"_a, "bits"_a,
        "Row-exact x @ dequantize(w).T (MLX affine format, transpose=True), CPU primitive.");
  m.def("row_matmul", &row_matmul, "x"_a, "w"_a, "Row-exact x @ w.T, CPU primitive.");
  m.def("row_attention", &row_attention, "q"_a, "k"_a, "v"_a, "offset"_a, "scale"_a,
        "Row-exact causal GQA attention over a KV buffer, CPU primitive. offset: int32 "
        "scalar array.");
  m.def("sparse_attention", &sparse_attention, "q"_a, "k"_a, "v"_a, "indices"_a, "offset"_a,
        "scale"_a, "Row-exact selected-key (sparse) GQA attention, CPU primitive.");
  register_row_expert_matmul(m);  // csrc/row_expert_matmul.cpp
  m.def("row_cpu_threads", &cpu::num_threads, "Threads used by the CPU row kernels.");
}

} // namespace tensorfold
