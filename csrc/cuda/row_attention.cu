// Row-exact causal GQA attention for MLX's CUDA backend (mx.fast.cuda_kernel, NVRTC JIT).
// Sections are cut by "// @@" marker lines (see row_gemm.cu).
//
// Arithmetic of query row (b, h, i) at absolute position p = offset + i (fixed by p, D and the
// KV dtype, which fix SPAN = 32 * NCH, `_cuda.attn_plan`):
//   keys are cut into chunks of C = 32 starting at key 0, chunks into spans of NCH chunks;
//   the last chunk is cut at p (keys > p are never read for this row).
//   chunk (key j = lane): a_x = fma-chain over 8-element groups ascending of q[8g+x]*k_j[8g+x]
//           (x = 0..7), s_j = (((a0+a1)+(a2+a3))+((a4+a5)+(a6+a7))) * scale
//           mc = max_j s_j (exact);  e_j = expf(s_j - mc)
//           lc = butterfly sum over the warp of e_j (the same value in every lane)
//           oc[d] = fma-chain over j ascending of e_j * v_j[d]
//   merge (one formula everywhere; from (m, l, o) = (-inf, 0, 0) the first merge is a copy):
//           m' = max(m, mc); a = expf(m - m'); b = expf(mc - m')
//           l = l*a + lc*b;  o = fma(oc, b, o*a);  m = m'
//   span   = the span's chunks merged ascending
//   group  = spans 16g .. 16g+15 (capped at p's span) merged ascending
//   row    = groups merged ascending;  out = o / l, rounded once to q's dtype.
// Kernel row_attn_partial: one block per (span, b*Hkv + kv head); the span's K and V come into
// shared memory once (cp.async, 16 bytes each) for every query row of that KV head (all GQA heads
// and all M rows of the call); warp (slot, chunk) takes one (row, chunk), WARPS / NCH rows a round.
// Kernel row_attn_tc (bf16/f16 KV of q's dtype, D % 16 == 0, D <= 128): the same spans with
// NCH = 1 and C = 64 (one chunk of 64 keys per span), scored and summed on tensor cores
// (mma.sync m16n8k16, fp32 accumulation; keys / head dims on the mma's M side, query rows on
// its N side, so each output element is its own dot product):
//           s_j = (mma chain over 16-element steps of D ascending of k_j . q) * scale
//           mc = max_j s_j;  e_j = expf(s_j - mc) rounded to T (the mma's input type)
//           lc = butterfly sum over the warp of (e_lane + e_lane+32), from the rounded e
//           oc[d] = mma chain over 16-key steps ascending of v[.][d] . e
// Kernel row_attn_merge: one block per (query row, DC columns); warp w merges group w of each
// batch of 16 groups, then warp 0 merges the batch's group results in order.
// M, the capacity and the offset only decide which blocks run and which rows they visit.

// @@header
// (the shared helpers tf_to_float, tf_from_float, tf_load8, tf_cp_async16, tf_warp_sum, tf_mma,
// tf_put_partial, tf_merge_partial,
// TF_FULL_MASK, TF_NEG_INF come from common.cuh, prepended by _sources.py)

// @@body row_attn_partial
// inputs: q [B, HQ, M, D] (T), k, v [B, HKV, cap, D] (TK), offset [1] int32,
//         scale_f [1] float32
// output: part [B*HQ*M, nspan, D+2] float32  (o[0..D), m, l) -- only spans <= p/SPAN written
// template: T, TK, D, HQ, HKV, NCH (chunks of 32 keys per span), VS (V staged in shared memory)
// launch: grid (nspan*256, B*HKV, 1), threadgroup (256,1,1), dynamic shared memory =
//         SPAN*(D+8)*sizeof(TK) (+ SPAN*D*sizeof(TK) with VS) + (8/NCH)*(NCH-1)*(D+2)*4 <= 48 KB
constexpr int C = 32;
constexpr int SPAN = C * NCH;
constexpr int WARPS = 8;
constexpr int RP = WARPS / NCH;                     // rows per round
constexpr int KST = D + 8;                          // padded K row: lanes' rows 16 B apart mod 128
constexpr int NT = (D + 31) / 32;
constexpr int G = HQ / HKV;
constexpr int EPV = 16 / sizeof(TK);
constexpr int DV = D / EPV;                         // 16-byte pieces of one K/V row
static_assert(D % 8 == 0 && (D * sizeof(TK)) % 16 == 0, "row_attn_partial: rows of 16-byte multiples");
extern __shared__ float sm[];
TK* ks = reinterpret_cast<TK*>(sm);                 // SPAN * KST keys
TK* vs = ks + SPAN * KST;                           // SPAN * D values (VS only)
float* xs = reinterpret_cast<float*>(vs + (VS ? SPAN * D : 0));   // RP*(NCH-1) chunk partials
const int M = q_shape[2];
const int cap = k_shape[2];
const int nspan = (cap + SPAN - 1) / SPAN;
const int lane = threadIdx.x & 31;
const int warp = threadIdx.x >> 5;
const int span = blockIdx.x;
const int b = blockIdx.y / HKV;
const int hk = blockIdx.y % HKV;
const int off = offset[0];
const int s0 = span * SPAN;
const int maxp = min(off + M - 1, cap - 1);
if (s0 > maxp) return; // uniform over the block
const int nk = min(SPAN, maxp + 1 - s0);
const size_t kvbase = (size_t)(b * HKV + hk) * cap * D;
for (int e = threadIdx.x; e < nk * DV; e += 32 * WARPS) {
  const int j = e / DV, x = (e % DV) * EPV;
  const size_t src = kvbase + (size_t)(s0 + j) * D + x;
  tf_cp_async16(ks + j * KST + x, k + src);
  if constexpr (VS) tf_cp_async16(vs + j * D + x, v + src);
}
tf_cp_async_wait_all();
__syncthreads();
const float scale = scale_f[0];
const int R = G * M;
const int rs = warp % RP;
const int c = warp / RP;
const int c0 = s0 + c * C;
for (int r0 = 0; r0 < R; r0 += RP) {
  const int r = r0 + rs;
  const int g = r / M, i = r % M;
  const int p = off + i;
  const int n = (r < R && p < cap) ? max(0, min(C, p + 1 - c0)) : 0;   // uniform over the warp
  float mc = TF_NEG_INF, lc = 0.0f, oc[NT];
#pragma unroll
  for (int t = 0; t < NT; ++t) oc[t] = 0.0f;
  if (n > 0) {
    const T* qrow = q + ((size_t)(b * HQ + hk * G + g) * M + i) * D;
    float s = TF_NEG_INF;
    if (lane < n) {
      const TK* krow = ks + (c * C + lane) * KST;
      float a[8];
#pragma unroll
      for (int x = 0; x < 8; ++x) a[x] = 0.0f;
#pragma unroll 4
      for (int d0 = 0; d0 < D; d0 += 8) {
        float kf[8];
        tf_load8(krow + d0, kf);
#pragma unroll
        for (int x = 0; x < 8; ++x) a[x] = __fmaf_rn(tf_to_float(qrow[d0 + x]), kf[x], a[x]);
      }
      s = __fmul_rn(__fadd_rn(__fadd_rn(__fadd_rn(a[0], a[1]), __fadd_rn(a[2], a[3])),
                              __fadd_rn(__fadd_rn(a[4], a[5]), __fadd_rn(a[6], a[7]))), scale);
    }
    mc = s;
#pragma unroll
    for (int sh = 16; sh >= 1; sh >>= 1) mc = fmaxf(mc, __shfl_xor_sync(TF_FULL_MASK, mc, sh));
    const float e = lane < n ? expf(__fsub_rn(s, mc)) : 0.0f;
    lc = tf_warp_sum(e);
#pragma unroll 8
    for (int j = 0; j < n; ++j) {
      const float ej = __shfl_sync(TF_FULL_MASK, e, j);
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        const int d = lane + 32 * t;
        if (d < D) {
          float vv;
          if constexpr (VS) vv = tf_to_float(vs[(c * C + j) * D + d]);
          else vv = tf_to_float(v[kvbase + (size_t)(c0 + j) * D + d]);
          oc[t] = __fmaf_rn(ej, vv, oc[t]);
        }
      }
    }
  }
  if constexpr (NCH > 1) {
    if (c > 0 && n > 0) tf_put_partial<D, NT>(xs + (rs * (NCH - 1) + c - 1) * (D + 2), oc, mc, lc, lane);
    __syncthreads();
  }
  if (c == 0 && n > 0) {
    float m = mc, l = lc;
    for (int cc = 1; cc < NCH; ++cc) {
      if (p >= s0 + cc * C) {      // chunk cc held keys of this row
        tf_merge_partial<D, NT>(m, l, oc, xs + (rs * (NCH - 1) + cc - 1) * (D + 2), lane);
      }
    }
    tf_put_partial<D, NT>(part + ((size_t)((b * HQ + hk * G + g) * M + i) * nspan + span) * (D + 2),
                          oc, m, l, lane);
  }
  if constexpr (NCH > 1) __syncthreads();
}

// @@body row_attn_tc
// inputs: q [B, HQ, M, D] (T), k, v [B, HKV, cap, D] (T), offset [1] int32, scale_f [1] float32
// output: part [B*HQ*M, nspan, D+2] float32  (o[0..D), m, l) -- only spans <= p/64 written
// template: T (bf16 or f16), D (multiple of 16, <= 128), HQ, HKV
// launch: grid (nspan*128, B*HKV, 1), threadgroup (128,1,1), dynamic shared memory =
//         (2*64 + 8)*(D+8)*2 + 8*68*4 + 8*72*2 + 8*2*4 <= 48 KB
// One block per (span of 64 keys, b*HKV + kv head): K and V come into shared memory once
// (cp.async; rows past the last needed key are zeroed), then the block walks the query rows of
// that KV head 8 at a time (the mma's N side). Warp w scores keys 16w..16w+15; warp w takes
// the softmax of rows 2w, 2w+1 (lane: keys lane, lane+32); warp w sums the d-tiles w, w+4, ...
constexpr int SPAN = 64;
constexpr int KST = D + 8;                          // padded K/V/q rows (16 B apart mod 128)
constexpr int SST = 68;                             // scores [8][SST] fp32
constexpr int PST = 72;                             // weights [8][PST] T
constexpr int G = HQ / HKV;
constexpr int DV = D / 8;                           // 16-byte pieces of a row
static_assert(D % 16 == 0 && D <= 128, "row_attn_tc: D a multiple of 16, at most 128");
extern __shared__ float sm[];
T* ks = reinterpret_cast<T*>(sm);
T* vs = ks + SPAN * KST;
T* qs = vs + SPAN * KST;
float* ss = reinterpret_cast<float*>(qs + 8 * KST);
T* ps = reinterpret_cast<T*>(ss + 8 * SST);
float* ml = reinterpret_cast<float*>(ps + 8 * PST);
const int M = q_shape[2];
const int cap = k_shape[2];
const int nspan = (cap + SPAN - 1) / SPAN;
const int lane = threadIdx.x & 31;
const int warp = threadIdx.x >> 5;
const int g8 = lane >> 2, t4 = lane & 3;            // mma fragment coordinates
const int span = blockIdx.x;
const int b = blockIdx.y / HKV;
const int hk = blockIdx.y % HKV;
const int off = offset[0];
const int s0 = span * SPAN;
const int maxp = min(off + M - 1, cap - 1);
if (s0 > maxp) return; // uniform over the block
const int nk = min(SPAN, maxp + 1 - s0);
const size_t kvbase = (size_t)(b * HKV + hk) * cap * D;
for (int e = threadIdx.x; e < SPAN * DV; e += 128) {
  const int j = e / DV, x = (e % DV) * 8;
  if (j < nk) {
    const size_t src = kvbase + (size_t)(s0 + j) * D + x;
    tf_cp_async16(ks + j * KST + x, k + src);
    tf_cp_async16(vs + j * KST + x, v + src);
  } else {
    *reinterpret_cast<uint4*>(ks + j * KST + x) = make_uint4(0u, 0u, 0u, 0u);
    *reinterpret_cast<uint4*>(vs + j * KST + x) = make_uint4(0u, 0u, 0u, 0u);
  }
}
tf_cp_async_wait_all();
const float scale = scale_f[0];
const int R = G * M;
for (int r0 = 0; r0 < R; r0 += 8) {
  __syncthreads();                                  // K/V staged; previous tile's reads done
  for (int e = threadIdx.x; e < 8 * DV; e += 128) { // this tile's 8 query rows (zeros past R)
    const int n = e / DV, x = (e % DV) * 8;
    const int r = r0 + n;
    uint4 val = make_uint4(0u, 0u, 0u, 0u);
    if (r < R) {
      const int g = r / M, i = r % M;
      val = *reinterpret_cast<const uint4*>(q + ((size_t)(b * HQ + hk * G + g) * M + i) * D + x);
    }
    *reinterpret_cast<uint4*>(qs + n * KST + x) = val;
  }
  __syncthreads();
  {                                                 // scores of keys 16w .. 16w+15
    float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    const T* ka = ks + (16 * warp + g8) * KST + 2 * t4;
    const T* qb = qs + g8 * KST + 2 * t4;
#pragma unroll
    for (int s = 0; s < D / 16; ++s) {
      unsigned int a[4], bb[2];
      a[0] = *reinterpret_cast<const unsigned int*>(ka + 16 * s);
      a[1] = *reinterpret_cast<const unsigned int*>(ka + 8 * KST + 16 * s);
      a[2] = *reinterpret_cast<const unsigned int*>(ka + 16 * s + 8);
      a[3] = *reinterpret_cast<const unsigned int*>(ka + 8 * KST + 16 * s + 8);
      bb[0] = *reinterpret_cast<const unsigned int*>(qb + 16 * s);
      bb[1] = *reinterpret_cast<const unsigned int*>(qb + 16 * s + 8);
      tf_mma(c, a, bb, T());
    }
    ss[(2 * t4) * SST + 16 * warp + g8] = c[0];
    ss[(2 * t4 + 1) * SST + 16 * warp + g8] = c[1];
    ss[(2 * t4) * SST + 16 * warp + g8 + 8] = c[2];
    ss[(2 * t4 + 1) * SST + 16 * warp + g8 + 8] = c[3];
  }
  __syncthreads();
#pragma unroll
  for (int h2 = 0; h2 < 2; ++h2) {                  // softmax of rows 2w, 2w+1
    const int n = 2 * warp + h2;
    const int r = r0 + n;
    const int p = off + (r % M);
    const bool rv = r < R && p < cap && p >= s0;    // uniform over the warp
    T ea = tf_from_float<T>(0.0f), eb = ea;
    if (rv) {
      const float sa = s0 + lane <= p ? __fmul_rn(ss[n * SST + lane], scale) : TF_NEG_INF;
      const float sb = s0 + lane + 32 <= p ? __fmul_rn(ss[n * SST + lane + 32], scale) : TF_NEG_INF;
      float mc = fmaxf(sa, sb);
#pragma unroll
      for (int sh = 16; sh >= 1; sh >>= 1) mc = fmaxf(mc, __shfl_xor_sync(TF_FULL_MASK, mc, sh));
      if (s0 + lane <= p) ea = tf_from_float<T>(expf(__fsub_rn(sa, mc)));
      if (s0 + lane + 32 <= p) eb = tf_from_float<T>(expf(__fsub_rn(sb, mc)));
      const float lc = tf_warp_sum(__fadd_rn(tf_to_float(ea), tf_to_float(eb)));
      if (lane == 0) {
        ml[2 * n] = mc;
        ml[2 * n + 1] = lc;
      }
    }
    ps[n * PST + lane] = ea;
    ps[n * PST + lane + 32] = eb;
  }
  __syncthreads();
  for (int dt = warp; dt < D / 16; dt += 4) {       // o[d] for d-tile dt, all 8 rows
    float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    const int mi = lane >> 3, rr = lane & 7;
    const T* va = vs + (rr + ((mi >> 1) << 3)) * KST + 16 * dt + ((mi & 1) << 3);
    const T* pb = ps + g8 * PST + 2 * t4;
#pragma unroll
    for (int s = 0; s < SPAN / 16; ++s) {
      unsigned int a[4], bb[2];
      const unsigned int addr = static_cast<unsigned int>(__cvta_generic_to_shared(va + 16 * s * KST));
      asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                   : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3]) : "r"(addr));
      bb[0] = *reinterpret_cast<const unsigned int*>(pb + 16 * s);
      bb[1] = *reinterpret_cast<const unsigned int*>(pb + 16 * s + 8);
      tf_mma(c, a, bb, T());
    }
#pragma unroll
    for (int h2 = 0; h2 < 2; ++h2) {
      const int n = 2 * t4 + h2;
      const int r = r0 + n;
      const int i = r % M;
      const int p = off + i;
      if (r < R && p < cap && p >= s0) {
        float* dst = part + ((size_t)((b * HQ + hk * G + r / M) * M + i) * nspan + span) * (D + 2);
        dst[16 * dt + g8] = c[h2];
        dst[16 * dt + g8 + 8] = c[2 + h2];
        if (dt == 0 && g8 == 0) {
          dst[D] = ml[2 * n];
          dst[D + 1] = ml[2 * n + 1];
        }
      }
    }
  }
}

// @@body row_attn_merge
// inputs: part [B*HQ*M, nspan, D+2] float32, offset [1] int32, q [B, HQ, M, D] (T),
//         k [B, HKV, cap, D] (TK)  (q and k are passed only for their shapes)
// output: out [B, HQ, M, D] (T).  template: T, D, SPAN, DC
// launch: grid (B*HQ*M*ceil(D/DC)*512, 1, 1), threadgroup (512, 1, 1), dynamic shared memory
//         16*(DC+2)*4.
// Block (row, c) writes columns [c*DC, c*DC + DC) of its row. Every block of a row folds the same
// (m, l) sequence in the same order, and a column's o depends only on that sequence and its own
// partials, so the columns come out bit-identical for every DC (DC = D: one block per row).
constexpr int GS = 16;                              // spans per group
constexpr int MW = 16;                              // warps: groups merged side by side
constexpr int NT = (DC + 31) / 32;
constexpr int NDB = (D + DC - 1) / DC;
constexpr int U = NT <= 4 ? 8 : (NT <= 8 ? 4 : 2);  // span partials loaded ahead of use
extern __shared__ float sm[];                       // MW group results (o[0..DC), m, l)
const int M = q_shape[2];
const int nspan = part_shape[1];
const int cap = k_shape[2];
const int row = blockIdx.x / NDB;
const int c0 = (blockIdx.x % NDB) * DC;             // this block's first column
const int lane = threadIdx.x & 31;
const int warp = threadIdx.x >> 5;
const int p = offset[0] + row % M;
T* dst = out + (size_t)row * D + c0;
if (p < 0 || p >= cap) {   // the row lies outside the KV buffer: NaN
  for (int d = threadIdx.x; d < DC && c0 + d < D; d += blockDim.x) dst[d] = tf_from_float<T>(__int_as_float(0x7fc00000));
  return;
}
const int ns = min(p / SPAN + 1, nspan);
const int ng = (ns + GS - 1) / GS;
const float* src = part + (size_t)row * nspan * (D + 2);
float m2 = TF_NEG_INF, l2 = 0.0f, o2[NT];
#pragma unroll
for (int t = 0; t < NT; ++t) o2[t] = 0.0f;
for (int gb = 0; gb < ng; gb += MW) {
  const int grp = gb + warp;
  if (grp < ng) {
    float m = TF_NEG_INF, l = 0.0f, o[NT];
#pragma unroll
    for (int t = 0; t < NT; ++t) o[t] = 0.0f;
    const int se = min(grp * GS + GS, ns);
    for (int s = grp * GS; s < se; s += U) {
      float pm[U], pl[U], po[U][NT];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (s + u < se) {
          const float* x = src + (size_t)(s + u) * (D + 2);
          pm[u] = x[D];
          pl[u] = x[D + 1];
#pragma unroll
          for (int t = 0; t < NT; ++t) {
            const int d = lane + 32 * t;
            po[u][t] = d < DC && c0 + d < D ? x[c0 + d] : 0.0f;
          }
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (s + u < se) {
          const float mn = fmaxf(m, pm[u]);
          const float fa = expf(__fsub_rn(m, mn)), fb = expf(__fsub_rn(pm[u], mn));
          l = __fadd_rn(__fmul_rn(l, fa), __fmul_rn(pl[u], fb));
#pragma unroll
          for (int t = 0; t < NT; ++t) o[t] = __fmaf_rn(po[u][t], fb, __fmul_rn(o[t], fa));
          m = mn;
        }
      }
    }
    tf_put_partial<DC, NT>(sm + warp * (DC + 2), o, m, l, lane);
  }
  __syncthreads();
  if (warp == 0) {
    for (int w = 0; w < MW && gb + w < ng; ++w) tf_merge_partial<DC, NT>(m2, l2, o2, sm + w * (DC + 2), lane);
  }
  __syncthreads();
}
if (warp == 0) {
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    const int d = lane + 32 * t;
    if (d < DC && c0 + d < D) dst[d] = tf_from_float<T>(__fdiv_rn(o2[t], l2));
  }
}
