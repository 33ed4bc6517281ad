// Row-exact sparse (selected-key) GQA attention for MLX's CUDA backend
// (mx.fast.cuda_kernel, NVRTC JIT). Sections are cut by "// @@" marker lines.
//
// Common to both arithmetics of query row (b, h, i) at absolute position p = offset + i:
//   kept list = indices[b, i, :] in the order given, keeping entries e with 0 <= e <= p.
//   The kept list is cut into spans of 64 consecutive kept entries (the last holds what is
//   left); each span gives a state (mc, lc, oc[0..D)) computed from its own entries alone;
//   the row state starts at (m, l, o) = (-inf, 0, 0) and the spans are merged in order:
//           m' = max(m, mc); a = expf(m - m'); b = expf(mc - m')
//           l = l*a + lc*b;  o = fma(oc, b, o*a);  m = m'
//   out = o / l, rounded once to q's dtype; 0 if the kept list is empty; NaN if p is
//   outside the buffer.
//
// Tensor-core arithmetic (bf16 / f16, q, K and V all of one dtype T, D % 16 == 0: kernel
// sparse_tc, the default for those dtypes; a function of T, D and the span's entries only):
//   s_j = (mma.sync m16n8k16 chain, fp32 accumulate from 0, over the 16-wide steps of d
//          ascending, of k_{e_j}[d] * q[d]) * scale
//   mc = max_j s_j (exact);  e_j = expf(s_j - mc) rounded to T
//   lc = butterfly sum over the warp of (e_lane + e_lane+32), from the rounded e_j
//   oc[d] = mma chain (fp32 from 0) over the 16-entry steps of j ascending of v_{e_j}[d] * e_j
// (row_attn_tc's span arithmetic over the span's kept entries instead of 64 consecutive keys.)
// Each element of an mma's result is its own dot product (common.cuh, tf_mma), so a (key, head)
// score and a (d, head) sum depend only on that head's query / weights and the span's K / V.
//
// CUDA-core arithmetic (every other dtype combination: kernels sparse_compact + sparse_partial,
// and the one-kernel form sparse_attn with the same bits):
//   s_j = fma-chain over d ascending of q[d]*k_{e_j}[d], times scale
//   mc = max_j s_j (exact);  e_j = expf(s_j - mc)
//   lc = butterfly sum over lanes of (e_lane + e_lane+32)
//   oc[d] = fma-chain over j ascending of e_j * v_{e_j}[d]
//   (the span state is one chunk merged into the zero state: the copy (mc, lc, oc)).
// Neither is row_attention.cu's arithmetic (its spans are 32 / 64 consecutive keys and its
// merge has two levels): given the full causal set a row's bits may differ from
// row_attention's by rounding (tests/test_sparse_attention.py holds both to the stated
// tolerance; docs/kernels.md, "sparse_attention").
//
// Kernel sparse_attn (one-kernel form, CUDA-core arithmetic): one block per (block of 8 heads
// of the GQA group, b*HKV + hk, query row i); warp w owns head g = 8*blockIdx.x + w. Warp 0
// compacts the kept entries 32 at a time (ballot + popc, order preserved) into a shared list;
// all warps of the block use the same span (same keys, shared by the GQA heads). K of a span is
// staged in shared memory as TK when STAGE (C*(D+1)*sizeof(TK) fits next to the rest in 48 KB;
// 16-byte loads, all in flight before any store), else each lane reads its key straight from
// global memory: same values, same arithmetic. V is read from global memory (L1/L2), 8 keys'
// loads ahead. M, T, the capacity, the offset and the rows' grouping into launches (rinfo)
// never change a row's arithmetic in any kernel here.

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
  const float fa = expf(__fsub_rn(m_all, tf_zmax(mn)));
  const float fb = expf(__fsub_rn(m_sp, tf_zmax(mn)));
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

// ---- CUDA-core split form (sparse_compact, sparse_partial, sparse_merge; every dtype but the
// tensor-core ones): the same arithmetic as sparse_attn, with the spans of a row spread over blocks (one block per span, like
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
// inputs: part [B*HQ*rows, nspan, D+2] float32, nkept [B, NR] int32, q [B, HQ, M, D] (T),
//         rinfo [3] int32 (R0, rows, R0n: query rows R0 .. R0+rows-1 of M; their counts are
//         nkept[b, R0n ..] -- R0n = R0 for sparse_compact's counts of all M rows, 0 for
//         sparse_tc's counts of the launch's rows)
// output: out [B, HQ, rows, D] (T): query rows R0 .. R0+rows-1
// template: T, D, HQ.
// launch: grid (B*HQ*rows*ceil(D/256)*256, 1, 1), threadgroup (256, 1, 1)
// One block per (b*HQ + h)*rows + zr and 256 columns d of it. The row's spans are merged in
// order with merge_span's formula, 32 at a time: every load of a batch is issued first; warp 0
// computes the batch's running maxima m_u (an inclusive max-scan over the lanes, fmaxf: exact,
// so m_u is the sequential running maximum), fa_u = expf(m_{u-1} - m_u), fb_u = expf(pm_u - m_u)
// and lane 0 the l chain in order; then every thread runs its o chain in order:
// o = fma(o_u, fb_u, o*fa_u). The same operations on the same values as one thread folding
// the spans one by one (sparse_attn's merge_span), so the same bits.
constexpr int C = 64;
constexpr int U = 32;
constexpr int NB = (D + 255) / 256;
__shared__ float sfa[U], sfb[U], spl[U];
__shared__ float sl;
const int rows = rinfo[1], R0n = rinfo[2];
const int NR = nkept_shape[0] / q_shape[0];
const int nspan = part_shape[1];
const int prow = blockIdx.x / NB;           // (b*HQ + h)*rows + zr
const int d = (blockIdx.x % NB) * 256 + threadIdx.x;
const int lane = threadIdx.x & 31;
const int zr = prow % rows;
const int b = prow / (rows * HQ);
const float* src = part + (size_t)prow * nspan * (D + 2);
// the first batch's loads go out with the count's (spans past the count are never used)
const int nf = min(U, nspan);
float po[U], pm = TF_NEG_INF, plv = 0.0f;
#pragma unroll
for (int u = 0; u < U; ++u) {
  if (u < nf && d < D) po[u] = src[(size_t)u * (D + 2) + d];
}
if (threadIdx.x < 32 && lane < nf) {
  pm = src[(size_t)lane * (D + 2) + D];
  plv = src[(size_t)lane * (D + 2) + D + 1];
}
const int nk = nkept[b * NR + R0n + zr];
if (nk < 0) {                               // NaN: the row lies outside the KV buffer
  if (d < D) out[(size_t)prow * D + d] = tf_from_float<T>(__int_as_float(0x7fc00000));
  return;
}
const int ns = (nk + C - 1) / C;
float m_all = TF_NEG_INF, l_all = 0.0f, o_all = 0.0f;   // m_all, l_all: warp 0 only
for (int s0 = 0; s0 < ns; s0 += U) {
  const int nb = min(U, ns - s0);
  if (s0 > 0) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (u < nb && d < D) po[u] = src[(size_t)(s0 + u) * (D + 2) + d];
    }
    if (threadIdx.x < 32 && lane < nb) {
      pm = src[(size_t)(s0 + lane) * (D + 2) + D];
      plv = src[(size_t)(s0 + lane) * (D + 2) + D + 1];
    }
  }
  if (threadIdx.x < 32) {
    if (lane >= nb) pm = TF_NEG_INF;
    spl[lane] = lane < nb ? plv : 0.0f;
    float mu = fmaxf(m_all, pm);            // running maximum after span s0 + lane
#pragma unroll
    for (int sh = 1; sh < 32; sh <<= 1) {
      const float y = __shfl_up_sync(TF_FULL_MASK, mu, sh);
      if (lane >= sh) mu = fmaxf(mu, y);
    }
    float mprev = __shfl_up_sync(TF_FULL_MASK, mu, 1);
    if (lane == 0) mprev = m_all;
    sfa[lane] = expf(__fsub_rn(mprev, tf_zmax(mu)));
    sfb[lane] = expf(__fsub_rn(pm, tf_zmax(mu)));
    m_all = __shfl_sync(TF_FULL_MASK, mu, nb - 1);
    __syncwarp();
    if (lane == 0) {
      for (int u = 0; u < nb; ++u) l_all = __fadd_rn(__fmul_rn(l_all, sfa[u]), __fmul_rn(spl[u], sfb[u]));
      sl = l_all;
    }
  }
  __syncthreads();
#pragma unroll
  for (int u = 0; u < U; ++u) {
    if (u < nb) o_all = __fmaf_rn(po[u], sfb[u], __fmul_rn(o_all, sfa[u]));
  }
  __syncthreads();                          // the batch's factors read before the next batch
}
if (d < D) out[(size_t)prow * D + d] = tf_from_float<T>(nk > 0 ? __fdiv_rn(o_all, sl) : 0.0f);

// @@body sparse_tc
// inputs: q [B, HQ, M, D] (T), k, v [B, HKV, cap, D] (T), indices [B, M, NI] int32,
//         offset [1] int32, scale_f [1] float32, rinfo [3] int32 (R0, rows, unused)
// outputs: part [B*HQ*rows, nspan, D+2] float32 (o[0..D), m, l) -- only spans < ceil(n/64);
//          nkept [B*rows] int32 (the row's kept count n; -1 when it lies outside the buffer)
// template: T (bf16 / f16: q, k and v all T), D (multiple of 16), HQ, HKV, DT (D tile, a
//           multiple of 16 dividing D), NST (tiles in the ring, >= 2), HB (heads per block: 8 or 16)
// launch: grid (nspan*128, B*HKV, rows*ceil(G/HB)), threadgroup (128, 1, 1), dynamic shared
//         memory = _cuda.sparse_tc_plan: NST*64*(DT+8)*2 + HB*68*4 + HB*72*2 + HB*8 + 64*4 + 32
// One block per (span of 64 kept entries, b*HKV + kv head, query row, HB heads of the group).
// 1. Compaction (every block of the row, redundantly): thread t counts the kept entries of its
//    run t*R .. t*R+R-1 of the raw list, a block-wide exclusive scan gives each run's first
//    rank, and the entries of ranks span*64 .. span*64+63 go to pl in order. Block (span 0,
//    head block 0) writes the count.
// 2. The span's keys (D tiles 0..NDT-1), then its values (tiles NDT..2*NDT-1), stream through a
//    ring of NST shared-memory tiles (64 rows of DT, padded to DT+8) by cp.async, NST-1 tiles
//    in flight; rows past n are zeros.
// 3. Scores on tensor cores: keys on the mma's M side (warp w: keys 16w..16w+15), heads on its N
//    side (HB/8 tiles of 8), q's fragments straight from global memory (L1); one accumulator
//    chain per (key, head) over the 16-wide steps of D ascending, across the tiles.
// 4. Softmax of head rows (warp w: heads w, w+4, ...; lane: keys lane, lane+32), weights
//    rounded to T. 5. PV on tensor cores: head dims on the M side (warp w: 16-wide d tiles
//    w, w+4, ... of each V tile, ldmatrix.trans), heads on the N side, 16-key steps ascending.
constexpr int C = 64;
constexpr int NW = 4;
constexpr int NTH = 32 * NW;
constexpr int KST = DT + 8;                         // padded tile row: 16 B apart mod 128
constexpr int NDT = D / DT;
constexpr int NTILE = 2 * NDT;                      // K tiles, then V tiles
constexpr int KS = DT / 16;                         // 16-wide steps of a tile
constexpr int NT = HB / 8;                          // n-tiles of 8 heads
constexpr int SST = C + 4;                          // scores [HB][SST] fp32
constexpr int PST = C + 8;                          // weights [HB][PST] T
constexpr int CPR = DT / 8;                         // 16-byte copies per tile row
constexpr int CPT = C * CPR / NTH;                  // copies per thread per tile
constexpr int G = HQ / HKV;
constexpr int GB = (G + HB - 1) / HB;
static_assert(D % DT == 0 && DT % 16 == 0 && (C * CPR) % NTH == 0 && HB % 8 == 0 && NST >= 2,
              "sparse_tc: D tiles of 16-multiples, heads in 8s");
extern __shared__ float sm[];
T* ring = reinterpret_cast<T*>(sm);                 // NST * C * KST
float* ss = reinterpret_cast<float*>(ring + NST * C * KST);
T* ps = reinterpret_cast<T*>(ss + HB * SST);
float* ml = reinterpret_cast<float*>(ps + HB * PST); // (m, l) per head
int* pl = reinterpret_cast<int*>(ml + HB * 2);      // C kept positions of this span
int* wsum = pl + C;                                 // NW warp counts
const int M = q_shape[2];
const int cap = k_shape[2];
const int NI = indices_shape[2];
const int R0 = rinfo[0], rows = rinfo[1];
const int nspan = max(1, (NI + C - 1) / C);         // = part's dim 1 (_cuda.sparse_attention)
const int lane = threadIdx.x & 31;
const int warp = threadIdx.x >> 5;
const int g8 = lane >> 2, t4 = lane & 3;            // mma fragment coordinates
const int span = blockIdx.x;
const int b = blockIdx.y / HKV;
const int hk = blockIdx.y % HKV;
const int zr = blockIdx.z / GB;
const int hb = blockIdx.z % GB;
const int i = R0 + zr;
const int p = offset[0] + i;
const bool writer = span == 0 && hb == 0 && threadIdx.x == 0;
if (p < 0 || p >= cap) {                            // uniform: the row lies outside the buffer
  if (writer) nkept[b * rows + zr] = -1;
  return;
}
// 1. compaction
const int* irow = indices + (size_t)(b * M + i) * NI;
const int R = (((NI + NTH - 1) / NTH) + 3) & ~3;    // a multiple of 4
const int e0 = min(NI, (int)threadIdx.x * R);
const int e1 = min(NI, e0 + R);
int cnt = 0;
if ((NI & 3) == 0) {                                // 16-byte loads (uniform branch)
#pragma unroll 4
  for (int e = e0; e < e1; e += 4) {
    const int4 x = __ldg(reinterpret_cast<const int4*>(irow + e));
    cnt += (x.x >= 0 && x.x <= p) + (x.y >= 0 && x.y <= p) + (x.z >= 0 && x.z <= p) +
           (x.w >= 0 && x.w <= p);
  }
} else {
#pragma unroll 4
  for (int e = e0; e < e1; ++e) {
    const int idx = __ldg(irow + e);
    cnt += (idx >= 0 && idx <= p) ? 1 : 0;
  }
}
int inc = cnt;
#pragma unroll
for (int sh = 1; sh < 32; sh <<= 1) {
  const int y = __shfl_up_sync(TF_FULL_MASK, inc, sh);
  if (lane >= sh) inc += y;
}
if (lane == 31) wsum[warp] = inc;
__syncthreads();
int rank = inc - cnt, total = 0;
#pragma unroll
for (int w = 0; w < NW; ++w) {
  const int x = wsum[w];
  if (w < warp) rank += x;
  total += x;
}
if (writer) nkept[b * rows + zr] = total;
const int s0 = span * C;
if (total <= s0) return;                            // uniform: no such span
const int n = min(C, total - s0);
if (rank < s0 + C && rank + cnt > s0) {
  for (int e = e0; e < e1 && rank < s0 + C; ++e) {
    const int idx = __ldg(irow + e);
    if (idx >= 0 && idx <= p) {
      if (rank >= s0) pl[rank - s0] = idx;
      ++rank;
    }
  }
}
if (n < C) {                                        // rows past n: zeros in every stage
  constexpr int PPR = KST / 8;
  for (int e = threadIdx.x; e < NST * (C - n) * PPR; e += NTH) {
    const int st = e / ((C - n) * PPR), rem = e % ((C - n) * PPR);
    *reinterpret_cast<uint4*>(ring + st * C * KST + (n + rem / PPR) * KST + (rem % PPR) * 8) =
        make_uint4(0u, 0u, 0u, 0u);
  }
}
__syncthreads();
const size_t kvbase = (size_t)(b * HKV + hk) * cap * D;
// 2. the tile copies of this thread (the same rows and columns in every tile)
size_t soff[CPT];
int doff[CPT];
bool cv[CPT];
#pragma unroll
for (int u = 0; u < CPT; ++u) {
  const int e = threadIdx.x + u * NTH;
  const int j = e / CPR, x = (e % CPR) * 8;
  cv[u] = j < n;
  soff[u] = kvbase + (cv[u] ? (size_t)pl[j] * D : 0) + x;
  doff[u] = j * KST + x;
}
auto issue = [&](int t) {
  if (t < NTILE) {
    const T* src = (t < NDT ? k + t * DT : v + (t - NDT) * DT);
    T* dst = ring + (t % NST) * C * KST;
#pragma unroll
    for (int u = 0; u < CPT; ++u) {
      if (cv[u]) tf_cp_async16(dst + doff[u], src + soff[u]);
    }
  }
  tf_cp_async_commit();
};
#pragma unroll
for (int t = 0; t < NST - 1; ++t) issue(t);
// q fragments: head 8*nt + g8 of the block, d = 16 s + 2 t4 (+1, +8, +9)
const unsigned int* qp[NT];
bool qv[NT];
#pragma unroll
for (int nt = 0; nt < NT; ++nt) {
  const int gh = hb * HB + 8 * nt + g8;
  qv[nt] = gh < G;
  qp[nt] = reinterpret_cast<const unsigned int*>(
      q + ((size_t)(b * HQ + hk * G + (qv[nt] ? gh : 0)) * M + i) * D + 2 * t4);
}
const float scale = scale_f[0];
float c[NT][4];
#pragma unroll
for (int nt = 0; nt < NT; ++nt) c[nt][0] = c[nt][1] = c[nt][2] = c[nt][3] = 0.0f;
for (int t = 0; t < NTILE; ++t) {
  unsigned int qb[KS][NT][2];
  if (t < NDT) {                                    // loads in flight with the tile's
#pragma unroll
    for (int s = 0; s < KS; ++s) {
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const int o = (t * DT + 16 * s) / 2;
        qb[s][nt][0] = qv[nt] ? __ldg(qp[nt] + o) : 0u;
        qb[s][nt][1] = qv[nt] ? __ldg(qp[nt] + o + 4) : 0u;
      }
    }
  }
  tf_cp_async_wait<NST - 2>();
  __syncthreads();                                  // tile t landed; tile t-1's readers done
  issue(t + NST - 1);
  const T* tile = ring + (t % NST) * C * KST;
  if (t < NDT) {                                    // 3. scores of keys 16w .. 16w+15
    const T* ka = tile + (16 * warp + g8) * KST + 2 * t4;
#pragma unroll
    for (int s = 0; s < KS; ++s) {
      unsigned int a[4];
      a[0] = *reinterpret_cast<const unsigned int*>(ka + 16 * s);
      a[1] = *reinterpret_cast<const unsigned int*>(ka + 8 * KST + 16 * s);
      a[2] = *reinterpret_cast<const unsigned int*>(ka + 16 * s + 8);
      a[3] = *reinterpret_cast<const unsigned int*>(ka + 8 * KST + 16 * s + 8);
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) tf_mma(c[nt], a, qb[s][nt], T());
    }
    continue;
  }
  if (t == NDT) {                                   // 4. softmax of the span's head rows
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      float* sd = ss + (8 * nt + 2 * t4) * SST + 16 * warp + g8;
      sd[0] = c[nt][0];
      sd[SST] = c[nt][1];
      sd[8] = c[nt][2];
      sd[SST + 8] = c[nt][3];
    }
    __syncthreads();
    for (int hh = warp; hh < HB; hh += NW) {
      const float sa = lane < n ? __fmul_rn(ss[hh * SST + lane], scale) : TF_NEG_INF;
      const float sb = lane + 32 < n ? __fmul_rn(ss[hh * SST + lane + 32], scale) : TF_NEG_INF;
      float mc = fmaxf(sa, sb);
#pragma unroll
      for (int sh = 16; sh >= 1; sh >>= 1) mc = fmaxf(mc, __shfl_xor_sync(TF_FULL_MASK, mc, sh));
      T ea = tf_from_float<T>(0.0f), eb = ea;
      if (lane < n) ea = tf_from_float<T>(expf(__fsub_rn(sa, tf_zmax(mc))));
      if (lane + 32 < n) eb = tf_from_float<T>(expf(__fsub_rn(sb, tf_zmax(mc))));
      const float lc = tf_warp_sum(__fadd_rn(tf_to_float(ea), tf_to_float(eb)));
      ps[hh * PST + lane] = ea;
      ps[hh * PST + lane + 32] = eb;
      if (lane == 0) {
        ml[2 * hh] = mc;
        ml[2 * hh + 1] = lc;
      }
    }
    __syncthreads();
  }
  const int vt = t - NDT;                           // 5. o of d tiles w, w+4, .. of V tile vt
  for (int dt = warp; dt < KS; dt += NW) {
    float o[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.0f;
    const int mi = lane >> 3, rr = lane & 7;
    const T* va = tile + (rr + ((mi >> 1) << 3)) * KST + 16 * dt + ((mi & 1) << 3);
#pragma unroll
    for (int s = 0; s < C / 16; ++s) {
      unsigned int a[4];
      tf_ldmatrix4t(va + 16 * s * KST, a);
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const T* pb = ps + (8 * nt + g8) * PST + 2 * t4 + 16 * s;
        unsigned int bb[2];
        bb[0] = *reinterpret_cast<const unsigned int*>(pb);
        bb[1] = *reinterpret_cast<const unsigned int*>(pb + 8);
        tf_mma(o[nt], a, bb, T());
      }
    }
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
      for (int h2 = 0; h2 < 2; ++h2) {
        const int hh = 8 * nt + 2 * t4 + h2;
        const int gh = hb * HB + hh;
        if (gh < G) {
          float* dst = part + ((size_t)((b * HQ + hk * G + gh) * rows + zr) * nspan + span) * (D + 2);
          const int d = vt * DT + 16 * dt + g8;
          dst[d] = o[nt][h2];
          dst[d + 8] = o[nt][2 + h2];
          if (vt == 0 && dt == 0 && g8 == 0) {
            dst[D] = ml[2 * hh];
            dst[D + 1] = ml[2 * hh + 1];
          }
        }
      }
    }
  }
}
