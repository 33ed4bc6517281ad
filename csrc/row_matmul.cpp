// row_matmul: CPU face. x @ w^T with w [N, K] in f32/bf16/f16, through the fixed-order GEMM
// of cpu_rowgemm.h (the "loader" widens a slice of a weight row to fp32, exactly).
#include <memory>
#include <sstream>

#include "cpu_common.h"
#include "cpu_primitive.h"
#include "cpu_rowgemm.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "row_kernels.h"

namespace mx = mlx::core;

namespace tensorfold {

namespace {

using namespace tensorfold::cpu;

class RowMatmul : public CpuPrimitive {
 public:
  explicit RowMatmul(mx::Stream s) : CpuPrimitive(s, "row_matmul") {}

  Task make_task() const override {
    return [](std::vector<mx::array>& in, mx::array& out) {
      const mx::array& x = in[0];
      const mx::array& w = in[1];
      const int64_t K = x.shape(-1);
      const int64_t R = K ? static_cast<int64_t>(x.size()) / K : 0;
      const int64_t N = out.shape(-1);
      if (R == 0 || N == 0) return;
      const FType xt = ftype_of(x.dtype(), "x");
      const FType wt = ftype_of(w.dtype(), "w");
      std::vector<float> xbuf;
      const float* xf = rows_as_f32(x, xt, xbuf);
      const char* wp = static_cast<const char*>(w.data<void>());
      const int64_t esz = (wt == FType::f32) ? 4 : 2;
      auto loader = [&](int64_t n, int64_t k0, int64_t len, float* dst) {
        convert_to_f32(wp + (n * K + k0) * esz, wt, len, dst);
      };
      row_gemm(xf, R, K, N, out.data<void>(), xt, loader);
    };
  }

  const char* name() const override { return "RowMatmul"; }

  bool is_equivalent(const mx::Primitive&) const override { return true; }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    auto shape = inputs[0].shape();
    shape.back() = inputs[1].shape(0);
    return {shape};
  }
};

} // namespace

mx::array row_matmul(const mx::array& x, const mx::array& w) {
  if (w.ndim() != 2) throw std::invalid_argument("row_matmul: w must be 2-D [N, K]");
  if (x.ndim() < 1 || x.shape(-1) != w.shape(1)) {
    std::ostringstream msg;
    msg << "row_matmul: x's last dimension must equal w.shape[1] (" << w.shape(1) << ")";
    throw std::invalid_argument(msg.str());
  }
  if (w.shape(1) % 16 != 0 || w.shape(1) == 0) {
    throw std::invalid_argument("row_matmul: K must be a positive multiple of 16");
  }
  cpu::ftype_of(x.dtype(), "x");
  cpu::ftype_of(w.dtype(), "w");
  auto s = cpu::cpu_stream();
  auto shape = x.shape();
  shape.back() = w.shape(0);
  return mx::array(shape, x.dtype(), std::make_shared<RowMatmul>(s),
                   {mx::contiguous(x, false, s), mx::contiguous(w, false, s)});
}

} // namespace tensorfold
