// Row-exact sparse (selected-key) GQA attention for MLX's Metal backend
// (mx.fast.metal_kernel, JIT; launched from tensorfold/kernels/sparse.py).
//
// NEVER COMPILED BY APPLE'S COMPILER OR RUN ON A GPU in this project (no Apple GPU here; CI
// runs it on the CPU emulation of tests/metal_emu): treat as a reviewed sketch
// that mirrors the CUDA face (csrc/cuda/sparse_attention.cu) and the Metal row_attn body
// (metal/row_ops.metal): one simdgroup per query row and head, no staging of K / V.
//
// Query row (b, h, i) at p = offset + i: the kept list is indices[b, i, :] in the order
// given, keeping entries e with 0 <= e <= p. It is cut into spans of 64 consecutive kept
// entries and spans into chunks of 64; lane j scores chunk entries j and j+32 (fma chain
// over d ascending, times scale); mc = butterfly max; e_j = exp(s_j - mc); lc = butterfly
// sum of (e_lane + e_lane+32) (simd_shuffle_xor 16, 8, 4, 2, 1 -- never simd_sum);
// oc[d] = fma chain over j ascending; chunks merged in order into the span state, spans
// merged in order into the row state (m' = max; a = exp(m - m'); b = exp(mc - m');
// l = l*a + lc*b; o = fma(oc, b, o*a)). out = o / l; 0 for an empty kept list; NaN when p
// is outside the buffer. Compaction of the kept entries uses integer prefix sums (exact).

// @@header
// (metal_stdlib and the shared helpers tf_extract, tf_simd_sum, tf_simd_max come from
// common.h, prepended by _sources.py)

// @@body sparse_attn
// inputs q [B, HQ, M, D] (T), k, v [B, HKV, cap, D] (TK), indices [B, M, NI] int32,
//        offset [1] int32, scale_f [1] float32
// output out [B, HQ, M, D] (T); template T, TK, D, HQ, HKV
// grid (32, B*HQ*M, 1), threadgroup (32, 1, 1): one simdgroup per (query row, head).
const int C = 64;
const int SPAN = 64;
const int NT = (D + 31) / 32;
const int G = HQ / HKV;
const int M = q_shape[2];
const int cap = k_shape[2];
const int NI = indices_shape[2];
const uint lane = thread_index_in_simdgroup;
const int row = threadgroup_position_in_grid.y;
const int i = row % M;
const int h = (row / M) % HQ;
const int b = row / (M * HQ);
const int p = offset[0] + i;
threadgroup float es[64];
threadgroup int plist[96];
if (p < 0 || p >= cap) {
  for (int t = 0; t < NT; ++t) {
    const int d = lane + 32 * t;
    if (d < D) out[(size_t)row * D + d] = static_cast<T>(NAN);
  }
  return;
}
const size_t kvbase = (size_t)(b * HKV + h / G) * cap * D;
const size_t qbase = (size_t)row * D;
const size_t ibase = (size_t)(b * M + i) * NI;
const float scale = scale_f[0];
float m_all = -INFINITY, l_all = 0.0f, o_all[NT];
float m_sp = -INFINITY, l_sp = 0.0f, o_sp[NT];
for (int t = 0; t < NT; ++t) {
  o_all[t] = 0.0f;
  o_sp[t] = 0.0f;
}
int pend = 0, rp = 0, taken = 0;
for (;;) {
  while (pend < C && rp < NI) {
    const int e = rp + (int)lane;
    const int idx = e < NI ? indices[ibase + e] : -1;
    const uint ok = (idx >= 0 && idx <= p) ? 1u : 0u;
    const uint slot = simd_prefix_exclusive_sum(ok);
    if (ok) plist[pend + (int)slot] = idx;
    pend += (int)simd_sum(ok); // integer: exact
    rp += 32;
    simdgroup_barrier(mem_flags::mem_threadgroup);
  }
  const int n = min(C, pend);
  if (n == 0) break;
  float sa = -INFINITY, sb = -INFINITY;
  if ((int)lane < n) {
    const size_t kb = kvbase + (size_t)plist[lane] * D;
    float acc = 0.0f;
    for (int d = 0; d < D; ++d) acc = fma(static_cast<float>(q[qbase + d]), static_cast<float>(k[kb + d]), acc);
    sa = acc * scale;
  }
  if ((int)lane + 32 < n) {
    const size_t kb = kvbase + (size_t)plist[lane + 32] * D;
    float acc = 0.0f;
    for (int d = 0; d < D; ++d) acc = fma(static_cast<float>(q[qbase + d]), static_cast<float>(k[kb + d]), acc);
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
      for (int j = 0; j < n; ++j) oc = fma(es[j], static_cast<float>(v[kvbase + (size_t)plist[j] * D + d]), oc);
      o_sp[t] = fma(oc, fb, o_sp[t] * fa);
    }
  }
  l_sp = l_sp * fa + lc * fb;
  m_sp = mn;
  taken += n;
  if (taken % SPAN == 0) {
    const float mn2 = max(m_all, m_sp);
    const float fa2 = precise::exp(m_all - tf_zmax(mn2)), fb2 = precise::exp(m_sp - tf_zmax(mn2));
    for (int t = 0; t < NT; ++t) {
      o_all[t] = fma(o_sp[t], fb2, o_all[t] * fa2);
      o_sp[t] = 0.0f;
    }
    l_all = l_all * fa2 + l_sp * fb2;
    m_all = mn2;
    m_sp = -INFINITY;
    l_sp = 0.0f;
  }
  // drop the consumed entries from the pending list
  simdgroup_barrier(mem_flags::mem_threadgroup);
  const int rest = pend - n;
  const int c0 = (int)lane < rest ? plist[n + lane] : 0;
  const int c1 = (int)lane + 32 < rest ? plist[n + lane + 32] : 0;
  simdgroup_barrier(mem_flags::mem_threadgroup);
  if ((int)lane < rest) plist[lane] = c0;
  if ((int)lane + 32 < rest) plist[lane + 32] = c1;
  pend = rest;
  simdgroup_barrier(mem_flags::mem_threadgroup);
}
if (taken % SPAN != 0) {
  const float mn2 = max(m_all, m_sp);
  const float fa2 = precise::exp(m_all - tf_zmax(mn2)), fb2 = precise::exp(m_sp - tf_zmax(mn2));
  for (int t = 0; t < NT; ++t) o_all[t] = fma(o_sp[t], fb2, o_all[t] * fa2);
  l_all = l_all * fa2 + l_sp * fb2;
}
for (int t = 0; t < NT; ++t) {
  const int d = lane + 32 * t;
  if (d < D) out[(size_t)row * D + d] = static_cast<T>(taken > 0 ? o_all[t] / l_all : 0.0f);
}
