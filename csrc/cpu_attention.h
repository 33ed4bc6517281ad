// The per-chunk step of the chunked online-softmax attention shared by the CPU faces of
// row_attention (row_attention.cpp) and sparse_attention (sparse_attention.cpp).
// Both files call attend_chunk for every (query row, chunk) with the chunk's keys and
// values gathered into kf / vf; the arithmetic (moved verbatim from those files) is:
//   s_j = dot8(q, k_j) * scale           (8-lane fma over D, fixed hsum)
//   mc  = max_j s_j ; e_j = expf(s_j - mc)      (mc = -inf: 0 subtracted; every e_j = 0)
//   lc  = sum_j e_j                        (j ascending, scalar)
//   oc  = sum_j e_j * v_j                  (j ascending, fma per element)
//   merge: m' = max(m, mc); a = expf(m - m'); b = expf(mc - m')   (m' = -inf: 0 subtracted)
//          l = l*a + lc*b ;  o = fma(oc, b, o*a) ; m = m'
// One function for both ops, so sparse_attention on the full causal set (ascending) and
// row_attention share the bits by construction.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "cpu_common.h"

namespace tensorfold::cpu {

constexpr int64_t kAttnChunk = 128; // keys per chunk (both ops: bit-equality on full sets)

inline float dot8(const float* a, const float* b, int64_t D) {
  v8 acc = v8_zero();
  for (int64_t d = 0; d < D; d += 8) {
    acc = v8_fma(v8_load(a + d), v8_load(b + d), acc);
  }
  return v8_hsum(acc);
}

inline void dot8x4(const float* a, const float* b, int64_t D, float* out) {
  v8 c0 = v8_zero(), c1 = v8_zero(), c2 = v8_zero(), c3 = v8_zero();
  for (int64_t d = 0; d < D; d += 8) {
    const v8 av = v8_load(a + d);
    c0 = v8_fma(av, v8_load(b + d), c0);
    c1 = v8_fma(av, v8_load(b + D + d), c1);
    c2 = v8_fma(av, v8_load(b + 2 * D + d), c2);
    c3 = v8_fma(av, v8_load(b + 3 * D + d), c3);
  }
  out[0] = v8_hsum(c0);
  out[1] = v8_hsum(c1);
  out[2] = v8_hsum(c2);
  out[3] = v8_hsum(c3);
}

// One chunk of n <= kAttnChunk keys for the query row qr (D floats): kf, vf hold the n
// keys / values (n x D fp32, key order = summation order). Merges the chunk into the row's
// running max m, sum l and output orow (D floats). Scratch: s (>= n floats), oc (D floats).
inline void attend_chunk(const float* qr, const float* kf, const float* vf, int64_t n,
                         int64_t D, float scale, float* s, float* oc, float& m, float& l,
                         float* orow) {
  float mc = -std::numeric_limits<float>::infinity();
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) { // 4 independent dot8 chains (same per-key arithmetic)
    dot8x4(qr, kf + j * D, D, s + j);
    for (int t = 0; t < 4; ++t) s[j + t] = s[j + t] * scale;
  }
  for (; j < n; ++j) s[j] = dot8(qr, kf + j * D, D) * scale;
  for (j = 0; j < n; ++j) mc = std::max(mc, s[j]);
  // a chunk whose scores are all -inf weighs nothing (exp(-inf - -inf) was NaN and made the
  // whole row NaN); with any finite score mz == mc, the same operations as before
  const float ninf = -std::numeric_limits<float>::infinity();
  const float mz = mc == ninf ? 0.0f : mc;
  float lc = 0.0f;
  for (j = 0; j < n; ++j) {
    s[j] = std::exp(s[j] - mz);
    lc += s[j];
  }
  // oc[d] = sum_j e_j * v_j[d], j ascending; 64 dims at a time held in registers.
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    const int nv = static_cast<int>(std::min<int64_t>(64, D - d0) / 8);
    v8 acc[8];
    for (int t = 0; t < 8; ++t) acc[t] = v8_zero();
    for (j = 0; j < n; ++j) {
      const v8 ev = v8_set1(s[j]);
      const float* vj = vf + j * D + d0;
      if (nv == 8) {
        for (int t = 0; t < 8; ++t) acc[t] = v8_fma(ev, v8_load(vj + 8 * t), acc[t]);
      } else {
        for (int t = 0; t < nv; ++t) acc[t] = v8_fma(ev, v8_load(vj + 8 * t), acc[t]);
      }
    }
    for (int t = 0; t < nv; ++t) v8_store(oc + d0 + 8 * t, acc[t]);
  }
  const float mo = m;
  const float mn = std::max(mo, mc);
  const float mnz = mn == ninf ? 0.0f : mn; // nothing yet on either side: a = bb = 0, not NaN
  const float a = std::exp(mo - mnz);
  const float bb = std::exp(mc - mnz);
  l = l * a + lc * bb;
  const v8 av = v8_set1(a), bv = v8_set1(bb);
  for (int64_t d = 0; d < D; d += 8) {
    v8_store(orow + d, v8_fma(v8_load(oc + d), bv, v8_mul(v8_load(orow + d), av)));
  }
  m = mn;
}

} // namespace tensorfold::cpu
