// Row-exact causal GQA attention for MLX's CUDA backend (mx.fast.cuda_kernel, NVRTC JIT).
// Sections are cut by "// @@" marker lines (see row_gemm.cu).
//
// Arithmetic of query row (b, h, i) at absolute position p = offset + i (fixed by p, D and the
// KV dtype, which fix SPAN = 32 * NCH, `_cuda.attn_plan`):
//   keys are cut into chunks of C = 32 starting at key 0, chunks into spans of NCH chunks;
//   the last chunk is cut at p (keys > p are never read for this row).
//   chunk (key j = lane): a_x = fma-chain over 8-element groups ascending of q[8g+x]*k_j[8g+x]
//           (x = 0..7), s_j = (((a0+a1)+(a2+a3))+((a4+a5)+(a6+a7))) * scale
//           (scale: the softmax scale times log2(e), rounded to fp32 by the host: scores in base 2)
//           mc = max_j s_j (exact);  e_j = 2^(s_j - mc)  (tf_ex2: ex2.approx.ftz, one MUFU.EX2)
//           lc = butterfly sum over the warp of e_j (the same value in every lane)
//           oc[d] = fma-chain over j ascending of e_j * v_j[d]
//   merge (one formula everywhere; from (m, l, o) = (-inf, 0, 0) the first merge is a copy):
//           m' = max(m, mc); a = 2^(m - m'); b = 2^(mc - m')
//           l = l*a + lc*b;  o = fma(oc, b, o*a);  m = m'
//   span   = the span's chunks merged ascending
//   half   = spans 8h .. 8h+7 (capped at p's span) merged ascending
//   group  = halves 2g, 2g+1 (the second where p reaches it) merged ascending: spans 16g .. 16g+15
//            (since session 37; before, the group's spans merged ascending. The halves let a
//            16-row verify window at 8k keys take 128 blocks where groups gave 64)
//   row    = groups merged ascending;  out = o / l, rounded once to q's dtype.
// Kernel row_attn_partial: one block per (span, b*Hkv + kv head); the span's K and V come into
// shared memory once (cp.async, 16 bytes each) for every query row of that KV head (all GQA heads
// and all M rows of the call); warp (slot, chunk) takes one (row, chunk), WARPS / NCH rows a round.
// Kernel row_attn_tc (bf16/f16 KV of q's dtype, D % 16 == 0, D <= 128): the same spans with
// NCH = 1 and C = 64 (one chunk of 64 keys per span), scored and summed on tensor cores
// (mma.sync m16n8k16, fp32 accumulation; keys / head dims on the mma's M side, query rows on
// its N side, so each output element is its own dot product):
//           s_j = (mma chain over 16-element steps of D ascending of k_j . q) * scale
//           mc = max_j s_j;  e_j = 2^(s_j - mc) rounded to T (the mma's input type)
//           lc = butterfly sum over the warp of (e_lane + e_lane+32), from the rounded e
//           oc[d] = mma chain over 16-key steps ascending of v[.][d] . e
// Kernel row_attn_tcg (where row_attn_tc applies; _cuda.attn_tcg_plan picks it): the same span
// arithmetic with each 8-row tile of query rows taken by its own warp (or 2 or 4: KW); with
// SPB = 8 a block also folds a half's spans itself (the merge's formula and order) and writes
// the half's result, which the merge takes as it is (E 8; row_attn_wg's SPB 16 folds the group, E
// 16). The same bits as row_attn_tc + row_attn_merge for every plan.
// Kernel row_attn_tcr: row_attn_tcg with the mma's sides swapped (16 query rows a warp on the M
// side, the weights passed to the value chains in registers): the same bits, every plan.
// Kernel row_attn_merge: one block per (query row, DC columns); warp w merges group w of each
// batch of MW groups, then warp 0 merges the batch's group results in order (span partials), or
// one warp walks the halves / groups of the group blocks in order.
// M, the capacity and the offset only decide which blocks run and which rows they visit.

// @@header
// (the shared helpers tf_to_float, tf_from_float, tf_load8, tf_cp_async16, tf_warp_sum, tf_mma, tf_ldmatrix4(t), tf_ex2,
// tf_put_partial, tf_merge_partial,
// TF_FULL_MASK, TF_NEG_INF come from common.cuh, prepended by _sources.py)
// The max of v[0 .. N) (N a power of 2) as a balanced tree of fmaxf: a max is order-free (scores
// hold no NaN; a +0 / -0 tie changes no weight, no fold factor and no output), so the tree gives the
// value a chain gives, with a dependent depth of log2 N instead of N.
template <int N>
__device__ __forceinline__ float tf_max_tree(const float* v) {
  if constexpr (N == 1) return v[0];
  else return fmaxf(tf_max_tree<N / 2>(v), tf_max_tree<N / 2>(v + N / 2));
}
// One 64-key span's softmax for a warp's 16 query rows in the mma C-fragment layout (row_attn_tcr,
// row_attn_wg): lane (g8, t4) holds c[n][2 h + e], the score of key s0 + 8 n + 2 t4 + e for row
// g8 + 8 h at position pr[h]. Masks keys past pr, scales, takes the span's max mc, writes the
// weights 2^(s - mc) rounded to T into c and as the value chains' A fragments pa[key step 16][4];
// the weight sum's tree (row_attn_tc's: key bits 5, 4, 3 inside the lane over n, then lanes ^ 2,
// ^ 1, then bit 0); and the fold factors fa, fb with the running (m, l) (SPB 1: the span's own).
template <typename T, int SPB>
__device__ __forceinline__ void tf_span_softmax(float (&c)[8][4], int s0, int t4, float scale,
                                                const int (&pr)[2], const bool (&rok)[2],
                                                float (&mrun)[2], float (&lrun)[2],
                                                unsigned int (&pa)[4][4], float (&fa)[2],
                                                float (&fb)[2], bool (&fold)[2]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float xs[16];
#pragma unroll
    for (int n = 0; n < 8; ++n) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float& x = c[n][2 * h + e];
        x = s0 + 8 * n + 2 * t4 + e <= pr[h] ? __fmul_rn(x, scale) : TF_NEG_INF;
        xs[2 * n + e] = x;
      }
    }
    float mc = tf_max_tree<16>(xs);
    mc = fmaxf(mc, __shfl_xor_sync(TF_FULL_MASK, mc, 1));
    mc = fmaxf(mc, __shfl_xor_sync(TF_FULL_MASK, mc, 2));
    const float mz = mc == TF_NEG_INF ? 0.0f : mc;
    unsigned int eb[8];                             // the rounded weights' bits, keys 8 n + 2 t4 + 0 / 1
#pragma unroll
    for (int n = 0; n < 8; ++n) {
      float* x = &c[n][2 * h];
      eb[n] = tf_pack2<T>(tf_ex2(__fsub_rn(x[0], mz)), tf_ex2(__fsub_rn(x[1], mz)));
      x[0] = tf_half_of<T>(eb[n], 0);
      x[1] = tf_half_of<T>(eb[n], 1);
    }
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      pa[ks][h] = eb[2 * ks];
      pa[ks][2 + h] = eb[2 * ks + 1];
    }
    float y[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {                   // key bits 5, 4, 3 in the lane, then 2, 1 across lanes
      const int i = 2 * h + e;
      y[e] = __fadd_rn(__fadd_rn(__fadd_rn(c[0][i], c[4][i]), __fadd_rn(c[2][i], c[6][i])),
                       __fadd_rn(__fadd_rn(c[1][i], c[5][i]), __fadd_rn(c[3][i], c[7][i])));
      y[e] = __fadd_rn(y[e], __shfl_xor_sync(TF_FULL_MASK, y[e], 2));
      y[e] = __fadd_rn(y[e], __shfl_xor_sync(TF_FULL_MASK, y[e], 1));
    }
    const float lc = __fadd_rn(y[0], y[1]);         // key bit 0
    fold[h] = rok[h] && pr[h] >= s0;
    const float mn = fmaxf(mrun[h], mc);
    fa[h] = tf_ex2(__fsub_rn(mrun[h], tf_zmax(mn)));
    fb[h] = tf_ex2(__fsub_rn(mc, tf_zmax(mn)));
    if (SPB == 1) {
      mrun[h] = mc;
      lrun[h] = lc;
    } else if (fold[h]) {
      lrun[h] = __fadd_rn(__fmul_rn(lrun[h], fa[h]), __fmul_rn(lc, fb[h]));
      mrun[h] = mn;
    }
  }
}

// The partials (o, m, l) of a warp's 16 query rows in the mma C-fragment layout (row_attn_tcr,
// row_attn_wg): lane (g8, t4) holds o[dt][2 h + e] = d 8 dt + 2 t4 + e of row r = rg + 8 h (rg = r0 +
// g8), written where the row is valid and reaches the block's first key k0; q head h0 + r / M.
template <int D>
__device__ __forceinline__ void tf_put_rows16(float* part, const float (&o)[D / 8][4], const float (&mrun)[2],
                                              const float (&lrun)[2], const int (&pr)[2], const bool (&rok)[2],
                                              int rg, int M, int h0, int nblk, int blk, int k0, int t4) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = rg + 8 * h;
    if (rok[h] && pr[h] >= k0) {
      float* dst = part + ((size_t)((h0 + r / M) * M + r % M) * nblk + blk) * (D + 2);
#pragma unroll
      for (int dt = 0; dt < D / 8; ++dt) {
        dst[8 * dt + 2 * t4] = o[dt][2 * h];
        dst[8 * dt + 2 * t4 + 1] = o[dt][2 * h + 1];
      }
      if (t4 == 0) {
        dst[D] = mrun[h];
        dst[D + 1] = lrun[h];
      }
    }
  }
}
// One span's K and V rows s0 .. s0 + nk - 1 into shared rows of KST elements (cp.async, the
// block's NTH threads), rows nk .. SPAN - 1 zeroed: row_attn_tc's staging, and row_attn_tcg's
// for a partial span or a head size whose 16-byte columns do not divide its threads
template <typename T, int D, int KST, int SPAN, int NTH>
__device__ __forceinline__ void tf_stage_kv(T* ks, T* vs, const T* k, const T* v, size_t kvbase,
                                            int s0, int nk) {
  constexpr int DV = D / 8;
  for (int e = threadIdx.x; e < SPAN * DV; e += NTH) {
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
}

// Span s (< se) of K and V into buffer s % NB of kvs (NB buffers of SPAN K rows then SPAN V rows of
// KST elements), then one cp.async commit (a group even when s >= se): row_attn_tcg's and
// row_attn_tcr's staging. A full span where 16-byte columns divide NTH (FIXED) has each thread on
// one column, every RS-th row, the row offsets in the copy instructions; else tf_stage_kv.
template <typename T, int D, int KST, int SPAN, int NTH, int NB>
__device__ __forceinline__ void tf_load_span(T* kvs, const T* k, const T* v, size_t kvbase, int s,
                                             int se, int maxp) {
  constexpr int DV = D / 8;
  constexpr int RS = NTH / DV;
  constexpr bool FIXED = NTH % DV == 0 && SPAN % RS == 0;
  if (s < se) {
    T* ks = kvs + (s % NB) * 2 * SPAN * KST;
    T* vs = ks + SPAN * KST;
    const int s0 = s * SPAN;
    const int nk = min(SPAN, maxp + 1 - s0);
    if (FIXED && nk == SPAN) {
      const int j0 = threadIdx.x / DV, x = (threadIdx.x % DV) * 8;
      const size_t src = kvbase + (size_t)(s0 + j0) * D + x;
      const unsigned int kd = static_cast<unsigned int>(__cvta_generic_to_shared(ks + j0 * KST + x));
      tf_unroll<SPAN / RS>([&](auto i) {
        constexpr int B = sizeof(T);
        tf_cp_async16s<i.value * RS * D * B>(kd + i.value * RS * KST * B, k + src);
        tf_cp_async16s<i.value * RS * D * B>(kd + (SPAN + i.value * RS) * KST * B, v + src);
      });
    } else {
      tf_stage_kv<T, D, KST, SPAN, NTH>(ks, vs, k, v, kvbase, s0, nk);
    }
  }
  tf_cp_async_commit();
}

// Unit u (16 bytes) of a 64-row tile of D 16-bit elements a row in wgmma's 128-byte swizzled layout,
// as an element offset, and its row j / column x: row u / DB, chunk cc = u % DB, stored in the half
// cc / 8 (64 rows x 128 bytes, 8-row atoms of 1,024 bytes) at chunk (cc % 8) ^ (j % 8). Unit u + 128 i
// is row j + RI i (RI = 128 / DB, a multiple of 8: the same swizzle) at offset + 64 RI i.
template <int D>
__device__ __forceinline__ int tf_wg_unit(int u, int& j, int& x) {
  constexpr int DB = D / 8;
  j = u / DB;
  const int cc = u % DB;
  x = cc * 8;
  return (cc / 8) * 4096 + j * 64 + (((cc % 8) ^ (j % 8)) * 8);
}
// Span s (< se) of K and V into buffer s % NB of kvs (NB buffers of SPAN K rows then SPAN V rows, D
// elements a row) in tf_wg_unit's layout (one copy instruction a unit, offsets constant), rows past
// the last needed key zeroed; then one cp.async commit (a group even when s >= se). row_attn_wg's.
template <typename T, int D, int SPAN, int NB>
__device__ __forceinline__ void tf_wg_load_span(T* kvs, const T* k, const T* v, size_t kvbase, int s,
                                                int se, int maxp) {
  constexpr int DB = D / 8;
  constexpr int RI = 128 / DB;
  constexpr int NI = SPAN * DB / 128;
  constexpr int STEP = RI * 64;                      // elements between a thread's units
  static_assert(128 % DB == 0 && SPAN % RI == 0 && RI % 8 == 0, "tf_wg_load_span: D");
  if (s < se) {
    T* ks = kvs + (s % NB) * 2 * SPAN * D;
    const int s0 = s * SPAN;
    const int nk = min(SPAN, maxp + 1 - s0);
    int j0, x;
    T* kdst = ks + tf_wg_unit<D>(threadIdx.x, j0, x);
    const size_t src = kvbase + (size_t)(s0 + j0) * D + x;
    const unsigned int kd = static_cast<unsigned int>(__cvta_generic_to_shared(kdst));
    if (nk == SPAN) {
      tf_unroll<NI>([&](auto i) {
        constexpr int B = sizeof(T);
        tf_cp_async16s<i.value * RI * D * B>(kd + i.value * STEP * B, k + src);
        tf_cp_async16s<i.value * RI * D * B>(kd + (SPAN * D + i.value * STEP) * B, v + src);
      });
    } else {
#pragma unroll
      for (int i = 0; i < NI; ++i) {
        T* dst = kdst + STEP * i;
        if (j0 + RI * i < nk) {
          tf_cp_async16(dst, k + src + (size_t)RI * i * D);
          tf_cp_async16(dst + SPAN * D, v + src + (size_t)RI * i * D);
        } else {
          *reinterpret_cast<uint4*>(dst) = make_uint4(0u, 0u, 0u, 0u);
          *reinterpret_cast<uint4*>(dst + SPAN * D) = make_uint4(0u, 0u, 0u, 0u);
        }
      }
    }
  }
  tf_cp_async_commit();
}

// A warp's 16 query rows rg + 8 h (lane (g8, t4): rg = the warp's first row + g8) at the start of a
// block (row_attn_tcr, row_attn_wg): positions pr, whether the row exists and lies in the KV buffer
// (rok), the running (m, l) = (-inf, 0) and o = 0.
template <int D>
__device__ __forceinline__ void tf_rows16_init(int rg, int off, int M, int R, int cap, int (&pr)[2],
                                               bool (&rok)[2], float (&mrun)[2], float (&lrun)[2],
                                               float (&o)[D / 8][4]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = rg + 8 * h;
    pr[h] = off + r % M;
    rok[h] = r < R && pr[h] < cap;
    mrun[h] = TF_NEG_INF;
    lrun[h] = 0.0f;
  }
#pragma unroll
  for (int dt = 0; dt < D / 8; ++dt) {
#pragma unroll
    for (int i = 0; i < 4; ++i) o[dt][i] = 0.0f;
  }
}

// A block's 64 query rows rb0 .. rb0 + 63 (of R; q head h0 + r / M, row r % M) into qs in tf_wg_unit's
// layout by cp.async (the caller's next commit group), rows past R zeroed (row_attn_wg; 128 threads).
// Plain loads each followed by its shared store ran as a chain of 8 round trips to memory.
template <typename T, int D>
__device__ __forceinline__ void tf_wg_stage_q(T* qs, const T* q, int rb0, int R, int M, int h0) {
#pragma unroll
  for (int i = 0; i < D / 16; ++i) {
    int jr, x;
    const int e = tf_wg_unit<D>(threadIdx.x + 128 * i, jr, x), r = rb0 + jr;
    if (r < R) tf_cp_async16(qs + e, q + ((size_t)(h0 + r / M) * M + r % M) * D + x);
    else *reinterpret_cast<uint4*>(qs + e) = make_uint4(0u, 0u, 0u, 0u);
  }
}

// A span's sums cv of one 8-column d tile (the C-fragment layout: rows g8 + 8 (i >> 1)) into the
// running o: taken as they are (SPB 1), or folded where the row saw the span (row_attn_tcr, row_attn_wg).
template <int SPB>
__device__ __forceinline__ void tf_take_sums(float (&x)[4], const float* cv, const bool (&fold)[2],
                                             const float (&fa)[2], const float (&fb)[2]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int h = i >> 1;
    if (SPB == 1) x[i] = cv[i];
    else if (fold[h]) x[i] = __fmaf_rn(cv[i], fb[h], __fmul_rn(x[i], fa[h]));
  }
}

// (m2, l2, o2) folded, the merge's formula, into (m, l, o), or into (-inf, 0, 0) with Z, for the
// rows where c (the C-fragment layout: row g8 + 8 h in o[.][2 h + e]): row_attn_wg's group of two halves.
template <int D, bool Z>
__device__ __forceinline__ void tf_fold_rows16(float (&m)[2], float (&l)[2], float (&o)[D / 8][4], const float (&m2)[2],
                                               const float (&l2)[2], const float (&o2)[D / 8][4], const bool (&c)[2]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    if (!c[h]) continue;
    const float m1 = Z ? TF_NEG_INF : m[h], mn = fmaxf(m1, m2[h]);
    const float fa = tf_ex2(__fsub_rn(m1, tf_zmax(mn))), fb = tf_ex2(__fsub_rn(m2[h], tf_zmax(mn)));
    l[h] = __fadd_rn(__fmul_rn(Z ? 0.0f : l[h], fa), __fmul_rn(l2[h], fb));
#pragma unroll
    for (int i = 0; i < D / 4; ++i) {
      float& x = o[i / 2][2 * h + i % 2];
      x = __fmaf_rn(o2[i / 2][2 * h + i % 2], fb, __fmul_rn(Z ? 0.0f : x, fa));
    }
    m[h] = mn;
  }
}

// One 64-key span s0 .. s0 + 63 of a warpgroup's 64 query rows on wgmma (row_attn_wg):
// K and V at kb (tf_wg_load_span's layout), q by the descriptor qd. The scores one m64n64k16 chain
// over the k16 steps of D, tcr's softmax (tf_span_softmax), the sums one m64n64k16 chain over the
// span's four 16-key steps a 64-column half of D (the weights from registers, V MN-major); then o
// (tcr's C-fragment layout) takes the span's sums (SPB 1) or folds them (SPB 8).
template <typename T, int D, int SPB>
__device__ __forceinline__ void tf_wg_span(const T* kb, unsigned long long qd, int s0, int t4, float scale,
                                           const int (&pr)[2], const bool (&rok)[2], float (&mrun)[2],
                                           float (&lrun)[2], float (&o)[D / 8][4]) {
  constexpr int NDT = D / 16;
  const unsigned long long kd = tf_wg_desc(kb, 16, 1024), vd = tf_wg_desc(kb + 64 * D, 8192, 1024);
  float c[32];                                      // scores: key 8 n + 2 t4 + (i & 1), row g8 + 8 (i >> 1) in c[4 n + i]
  tf_wg_fence();
  tf_wgmma_ss<true>(c, qd, kd, T());
#pragma unroll
  for (int st = 1; st < NDT; ++st) {                // k16 step st: 32 bytes along a 128-byte row, then the other half
    const int o16 = (st / 4) * 512 + (st % 4) * 2;
    tf_wgmma_ss<false>(c, qd + o16, kd + o16, T());
  }
  tf_wg_commit();
  tf_wg_wait<0>();
  tf_wg_hold(c);
  float sc[32];                                     // the scores, then the rounded weights (c only ever wgmma's)
#pragma unroll
  for (int i = 0; i < 32; ++i) sc[i] = c[i];
  float fa[2], fb[2];
  bool fold[2];
  unsigned int pa[4][4];                            // A fragments of the weights, key steps of 16
  tf_span_softmax<T, SPB>(reinterpret_cast<float(&)[8][4]>(sc), s0, t4, scale, pr, rok, mrun, lrun, pa, fa, fb, fold);
#pragma unroll
  for (int nh = 0; nh < D / 64; ++nh) {             // d 64 nh .. 64 nh + 63: tcr's value chains (V MN-major,
    float cv[32];                                   // SBO the 8-key atoms, a key step 2 of them, a d half 8 KB)
    tf_wg_fence();
    tf_wgmma_rs<true>(cv, pa[0], vd + 512 * nh, T());
#pragma unroll
    for (int ks = 1; ks < 4; ++ks) tf_wgmma_rs<false>(cv, pa[ks], vd + 128 * ks + 512 * nh, T());
    tf_wg_commit();
    tf_wg_wait<0>();
    tf_wg_hold(cv);
#pragma unroll
    for (int j = 0; j < 8; ++j) tf_take_sums<SPB>(o[8 * nh + j], cv + 4 * j, fold, fa, fb);
  }
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) tf_wg_hold(pa[ks]);  // the value chains' A fragments, read until here
}

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
    const float e = lane < n ? tf_ex2(__fsub_rn(s, tf_zmax(mc))) : 0.0f;
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
tf_stage_kv<T, D, KST, SPAN, 128>(ks, vs, k, v, kvbase, s0, nk);
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
      const float mz = tf_zmax(mc);
      if (s0 + lane <= p) ea = tf_from_float<T>(tf_ex2(__fsub_rn(sa, mz)));
      if (s0 + lane + 32 <= p) eb = tf_from_float<T>(tf_ex2(__fsub_rn(sb, mz)));
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
      tf_ldmatrix4t(va + 16 * s * KST, a);
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

// @@body row_attn_tcg
// inputs: q [B, HQ, M, D] (T), k, v [B, HKV, cap, D] (T), offset [1] int32, scale_f [1] float32
// output: part [B*HQ*M, nblk, D+2] float32, nblk = ceil(cap / (64 SPB)): with SPB = 1
//         row_attn_tc's span partials, with SPB = 8 half results (only those <= p written)
// template: T (bf16 or f16), D (multiple of 16, <= 128), HQ, HKV, NW (8-row tiles a block),
//           NB (K/V buffers, >= 2), SPB (spans a block: 1 or 8, a half), KW (warps a row tile, 1, 2 or 4:
//           warp kh scores keys 64 / KW kh .. and sums d tiles kh NDW ..)
// launch: grid (nblk * ceil(HQ/HKV * M / (8 NW)) * 32 NW KW, B*HKV, 1), threadgroup (32 NW KW, 1,
//         1), dynamic shared memory (NB*2*64*(D+8) + NW*8*72)*2 + NW*KW*8*4 (_cuda.attn_tcg_smem)
// row_attn_tc's span arithmetic with the rows spread over warps: block (SPB spans, 8 NW query
// rows, b*HKV + kv head) stages each span's K and V for all its warps (NB buffers), and row tile
// rt (its KW warps) alone takes rows 8 rt .. 8 rt + 7 through the block's spans: the same mma
// chains as row_attn_tc (scores over D, weights over keys), the same softmax (mc a max,
// order-free: with KW > 1 each warp's max of its keys, exchanged; lc row_attn_tc's butterfly
// tree over lanes l of e_l + e_{l+32}: the pairs l ^ 16 and l ^ 8 inside a lane, l ^ 4, 2, 1
// across lanes, with KW > 1 from the rounded weights in shared memory). SPB 1 writes the span
// partial as row_attn_tc does. SPB 8 folds the half's spans (capped at each row's span) in
// order with row_attn_merge's formula, in registers, from (-inf, 0, 0), and writes the half's
// state, which row_attn_merge (E 8) folds into its group as it folds the halves it computes.
// Either way the bits of row_attn_tc + row_attn_merge, whatever NW, NB, SPB and KW.
constexpr int SPAN = 64;
constexpr int KST = D + 8;
constexpr int PST = 72;                             // a row tile's weights [8][PST]
constexpr int G = HQ / HKV;
constexpr int NDT = D / 16;
constexpr int NKT = 4 / KW;                         // key tiles a warp scores
constexpr int NDW = (NDT + KW - 1) / KW;            // d tiles a warp sums
constexpr int NTH = 32 * NW * KW;
static_assert(D % 16 == 0 && D <= 128 && NW >= 1 && NW <= 8 && NB >= 2 && (SPB == 1 || SPB == 8) &&
              (KW == 1 || KW == 2 || KW == 4), "row_attn_tcg: plan");
extern __shared__ float sm[];
const int lane = threadIdx.x & 31;
const int warp = threadIdx.x >> 5;
const int rt = warp / KW, kh = warp % KW;
const int g8 = lane >> 2, t4 = lane & 3;
T* kvs = reinterpret_cast<T*>(sm);                  // NB buffers of (K, V), SPAN x KST each
T* pw = kvs + NB * 2 * SPAN * KST + rt * 8 * PST;   // the row tile's weights
float* xm = reinterpret_cast<float*>(kvs + NB * 2 * SPAN * KST + NW * 8 * PST) + rt * KW * 8;
const int M = q_shape[2];
const int cap = k_shape[2];
const int nblk = (cap + SPAN * SPB - 1) / (SPAN * SPB);
const int R = G * M;
const int nrb = (R + 8 * NW - 1) / (8 * NW);
const int blk = blockIdx.x / nrb;
const int r0 = (blockIdx.x % nrb) * 8 * NW + 8 * rt;    // the row tile's rows
const int b = blockIdx.y / HKV;
const int hk = blockIdx.y % HKV;
const int off = offset[0];
const int maxp = min(off + M - 1, cap - 1);
const int sg = blk * SPB;
if (sg * SPAN > maxp) return; // uniform over the block
const int se = min(sg + SPB, maxp / SPAN + 1);
const bool act = r0 < R;                            // uniform over the row tile
const size_t kvbase = (size_t)(b * HKV + hk) * cap * D;
auto pair_sync = [&]() {                            // the row tile's KW warps (barriers 1 .. 8)
  if (KW == 1) __syncwarp();
  else asm volatile("bar.sync %0, %1;\n" ::"r"(1 + rt), "n"(32 * KW) : "memory");
};
auto load_kv = [&](int s) { tf_load_span<T, D, KST, SPAN, NTH, NB>(kvs, k, v, kvbase, s, se, maxp); };
#pragma unroll
for (int i = 0; i < NB - 1; ++i) load_kv(sg + i);
unsigned int qf[NDT][2];                            // B fragments of rows r0 + g8 (zeros past R)
{
  const int r = r0 + g8;
  const T* qr = r < R ? q + ((size_t)(b * HQ + hk * G + r / M) * M + r % M) * D + 2 * t4 : nullptr;
#pragma unroll
  for (int st = 0; st < NDT; ++st) {
    qf[st][0] = qr ? *reinterpret_cast<const unsigned int*>(qr + 16 * st) : 0u;
    qf[st][1] = qr ? *reinterpret_cast<const unsigned int*>(qr + 16 * st + 8) : 0u;
  }
}
int pr[2];                                          // rows r0 + 2 t4 + h of the C fragments
bool rok[2];
float mrun[2], lrun[2];
#pragma unroll
for (int h = 0; h < 2; ++h) {
  const int r = r0 + 2 * t4 + h;
  pr[h] = off + r % M;
  rok[h] = r < R && pr[h] < cap;
  mrun[h] = TF_NEG_INF;
  lrun[h] = 0.0f;
}
const float scale = scale_f[0];
float o[NDW][4];
#pragma unroll
for (int dt = 0; dt < NDW; ++dt) {
#pragma unroll
  for (int i = 0; i < 4; ++i) o[dt][i] = 0.0f;
}
for (int s = sg; s < se; ++s) {
  __syncthreads();                                  // span s - 1 done: its buffer and the weights free
  load_kv(s + NB - 1);
  tf_cp_async_wait<NB - 1>();
  __syncthreads();                                  // span s staged
  if (!act) continue;
  const T* kvb = kvs + (s % NB) * 2 * SPAN * KST;
  float c[NKT][4];                                  // scores: key 16 (kh NKT + kt) + 8 (i >> 1) + g8, row 2 t4 + (i & 1)
#pragma unroll
  for (int kt = 0; kt < NKT; ++kt) {
#pragma unroll
    for (int i = 0; i < 4; ++i) c[kt][i] = 0.0f;
  }
  {                                                 // ldmatrix rows: row_attn_tc's A fragments
    const T* kl = kvb + (16 * NKT * kh + (lane & 15)) * KST + ((lane >> 4) << 3);
#pragma unroll
    for (int st = 0; st < NDT; ++st) {
      unsigned int a[NKT][4];
#pragma unroll
      for (int kt = 0; kt < NKT; ++kt) tf_ldmatrix4(kl + 16 * kt * KST + 16 * st, a[kt]);
#pragma unroll
      for (int kt = 0; kt < NKT; ++kt) tf_mma(c[kt], a[kt], qf[st], T());
    }
  }
  const int s0 = s * SPAN;
  float sv[2][2 * NKT], mc[2], ef[2][8], fa[2], fb[2];
  bool fold[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {                     // row 2 t4 + h; key g8 + 8 j is c[j >> 1][2 (j & 1) + h]
#pragma unroll
    for (int j = 0; j < 2 * NKT; ++j)
      sv[h][j] = s0 + g8 + 8 * (2 * NKT * kh + j) <= pr[h] ? __fmul_rn(c[j >> 1][2 * (j & 1) + h], scale) : TF_NEG_INF;
    mc[h] = tf_max_tree<2 * NKT>(sv[h]);
    mc[h] = fmaxf(mc[h], __shfl_xor_sync(TF_FULL_MASK, mc[h], 4));
    mc[h] = fmaxf(mc[h], __shfl_xor_sync(TF_FULL_MASK, mc[h], 8));
    mc[h] = fmaxf(mc[h], __shfl_xor_sync(TF_FULL_MASK, mc[h], 16));
    if (KW > 1 && g8 == 0) xm[8 * kh + 2 * t4 + h] = mc[h];
  }
  if (KW > 1) {                                     // the other warps' keys' maxima (its own again: a max)
    pair_sync();
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int w = 0; w < KW; ++w) mc[h] = fmaxf(mc[h], xm[8 * w + 2 * t4 + h]);
    }
  }
  if (KW == 1) {                                    // rows 2 t4 and 2 t4 + 1 at key j rounded in one pair (one
    float mz[2];                                    // F2FP where two F2F ran; with KW > 1 nvcc already rounds each
#pragma unroll                                      // with an F2FP of its own, and pairing measured more instructions)
    for (int h = 0; h < 2; ++h) mz[h] = mc[h] == TF_NEG_INF ? 0.0f : mc[h];
    unsigned short* pwu = reinterpret_cast<unsigned short*>(pw) + 2 * t4 * PST + g8;
#pragma unroll
    for (int j = 0; j < 2 * NKT; ++j) {
      const unsigned int eb = tf_pack2<T>(tf_ex2(__fsub_rn(sv[0][j], mz[0])), tf_ex2(__fsub_rn(sv[1][j], mz[1])));
      ef[0][j] = tf_half_of<T>(eb, 0);
      ef[1][j] = tf_half_of<T>(eb, 1);
      pwu[8 * j] = (unsigned short)(eb & 0xffffu);
      pwu[PST + 8 * j] = (unsigned short)(eb >> 16);
    }
  } else {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float mz = mc[h] == TF_NEG_INF ? 0.0f : mc[h];   // a masked key's sv is -inf: tf_ex2 gives
#pragma unroll                                               // it +0, as row_attn_tc's branch does
      for (int j = 0; j < 2 * NKT; ++j) {
        const T e = tf_from_float<T>(tf_ex2(__fsub_rn(sv[h][j], mz)));
        ef[h][j] = tf_to_float(e);
        pw[(2 * t4 + h) * PST + g8 + 8 * (2 * NKT * kh + j)] = e;
      }
    }
  }
  pair_sync();                                      // the weights written
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int p = pr[h];
    float lc = 0.0f;                                // with KW > 1, row 2 t4 + h's warp kh == h sums it
    if (KW == 1 || h == kh) {
#pragma unroll
      for (int j = 0; j < 8 && KW > 1; ++j) ef[h][j] = tf_to_float(pw[(2 * t4 + h) * PST + g8 + 8 * j]);
      // lane l = g8 + 8 j' of row_attn_tc's butterfly holds e_l + e_{l+32} = ef[j'] + ef[j' + 4]
      const float w0 = __fadd_rn(__fadd_rn(ef[h][0], ef[h][4]), __fadd_rn(ef[h][2], ef[h][6]));   // l ^ 16
      const float w1 = __fadd_rn(__fadd_rn(ef[h][1], ef[h][5]), __fadd_rn(ef[h][3], ef[h][7]));
      lc = __fadd_rn(w0, w1);                                                                   // l ^ 8
      lc = __fadd_rn(lc, __shfl_xor_sync(TF_FULL_MASK, lc, 16));                                // l ^ 4
      lc = __fadd_rn(lc, __shfl_xor_sync(TF_FULL_MASK, lc, 8));                                 // l ^ 2
      lc = __fadd_rn(lc, __shfl_xor_sync(TF_FULL_MASK, lc, 4));                                 // l ^ 1
    }
    fold[h] = rok[h] && p >= s0;
    const float mn = fmaxf(mrun[h], mc[h]);         // row_attn_merge's fold of (mc, lc)
    fa[h] = tf_ex2(__fsub_rn(mrun[h], tf_zmax(mn)));
    fb[h] = tf_ex2(__fsub_rn(mc[h], tf_zmax(mn)));
    if (SPB == 1) {
      mrun[h] = mc[h];
      lrun[h] = lc;
    } else if (fold[h]) {
      lrun[h] = __fadd_rn(__fmul_rn(lrun[h], fa[h]), __fmul_rn(lc, fb[h]));
      mrun[h] = mn;
    }
  }
  const int mi = lane >> 3, rr = lane & 7;
  const T* pb = pw + g8 * PST + 2 * t4;
  const T* vb = kvb + SPAN * KST + (rr + ((mi >> 1) << 3)) * KST + ((mi & 1) << 3);
#pragma unroll
  for (int dl = 0; dl < NDW; ++dl) {                // d tile kh NDW + dl: row_attn_tc's value chain
    const int dt = kh * NDW + dl;
    if (NDT % KW != 0 && dt >= NDT) break;
    float cv[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int st = 0; st < SPAN / 16; ++st) {
      unsigned int a[4], bb[2];
      tf_ldmatrix4t(vb + 16 * st * KST + 16 * dt, a);
      bb[0] = *reinterpret_cast<const unsigned int*>(pb + 16 * st);
      bb[1] = *reinterpret_cast<const unsigned int*>(pb + 16 * st + 8);
      tf_mma(cv, a, bb, T());
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {                   // the span's o, or folded
      if (SPB == 1) {
        o[dl][h] = cv[h];
        o[dl][2 + h] = cv[2 + h];
      } else if (fold[h]) {
        o[dl][h] = __fmaf_rn(cv[h], fb[h], __fmul_rn(o[dl][h], fa[h]));
        o[dl][2 + h] = __fmaf_rn(cv[2 + h], fb[h], __fmul_rn(o[dl][2 + h], fa[h]));
      }
    }
  }
}
if (act) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {                     // the block's result, for every row that saw it
    const int r = r0 + 2 * t4 + h;
    if (rok[h] && pr[h] >= sg * SPAN) {
      float* dst = part + ((size_t)((b * HQ + hk * G + r / M) * M + r % M) * nblk + blk) * (D + 2);
#pragma unroll
      for (int dl = 0; dl < NDW; ++dl) {
        const int dt = kh * NDW + dl;
        if (NDT % KW != 0 && dt >= NDT) break;
        dst[16 * dt + g8] = o[dl][h];
        dst[16 * dt + g8 + 8] = o[dl][2 + h];
      }
      if (g8 == 0 && (KW == 1 || h == kh)) {        // m, l: the warp that summed the row's weights
        dst[D] = mrun[h];
        dst[D + 1] = lrun[h];
      }
    }
  }
}

// @@body row_attn_tcr
// inputs, output: as row_attn_tcg
// template: T (bf16 or f16), D (multiple of 16, <= 128), HQ, HKV, NW (16-row tiles a block, a warp
//           each), NB (K/V buffers, >= 2), SPB (spans a block: 1 or 8)
// launch: grid (nblk * ceil(HQ/HKV * M / (16 NW)) * 32 NW, B*HKV, 1), threadgroup (32 NW, 1, 1),
//         dynamic shared memory (NB*2*64 + 16 NW)*(D+8)*2 (_cuda.attn_tcr_smem)
// row_attn_tcg (KW 1) with the mma's sides swapped: a warp's 16 query rows on the M side, keys (the
// scores) and head dims (the sums) on the N side. Every output element is the same dot product
// in the same k16 steps and order (scores over D, sums over keys), so the weights pass from the
// score chains' C fragments to the sum chains' A fragments in registers, and each K / V fragment
// serves 16 rows. Lane (g8, t4) holds keys 8 n + 2 t4 + b (n 0..7, b 0..1) of rows g8 and g8 + 8:
// the weight sum's tree over key bits 5, 4, 3, 2, 1, 0 (row_attn_tc's) is taken over n inside the
// lane, then lanes ^ 2, ^ 1, then b. The same bits as row_attn_tcg, whatever NW, NB and SPB.
constexpr int SPAN = 64;
constexpr int KST = D + 8;
constexpr int G = HQ / HKV;
constexpr int DV = D / 8;
constexpr int NDT = D / 16;
constexpr int NTH = 32 * NW;
static_assert(D % 16 == 0 && D <= 128 && NW >= 1 && NW <= 8 && NB >= 2 && (SPB == 1 || SPB == 8),
              "row_attn_tcr: plan");
extern __shared__ float sm[];
const int lane = threadIdx.x & 31;
const int g8 = lane >> 2, t4 = lane & 3;
T* kvs = reinterpret_cast<T*>(sm);
const int M = q_shape[2];
const int cap = k_shape[2];
const int nblk = (cap + SPAN * SPB - 1) / (SPAN * SPB);
const int R = G * M;
const int nrb = (R + 16 * NW - 1) / (16 * NW);
const int blk = blockIdx.x / nrb;
const int r0 = (blockIdx.x % nrb) * 16 * NW + 16 * (threadIdx.x >> 5);
const int b = blockIdx.y / HKV;
const int hk = blockIdx.y % HKV;
const int off = offset[0];
const int maxp = min(off + M - 1, cap - 1);
const int sg = blk * SPB;
if (sg * SPAN > maxp) return;
const int se = min(sg + SPB, maxp / SPAN + 1);
const bool act = r0 < R;
const size_t kvbase = (size_t)(b * HKV + hk) * cap * D;
auto load_kv = [&](int s) { tf_load_span<T, D, KST, SPAN, NTH, NB>(kvs, k, v, kvbase, s, se, maxp); };
T* qs = kvs + NB * 2 * SPAN * KST + (threadIdx.x >> 5) * 16 * KST;   // the warp's 16 query rows, by cp.async
#pragma unroll
for (int i = 0; i < DV / 2; ++i) {                  // with span sg's commit group (the loop's first wait)
  const int e = lane + 32 * i, r = r0 + e / DV, x = (e % DV) * 8;
  if (r < R) tf_cp_async16(qs + (e / DV) * KST + x, q + ((size_t)(b * HQ + hk * G + r / M) * M + r % M) * D + x);
  else *reinterpret_cast<uint4*>(qs + (e / DV) * KST + x) = make_uint4(0u, 0u, 0u, 0u);
}
#pragma unroll
for (int i = 0; i < NB - 1; ++i) load_kv(sg + i);
int pr[2];
bool rok[2];
float mrun[2], lrun[2];
float o[2 * NDT][4];                                // d tile dt: d 8 dt + 2 t4 + (i & 1), row g8 + 8 (i >> 1)
tf_rows16_init<D>(r0 + g8, off, M, R, cap, pr, rok, mrun, lrun, o);
const float scale = scale_f[0];
for (int s = sg; s < se; ++s) {
  __syncthreads();
  load_kv(s + NB - 1);
  tf_cp_async_wait<NB - 1>();
  __syncthreads();
  if (!act) continue;
  const T* kvb = kvs + (s % NB) * 2 * SPAN * KST;
  float c[8][4];                                    // scores: key 8 n + 2 t4 + (i & 1), row g8 + 8 (i >> 1)
#pragma unroll
  for (int n = 0; n < 8; ++n) {
#pragma unroll
    for (int i = 0; i < 4; ++i) c[n][i] = 0.0f;
  }
  {
    const T* kl = kvb + (((lane >> 4) << 3) + (lane & 7)) * KST + (((lane >> 3) & 1) << 3);
#pragma unroll
    for (int st = 0; st < NDT; ++st) {
      unsigned int qa[4];                           // A fragment: rows g8 (+ 8), d 16 st ..
      tf_ldmatrix4(qs + ((((lane >> 3) & 1) << 3) + (lane & 7)) * KST + ((lane >> 4) << 3) + 16 * st, qa);
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        unsigned int bk[4];
        tf_ldmatrix4(kl + 16 * np * KST + 16 * st, bk);
        tf_mma(c[2 * np], qa, bk, T());
        tf_mma(c[2 * np + 1], qa, bk + 2, T());
      }
    }
  }
  const int s0 = s * SPAN;
  float fa[2], fb[2];
  bool fold[2];
  unsigned int pa[4][4];                            // A fragments of the weights, key steps of 16
  tf_span_softmax<T, SPB>(c, s0, t4, scale, pr, rok, mrun, lrun, pa, fa, fb, fold);
  const T* vl = kvb + SPAN * KST + ((((lane >> 3) & 1) << 3) + (lane & 7)) * KST + ((lane >> 4) << 3);
#pragma unroll
  for (int dp = 0; dp < NDT; ++dp) {                // d tiles 2 dp, 2 dp + 1: row_attn_tc's value chains
    float cv[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      unsigned int bv[4];
      tf_ldmatrix4t(vl + 16 * ks * KST + 16 * dp, bv);
      tf_mma(cv[0], pa[ks], bv, T());
      tf_mma(cv[1], pa[ks], bv + 2, T());
    }
#pragma unroll
    for (int j = 0; j < 2; ++j) tf_take_sums<SPB>(o[2 * dp + j], cv[j], fold, fa, fb);
  }
}
if (act) tf_put_rows16<D>(part, o, mrun, lrun, pr, rok, r0 + g8, M, b * HQ + hk * G, nblk, blk, sg * SPAN, t4);

// @@body row_attn_wg
// inputs, output: as row_attn_tcg
// template: T (bf16 or f16), D (64 or 128), HQ, HKV, NB (K/V buffers, >= 2), SPB (1, 8: a half, or
//           16: a group, half 0's result kept in registers while half 1 runs, then the two folded)
// launch: grid (nblk * ceil(HQ/HKV * M / 64) * 128, B*HKV, 1), threadgroup (128, 1, 1), dynamic
//         shared memory (NB*2*64 + 64)*D*2 (_cuda.attn_wg_smem)
// row_attn_tcr on Hopper's warpgroup MMA (sm_90a): one warpgroup takes 64 query rows (warp w rows
// 16 w .. 16 w + 15, tcr's layout), its scores one m64n64k16 chain over the k16 steps of D (q and
// K from shared memory by descriptor), its sums one m64n64k16 chain over the span's four 16-key
// steps a 64-column half of D (the weights from registers, V by descriptor, MN-major); q, K and V
// in shared memory with the 128-byte swizzle (tf_wg_unit; plain core matrices took a third more
// time on the H200, likely bank conflicts of the tensor core's reads, not profiled). Every
// output is mma.sync.m16n8k16's dot product in the same steps and order, and the softmax, the
// weight sum's tree and the fold are tcr's, so the same bits as row_attn_tcr, whatever NB and SPB.
// No ldmatrix: the tensor core reads K, V and q from shared memory itself.
constexpr int SPAN = 64;
constexpr int G = HQ / HKV;
constexpr int NDT = D / 16;
static_assert((D == 64 || D == 128) && NB >= 2 && (SPB == 1 || SPB == 8 || SPB == 16), "row_attn_wg: plan");
extern __shared__ __align__(1024) float sm[];
const int lane = threadIdx.x & 31;
const int g8 = lane >> 2, t4 = lane & 3;
T* kvs = reinterpret_cast<T*>(sm);
T* qs = kvs + NB * 2 * SPAN * D;                     // the block's 64 query rows, K's layout
const int M = q_shape[2];
const int cap = k_shape[2];
constexpr int GSP = SPB > 8 ? 8 : SPB;              // spans a fold from (-inf, 0, 0): a span, or a half
const int npart = (cap + SPAN * SPB - 1) / (SPAN * SPB);
const int R = G * M;
const int nrb = (R + 63) / 64;
const int blk = blockIdx.x / nrb;
const int rb0 = (blockIdx.x % nrb) * 64;
const int r0 = rb0 + 16 * (threadIdx.x >> 5);
const int h0 = blockIdx.y * G;                      // (b HKV + kv head) G: the first q head
const int off = offset[0];
const int maxp = min(off + M - 1, cap - 1);
const int sg = blk * SPB;
if (sg * SPAN > maxp) return;
const int se = min(sg + SPB, maxp / SPAN + 1);
const size_t kvbase = (size_t)blockIdx.y * cap * D;
auto load_kv = [&](int s) { tf_wg_load_span<T, D, SPAN, NB>(kvs, k, v, kvbase, s, se, maxp); };
tf_wg_stage_q<T, D>(qs, q, rb0, R, M, h0);          // with span sg's commit group
#pragma unroll
for (int i = 0; i < NB - 1; ++i) load_kv(sg + i);
int pr[2];
bool rok[2];
float mrun[2], lrun[2];
float o[2 * NDT][4];                                // d tile dt: d 8 dt + 2 t4 + (i & 1), row g8 + 8 (i >> 1)
const float scale = scale_f[0];
const unsigned long long qd = tf_wg_desc(qs, 16, 1024);   // K-major, 128-byte swizzle: SBO the 8-row atoms
float ma[2], la[2], oa[2 * NDT][4];                // SPB 16: the group, half 0 while half 1 runs
for (int g0 = sg; g0 < se; g0 += GSP) {
  tf_rows16_init<D>(r0 + g8, off, M, R, cap, pr, rok, mrun, lrun, o);
  for (int s = g0; s < min(g0 + GSP, se); ++s) {
    __syncthreads();
    load_kv(s + NB - 1);
    tf_cp_async_wait<NB - 1>();
    tf_fence_async();
    __syncthreads();
    tf_wg_span<T, D, SPB>(kvs + (s % NB) * 2 * SPAN * D, qd, s * SPAN, t4, scale, pr, rok, mrun, lrun, o);
  }
  if (SPB > 8 && g0 == sg) tf_fold_rows16<D, true>(ma, la, oa, mrun, lrun, o, rok);
}
if (SPB > 8) {
  const bool h1[2] = {pr[0] >= (sg + 8) * SPAN, pr[1] >= (sg + 8) * SPAN};   // rows that reach half 1
  tf_fold_rows16<D, false>(ma, la, oa, mrun, lrun, o, h1);
}
tf_put_rows16<D>(part, SPB > 8 ? oa : o, SPB > 8 ? ma : mrun, SPB > 8 ? la : lrun, pr, rok, r0 + g8, M, h0, npart, blk, sg * SPAN, t4);

// @@body row_attn_merge
// inputs: part [B*HQ*M, nent, D+2] float32, offset [1] int32, q [B, HQ, M, D] (T),
//         k [B, HKV, cap, D] (TK)  (q and k are passed only for their shapes)
// output: out [B, HQ, M, D] (T).  template: T, D, SPAN, DC, MW (warps: groups merged side by
//         side; any count gives the same bits), E (spans an entry of part: 1, the span partials;
//         8, the halves of group blocks of SPB 8; 16, the groups of row_attn_wg's SPB 16)
// launch: grid (B*HQ*M*ceil(D/DC)*32*MW, 1, 1), threadgroup (32*MW, 1, 1), dynamic shared memory
//         MW*(DC+2)*4.
// Block (row, c) writes columns [c*DC, c*DC + DC) of its row. Every block of a row folds the same
// (m, l) sequence in the same order, and a column's o depends only on that sequence and its own
// partials, so the columns come out bit-identical for every DC (DC = D: one block per row).
// One walk folds a run of entries in order, UE loaded at a time: spans into their half and halves
// into their group, each from (-inf, 0, 0) (an entry of E 16 is a group as it is), handing each
// group on. With MW 1 the one warp walks the row and folds its groups in order; with MW > 1 warp w
// walks group gb + w of each batch of MW groups and warp 0 folds the batch's groups in order.
constexpr int GS = 16;                              // spans per group, 8 a half
constexpr int EG = GS / E;                          // entries a group
constexpr int NT = (DC + 31) / 32;
constexpr int NDB = (D + DC - 1) / DC;
constexpr int UL = NT <= 2 ? 16 : (NT <= 4 ? 8 : (NT <= 8 ? 4 : 2));   // entries loaded ahead of use
constexpr int UE = MW > 1 && EG < UL ? EG : UL;     // a group's at most where a warp walks one group
extern __shared__ float sm[];                       // MW group results (o[0..DC), m, l)
const int M = q_shape[2];
const int cap = k_shape[2];
const int nspan = (cap + SPAN - 1) / SPAN;
const int row = blockIdx.x / NDB;
const int c0 = (blockIdx.x % NDB) * DC;             // this block's first column
const int lane = threadIdx.x & 31;
const int warp = threadIdx.x >> 5;
const int nent = part_shape[1];
const float* src = part + (size_t)row * nent * (D + 2);
auto load = [&](int s, float& pm, float& pl, float* po) {   // entry s: m, l and this block's columns
  const float* x = src + (size_t)s * (D + 2);
  pm = x[D];
  pl = x[D + 1];
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    const int d = lane + 32 * t;
    po[t] = d < DC && c0 + d < D ? x[c0 + d] : 0.0f;
  }
};
// The warp's first UE entries are loaded before the offset is read: their addresses do not depend
// on it, so the two loads overlap (one memory round trip less). Entries past the row's reach are
// read from part's buffer and never used.
const int ew = MW == 1 ? 0 : warp * EG;             // the warp's first entry
float pm0[UE], pl0[UE], po0[UE][NT];
#pragma unroll
for (int u = 0; u < UE; ++u) {
  if (ew + u < nent) load(ew + u, pm0[u], pl0[u], po0[u]);
}
const int p = offset[0] + row % M;
T* dst = out + (size_t)row * D + c0;
if (p < 0 || p >= cap) {   // the row lies outside the KV buffer: NaN
  for (int d = threadIdx.x; d < DC && c0 + d < D; d += blockDim.x) dst[d] = tf_from_float<T>(__int_as_float(0x7fc00000));
  return;
}
const int ns = min(p / SPAN + 1, nspan);
const int ne = (ns + E - 1) / E;                    // the entries the row reaches
const int ng = (ns + GS - 1) / GS;
auto fold = [&](float& m, float& l, float* o, float pm, float pl, const float* po) {   // the merge's formula
  const float mn = fmaxf(m, pm);
  const float fa = tf_ex2(__fsub_rn(m, tf_zmax(mn))), fb = tf_ex2(__fsub_rn(pm, tf_zmax(mn)));
  l = __fadd_rn(__fmul_rn(l, fa), __fmul_rn(pl, fb));
#pragma unroll
  for (int t = 0; t < NT; ++t) o[t] = __fmaf_rn(po[t], fb, __fmul_rn(o[t], fa));
  m = mn;
};
auto clear = [](float& m, float& l, float* o) {
  m = TF_NEG_INF;
  l = 0.0f;
#pragma unroll
  for (int t = 0; t < NT; ++t) o[t] = 0.0f;
};
auto walk = [&](int e0, int e1, bool pre, auto&& group) {   // entries e0 .. e1 - 1 (e0 a group's first;
  float mh, lh, oh[NT], mg, lg, og[NT];             // pre: its first UE are pm0 ...); the half, the group so far
  auto batch = [&](int r, const float (&pm)[UE], const float (&pl)[UE], const float (&po)[UE][NT]) {
#pragma unroll
    for (int u = 0; u < UE; ++u) {
      const int j = UE % EG == 0 ? u % EG : (r + u) % EG;       // in its group (r is a multiple of UE)
      const int jh = UE % 8 == 0 ? u % 8 : (r + u) % 8;         // in its half (E 1)
      if (e0 + r + u >= e1) continue;
      if (E == GS) {
        group(pm[u], pl[u], po[u]);
        continue;
      }
      if (j == 0) clear(mg, lg, og);
      if (E == 1) {                                 // a span into its half, the half into the group
        if (jh == 0) clear(mh, lh, oh);
        fold(mh, lh, oh, pm[u], pl[u], po[u]);
        if (jh == GS / 2 - 1) fold(mg, lg, og, mh, lh, oh);
      } else {
        fold(mg, lg, og, pm[u], pl[u], po[u]);      // a half into the group
      }
      if (j == EG - 1) group(mg, lg, og);
    }
  };
  int r = 0;
  if (pre) {
    batch(0, pm0, pl0, po0);
    r = UE;
  }
  for (; e0 + r < e1 && (MW == 1 || r < EG); r += UE) {   // MW > 1: a group at most
    float pm[UE], pl[UE], po[UE][NT];
#pragma unroll
    for (int u = 0; u < UE; ++u) {
      if (e0 + r + u < e1) load(e0 + r + u, pm[u], pl[u], po[u]);
    }
    batch(r, pm, pl, po);
  }
  const int k = e1 - 1 - e0;                        // the last entry closes its half and group here, once,
  if (E < GS && k >= 0) {                           // not at every position of the unrolled loop
    if (E == 1 && k % (GS / 2) != GS / 2 - 1) fold(mg, lg, og, mh, lh, oh);
    if (k % EG != EG - 1) group(mg, lg, og);
  }
};
float m2 = TF_NEG_INF, l2 = 0.0f, o2[NT];
#pragma unroll
for (int t = 0; t < NT; ++t) o2[t] = 0.0f;
if (MW == 1) {
  walk(0, ne, true, [&](float gm, float gl, const float (&go)[NT]) { fold(m2, l2, o2, gm, gl, go); });
} else {
  auto batch_of_groups = [&](int gb, bool pre) {
    const int grp = gb + warp;
    if (grp < ng) {
      walk(grp * EG, min(grp * EG + EG, ne), pre, [&](float gm, float gl, const float (&go)[NT]) {
        tf_put_partial<DC, NT>(sm + warp * (DC + 2), go, gm, gl, lane);
      });
    }
    __syncthreads();
    if (warp == 0) {
      for (int w = 0; w < MW && gb + w < ng; ++w) tf_merge_partial<DC, NT>(m2, l2, o2, sm + w * (DC + 2), lane);
    }
    __syncthreads();
  };
  batch_of_groups(0, true);                         // the first batch out of the loop: pm0 ... die there
  for (int gb = MW; gb < ng; gb += MW) batch_of_groups(gb, false);
}
if (warp == 0) {
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    const int d = lane + 32 * t;
    if (d < DC && c0 + d < D) dst[d] = tf_from_float<T>(__fdiv_rn(o2[t], l2));
  }
}
