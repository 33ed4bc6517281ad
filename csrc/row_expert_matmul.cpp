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
// The GEMM inner loop is a copy of row_gemm's (cpu_rowgemm.h), with gathered input rows
// and scattered output rows; the unpacking is a copy of row_quantized_matmul.cpp's.
#include <limits>
#include <memory>
#include <optional>
#include <sstream>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>

#include "cpu_common.h"
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

// Same as row_quantized_matmul.cpp: the 8 quantised integers of elements k..k+7 (k % 8 == 0).
template <int bits>
inline void unpack8(const uint8_t* row, int64_t k, float* q) {
  const uint8_t* p = row + (k * bits) / 8;
#if TF_AVX2
  if constexpr (bits == 4) {
    uint32_t u;
    std::memcpy(&u, p, 4);
    const __m256i sh = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    __m256i v = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(u)), sh),
                                 _mm256_set1_epi32(0xf));
    _mm256_storeu_ps(q, _mm256_cvtepi32_ps(v));
    return;
  } else if constexpr (bits == 8) {
    uint64_t u;
    std::memcpy(&u, p, 8);
    __m256i v = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>(u)));
    _mm256_storeu_ps(q, _mm256_cvtepi32_ps(v));
    return;
  } else if constexpr (bits == 2) {
    uint16_t u;
    std::memcpy(&u, p, 2);
    const __m256i sh = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
    __m256i v = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(u), sh),
                                 _mm256_set1_epi32(0x3));
    _mm256_storeu_ps(q, _mm256_cvtepi32_ps(v));
    return;
  }
#endif
  uint64_t u = 0;
  std::memcpy(&u, p, bits);
  constexpr uint64_t mask = (uint64_t(1) << bits) - 1;
  for (int j = 0; j < 8; ++j) {
    q[j] = static_cast<float>((u >> (j * bits)) & mask);
  }
}

// One task of the expert GEMM: columns [nt0, nt1) of one expert, for its `cnt` rows.
// rows[i]: the row of x; dst[i]: the flat output row (r * k + j). Arithmetic as row_gemm.
template <class Loader>
void expert_tile(const float* xf, int64_t K, int64_t N, const int64_t* rows,
                 const int64_t* dst, int64_t cnt, int64_t nt0, int64_t nt1, void* out,
                 FType ot, const Loader& load) {
  alignas(64) float wbuf[kNC][kKC];
  alignas(64) float acc[kRB][kNC][16];
  for (int64_t n0 = nt0; n0 < nt1; n0 += kNC) {
    const int nc = static_cast<int>(std::min<int64_t>(kNC, nt1 - n0));
    for (int64_t r0 = 0; r0 < cnt; r0 += kRB) {
      const int64_t rb = std::min(kRB, cnt - r0);
      std::memset(acc, 0, sizeof(float) * rb * kNC * 16);
      for (int64_t k0 = 0; k0 < K; k0 += kKC) {
        const int64_t len = std::min(kKC, K - k0);
        for (int c = 0; c < kNC; ++c) {
          if (c < nc) {
            load(n0 + c, k0, len, wbuf[c]);
          } else {
            std::memset(wbuf[c], 0, sizeof(float) * len);
          }
        }
        for (int64_t m = 0; m < rb; ++m) {
          const float* xr = xf + rows[r0 + m] * K + k0;
          float* am = &acc[m][0][0];
          v8 a00 = v8_load(am + 0), a01 = v8_load(am + 8);
          v8 a10 = v8_load(am + 16), a11 = v8_load(am + 24);
          v8 a20 = v8_load(am + 32), a21 = v8_load(am + 40);
          v8 a30 = v8_load(am + 48), a31 = v8_load(am + 56);
          for (int64_t k = 0; k < len; k += 16) {
            const v8 x0 = v8_load(xr + k), x1 = v8_load(xr + k + 8);
            a00 = v8_fma(v8_load(wbuf[0] + k), x0, a00);
            a01 = v8_fma(v8_load(wbuf[0] + k + 8), x1, a01);
            a10 = v8_fma(v8_load(wbuf[1] + k), x0, a10);
            a11 = v8_fma(v8_load(wbuf[1] + k + 8), x1, a11);
            a20 = v8_fma(v8_load(wbuf[2] + k), x0, a20);
            a21 = v8_fma(v8_load(wbuf[2] + k + 8), x1, a21);
            a30 = v8_fma(v8_load(wbuf[3] + k), x0, a30);
            a31 = v8_fma(v8_load(wbuf[3] + k + 8), x1, a31);
          }
          v8_store(am + 0, a00), v8_store(am + 8, a01);
          v8_store(am + 16, a10), v8_store(am + 24, a11);
          v8_store(am + 32, a20), v8_store(am + 40, a21);
          v8_store(am + 48, a30), v8_store(am + 56, a31);
        }
      }
      for (int64_t m = 0; m < rb; ++m) {
        for (int c = 0; c < nc; ++c) {
          const float* a = acc[m][c];
          const float v = v8_hsum(v8_add(v8_load(a), v8_load(a + 8)));
          store_scalar(out, ot, dst[r0 + m] * N + n0 + c, v);
        }
      }
    }
  }
}

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
    expert_tile(xf, K, N, p.rows.data() + s, p.dst.data() + s, p.start[e + 1] - s, nt0, nt1,
                out, ot, loader_for(e));
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
      const uint8_t* row = we + n * row_bytes;
      alignas(32) float q[8];
      for (int64_t k = k0; k < k0 + len; k += group_size) {
        const int64_t g = k / group_size;
        const v8 s = v8_set1(load_scalar(scales, st, so + n * n_groups + g));
        const v8 b = v8_set1(load_scalar(biases, st, so + n * n_groups + g));
        for (int64_t j = 0; j < group_size; j += 8) {
          unpack8<bits>(row, k + j, q);
          v8_store(dst + (k - k0) + j, v8_fma(s, v8_load(q), b));
        }
      }
    };
  });
}

class RowExpertMatmul : public mx::UnaryPrimitive {
 public:
  RowExpertMatmul(mx::Stream s, int group_size, int bits)
      : mx::UnaryPrimitive(s), group_size_(group_size), bits_(bits) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const bool quant = bits_ > 0;
    const auto& x = inputs[0];
    const auto& w = inputs[1];
    const auto& idx = inputs.back();
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) enc.set_input_array(a);
    enc.set_output_array(out);
    std::optional<mx::array> sc, bi;
    if (quant) {
      sc = mx::array::unsafe_weak_copy(inputs[2]);
      bi = mx::array::unsafe_weak_copy(inputs[3]);
    }
    enc.dispatch([x = mx::array::unsafe_weak_copy(x), w = mx::array::unsafe_weak_copy(w),
                  idx = mx::array::unsafe_weak_copy(idx), sc, bi,
                  out = mx::array::unsafe_weak_copy(out), gs = group_size_,
                  bits = bits_]() mutable {
      const int64_t K = x.shape(-1);
      const int64_t R = K ? static_cast<int64_t>(x.size()) / K : 0;
      const int64_t k = idx.shape(-1);
      const int64_t E = w.shape(0);
      const int64_t N = w.shape(1);
      if (R == 0 || N == 0 || k == 0) return;
      const FType xt = ftype_of(x.dtype(), "x");
      std::vector<float> xbuf;
      const float* xf = x.data<float>();
      if (xt != FType::f32) {
        xbuf.resize(R * K);
        convert_to_f32(x.data<void>(), xt, R * K, xbuf.data());
        xf = xbuf.data();
      }
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
      const FType st = ftype_of(sc->dtype(), "scales");
      const uint8_t* wp = reinterpret_cast<const uint8_t*>(w.data<uint32_t>());
      const void* sp = sc->data<void>();
      const void* bp = bi->data<void>();
      switch (bits) {
        case 2: run_quant<2>(plan, xf, K, N, wp, sp, bp, st, gs, op, xt); break;
        case 3: run_quant<3>(plan, xf, K, N, wp, sp, bp, st, gs, op, xt); break;
        case 4: run_quant<4>(plan, xf, K, N, wp, sp, bp, st, gs, op, xt); break;
        case 5: run_quant<5>(plan, xf, K, N, wp, sp, bp, st, gs, op, xt); break;
        case 6: run_quant<6>(plan, xf, K, N, wp, sp, bp, st, gs, op, xt); break;
        case 8: run_quant<8>(plan, xf, K, N, wp, sp, bp, st, gs, op, xt); break;
        default: throw std::invalid_argument("row_expert_matmul: unsupported bits");
      }
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error(
        "tensorfold row_expert_matmul: the C++ primitive is CPU only; GPU faces go through "
        "tensorfold.kernels.row_expert_matmul (CUDA / Metal kernels).");
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
  if (K % 16 != 0) fail("K must be a multiple of 16");
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
