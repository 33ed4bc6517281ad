// Row-exact causal GQA attention for MLX's CUDA backend (mx.fast.cuda_kernel, NVRTC JIT).
// Sections are cut by "// @@" marker lines (see row_gemm.cu).
//
// Arithmetic of query row (b, h, i) at absolute position p = offset + i (fixed by p, D):
//   keys are cut into spans of SPAN=64 starting at key 0, spans into chunks of C=64; the
//   last chunk is cut at p (keys > p are never read for this row).
//   chunk:  s_j = fma-chain over d ascending of q[d]*k_j[d], times scale
//           mc = max_j s_j (exact);  e_j = expf(s_j - mc)
//           lc = butterfly sum over lanes of (e_lane + e_lane+32)
//           oc[d] = fma-chain over j ascending of e_j * v_j[d]
//   merge (chunks of a span ascending, then spans ascending, same formula):
//           m' = max(m, mc); a = expf(m - m'); b = expf(mc - m')
//           l = l*a + lc*b;  o = fma(oc, b, o*a);  m = m'
//   out = o / l, rounded once to q's dtype.
// Kernel row_attn_partial: one block per (span, b*Hkv + hk, group of 8 query rows); warp w
// owns one query row (rows of a GQA group share the K/V staged in shared memory).
// Kernel row_attn_merge: one thread per (row, d) merges the row's spans in order.
// M, the capacity and the offset only decide which blocks run and which rows they visit.

// @@header
// (the shared helpers tf_to_float, tf_from_float, tf_load8, tf_extract, tf_load_chunk,
// tf_warp_sum, TF_FULL_MASK, TF_NEG_INF come from common.cuh, prepended by _sources.py)

// @@body row_attn_partial
// inputs: q [B, HQ, M, D] (T), k, v [B, HKV, cap, D] (TK), offset [1] int32,
//         scale_f [1] float32
// output: part [B*HQ*M, nspan, D+2] float32  (o[0..D), m, l) -- only spans <= p/SPAN written
// template: T, TK, D, HQ, HKV, VS (V staged in shared memory too)
// launch: grid (nspan*256, B*HKV, ceil(HQ/HKV*M/8)), threadgroup (256,1,1), dynamic shared
//         memory = 8*C*4 + 8*D*4 + C*(D+1)*sizeof(TK) (+ C*D*sizeof(TK) with VS) <= 48 KB
// Data movement only (the arithmetic above is untouched): the chunk's K (and V) rows are one
// contiguous run of global memory, read with 16-byte loads all issued before any is stored;
// each warp's query row is staged once as fp32.
constexpr int C = 64;
constexpr int SPAN = 64;
constexpr int WARPS = 8;
constexpr int DP = D + 1;
constexpr int NT = (D + 31) / 32;
constexpr int G = HQ / HKV;
constexpr int EPV = 16 / sizeof(TK);               // elements per 16-byte load
constexpr int NV = C * D / EPV;                    // 16-byte loads of one full chunk
constexpr int PER = (NV + 32 * WARPS - 1) / (32 * WARPS);
static_assert((D * sizeof(TK)) % 16 == 0, "row_attn_partial: rows of 16-byte multiples");
extern __shared__ float sm[];
float* es = sm;                                    // WARPS * C softmax weights
float* qs = es + WARPS * C;                        // WARPS * D query rows (fp32)
TK* ks = reinterpret_cast<TK*>(qs + WARPS * D);    // C * DP keys, stored as TK
TK* vs = ks + C * DP;                              // C * D values (VS only; 16-byte aligned)
const int M = q_shape[2];
const int cap = k_shape[2];
const int nspan = (cap + SPAN - 1) / SPAN;
const int lane = threadIdx.x & 31;
const int warp = threadIdx.x >> 5;
const int span = blockIdx.x;
const int b = blockIdx.y / HKV;
const int hk = blockIdx.y % HKV;
const int r = blockIdx.z * WARPS + warp;
const int off = offset[0];
const int s0 = span * SPAN;
const int maxp = min(off + M - 1, cap - 1);
if (s0 > maxp) return; // uniform over the block
const bool row_ok = r < G * M;
const int g = row_ok ? r / M : 0;
const int i = row_ok ? r % M : 0;
const int h = hk * G + g;
const int p = off + i;
const bool active = row_ok && p >= s0 && p >= 0 && p < cap;
const T* qrow = q + ((size_t)(b * HQ + h) * M + i) * D;
const size_t kvbase = (size_t)(b * HKV + hk) * cap * D;
float* qw = qs + warp * D;
for (int d = lane; d < D; d += 32) qw[d] = tf_to_float(qrow[d]);
float mrun = TF_NEG_INF, lrun = 0.0f;
float o[NT];
#pragma unroll
for (int t = 0; t < NT; ++t) o[t] = 0.0f;
const int send = min(s0 + SPAN, maxp + 1);
for (int c0 = s0; c0 < send; c0 += C) {
  const int cn = min(C, send - c0);
  const int nv = cn * D / EPV;
  const uint4* kg = reinterpret_cast<const uint4*>(k + kvbase + (size_t)c0 * D);
  const uint4* vg = reinterpret_cast<const uint4*>(v + kvbase + (size_t)c0 * D);
  uint4 kb[PER], vb[PER];
  __syncthreads();
#pragma unroll
  for (int u = 0; u < PER; ++u) {
    const int e = threadIdx.x + u * 32 * WARPS;
    if (e < nv) {
      kb[u] = __ldg(kg + e);
      if constexpr (VS) vb[u] = __ldg(vg + e);
    }
  }
#pragma unroll
  for (int u = 0; u < PER; ++u) {
    const int e = threadIdx.x + u * 32 * WARPS;
    if (e < nv) {
      const int j = (e * EPV) / D, d = (e * EPV) % D;
      const TK* kv = reinterpret_cast<const TK*>(&kb[u]);
#pragma unroll
      for (int x = 0; x < EPV; ++x) ks[j * DP + d + x] = kv[x];
      if constexpr (VS) reinterpret_cast<uint4*>(vs)[e] = vb[u];
    }
  }
  __syncthreads();
  if (active && c0 <= p) {
    const int n = min(C, p + 1 - c0);
    float sa = TF_NEG_INF, sb = TF_NEG_INF;
    if (lane < n) {
      float acc = 0.0f;
      for (int d = 0; d < D; ++d) acc = __fmaf_rn(qw[d], tf_to_float(ks[lane * DP + d]), acc);
      sa = __fmul_rn(acc, scale_f[0]);
    }
    if (lane + 32 < n) {
      float acc = 0.0f;
      for (int d = 0; d < D; ++d) acc = __fmaf_rn(qw[d], tf_to_float(ks[(lane + 32) * DP + d]), acc);
      sb = __fmul_rn(acc, scale_f[0]);
    }
    const TfChunkSoftmax cs = tf_chunk_softmax(sa, sb, n, lane, es + warp * C, mrun);
    const float lc = cs.lc, mn = cs.mn, fa = cs.fa, fb = cs.fb;
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      const int d = lane + 32 * t;
      if (d < D) {
        float oc = 0.0f;
        if constexpr (VS) {
#pragma unroll 8
          for (int j = 0; j < n; ++j) oc = __fmaf_rn(es[warp * C + j], tf_to_float(vs[j * D + d]), oc);
        } else {
          const TK* vcol = v + kvbase + (size_t)c0 * D + d;   // V from global (L1/L2)
#pragma unroll 8
          for (int j = 0; j < n; ++j) oc = __fmaf_rn(es[warp * C + j], tf_to_float(vcol[(size_t)j * D]), oc);
        }
        o[t] = __fmaf_rn(oc, fb, __fmul_rn(o[t], fa));
      }
    }
    lrun = __fadd_rn(__fmul_rn(lrun, fa), __fmul_rn(lc, fb));
    mrun = mn;
    __syncwarp();
  }
}
if (active) {
  float* dst = part + ((size_t)((b * HQ + h) * M + i) * nspan + span) * (D + 2);
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    const int d = lane + 32 * t;
    if (d < D) dst[d] = o[t];
  }
  if (lane == 0) {
    dst[D] = mrun;
    dst[D + 1] = lrun;
  }
}

// @@body row_attn_merge
// inputs: part [B*HQ*M, nspan, D+2] float32, offset [1] int32, q [B, HQ, M, D] (T),
//         k [B, HKV, cap, D] (TK)  (q and k are passed only for their shapes)
// output: out [B, HQ, M, D] (T).  template: T, D
// launch: grid (B*HQ*M*D, 1, 1), threadgroup (256, 1, 1).
constexpr int SPAN = 64;
const int M = q_shape[2];
const int nrow = q_shape[0] * q_shape[1] * M;
const int nspan = part_shape[1];
const int cap_spans = nspan;
const size_t tid = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
if (tid >= (size_t)nrow * D) return;
const int row = (int)(tid / D);
const int d = (int)(tid % D);
const int i = row % M;
const int p = offset[0] + i;
const int cap = k_shape[2];
float res;
if (p < 0 || p >= cap) {
  res = __int_as_float(0x7fc00000); // NaN: the row lies outside the KV buffer
} else {
  const int ns = min(p / SPAN + 1, cap_spans);
  float mrun = TF_NEG_INF, lrun = 0.0f, o = 0.0f;
  // spans in order, their partials loaded U at a time ahead of use (same arithmetic)
  constexpr int U = 8;
  for (int s0 = 0; s0 < ns; s0 += U) {
    float pm[U], pl[U], po[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (s0 + u < ns) {
        const float* src = part + ((size_t)row * nspan + s0 + u) * (D + 2);
        pm[u] = src[D]; pl[u] = src[D + 1]; po[u] = src[d];
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (s0 + u < ns) {
        const float mn = fmaxf(mrun, pm[u]);
        const float fa = expf(__fsub_rn(mrun, mn));
        const float fb = expf(__fsub_rn(pm[u], mn));
        lrun = __fadd_rn(__fmul_rn(lrun, fa), __fmul_rn(pl[u], fb));
        o = __fmaf_rn(po[u], fb, __fmul_rn(o, fa));
        mrun = mn;
      }
    }
  }
  res = __fdiv_rn(o, lrun);
}
out[tid] = tf_from_float<T>(res);
