// Row-exact sparse (selected-key) GQA attention for MLX's CUDA backend
// (mx.fast.cuda_kernel, NVRTC JIT). Sections are cut by "// @@" marker lines.
//
// Arithmetic of query row (b, h, i) at absolute position p = offset + i (fixed by the
// row's ordered list of kept indices and D):
//   kept list = indices[b, i, :] in the order given, keeping entries e with 0 <= e <= p.
//   The kept list is cut into spans of SPAN=64 consecutive kept entries, spans into
//   chunks of C=64 (the last chunk holds what is left).
//   chunk:  s_j = fma-chain over d ascending of q[d]*k_{e_j}[d], times scale
//           mc = max_j s_j (exact);  e_j = expf(s_j - mc)
//           lc = butterfly sum over lanes of (e_lane + e_lane+32)
//           oc[d] = fma-chain over j ascending of e_j * v_{e_j}[d]
//   merge (chunks of a span in order into the span state, then spans in order into the
//   row state, same formula):
//           m' = max(m, mc); a = expf(m - m'); b = expf(mc - m')
//           l = l*a + lc*b;  o = fma(oc, b, o*a);  m = m'
//   out = o / l, rounded once to q's dtype; 0 if the kept list is empty; NaN if p is
//   outside the buffer.
// This is the arithmetic of row_attention.cu (spans of 64 keys, chunks of 64, span
// partials merged in order): with the full causal set 0..p in ascending order the bits
// are meant to equal row_attention's (tests/test_sparse_attention.py checks it).
//
// Kernel sparse_attn: one block per (block of 8 heads of the GQA group, b*HKV + hk, query
// row i); warp w owns head g = 8*blockIdx.x + w. Warp 0 compacts the kept entries 32 at a
// time (ballot + popc, order preserved) into a shared list; all warps of the block use the
// same chunk (same keys, shared by the GQA heads). K of a chunk is staged in shared memory
// as TK when STAGE (C*(D+1)*sizeof(TK) fits next to the rest in 48 KB; 16-byte loads, all
// in flight before any store), else each lane reads its key straight from global memory:
// same values, same arithmetic. V is read from global memory (L1/L2), 8 keys' loads ahead. M, T, the capacity and the offset never change a row's
// arithmetic.

// @@header
// (the shared helpers tf_to_float, tf_from_float, tf_load8, tf_extract, tf_load_chunk,
// tf_warp_sum, TF_FULL_MASK, TF_NEG_INF come from common.cuh, prepended by _sources.py)

// sparse_partial: 16-byte loads of D tile [d0, d0 + VPR * (16 / sizeof(TK))) of the rows pl[0..n)
// of src [cap, D] (from row base kvbase), PER per thread, all issued before any is used.
template <typename TK, int D, int VPR, int PER, int NTHREADS>
__device__ __forceinline__ void tf_tile_loads(const TK* src, size_t kvbase, const int* pl, int n,
                                              int d0, uint4 (&buf)[PER]) {
#pragma unroll
  for (int u = 0; u < PER; ++u) {
    const int e = threadIdx.x + u * NTHREADS;
    if (e < n * VPR) {
      buf[u] = __ldg(reinterpret_cast<const uint4*>(src + kvbase + (size_t)pl[e / VPR] * D + d0) + e % VPR);
    }
  }
}

// @@body sparse_attn
// inputs: q [B, HQ, M, D] (T), k, v [B, HKV, cap, D] (TK), indices [B, M, NI] int32,
//         offset [1] int32, scale_f [1] float32
// output: out [B, HQ, M, D] (T)
// template: T, TK, D, HQ, HKV, STAGE (bool)
// launch: grid (ceil(HQ/HKV/8)*256, B*HKV, M), threadgroup (256,1,1),
//         dynamic shared memory = 8*C*4 + (C+32)*4 + (STAGE ? C*(D+1)*sizeof(TK) : 0)
constexpr int C = 64;
constexpr int SPAN = 64;
constexpr int WARPS = 8;
constexpr int DP = D + 1;
constexpr int NT = (D + 31) / 32;
constexpr int G = HQ / HKV;
extern __shared__ float sm[];
__shared__ int s_count;
float* es = sm;                                    // WARPS * C softmax weights
int* plist = reinterpret_cast<int*>(es + WARPS * C); // C + 32 pending kept positions
TK* ks = reinterpret_cast<TK*>(plist + C + 32);    // C * DP keys (STAGE only)
const int M = q_shape[2];
const int cap = k_shape[2];
const int NI = indices_shape[2];
const int lane = threadIdx.x & 31;
const int warp = threadIdx.x >> 5;
const int b = blockIdx.y / HKV;
const int hk = blockIdx.y % HKV;
const int i = blockIdx.z;
const int g = blockIdx.x * WARPS + warp;
const bool head_ok = g < G;
const int h = hk * G + (head_ok ? g : 0);
const int p = offset[0] + i;
T* orow = out + ((size_t)(b * HQ + h) * M + i) * D;
if (p < 0 || p >= cap) { // uniform over the block: the row lies outside the KV buffer
  if (head_ok) {
    for (int d = lane; d < D; d += 32) orow[d] = tf_from_float<T>(__int_as_float(0x7fc00000));
  }
  return;
}
const int* irow = indices + (size_t)(b * M + i) * NI;
const T* qrow = q + ((size_t)(b * HQ + h) * M + i) * D;
const size_t kvbase = (size_t)(b * HKV + hk) * cap * D;
const float scale = scale_f[0];
float m_all = TF_NEG_INF, l_all = 0.0f, m_sp = TF_NEG_INF, l_sp = 0.0f;
float o_all[NT], o_sp[NT];
#pragma unroll
for (int t = 0; t < NT; ++t) {
  o_all[t] = 0.0f;
  o_sp[t] = 0.0f;
}
// span state -> row state (called once per span, spans in order; uniform over the block)
auto merge_span = [&]() {
  if (!head_ok) return;
  const float mn = fmaxf(m_all, m_sp);
  const float fa = expf(__fsub_rn(m_all, mn));
  const float fb = expf(__fsub_rn(m_sp, mn));
  l_all = __fadd_rn(__fmul_rn(l_all, fa), __fmul_rn(l_sp, fb));
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    o_all[t] = __fmaf_rn(o_sp[t], fb, __fmul_rn(o_all[t], fa));
    o_sp[t] = 0.0f;
  }
  m_all = mn;
  m_sp = TF_NEG_INF;
  l_sp = 0.0f;
};
int pend = 0;   // kept entries waiting in plist (uniform over the block)
int rp = 0;     // next raw index entry to look at (uniform)
int taken = 0;  // kept entries consumed so far (uniform)
for (;;) {
  // Refill the pending list to >= C kept entries (or to the end of the raw list).
  while (pend < C && rp < NI) {
    if (warp == 0) {
      const int e = rp + lane;
      const int idx = e < NI ? irow[e] : -1;
      const bool ok = idx >= 0 && idx <= p;
      const unsigned bal = __ballot_sync(TF_FULL_MASK, ok);
      if (ok) plist[pend + __popc(bal & ((1u << lane) - 1u))] = idx;
      if (lane == 0) s_count = __popc(bal);
    }
    __syncthreads();
    pend += s_count;
    rp += 32;
    __syncthreads();
  }
  const int n = min(C, pend);
  if (n == 0) break;
  if constexpr (STAGE) {
    // the chunk's key rows with 16-byte loads, all issued before any is stored (same values)
    constexpr int EPV = 16 / sizeof(TK);
    constexpr int VPR = D / EPV;                     // 16-byte loads per key row
    constexpr int PER = (C * VPR + 32 * WARPS - 1) / (32 * WARPS);
    static_assert(D % EPV == 0, "sparse_attn: rows of 16-byte multiples");
    uint4 kb[PER];
#pragma unroll
    for (int u = 0; u < PER; ++u) {
      const int e = threadIdx.x + u * 32 * WARPS;
      if (e < n * VPR) {
        kb[u] = __ldg(reinterpret_cast<const uint4*>(k + kvbase + (size_t)plist[e / VPR] * D) + e % VPR);
      }
    }
#pragma unroll
    for (int u = 0; u < PER; ++u) {
      const int e = threadIdx.x + u * 32 * WARPS;
      if (e < n * VPR) {
        const TK* kv = reinterpret_cast<const TK*>(&kb[u]);
        TK* dst = ks + (e / VPR) * DP + (e % VPR) * EPV;
#pragma unroll
        for (int x = 0; x < EPV; ++x) dst[x] = kv[x];
      }
    }
  }
  __syncthreads();
  if (head_ok) {
    float sa = TF_NEG_INF, sb = TF_NEG_INF;
    if (lane < n) {
      const TK* kr = STAGE ? (const TK*)(ks + lane * DP) : (k + kvbase + (size_t)plist[lane] * D);
      float acc = 0.0f;
#pragma unroll 16
      for (int d = 0; d < D; ++d) acc = __fmaf_rn(tf_to_float(qrow[d]), tf_to_float(kr[d]), acc);
      sa = __fmul_rn(acc, scale);
    }
    if (lane + 32 < n) {
      const TK* kr = STAGE ? (const TK*)(ks + (lane + 32) * DP)
                           : (k + kvbase + (size_t)plist[lane + 32] * D);
      float acc = 0.0f;
#pragma unroll 16
      for (int d = 0; d < D; ++d) acc = __fmaf_rn(tf_to_float(qrow[d]), tf_to_float(kr[d]), acc);
      sb = __fmul_rn(acc, scale);
    }
    const TfChunkSoftmax cs = tf_chunk_softmax(sa, sb, n, lane, es + warp * C, m_sp);
    const float lc = cs.lc, mn = cs.mn, fa = cs.fa, fb = cs.fb;
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      const int d = lane + 32 * t;
      if (d < D) {
        float oc = 0.0f;
#pragma unroll 8
        for (int j = 0; j < n; ++j) {
          oc = __fmaf_rn(es[warp * C + j], tf_to_float(v[kvbase + (size_t)plist[j] * D + d]), oc);
        }
        o_sp[t] = __fmaf_rn(oc, fb, __fmul_rn(o_sp[t], fa));
      }
    }
    l_sp = __fadd_rn(__fmul_rn(l_sp, fa), __fmul_rn(lc, fb));
    m_sp = mn;
    __syncwarp();
  }
  taken += n;
  if (taken % SPAN == 0) merge_span(); // a full span: merge it into the row state
  // Drop the consumed entries from the pending list.
  __syncthreads();
  const int rest = pend - n;
  const int carry = (int)threadIdx.x < rest ? plist[n + threadIdx.x] : 0;
  __syncthreads();
  if ((int)threadIdx.x < rest) plist[threadIdx.x] = carry;
  pend = rest;
  __syncthreads();
}
if (taken % SPAN != 0) merge_span(); // the last, partial span
if (head_ok) {
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    const int d = lane + 32 * t;
    if (d < D) orow[d] = tf_from_float<T>(taken > 0 ? __fdiv_rn(o_all[t], l_all) : 0.0f);
  }
}

// ---- split form (sparse_compact, sparse_partial, sparse_merge): the same arithmetic as
// sparse_attn, with the spans of a row spread over blocks (one block per span, like
// row_attn_partial) and D tiled so that any head size stages its keys and values with 16-byte
// loads. A span's state is computed from the zero state exactly as sparse_attn computes it
// (one chunk per span), written to a scratch array, and sparse_merge folds the spans in order
// with merge_span's formula.

// @@body sparse_compact
// inputs: indices [B, M, NI] int32, offset [1] int32, k [B, HKV, cap, D] (for cap only)
// outputs: kept [B*M, NI] int32 (the row's kept entries in order), nkept [B*M] int32
//          (their count; -1 when the row lies outside the KV buffer)
// launch: grid (B*M*32, 1, 1), threadgroup (32, 1, 1)
const int M = indices_shape[1];
const int NI = indices_shape[2];
const int cap = k_shape[2];
const int row = blockIdx.x;
const int lane = threadIdx.x;
const int p = offset[0] + row % M;
if (p < 0 || p >= cap) {
  if (lane == 0) nkept[row] = -1;
  return;
}
const int* irow = indices + (size_t)row * NI;
int* krow = kept + (size_t)row * NI;
int cnt = 0;
for (int rp = 0; rp < NI; rp += 32) {
  const int e = rp + lane;
  const int idx = e < NI ? irow[e] : -1;
  const bool ok = idx >= 0 && idx <= p;
  const unsigned bal = __ballot_sync(TF_FULL_MASK, ok);
  if (ok) krow[cnt + __popc(bal & ((1u << lane) - 1u))] = idx;
  cnt += __popc(bal);
}
if (lane == 0) nkept[row] = cnt;

// @@body sparse_partial
// inputs: q [B, HQ, M, D] (T), k, v [B, HKV, cap, D] (TK), kept [B*M, NI], nkept [B*M],
//         scale_f [1] float32, rinfo [2] int32 (R0, rows: query rows R0 .. R0+rows-1 of M)
// output: part [B*HQ*rows, nspan, D+2] float32 (o[0..D), m, l) -- only spans < ceil(n/64)
// template: T, TK, D, HQ, HKV, DT (D tile: divides D, DT*sizeof(TK) a multiple of 16)
// launch: grid (nspan*256, B*HKV, rows*ceil(G/8)), threadgroup (256, 1, 1),
//         dynamic shared memory = 8*C*4 + C*4 + C*(DT+1)*sizeof(TK) + C*DT*sizeof(TK)
constexpr int C = 64;
constexpr int WARPS = 8;
constexpr int G = HQ / HKV;
constexpr int GB = (G + WARPS - 1) / WARPS;
constexpr int EPV = 16 / sizeof(TK);
constexpr int VPR = DT / EPV;                       // 16-byte loads per key row of a D tile
constexpr int PER = (C * VPR + 32 * WARPS - 1) / (32 * WARPS);
constexpr int NTT = (DT + 31) / 32;                 // columns of a D tile per lane
static_assert(D % DT == 0 && (DT * sizeof(TK)) % 16 == 0, "sparse_partial: D tile");
extern __shared__ float sm[];
float* es = sm;                                     // WARPS * C softmax weights
int* pl = reinterpret_cast<int*>(es + WARPS * C);   // C kept positions of this span
TK* kt = reinterpret_cast<TK*>(pl + C);             // C * (DT+1) keys of one D tile
TK* vt = kt + C * (DT + 1);                         // C * DT values of one D tile (16-byte aligned)
const int M = q_shape[2];
const int cap = k_shape[2];
const int NI = kept_shape[1];
const int R0 = rinfo[0], rows = rinfo[1];
const int nspan = max(1, (NI + C - 1) / C);    // = part's dim 1 (_cuda.sparse_attention)
const int lane = threadIdx.x & 31;
const int warp = threadIdx.x >> 5;
const int span = blockIdx.x;
const int b = blockIdx.y / HKV;
const int hk = blockIdx.y % HKV;
const int zr = blockIdx.z / GB;
const int gb = blockIdx.z % GB;
const int i = R0 + zr;
const int gi = b * M + i;
const int g = gb * WARPS + warp;
const bool head_ok = g < G;
const int h = hk * G + (head_ok ? g : 0);
const int n_all = nkept[gi];
const int s0 = span * C;
if (n_all <= s0) return;                            // uniform: no such span (or row outside)
const int n = min(C, n_all - s0);
if ((int)threadIdx.x < n) pl[threadIdx.x] = kept[(size_t)gi * NI + s0 + threadIdx.x];
const T* qrow = q + ((size_t)(b * HQ + h) * M + i) * D;
const size_t kvbase = (size_t)(b * HKV + hk) * cap * D;
float* dst = part + ((size_t)((b * HQ + h) * rows + zr) * nspan + span) * (D + 2);
float acc_a = 0.0f, acc_b = 0.0f;
// scores: sparse_attn's fma chain over d ascending, continued across the D tiles
for (int d0 = 0; d0 < D; d0 += DT) {
  __syncthreads();
  uint4 buf[PER];
  tf_tile_loads<TK, D, VPR, PER, 32 * WARPS>(k, kvbase, pl, n, d0, buf);
#pragma unroll
  for (int u = 0; u < PER; ++u) {
    const int e = threadIdx.x + u * 32 * WARPS;
    if (e < n * VPR) {
      const TK* src = reinterpret_cast<const TK*>(&buf[u]);
      TK* kd = kt + (e / VPR) * (DT + 1) + (e % VPR) * EPV;
#pragma unroll
      for (int x = 0; x < EPV; ++x) kd[x] = src[x];
    }
  }
  __syncthreads();
  if (head_ok) {
#pragma unroll 8
    for (int d = 0; d < DT; ++d) {
      const float qd = tf_to_float(qrow[d0 + d]);
      if (lane < n) acc_a = __fmaf_rn(qd, tf_to_float(kt[lane * (DT + 1) + d]), acc_a);
      if (lane + 32 < n) acc_b = __fmaf_rn(qd, tf_to_float(kt[(lane + 32) * (DT + 1) + d]), acc_b);
    }
  }
}
float fa = 0.0f, fb = 0.0f;
if (head_ok) {
  // the span's one chunk from the zero state (m = -inf, l = 0, o = 0), as sparse_attn
  const float sa = lane < n ? __fmul_rn(acc_a, scale_f[0]) : TF_NEG_INF;
  const float sb = lane + 32 < n ? __fmul_rn(acc_b, scale_f[0]) : TF_NEG_INF;
  const TfChunkSoftmax cs = tf_chunk_softmax(sa, sb, n, lane, es + warp * C, TF_NEG_INF);
  fa = cs.fa;
  fb = cs.fb;
  if (lane == 0) {
    dst[D] = cs.mn;
    dst[D + 1] = __fadd_rn(__fmul_rn(0.0f, fa), __fmul_rn(cs.lc, fb));
  }
}
// values: per D tile, oc[d] = fma chain over j ascending
for (int d0 = 0; d0 < D; d0 += DT) {
  __syncthreads();
  uint4 buf[PER];
  tf_tile_loads<TK, D, VPR, PER, 32 * WARPS>(v, kvbase, pl, n, d0, buf);
#pragma unroll
  for (int u = 0; u < PER; ++u) {
    const int e = threadIdx.x + u * 32 * WARPS;
    if (e < n * VPR) reinterpret_cast<uint4*>(vt)[e] = buf[u];
  }
  __syncthreads();
  if (head_ok) {
#pragma unroll
    for (int tt = 0; tt < NTT; ++tt) {
      const int c = lane + 32 * tt;
      if (c < DT) {
        float oc = 0.0f;
#pragma unroll 8
        for (int j = 0; j < n; ++j) oc = __fmaf_rn(es[warp * C + j], tf_to_float(vt[j * DT + c]), oc);
        dst[d0 + c] = __fmaf_rn(oc, fb, __fmul_rn(0.0f, fa));
      }
    }
  }
}

// @@body sparse_merge
// inputs: part [B*HQ*rows, nspan, D+2] float32, nkept [B*M] int32, q [B, HQ, M, D] (T),
//         rinfo [2] int32 (R0, rows)
// output: out [B, HQ, rows, D] (T): query rows R0 .. R0+rows-1
// template: T, D, HQ.   launch: grid (B*HQ*rows*D, 1, 1), threadgroup (256, 1, 1)
constexpr int C = 64;
const int M = q_shape[2];
const int R0 = rinfo[0], rows = rinfo[1];
const int nspan = part_shape[1];
const size_t tid = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
if (tid >= (size_t)part_shape[0] * D) return;
const int prow = (int)(tid / D);          // (b*HQ + h)*rows + zr
const int d = (int)(tid % D);
const int zr = prow % rows;
const int b = prow / (rows * HQ);
const int nk = nkept[b * M + R0 + zr];
float res;
if (nk < 0) {
  res = __int_as_float(0x7fc00000);       // NaN: the row lies outside the KV buffer
} else {
  const int ns = (nk + C - 1) / C;
  float m_all = TF_NEG_INF, l_all = 0.0f, o_all = 0.0f;
  constexpr int U = 8;
  for (int s0 = 0; s0 < ns; s0 += U) {
    float pm[U], plv[U], po[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (s0 + u < ns) {
        const float* src = part + ((size_t)prow * nspan + s0 + u) * (D + 2);
        pm[u] = src[D]; plv[u] = src[D + 1]; po[u] = src[d];
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (s0 + u < ns) {                  // sparse_attn's merge_span
        const float mn = fmaxf(m_all, pm[u]);
        const float fa = expf(__fsub_rn(m_all, mn));
        const float fb = expf(__fsub_rn(pm[u], mn));
        l_all = __fadd_rn(__fmul_rn(l_all, fa), __fmul_rn(plv[u], fb));
        o_all = __fmaf_rn(po[u], fb, __fmul_rn(o_all, fa));
        m_all = mn;
      }
    }
  }
  res = nk > 0 ? __fdiv_rn(o_all, l_all) : 0.0f;
}
out[tid] = tf_from_float<T>(res);
