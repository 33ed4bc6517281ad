// row_expert_matmul: CPU face. Routed-expert matmul for MoE decode, row-exact.
//
//   x [..., K] (R rows), w [E, N, K*bits/32] uint32 (+ scales / biases [E, N, K/gs]) or a
//   float w [E, N, K]; indices [..., k] int32 (same leading shape as x).
//   out [..., k, N] in x's dtype:  out[r, j, :] = x[r] @ dequant(w[indices[r, j]]).T
//
// Arithmetic of one element out[r, j, n] with e = indices[r, j]: EXACTLY the fixed order of
// cpu_rowgemm.h (the one of row_quantized_matmul / row_matmul):
//   a0, a1 = 8-lane fp32 zeros; for k in 0, 16, ..., K-16:
//     a0 = fma(w_hat[e, n, k:k+8], x[r, k:k+8], a0); a1 = fma(w_hat[e, n, k+8:k+16], x[r, k+8:k+16], a1)
//   out = hsum(a0 + a1), hsum = ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7))
//   w_hat = fma(scale, q, bias) in fp32 (quantised) or the widened weight (float).
// It depends only on x[r], expert e's column n and K: never on R, on the other rows or on
// which experts they chose, nor on the thread count. out[r, j] is bit-identical to
// row_quantized_matmul(x[r], w[e], scales[e], biases[e]) (tested).
//
// Work layout (speed only): the (r, j) pairs are bucketed by expert (counting sort, pairs
// of one expert in ascending (r, j) order); one thread-pool task per (expert, 16 output
// columns); inside a task the loop of row_gemm (4 columns dequantised per 512-wide K chunk
// into an fp32 buffer, dotted with up to 32 of the expert's rows), so each used expert's
// weights are read once per call. An index outside [0, E) gives a NaN output row.
//
// The GEMM tile (row_gemm_tile, with gathered input rows and scattered output rows) and the
// dequantising loader (dequant_row) are cpu_rowgemm.h's, shared with row_gemm.
#include <limits>
#include <memory>
#include <optional>
#include <sstream>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>

#include "cpu_common.h"
#include "cpu_primitive.h"
#include "cpu_rowgemm.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "row_kernels.h"

namespace mx = mlx::core;
namespace nb = nanobind;

namespace tensorfold {

namespace {

using namespace tensorfold::cpu;

struct Plan {
  std::vector<int64_t> rows, dst;           // pairs bucketed by expert
  std::vector<int64_t> start;               // expert e's pairs: [start[e], start[e+1])
  std::vector<int64_t> bad;                 // flat output rows with an invalid index
  std::vector<std::pair<int64_t, int64_t>> tasks;  // (expert, column tile)
};

Plan make_plan(const int32_t* idx, int64_t R, int64_t k, int64_t E, int64_t N) {
  Plan p;
  std::vector<int64_t> count(E + 1, 0);
  for (int64_t t = 0; t < R * k; ++t) {
    const int32_t e = idx[t];
    if (e >= 0 && e < E) count[e + 1] += 1;
    else p.bad.push_back(t);
  }
  for (int64_t e = 0; e < E; ++e) count[e + 1] += count[e];
  p.start = count;
  p.rows.resize(count[E]);
  p.dst.resize(count[E]);
  std::vector<int64_t> fill(count.begin(), count.end() - 1);
  for (int64_t t = 0; t < R * k; ++t) {
    const int32_t e = idx[t];
    if (e < 0 || e >= E) continue;
    p.rows[fill[e]] = t / k;
    p.dst[fill[e]] = t;
    fill[e] += 1;
  }
  const int64_t tiles = (N + kTaskCols - 1) / kTaskCols;
  for (int64_t e = 0; e < E; ++e) {
    if (p.start[e + 1] > p.start[e]) {
      for (int64_t t = 0; t < tiles; ++t) p.tasks.emplace_back(e, t);
    }
  }
  return p;
}

template <class LoaderFor>
void run_plan(const Plan& p, const float* xf, int64_t K, int64_t N, void* out, FType ot,
              const LoaderFor& loader_for) {
  parallel_for(static_cast<int64_t>(p.tasks.size()), [&](int64_t t) {
    const auto [e, tile] = p.tasks[t];
    const int64_t nt0 = tile * kTaskCols;
    const int64_t nt1 = std::min(N, nt0 + kTaskCols);
    const int64_t s = p.start[e];
    const int64_t* rows = p.rows.data() + s;
    const int64_t* dst = p.dst.data() + s;
    row_gemm_tile(xf, K, N, p.start[e + 1] - s, nt0, nt1, out, ot,
                  [rows](int64_t i) { return rows[i]; }, [dst](int64_t i) { return dst[i]; },
                  loader_for(e));
  });
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (int64_t b : p.bad) {
    for (int64_t n = 0; n < N; ++n) store_scalar(out, ot, b * N + n, nan);
  }
}

template <int bits>
void run_quant(const Plan& p, const float* xf, int64_t K, int64_t N, const uint8_t* w,
               const void* scales, const void* biases, FType st, int group_size, void* out,
               FType ot) {
  const int64_t row_bytes = K * bits / 8;
  const int64_t n_groups = K / group_size;
  run_plan(p, xf, K, N, out, ot, [&](int64_t e) {
    const uint8_t* we = w + e * N * row_bytes;
    const int64_t so = e * N * n_groups;
    return [=](int64_t n, int64_t k0, int64_t len, float* dst) {
      dequant_row<bits>(we + n * row_bytes, scales, biases, st, so + n * n_groups, group_size,
                        k0, len, dst);
    };
  });
}

class RowExpertMatmul : public CpuPrimitive {
 public:
  RowExpertMatmul(mx::Stream s, int group_size, int bits)
      : CpuPrimitive(s, "row_expert_matmul"), group_size_(group_size), bits_(bits) {}

  Task make_task() const override {
    // inputs: x, w[, scales, biases], indices
    return [gs = group_size_, bits = bits_](std::vector<mx::array>& in, mx::array& out) {
      const mx::array& x = in[0];
      const mx::array& w = in[1];
      const mx::array& idx = in.back();
      const int64_t K = x.shape(-1);
      const int64_t R = K ? static_cast<int64_t>(x.size()) / K : 0;
      const int64_t k = idx.shape(-1);
      const int64_t E = w.shape(0);
      const int64_t N = w.shape(1);
      if (R == 0 || N == 0 || k == 0) return;
      const FType xt = ftype_of(x.dtype(), "x");
      std::vector<float> xbuf;
      const float* xf = rows_as_f32(x, xt, xbuf);
      const Plan plan = make_plan(idx.data<int32_t>(), R, k, E, N);
      void* op = out.data<void>();
      if (bits == 0) {
        const FType wt = ftype_of(w.dtype(), "w");
        const char* wp = static_cast<const char*>(w.data<void>());
        const int64_t esz = (wt == FType::f32) ? 4 : 2;
        run_plan(plan, xf, K, N, op, xt, [&](int64_t e) {
          const char* we = wp + e * N * K * esz;
          return [=](int64_t n, int64_t k0, int64_t len, float* dst) {
            convert_to_f32(we + (n * K + k0) * esz, wt, len, dst);
          };
        });
        return;
      }
      const FType st = ftype_of(in[2].dtype(), "scales");
      const uint8_t* wp = reinterpret_cast<const uint8_t*>(w.data<uint32_t>());
      const void* sp = in[2].data<void>();
      const void* bp = in[3].data<void>();
      switch (bits) {
        case 2: run_quant<2>(plan, xf, K, N, wp, sp, bp, st, gs, op, xt); break;
        case 3: run_quant<3>(plan, xf, K, N, wp, sp, bp, st, gs, op, xt); break;
        case 4: run_quant<4>(plan, xf, K, N, wp, sp, bp, st, gs, op, xt); break;
        case 5: run_quant<5>(plan, xf, K, N, wp, sp, bp, st, gs, op, xt); break;
        case 6: run_quant<6>(plan, xf, K, N, wp, sp, bp, st, gs, op, xt); break;
        case 8: run_quant<8>(plan, xf, K, N, wp, sp, bp, st, gs, op, xt); break;
        default: throw std::invalid_argument("row_expert_matmul: unsupported bits");
      }
    };
  }

  const char* name() const override { return "RowExpertMatmul"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const RowExpertMatmul&>(other);
    return group_size_ == o.group_size_ && bits_ == o.bits_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    auto shape = inputs[0].shape();
    shape.back() = inputs.back().shape(-1);
    shape.push_back(inputs[1].shape(1));
    return {shape};
  }

 private:
  int group_size_;
  int bits_;   // 0: float weights
};

} // namespace

mx::array row_expert_matmul(const mx::array& x, const mx::array& w,
                            const std::optional<mx::array>& scales,
                            const std::optional<mx::array>& biases, const mx::array& indices,
                            int group_size, int bits) {
  auto fail = [](const std::string& msg) {
    throw std::invalid_argument("row_expert_matmul: " + msg);
  };
  const bool quant = scales.has_value();
  if (x.ndim() < 1) fail("x must have at least one dimension");
  if (w.ndim() != 3) fail("w must be 3-D [E, N, K'] (stacked experts)");
  if (indices.ndim() != x.ndim() || indices.dtype() != mx::int32) {
    fail("indices must be int32 [..., k] with x's leading dimensions");
  }
  for (int d = 0; d + 1 < x.ndim(); ++d) {
    if (indices.shape(d) != x.shape(d)) fail("indices' leading dimensions must match x's");
  }
  const int64_t E = w.shape(0), N = w.shape(1);
  int64_t K = w.shape(2);
  if (quant) {
    if (!biases.has_value()) fail("quantized weights need scales and biases");
    if (bits != 2 && bits != 3 && bits != 4 && bits != 5 && bits != 6 && bits != 8) {
      fail("bits must be one of 2, 3, 4, 5, 6, 8");
    }
    if (group_size != 32 && group_size != 64 && group_size != 128) {
      fail("group_size must be 32, 64 or 128");
    }
    if (w.dtype() != mx::uint32) fail("quantized w must be uint32");
    K = K * 32 / bits;
    if (K % group_size != 0) fail("K must be a multiple of group_size");
    if (scales->ndim() != 3 || scales->shape(0) != E || scales->shape(1) != N ||
        scales->shape(2) != K / group_size || biases->shape() != scales->shape()) {
      fail("scales and biases must be [E, N, K / group_size]");
    }
    cpu::ftype_of(scales->dtype(), "scales");
    if (biases->dtype() != scales->dtype()) fail("biases must have the dtype of scales");
  } else {
    if (biases.has_value()) fail("biases without scales");
    cpu::ftype_of(w.dtype(), "w");
    bits = 0;
  }
  if (x.shape(-1) != K) {
    std::ostringstream msg;
    msg << "x's last dimension " << x.shape(-1) << " does not match w (K=" << K << ")";
    fail(msg.str());
  }
  if (K % 16 != 0 || K == 0) fail("K must be a positive multiple of 16");
  cpu::ftype_of(x.dtype(), "x");
  auto s = cpu::cpu_stream();
  std::vector<mx::array> ins = {mx::contiguous(x, false, s), mx::contiguous(w, false, s)};
  if (quant) {
    ins.push_back(mx::contiguous(*scales, false, s));
    ins.push_back(mx::contiguous(*biases, false, s));
  }
  ins.push_back(mx::contiguous(indices, false, s));
  auto shape = x.shape();
  shape.back() = indices.shape(-1);
  shape.push_back(static_cast<int>(N));
  return mx::array(shape, x.dtype(), std::make_shared<RowExpertMatmul>(s, group_size, bits),
                   std::move(ins));
}

void register_row_expert_matmul(nanobind::module_& m) {
  using namespace nb::literals;
  m.def("row_expert_matmul", &row_expert_matmul, "x"_a, "w"_a, "scales"_a.none(),
        "biases"_a.none(), "indices"_a, "group_size"_a = 64, "bits"_a = 4,
        "Row-exact routed-expert matmul: out[..., j, :] = x @ dequant(w[indices[..., j]]).T, "
        "CPU primitive. scales / biases None for float w [E, N, K].");
}

} // namespace tensorfold
