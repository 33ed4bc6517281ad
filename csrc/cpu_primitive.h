// The shape every tensorfold primitive shares: a CPU-only MLX primitive whose eval_cpu
// allocates the output and runs one task on the CPU stream's encoder (inputs held by weak
// copies, as MLX's own CPU primitives do), and whose eval_gpu refuses: the GPU faces are
// mx.fast kernels reached through tensorfold.kernels, never this primitive.
#pragma once

#include <functional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"

namespace tensorfold {

class CpuPrimitive : public mlx::core::UnaryPrimitive {
 public:
  // The work of one evaluation: (inputs, output); the output is already allocated and
  // non-empty. Captures only values (never the primitive), so it may outlive it.
  using Task = std::function<void(std::vector<mlx::core::array>&, mlx::core::array&)>;

  CpuPrimitive(mlx::core::Stream s, const char* op) : UnaryPrimitive(s), op_(op) {}

  void eval_cpu(const std::vector<mlx::core::array>& inputs, mlx::core::array& out) final {
    namespace mx = mlx::core;
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    std::vector<mx::array> ins;
    ins.reserve(inputs.size());
    for (const auto& a : inputs) {
      enc.set_input_array(a);
      ins.push_back(mx::array::unsafe_weak_copy(a));
    }
    enc.set_output_array(out);
    enc.dispatch([ins = std::move(ins), out = mx::array::unsafe_weak_copy(out),
                  task = make_task()]() mutable {
      if (out.size() == 0) return;
      task(ins, out);
    });
  }

  void eval_gpu(const std::vector<mlx::core::array>&, mlx::core::array&) final {
    throw std::runtime_error(std::string("tensorfold ") + op_ +
                             ": the C++ primitive is CPU only; GPU faces go through "
                             "tensorfold.kernels." + op_ + " (CUDA / Metal kernels).");
  }

 protected:
  virtual Task make_task() const = 0;

 private:
  const char* op_;
};

}  // namespace tensorfold
