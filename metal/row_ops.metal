// Row-exact kernels for MLX's Metal backend (mx.fast.metal_kernel, JIT).
//
// NEVER COMPILED BY APPLE'S COMPILER OR RUN ON A GPU in this project (no Apple GPU here; CI
// runs it on the CPU emulation of tests/metal_emu): treat as a reviewed
// sketch that mirrors the CUDA faces' arithmetic order (csrc/cuda/*.cu), kept small:
// no threadgroup staging of x / K / V, one simdgroup per output column (GEMMs) or per
// query row (attention). tensorfold.kernels._metal cuts this file at "// @@" markers
// exactly like the CUDA sources.
//
// GEMMs: K in 32-element chunks, lane l of the simdgroup takes chunks l, l+32, ... ; in a
// chunk j = 0..31: acc = fma(w_hat_j, x_j, acc); butterfly over lanes with
// simd_shuffle_xor 16, 8, 4, 2, 1 (never simd_sum, whose order is unspecified).
// Attention: spans of 64 keys from 0, chunks of 64 (one per span, as in CUDA); chunk partial as in CUDA; chunks
// merged in order into the span state, spans merged in order into the row state.

// @@header
// (metal_stdlib and the shared helpers tf_extract, tf_simd_sum, tf_simd_max come from
// common.h, prepended by _sources.py)

// @@body row_qmm
// inputs x [R, K] (T), w uint32, scales/biases (S); output out [R, N] (T)
// template T, S, K, N, GS, BITS; grid (32, N, ceil(R/16)), threadgroup (32, 1, 1)
const int MAXM = 16;
const int NCHUNK = K / 32;
const int KW = K * BITS / 32;
const int NG = K / GS;
const int R = x_shape[0];
const uint lane = thread_index_in_simdgroup;
const int n = threadgroup_position_in_grid.y;
const int r0 = threadgroup_position_in_grid.z * MAXM;
const int rows = min(MAXM, R - r0);
float acc[MAXM];
for (int m = 0; m < MAXM; ++m) acc[m] = 0.0f;
for (int ch = lane; ch < NCHUNK; ch += 32) {
  uint words[BITS];
  for (int i = 0; i < BITS; ++i) words[i] = w[(size_t)n * KW + (size_t)ch * BITS + i];
  const int g = (ch * 32) / GS;
  const float s = static_cast<float>(scales[n * NG + g]);
  const float b = static_cast<float>(biases[n * NG + g]);
  for (int j = 0; j < 32; ++j) {
    const float wh = fma(s, static_cast<float>(tf_extract<BITS>(words, j)), b);
    for (int m = 0; m < MAXM; ++m) {
      if (m < rows) acc[m] = fma(wh, static_cast<float>(x[(size_t)(r0 + m) * K + ch * 32 + j]), acc[m]);
    }
  }
}
for (int m = 0; m < MAXM; ++m) {
  if (m < rows) {
    const float v = tf_simd_sum(acc[m]);
    if (lane == 0) out[(size_t)(r0 + m) * N + n] = static_cast<T>(v);
  }
}

// @@body row_mm
// inputs x [R, K] (T), w [N, K] (W); output out [R, N] (T)
// template T, W, K, N; grid (32, N, ceil(R/16)), threadgroup (32, 1, 1)
const int MAXM = 16;
const int NCHUNK = K / 32;
const int R = x_shape[0];
const uint lane = thread_index_in_simdgroup;
const int n = threadgroup_position_in_grid.y;
const int r0 = threadgroup_position_in_grid.z * MAXM;
const int rows = min(MAXM, R - r0);
float acc[MAXM];
for (int m = 0; m < MAXM; ++m) acc[m] = 0.0f;
for (int ch = lane; ch < NCHUNK; ch += 32) {
  for (int j = 0; j < 32; ++j) {
    const float wh = static_cast<float>(w[(size_t)n * K + ch * 32 + j]);
    for (int m = 0; m < MAXM; ++m) {
      if (m < rows) acc[m] = fma(wh, static_cast<float>(x[(size_t)(r0 + m) * K + ch * 32 + j]), acc[m]);
    }
  }
}
for (int m = 0; m < MAXM; ++m) {
  if (m < rows) {
    const float v = tf_simd_sum(acc[m]);
    if (lane == 0) out[(size_t)(r0 + m) * N + n] = static_cast<T>(v);
  }
}

// @@body row_attn
// inputs q [B, HQ, M, D] (T), k, v [B, HKV, cap, D] (TK), offset [1] int32, scale_f [1]
// output out [B, HQ, M, D] (T); template T, TK, D, HQ, HKV
// grid (32, B*HQ*M, 1), threadgroup (32, 1, 1): one simdgroup per query row.
const int C = 64;
const int SPAN = 64;
const int NT = (D + 31) / 32;
const int G = HQ / HKV;
const int M = q_shape[2];
const int cap = k_shape[2];
const uint lane = thread_index_in_simdgroup;
const int row = threadgroup_position_in_grid.y;
const int i = row % M;
const int h = (row / M) % HQ;
const int b = row / (M * HQ);
const int p = offset[0] + i;
threadgroup float es[64];
if (p < 0 || p >= cap) {
  for (int t = 0; t < NT; ++t) {
    const int d = lane + 32 * t;
    if (d < D) out[(size_t)row * D + d] = static_cast<T>(NAN);
  }
  return;
}
const size_t kvbase = (size_t)(b * HKV + h / G) * cap * D;
const size_t qbase = (size_t)row * D;
const float scale = scale_f[0];
float m_all = -INFINITY, l_all = 0.0f, o_all[NT];
for (int t = 0; t < NT; ++t) o_all[t] = 0.0f;
for (int s0 = 0; s0 <= p; s0 += SPAN) {
  float m_sp = -INFINITY, l_sp = 0.0f, o_sp[NT];
  for (int t = 0; t < NT; ++t) o_sp[t] = 0.0f;
  for (int c0 = s0; c0 < s0 + SPAN && c0 <= p; c0 += C) {
    const int n = min(C, p + 1 - c0);
    float sa = -INFINITY, sb = -INFINITY;
    if ((int)lane < n) {
      float acc = 0.0f;
      for (int d = 0; d < D; ++d)
        acc = fma(static_cast<float>(q[qbase + d]), static_cast<float>(k[kvbase + (size_t)(c0 + lane) * D + d]), acc);
      sa = acc * scale;
    }
    if ((int)lane + 32 < n) {
      float acc = 0.0f;
      for (int d = 0; d < D; ++d)
        acc = fma(static_cast<float>(q[qbase + d]), static_cast<float>(k[kvbase + (size_t)(c0 + lane + 32) * D + d]), acc);
      sb = acc * scale;
    }
    const float mc = tf_simd_max(max(sa, sb));
    const float ea = (int)lane < n ? precise::exp(sa - tf_zmax(mc)) : 0.0f;
    const float eb = (int)lane + 32 < n ? precise::exp(sb - tf_zmax(mc)) : 0.0f;
    es[lane] = ea;
    es[lane + 32] = eb;
    const float lc = tf_simd_sum(ea + eb);
    simdgroup_barrier(mem_flags::mem_threadgroup);
    const float mn = max(m_sp, mc);
    const float fa = precise::exp(m_sp - tf_zmax(mn)), fb = precise::exp(mc - tf_zmax(mn));
    for (int t = 0; t < NT; ++t) {
      const int d = lane + 32 * t;
      if (d < D) {
        float oc = 0.0f;
        for (int j = 0; j < n; ++j) oc = fma(es[j], static_cast<float>(v[kvbase + (size_t)(c0 + j) * D + d]), oc);
        o_sp[t] = fma(oc, fb, o_sp[t] * fa);
      }
    }
    l_sp = l_sp * fa + lc * fb;
    m_sp = mn;
    simdgroup_barrier(mem_flags::mem_threadgroup);
  }
  const float mn = max(m_all, m_sp);
  const float fa = precise::exp(m_all - tf_zmax(mn)), fb = precise::exp(m_sp - tf_zmax(mn));
  for (int t = 0; t < NT; ++t) o_all[t] = fma(o_sp[t], fb, o_all[t] * fa);
  l_all = l_all * fa + l_sp * fb;
  m_all = mn;
}
for (int t = 0; t < NT; ++t) {
  const int d = lane + 32 * t;
  if (d < D) out[(size_t)row * D + d] = static_cast<T>(o_all[t] / l_all);
}
