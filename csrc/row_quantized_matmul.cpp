// row_quantized_matmul: CPU face. MLX affine quantisation, w_hat = fma(scale, q, bias) in
// fp32, then the fixed-order GEMM of cpu_rowgemm.h. Row-exact by construction: the
// arithmetic of out[r, n] depends only on x[r, :], column n's weights and K.
//
// Packing (same as MLX): the bytes of a row of w form a little-endian bit stream and
// element k occupies bits [k*bits, (k+1)*bits). For 2/4/8 bits this is "uint32 words,
// lowest bits first"; 3/5/6 bits pack 8 (3, 5) or 4 (6) values into 3/5/3 bytes, so
// values straddle bytes and words -- still the same bit stream.
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

template <int bits>
void run_qmm(const float* xf, int64_t R, int64_t K, int64_t N, const uint8_t* w,
             const void* scales, const void* biases, FType st, int group_size, void* out,
             FType ot) {
  const int64_t row_bytes = K * bits / 8;
  const int64_t n_groups = K / group_size;
  auto loader = [&](int64_t n, int64_t k0, int64_t len, float* dst) {
    dequant_row<bits>(w + n * row_bytes, scales, biases, st, n * n_groups, group_size, k0,
                      len, dst);
  };
  row_gemm(xf, R, K, N, out, ot, loader);
}

class RowQuantizedMatmul : public CpuPrimitive {
 public:
  RowQuantizedMatmul(mx::Stream s, int group_size, int bits)
      : CpuPrimitive(s, "row_quantized_matmul"), group_size_(group_size), bits_(bits) {}

  Task make_task() const override {
    return [gs = group_size_, bits = bits_](std::vector<mx::array>& in, mx::array& out) {
      const mx::array& x = in[0];
      const mx::array& w = in[1];
      const mx::array& scales = in[2];
      const mx::array& biases = in[3];
      const int64_t K = x.shape(-1);
      const int64_t R = K ? static_cast<int64_t>(x.size()) / K : 0;
      const int64_t N = out.shape(-1);
      if (R == 0 || N == 0) return;
      const FType xt = ftype_of(x.dtype(), "x");
      const FType st = ftype_of(scales.dtype(), "scales");
      std::vector<float> xbuf;
      const float* xf = rows_as_f32(x, xt, xbuf);
      const uint8_t* wp = reinterpret_cast<const uint8_t*>(w.data<uint32_t>());
      const void* sp = scales.data<void>();
      const void* bp = biases.data<void>();
      void* op = out.data<void>();
      switch (bits) {
        case 2: run_qmm<2>(xf, R, K, N, wp, sp, bp, st, gs, op, xt); break;
        case 3: run_qmm<3>(xf, R, K, N, wp, sp, bp, st, gs, op, xt); break;
        case 4: run_qmm<4>(xf, R, K, N, wp, sp, bp, st, gs, op, xt); break;
        case 5: run_qmm<5>(xf, R, K, N, wp, sp, bp, st, gs, op, xt); break;
        case 6: run_qmm<6>(xf, R, K, N, wp, sp, bp, st, gs, op, xt); break;
        case 8: run_qmm<8>(xf, R, K, N, wp, sp, bp, st, gs, op, xt); break;
        default: throw std::invalid_argument("row_quantized_matmul: unsupported bits");
      }
    };
  }

  const char* name() const override { return "RowQuantizedMatmul"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const RowQuantizedMatmul&>(other);
    return group_size_ == o.group_size_ && bits_ == o.bits_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    auto shape = inputs[0].shape();
    shape.back() = inputs[1].shape(0);
    return {shape};
  }

 private:
  int group_size_;
  int bits_;
};

} // namespace

mx::array row_quantized_matmul(const mx::array& x, const mx::array& w,
                               const mx::array& scales, const mx::array& biases,
                               int group_size, int bits) {
  auto fail = [](const std::string& msg) {
    throw std::invalid_argument("row_quantized_matmul: " + msg);
  };
  if (bits != 2 && bits != 3 && bits != 4 && bits != 5 && bits != 6 && bits != 8) {
    fail("bits must be one of 2, 3, 4, 5, 6, 8");
  }
  if (group_size != 32 && group_size != 64 && group_size != 128) {
    fail("group_size must be 32, 64 or 128");
  }
  if (w.dtype() != mx::uint32 || w.ndim() != 2) fail("w must be a 2-D uint32 array");
  if (x.ndim() < 1) fail("x must have at least one dimension");
  const int64_t N = w.shape(0);
  const int64_t K = static_cast<int64_t>(w.shape(1)) * 32 / bits;
  if (x.shape(-1) != K) {
    std::ostringstream msg;
    msg << "x's last dimension " << x.shape(-1) << " does not match w (K=" << K << ")";
    fail(msg.str());
  }
  if (K % group_size != 0 || K == 0) fail("K must be a positive multiple of group_size");
  if (scales.ndim() != 2 || scales.shape(0) != N || scales.shape(1) != K / group_size ||
      biases.shape() != scales.shape()) {
    fail("scales and biases must be [N, K / group_size]");
  }
  cpu::ftype_of(x.dtype(), "x");
  cpu::ftype_of(scales.dtype(), "scales");
  if (biases.dtype() != scales.dtype()) fail("biases must have the dtype of scales");
  auto s = cpu::cpu_stream();
  auto xc = mx::contiguous(x, false, s);
  auto wc = mx::contiguous(w, false, s);
  auto sc = mx::contiguous(scales, false, s);
  auto bc = mx::contiguous(biases, false, s);
  auto shape = x.shape();
  shape.back() = static_cast<int>(N);
  return mx::array(shape, x.dtype(),
                   std::make_shared<RowQuantizedMatmul>(s, group_size, bits),
                   {xc, wc, sc, bc});
}

} // namespace tensorfold
