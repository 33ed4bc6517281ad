// row_attention: CPU face. Causal GQA attention over a KV buffer, row-exact.
//
// Fixed arithmetic for query row (b, h, i) at absolute position p = offset + i:
//   keys 0..p are taken in chunks of kChunk starting at 0: [0,C), [C,2C), ... with the
//   last chunk cut at p (keys > p are never used by this row).
//   per chunk: s_j = dot8(q, k_j) * scale           (8-lane fma over D, fixed hsum)
//              mc  = max_j s_j
//              e_j = expf(s_j - mc)
//              lc  = sum_j e_j                        (j ascending, scalar)
//              oc  = sum_j e_j * v_j                  (j ascending, fma per element)
//   merge, chunks ascending: m' = max(m, mc); a = expf(m - m'); b = expf(mc - m')
//              l = l*a + lc*b ;  o = fma(oc, b, o*a) ; m = m'
//   out = o / l, rounded once to q's dtype.
// Nothing depends on M, on the other rows, on the buffer capacity or on the thread count.
#include <algorithm>
#include <limits>
#include <memory>
#include <sstream>

#include "cpu_attention.h"
#include "cpu_common.h"
#include "cpu_primitive.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "row_kernels.h"

namespace mx = mlx::core;

namespace tensorfold {

namespace {

using namespace tensorfold::cpu;

constexpr int64_t kChunk = kAttnChunk;

void attention_cpu(const mx::array& q, const mx::array& k, const mx::array& v,
                   int64_t offset, float scale, mx::array& out) {
  const int64_t B = q.shape(0), Hq = q.shape(1), M = q.shape(2), D = q.shape(3);
  const int64_t Hkv = k.shape(1), cap = k.shape(2);
  const int64_t G = Hq / Hkv;
  const FType qt = ftype_of(q.dtype(), "q");
  const FType kt = ftype_of(k.dtype(), "k");
  const FType vt = ftype_of(v.dtype(), "v");
  const int64_t kesz = kt == FType::f32 ? 4 : 2;
  const int64_t vesz = vt == FType::f32 ? 4 : 2;
  const char* qp = static_cast<const char*>(q.data<void>());
  const char* kp = static_cast<const char*>(k.data<void>());
  const char* vp = static_cast<const char*>(v.data<void>());
  const int64_t qesz = qt == FType::f32 ? 4 : 2;
  void* op = out.data<void>();

  parallel_for(B * Hkv, [&](int64_t item) {
    const int64_t b = item / Hkv, hk = item % Hkv;
    const int64_t rows = G * M;
    std::vector<float> qf(rows * D), o(rows * D, 0.0f), oc(D);
    std::vector<float> mrow(rows, -std::numeric_limits<float>::infinity()), lrow(rows, 0.0f);
    std::vector<float> kf(kChunk * D), vf(kChunk * D);
    float s[kChunk];
    // Row r = g*M + i  <->  head h = hk*G + g, query i.
    for (int64_t g = 0; g < G; ++g) {
      const int64_t h = hk * G + g;
      convert_to_f32(qp + ((b * Hq + h) * M) * D * qesz, qt, M * D, qf.data() + g * M * D);
    }
    // Positions: row i of any head sits at offset + i; rows past the buffer get NaN.
    const int64_t last = std::min(offset + M - 1, cap - 1); // largest key any row uses
    const char* kbase = kp + ((b * Hkv + hk) * cap) * D * kesz;
    const char* vbase = vp + ((b * Hkv + hk) * cap) * D * vesz;
    for (int64_t c0 = 0; c0 <= last; c0 += kChunk) {
      const int64_t cn = std::min(kChunk, last + 1 - c0);
      convert_to_f32(kbase + c0 * D * kesz, kt, cn * D, kf.data());
      convert_to_f32(vbase + c0 * D * vesz, vt, cn * D, vf.data());
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t p = offset + (r % M);
        if (p >= cap || c0 > p) continue;
        const int64_t n = std::min(kChunk, p + 1 - c0);
        attend_chunk(qf.data() + r * D, kf.data(), vf.data(), n, D, scale, s, oc.data(), mrow[r],
                     lrow[r], o.data() + r * D);
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      const int64_t h = hk * G + g;
      for (int64_t i = 0; i < M; ++i) {
        const int64_t r = g * M + i;
        const int64_t p = offset + i;
        const int64_t obase = ((b * Hq + h) * M + i) * D;
        const bool valid = p >= 0 && p < cap;
        for (int64_t d = 0; d < D; ++d) {
          const float val = valid ? o[r * D + d] / lrow[r]
                                  : std::numeric_limits<float>::quiet_NaN();
          store_scalar(op, qt, obase + d, val);
        }
      }
    }
  });
}

class RowAttention : public CpuPrimitive {
 public:
  RowAttention(mx::Stream s, float scale) : CpuPrimitive(s, "row_attention"), scale_(scale) {}

  Task make_task() const override {
    // inputs: q, k, v, offset
    return [scale = scale_](std::vector<mx::array>& in, mx::array& out) {
      attention_cpu(in[0], in[1], in[2], in[3].data<int32_t>()[0], scale, out);
    };
  }

  const char* name() const override { return "RowAttention"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    return scale_ == static_cast<const RowAttention&>(other).scale_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  float scale_;
};

} // namespace

mx::array row_attention(const mx::array& q, const mx::array& k, const mx::array& v,
                        const mx::array& offset, float scale) {
  auto fail = [](const std::string& msg) {
    throw std::invalid_argument("row_attention: " + msg);
  };
  if (q.ndim() != 4 || k.ndim() != 4 || v.ndim() != 4) {
    fail("q, k, v must be 4-D: q [B, Hq, M, D], k/v [B, Hkv, cap, D]");
  }
  if (k.shape() != v.shape()) fail("k and v must have the same shape");
  if (k.shape(0) != q.shape(0) || k.shape(3) != q.shape(3)) fail("batch / head dim mismatch");
  if (k.shape(1) == 0 || q.shape(1) % k.shape(1) != 0) fail("Hq must be a multiple of Hkv");
  if (q.shape(3) % 16 != 0) fail("head dim must be a multiple of 16 (64/80/96/128/256)");
  if (k.shape(2) < q.shape(2)) fail("KV capacity smaller than the number of query rows");
  if (offset.size() != 1) fail("offset must be a scalar");
  // int32 only: a cast here read 2^32 + 5 as 5 and 5.9 as 5 (the Python wrapper clips or refuses)
  if (offset.dtype() != mx::int32) fail("offset must be an int32 array");
  cpu::ftype_of(q.dtype(), "q");
  cpu::ftype_of(k.dtype(), "k");
  cpu::ftype_of(v.dtype(), "v");
  auto s = cpu::cpu_stream();
  auto off = mx::reshape(offset, {}, s);
  return mx::array(q.shape(), q.dtype(), std::make_shared<RowAttention>(s, scale),
                   {mx::contiguous(q, false, s), mx::contiguous(k, false, s),
                    mx::contiguous(v, false, s), mx::contiguous(off, false, s)});
}

} // namespace tensorfold
