// sparse_attention: CPU face. Attention over selected keys (DeepSeek V3.2-style sparse
// attention: an indexer picks, per query row, the key positions the row attends to), GQA,
// row-exact. It gathers the selected keys itself: no L x S mask, no dense score matrix.
//
// Inputs: q [B, Hq, M, D]; k, v [B, Hkv, cap, D]; indices [B, M, T] int32 (shared by all
// heads of a query row); offset int32 scalar; scale.
//
// Fixed arithmetic for query row (b, h, i) at absolute position p = offset + i:
//   the row's key list is indices[b, i, :] taken in the order given, keeping only the
//   entries e with 0 <= e <= p (e < 0: sentinel / padding; e > p: beyond the causal
//   limit; both are skipped wherever they sit in the list). The kept entries are cut into
//   chunks of kChunk consecutive kept entries: [0,C), [C,2C), ... Per chunk, the same
//   function as row_attention.cpp (attend_chunk, cpu_attention.h):
//     s_j = dot8(q, k_{e_j}) * scale           (8-lane fma over D, fixed hsum)
//     mc  = max_j s_j ; e_j = expf(s_j - mc)
//     lc  = sum_j e_j                            (j ascending, scalar)
//     oc  = sum_j e_j * v_{e_j}                  (j ascending, fma per element)
//   merge, chunks in list order: m' = max(m, mc); a = expf(m - m'); b = expf(mc - m')
//     l = l*a + lc*b ;  o = fma(oc, b, o*a) ; m = m'
//   out = o / l rounded once to q's dtype; a row with no kept entry returns 0; a row whose
//   position lies outside the KV buffer (p < 0 or p >= cap) returns NaN.
// So the bits of a row depend only on its query, its ordered list of kept indices and
// the keys they name: never on M, on the other rows, on T / where the padding sits, on the
// buffer capacity or on the thread count. With the full causal set 0..p in ascending order
// the chunks, and therefore the bits, are exactly those of row_attention's CPU face.
// Duplicate entries are not removed (each occurrence is one term).
#include <algorithm>
#include <limits>
#include <memory>
#include <vector>

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

constexpr int64_t kChunk = kAttnChunk; // cpu_attention.h, shared with row_attention.cpp

void sparse_attention_cpu(const mx::array& q, const mx::array& k, const mx::array& v,
                          const mx::array& ind, int64_t offset, float scale, mx::array& out) {
  const int64_t B = q.shape(0), Hq = q.shape(1), M = q.shape(2), D = q.shape(3);
  const int64_t Hkv = k.shape(1), cap = k.shape(2);
  const int64_t T = ind.shape(2);
  const int64_t G = Hq / Hkv;
  const FType qt = ftype_of(q.dtype(), "q");
  const FType kt = ftype_of(k.dtype(), "k");
  const FType vt = ftype_of(v.dtype(), "v");
  const int64_t qesz = qt == FType::f32 ? 4 : 2;
  const int64_t kesz = kt == FType::f32 ? 4 : 2;
  const int64_t vesz = vt == FType::f32 ? 4 : 2;
  const char* qp = static_cast<const char*>(q.data<void>());
  const char* kp = static_cast<const char*>(k.data<void>());
  const char* vp = static_cast<const char*>(v.data<void>());
  const int32_t* ip = ind.data<int32_t>();
  void* op = out.data<void>();

  // Task = (b, kv head, query row, block of heads of the GQA group). The head blocking
  // only decides which thread computes which (row, head); each (row, head) runs the same
  // arithmetic whatever the blocking (speed only: M = 1 decode still uses all threads).
  const int64_t base_tasks = B * Hkv * M;
  const int64_t want = 2 * static_cast<int64_t>(num_threads());
  const int64_t nhb = std::min<int64_t>(G, std::max<int64_t>(1, (want + base_tasks - 1) / base_tasks));
  const int64_t hpb = (G + nhb - 1) / nhb; // heads per block
  const int64_t nblk = (G + hpb - 1) / hpb;

  parallel_for(base_tasks * nblk, [&](int64_t item) {
    const int64_t blk = item % nblk;
    const int64_t row = item / nblk; // (b*Hkv + hk)*M + i
    const int64_t i = row % M;
    const int64_t bh = row / M;
    const int64_t b = bh / Hkv, hk = bh % Hkv;
    const int64_t g0 = blk * hpb, g1 = std::min(G, g0 + hpb);
    const int64_t nh = g1 - g0;
    const int64_t p = offset + i;
    const bool valid = p >= 0 && p < cap;

    std::vector<float> qf(nh * D), o(nh * D, 0.0f), oc(D);
    std::vector<float> mrow(nh, -std::numeric_limits<float>::infinity()), lrow(nh, 0.0f);
    for (int64_t g = 0; g < nh; ++g) {
      const int64_t h = hk * G + g0 + g;
      convert_to_f32(qp + ((b * Hq + h) * M + i) * D * qesz, qt, D, qf.data() + g * D);
    }
    bool any = false;
    if (valid) {
      std::vector<float> kf(kChunk * D), vf(kChunk * D);
      float s[kChunk];
      int64_t pos[kChunk];
      const int32_t* irow = ip + (b * M + i) * T;
      const char* kbase = kp + ((b * Hkv + hk) * cap) * D * kesz;
      const char* vbase = vp + ((b * Hkv + hk) * cap) * D * vesz;
      int64_t t = 0;
      for (;;) {
        // next chunk: up to kChunk kept entries, in list order
        int64_t n = 0;
        for (; t < T && n < kChunk; ++t) {
          const int64_t e = irow[t];
          if (e >= 0 && e <= p) pos[n++] = e;
        }
        if (n == 0) break;
        any = true;
        for (int64_t j = 0; j < n; ++j) {
          convert_to_f32(kbase + pos[j] * D * kesz, kt, D, kf.data() + j * D);
          convert_to_f32(vbase + pos[j] * D * vesz, vt, D, vf.data() + j * D);
        }
        for (int64_t g = 0; g < nh; ++g) {
          attend_chunk(qf.data() + g * D, kf.data(), vf.data(), n, D, scale, s, oc.data(),
                       mrow[g], lrow[g], o.data() + g * D);
        }
        if (n < kChunk) break; // list exhausted
      }
    }
    for (int64_t g = 0; g < nh; ++g) {
      const int64_t h = hk * G + g0 + g;
      const int64_t obase = ((b * Hq + h) * M + i) * D;
      for (int64_t d = 0; d < D; ++d) {
        const float val = !valid ? std::numeric_limits<float>::quiet_NaN()
                          : any  ? o[g * D + d] / lrow[g]
                                 : 0.0f;
        store_scalar(op, qt, obase + d, val);
      }
    }
  });
}

class SparseAttention : public CpuPrimitive {
 public:
  SparseAttention(mx::Stream s, float scale)
      : CpuPrimitive(s, "sparse_attention"), scale_(scale) {}

  Task make_task() const override {
    // inputs: q, k, v, indices, offset
    return [scale = scale_](std::vector<mx::array>& in, mx::array& out) {
      sparse_attention_cpu(in[0], in[1], in[2], in[3], in[4].data<int32_t>()[0], scale, out);
    };
  }

  const char* name() const override { return "SparseAttention"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    return scale_ == static_cast<const SparseAttention&>(other).scale_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  float scale_;
};

} // namespace

mx::array sparse_attention(const mx::array& q, const mx::array& k, const mx::array& v,
                           const mx::array& indices, const mx::array& offset, float scale) {
  auto fail = [](const std::string& msg) {
    throw std::invalid_argument("sparse_attention: " + msg);
  };
  if (q.ndim() != 4 || k.ndim() != 4 || v.ndim() != 4) {
    fail("q, k, v must be 4-D: q [B, Hq, M, D], k/v [B, Hkv, cap, D]");
  }
  if (k.shape() != v.shape()) fail("k and v must have the same shape");
  if (k.shape(0) != q.shape(0) || k.shape(3) != q.shape(3)) fail("batch / head dim mismatch");
  if (k.shape(1) == 0 || q.shape(1) % k.shape(1) != 0) fail("Hq must be a multiple of Hkv");
  if (q.shape(3) % 16 != 0) fail("head dim must be a multiple of 16 (64..576)");
  if (indices.ndim() != 3 || indices.shape(0) != q.shape(0) || indices.shape(1) != q.shape(2)) {
    fail("indices must be [B, M, T]");
  }
  // int32 only: a cast here read 2^32 + 3 as key 3 (the Python wrapper clips or refuses)
  if (indices.dtype() != mx::int32) fail("indices must be an int32 array");
  if (offset.size() != 1) fail("offset must be a scalar");
  if (offset.dtype() != mx::int32) fail("offset must be an int32 array");
  cpu::ftype_of(q.dtype(), "q");
  cpu::ftype_of(k.dtype(), "k");
  cpu::ftype_of(v.dtype(), "v");
  auto s = cpu::cpu_stream();
  auto off = mx::reshape(offset, {}, s);
  return mx::array(q.shape(), q.dtype(), std::make_shared<SparseAttention>(s, scale),
                   {mx::contiguous(q, false, s), mx::contiguous(k, false, s),
                    mx::contiguous(v, false, s), mx::contiguous(indices, false, s),
                    mx::contiguous(off, false, s)});
}

} // namespace tensorfold
