// Row-exact routed-expert GEMMs for MLX's CUDA backend (mx.fast.cuda_kernel, NVRTC JIT):
// the CUDA face of tensorfold.kernels.row_expert_matmul (MoE decode).
//
// Sections as in row_gemm.cu ("// @@header", "// @@body <name>"); launched from
// tensorfold/kernels/_cuda.py (expert_matmul). The helpers come from common.cuh
// (prepended to this file's header; each file is JIT-compiled on its own).
//
// out[p, n] for pair p = r * TOPK + j, expert e = indices[p]:  x[r] . w_hat[e, n, :]
// Arithmetic of one element: EXACTLY row_gemm.cu's (row_qmm / row_mm): K in 32-element
// chunks, lane l of the warp owning column n takes chunks l, l+32, ... in order; inside a
// chunk j = 0..31 in order acc = fma(w_hat_j, x_j, acc) with w_hat = fma(scale, q, bias);
// then the xor-16/8/4/2/1 butterfly with __fadd_rn. So out[p] is bit-identical to
// row_qmm(x[r], w[e]) on this backend, and depends on K, the group size and bits only:
// never on R, TOPK, the other pairs or which experts they chose. An expert id outside
// [0, E) writes NaN.
//
// The fused MoE-decode kernels below (row_expert_*_glu: gate + up + SwiGLU; row_expert_*_sum:
// down + the score-weighted sum + the residual add; moe_route: the router's softmax + top-k;
// row_expert_*_glu_route: moe_route's code, then row_expert_*_glu's, in one launch)
// keep each dot product in exactly this arithmetic (tf_expert_qdot / tf_expert_dot) and
// define their epilogues in the helpers next to it.
//
// Work layout (speed only): one block = 8 warps x 2 columns = 16 output columns of ONE
// (row, expert) pair, blockIdx.y = pair. No shared-memory staging: each lane reads its x
// chunk straight from global memory (decode has few pairs: R <= 16 rows x TOPK experts),
// so an expert used by several pairs is read once per pair.

// @@header
// (the shared helpers tf_to_float, tf_from_float, tf_load8, tf_extract, tf_load_chunk,
// tf_dequant8, tf_warp_sum, TF_FULL_MASK, TF_NEG_INF come from common.cuh, prepended by
// _sources.py)

// The lane's share of NC dot products x . w_hat[row c], row c of a quantized weight given by
// its base pointers (wr: K*BITS/32 words; sr / br: K/GS scales / biases): row_gemm.cu's
// row_qmm arithmetic. Chunks lane, lane + 32, ... in order; in a chunk j = 0..31 in order
// acc = fma(w_hat_j, x_j, acc) with w_hat = fma(scale, q, bias). The caller finishes each
// acc[c] with tf_warp_sum.
template <typename T, typename S, int K, int GS, int BITS, int NC>
__device__ __forceinline__ void tf_expert_qdot(const T* xr, const unsigned int* const (&wr)[NC],
                                               const S* const (&sr)[NC], const S* const (&br)[NC],
                                               int lane, float (&acc)[NC]) {
  constexpr int NCHUNK = K / 32;
  for (int ch = lane; ch < NCHUNK; ch += 32) {
    unsigned int words[NC][BITS];
    float sc[NC], bi[NC];
#pragma unroll
    for (int c = 0; c < NC; ++c) {
      tf_load_chunk<BITS>(wr[c] + (size_t)ch * BITS, words[c]);
      const int g = (ch * 32) / GS;
      sc[c] = tf_to_float(sr[c][g]);
      bi[c] = tf_to_float(br[c][g]);
    }
#pragma unroll
    for (int jb = 0; jb < 32; jb += 8) {
      float wh[NC][8];
      tf_dequant8<BITS, NC>(words, sc, bi, jb, wh);
#pragma unroll
      for (int jj = 0; jj < 8; ++jj) {
        const float xv = tf_to_float(xr[ch * 32 + jb + jj]);
#pragma unroll
        for (int c = 0; c < NC; ++c) acc[c] = __fmaf_rn(wh[c][jj], xv, acc[c]);
      }
    }
  }
}

// The same for rows of an unquantized weight (K elements each): row_mm's arithmetic.
template <typename T, typename W, int K, int NC>
__device__ __forceinline__ void tf_expert_dot(const T* xr, const W* const (&wr)[NC], int lane,
                                              float (&acc)[NC]) {
  constexpr int NCHUNK = K / 32;
  for (int ch = lane; ch < NCHUNK; ch += 32) {
#pragma unroll
    for (int jb = 0; jb < 32; jb += 8) {
      float wh[NC][8];
#pragma unroll
      for (int c = 0; c < NC; ++c) tf_load8(wr[c] + (size_t)ch * 32 + jb, wh[c]);
#pragma unroll
      for (int jj = 0; jj < 8; ++jj) {
        const float xv = tf_to_float(xr[ch * 32 + jb + jj]);
#pragma unroll
        for (int c = 0; c < NC; ++c) acc[c] = __fmaf_rn(wh[c][jj], xv, acc[c]);
      }
    }
  }
}

// The base pointers of columns n0 .. n0 + NC - 1 of expert e (a column past N repeats the last;
// the callers never store it): a quantized weight [E, N, K*BITS/32] with scales / biases
// [E, N, K/GS], or an unquantized one [E, N, K].
template <typename S, int K, int N, int GS, int BITS, int NC>
__device__ __forceinline__ void tf_qrows(const unsigned int* w, const S* scales, const S* biases,
                                         int e, int n0, const unsigned int** wr, const S** sr,
                                         const S** br) {
  constexpr int KW = K * BITS / 32;
  constexpr int NG = K / GS;
#pragma unroll
  for (int c = 0; c < NC; ++c) {
    const size_t row = (size_t)e * N + min(n0 + c, N - 1);
    wr[c] = w + row * KW;
    sr[c] = scales + row * NG;
    br[c] = biases + row * NG;
  }
}
template <typename W, int K, int N, int NC>
__device__ __forceinline__ void tf_rows(const W* w, int e, int n0, const W** wr) {
#pragma unroll
  for (int c = 0; c < NC; ++c) wr[c] = w + ((size_t)e * N + min(n0 + c, N - 1)) * K;
}

// SwiGLU of one element of the fused gate/up kernels: the gate and up sums rounded to T (the
// values row_expert_qmm would store), then silu(g) * u in fp32 as MLX computes it on float32
// arrays (Sigmoid: y = 1 / (1 + exp(|g|)), g < 0 ? y : 1 - y; then (g * s) * u), rounded once.
template <typename T>
__device__ __forceinline__ T tf_glu(float g, float u) {
  const float gf = tf_to_float(tf_from_float<T>(g));
  const float uf = tf_to_float(tf_from_float<T>(u));
  const float y = __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(fabsf(gf))));
  const float s = gf < 0.0f ? y : __fsub_rn(1.0f, y);
  return tf_from_float<T>(__fmul_rn(__fmul_rn(gf, s), uf));
}

// The fused gate/up kernels' store: each of the warp's NCW columns n0 + c of pair p gets
// tf_glu of its gate sum acc[c] and up sum acc[NCW + c] (NaN for a bad expert id).
template <typename T, int NCW>
__device__ __forceinline__ void tf_glu_store(const float (&acc)[2 * NCW], bool bad, int lane, int n0,
                                             int N, int p, T* h) {
#pragma unroll
  for (int c = 0; c < NCW; ++c) {
    const float g = tf_warp_sum(acc[c]);
    const float u = tf_warp_sum(acc[NCW + c]);
    const T v = bad ? tf_from_float<T>(__int_as_float(0x7fc00000)) : tf_glu<T>(g, u);
    if (lane == 0 && n0 + c < N) h[(size_t)p * N + n0 + c] = v;
  }
}

// The k expert outputs of one column of one row, combined (row_expert_qmm_sum / mm_sum): each
// ys[j] already rounded to T, acc = ys[0] * s[0], then acc = acc + ys[j] * s[j] for j = 1..k-1
// (fp32, each product and sum rounded: no fma), rounded to T; with a residual, res + that in
// fp32, rounded to T.
template <typename T, int TOPK, bool RES>
__device__ __forceinline__ T tf_expert_combine(const float (&ys)[TOPK], const float* s, const T* res) {
  float a = __fmul_rn(ys[0], s[0]);
#pragma unroll
  for (int j = 1; j < TOPK; ++j) a = __fadd_rn(a, __fmul_rn(ys[j], s[j]));
  float o = tf_to_float(tf_from_float<T>(a));
  if constexpr (RES) o = __fadd_rn(tf_to_float(*res), o);
  return tf_from_float<T>(o);
}

// The fused down kernels' second half: warp j's sums (rounded to T; NaN for a bad expert id)
// go to ys[c][j]; after the barrier thread c < NCW combines column n0 + c of row r.
template <typename T, int TOPK, int NCW, bool RES>
__device__ __forceinline__ void tf_sum_store(const float (&acc)[NCW], bool bad, int lane, int j,
                                             int n0, int N, int r, float (&ys)[NCW][TOPK],
                                             const float* scores, const T* res, T* out) {
#pragma unroll
  for (int c = 0; c < NCW; ++c) {
    const float v = bad ? __int_as_float(0x7fc00000) : tf_to_float(tf_from_float<T>(tf_warp_sum(acc[c])));
    if (lane == 0) ys[c][j] = v;
  }
  __syncthreads();
  if (threadIdx.x < NCW && n0 + threadIdx.x < N) {
    const int n = n0 + threadIdx.x;
    out[(size_t)r * N + n] = tf_expert_combine<T, TOPK, RES>(ys[threadIdx.x], scores + (size_t)r * TOPK,
                                                             res + (size_t)r * N + n);
  }
}

// The router's softmax and top-k for one row, run by one warp (moe_route, tf_route_pair):
// p = softmax(lr[0..E)) in fp32 (max, then exp(l - max) summed lane-sequentially and by
// tf_warp_sum, then divided), the TOPK largest p by (p descending, expert id ascending: ties go
// to the lower id; a NaN p ranks below every number), and their p, divided by their sum in rank
// order when NORM. Reads logits[r, 0..E) (row stride E), writes inds[r, 0..TOPK) and
// scores[r, 0..TOPK).
template <int E, int TOPK, bool NORM>
__device__ __forceinline__ void tf_route(const float* logits, int r, int lane, int* inds,
                                         float* scores) {
  constexpr int EPL = (E + 31) / 32;
  const float* lr = logits + (size_t)r * E;
  float v[EPL];
  float m = TF_NEG_INF;
  #pragma unroll
  for (int t = 0; t < EPL; ++t) {
    const int i = lane + 32 * t;
    v[t] = i < E ? lr[i] : TF_NEG_INF;
    m = fmaxf(m, v[t]);
  }
  #pragma unroll
  for (int off = 16; off >= 1; off >>= 1) m = fmaxf(m, __shfl_xor_sync(TF_FULL_MASK, m, off));
  float sum = 0.0f;
  #pragma unroll
  for (int t = 0; t < EPL; ++t) {
    if (lane + 32 * t < E) {
      v[t] = expf(__fsub_rn(v[t], m));
      sum = __fadd_rn(sum, v[t]);
    }
  }
  sum = tf_warp_sum(sum);
  #pragma unroll
  for (int t = 0; t < EPL; ++t) v[t] = __fdiv_rn(v[t], sum);
  unsigned int taken = 0u;
  int my_i = 0;
  float my_p = 0.0f, tot = 0.0f;
  for (int j = 0; j < TOPK; ++j) {
    float bk = -2.0f;          // below every key: padding and taken entries never win
    int bi = 0x7fffffff;
  #pragma unroll
    for (int t = 0; t < EPL; ++t) {
      const int i = lane + 32 * t;
      const float key = v[t] == v[t] ? v[t] : -1.0f;
      if (i < E && !((taken >> t) & 1u) && (key > bk || (key == bk && i < bi))) {
        bk = key;
        bi = i;
      }
    }
  #pragma unroll
    for (int off = 16; off >= 1; off >>= 1) {
      const float ok = __shfl_xor_sync(TF_FULL_MASK, bk, off);
      const int oi = __shfl_xor_sync(TF_FULL_MASK, bi, off);
      if (ok > bk || (ok == bk && oi < bi)) {
        bk = ok;
        bi = oi;
      }
    }
    float pv = 0.0f;
  #pragma unroll
    for (int t = 0; t < EPL; ++t) if (t == (bi >> 5)) pv = v[t];
    pv = __shfl_sync(TF_FULL_MASK, pv, bi & 31);
    if ((bi & 31) == lane) taken |= 1u << (bi >> 5);
    tot = __fadd_rn(tot, pv);
    if (lane == j) {
      my_i = bi;
      my_p = pv;
    }
  }
  if (lane < TOPK) {
    inds[(size_t)r * TOPK + lane] = my_i;
    scores[(size_t)r * TOPK + lane] = NORM ? __fdiv_rn(my_p, tot) : my_p;
  }
}

// One block's share of the fused gate/up kernels (row_expert_*_glu*): pair p = blockIdx.y (row
// r, expert e), 8 warps x NCW = 2 columns n0 = (blockIdx.x * 8 + warp) * 2 of h[p]; dot(n0,
// lane, acc) adds the gate sums (acc[0..NCW)) and up sums (acc[NCW..2 NCW)) of a valid expert,
// then tf_glu_store.
template <typename T, int N, int E, typename Dot>
__device__ __forceinline__ void tf_glu_block(int e, T* h, Dot&& dot) {
  constexpr int WARPS = 8;
  constexpr int NCW = 2;
  const int lane = threadIdx.x & 31;
  const int n0 = (blockIdx.x * WARPS + (threadIdx.x >> 5)) * NCW;
  if (n0 >= N) return;
  const bool bad = e < 0 || e >= E;
  float acc[2 * NCW];
#pragma unroll
  for (int c = 0; c < 2 * NCW; ++c) acc[c] = 0.0f;
  if (!bad) dot(n0, lane, acc);     // gate columns, then up columns: one pass over x for both
  tf_glu_store<T, NCW>(acc, bad, lane, n0, N, blockIdx.y, h);
}

// Quantized experts: tf_expert_qdot's arithmetic.
template <typename T, typename S, int K, int N, int E, int GS, int BITS>
__device__ __forceinline__ void tf_qmm_glu_block(const T* x, const unsigned int* wg, const S* sg,
                                                 const S* bg, const unsigned int* wu, const S* su,
                                                 const S* bu, int e, int r, T* h) {
  tf_glu_block<T, N, E>(e, h, [&](int n0, int lane, float (&acc)[4]) {
    const unsigned int* wr[4];
    const S* sr[4];
    const S* br[4];
    tf_qrows<S, K, N, GS, BITS, 2>(wg, sg, bg, e, n0, wr, sr, br);
    tf_qrows<S, K, N, GS, BITS, 2>(wu, su, bu, e, n0, wr + 2, sr + 2, br + 2);
    tf_expert_qdot<T, S, K, GS, BITS, 4>(x + (size_t)r * K, wr, sr, br, lane, acc);
  });
}

// Unquantized experts: tf_expert_dot's arithmetic.
template <typename T, typename W, int K, int N, int E>
__device__ __forceinline__ void tf_mm_glu_block(const T* x, const W* wg, const W* wu, int e, int r,
                                                T* h) {
  tf_glu_block<T, N, E>(e, h, [&](int n0, int lane, float (&acc)[4]) {
    const W* wr[4];
    tf_rows<W, K, N, 2>(wg, e, n0, wr);
    tf_rows<W, K, N, 2>(wu, e, n0, wr + 2);
    tf_expert_dot<T, W, K, 4>(x + (size_t)r * K, wr, lane, acc);
  });
}

// The route of the fused route + gate/up kernels: warp 0 runs tf_route on row r = blockIdx.y /
// TOPK of logits [R, E] into s_inds / s_scores (shared), the block waits for it, and the block
// with blockIdx.x == 0 stores entry j = blockIdx.y % TOPK to inds / scores [R, TOPK]. Returns j.
template <int E, int TOPK, bool NORM>
__device__ __forceinline__ int tf_route_pair(const float* logits, int* s_inds, float* s_scores,
                                             int* inds, float* scores) {
  const int p = blockIdx.y;
  if (threadIdx.x < 32) tf_route<E, TOPK, NORM>(logits + (size_t)(p / TOPK) * E, 0, threadIdx.x,
                                                s_inds, s_scores);
  __syncthreads();
  const int j = p % TOPK;
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    inds[p] = s_inds[j];
    scores[p] = s_scores[j];
  }
  return j;
}

// @@body row_expert_qmm
// inputs: x [R, K] (T), w [E, N, K*BITS/32] uint32, scales / biases [E, N, K/GS] (S),
//         indices [R*TOPK] int32.    output: out [R*TOPK, N] (T).
// template: T, S, K, N, E, TOPK, GS, BITS
// launch: grid (ceil(N/16)*256, R*TOPK, 1), threadgroup (256, 1, 1), no shared memory
constexpr int WARPS = 8;
constexpr int NCW = 2;
const int lane = threadIdx.x & 31;
const int warp = threadIdx.x >> 5;
const int n0 = (blockIdx.x * WARPS + warp) * NCW;
const int p = blockIdx.y;
const int r = p / TOPK;
const int e = indices[p];
if (n0 < N) {
  const bool bad = e < 0 || e >= E;
  float acc[NCW];
#pragma unroll
  for (int c = 0; c < NCW; ++c) acc[c] = 0.0f;
  if (!bad) {
    const unsigned int* wr[NCW];
    const S* sr[NCW];
    const S* br[NCW];
    tf_qrows<S, K, N, GS, BITS, NCW>(w, scales, biases, e, n0, wr, sr, br);
    tf_expert_qdot<T, S, K, GS, BITS, NCW>(x + (size_t)r * K, wr, sr, br, lane, acc);
  }
#pragma unroll
  for (int c = 0; c < NCW; ++c) {
    const float v = bad ? __int_as_float(0x7fc00000) : tf_warp_sum(acc[c]);
    if (lane == 0 && n0 + c < N) out[(size_t)p * N + n0 + c] = tf_from_float<T>(v);
  }
}

// @@body row_expert_mm
// inputs: x [R, K] (T), w [E, N, K] (W), indices [R*TOPK] int32.  output: out [R*TOPK, N] (T).
// template: T, W, K, N, E, TOPK.   launch: as row_expert_qmm.
constexpr int WARPS = 8;
constexpr int NCW = 2;
const int lane = threadIdx.x & 31;
const int warp = threadIdx.x >> 5;
const int n0 = (blockIdx.x * WARPS + warp) * NCW;
const int p = blockIdx.y;
const int r = p / TOPK;
const int e = indices[p];
if (n0 < N) {
  const bool bad = e < 0 || e >= E;
  float acc[NCW];
#pragma unroll
  for (int c = 0; c < NCW; ++c) acc[c] = 0.0f;
  if (!bad) {
    const W* wr[NCW];
    tf_rows<W, K, N, NCW>(w, e, n0, wr);
    tf_expert_dot<T, W, K, NCW>(x + (size_t)r * K, wr, lane, acc);
  }
#pragma unroll
  for (int c = 0; c < NCW; ++c) {
    const float v = bad ? __int_as_float(0x7fc00000) : tf_warp_sum(acc[c]);
    if (lane == 0 && n0 + c < N) out[(size_t)p * N + n0 + c] = tf_from_float<T>(v);
  }
}

// @@body row_expert_qmm_glu
// The gate and up projections of the routed experts and their SwiGLU in one launch (MoE
// decode): h[p, n] = tf_glu(x[r] . gate_hat[e, n, :], x[r] . up_hat[e, n, :]), each dot
// product with row_expert_qmm's arithmetic (so the gate and up sums are the bits
// row_expert_qmm gives on those weights).
// inputs: x [R, K] (T), wg / wu [E, N, K*BITS/32] uint32, sg, bg, su, bu [E, N, K/GS] (S),
//         indices [R*TOPK] int32.    output: h [R*TOPK, N] (T).
// template: T, S, K, N, E, TOPK, GS, BITS.   launch: as row_expert_qmm.
tf_qmm_glu_block<T, S, K, N, E, GS, BITS>(x, wg, sg, bg, wu, su, bu, indices[blockIdx.y],
                                          blockIdx.y / TOPK, h);

// @@body row_expert_qmm_glu_route
// moe_route and row_expert_qmm_glu in one launch (MoE decode): every block first runs the
// router's softmax + top-k of its row r (tf_route, warp 0, into shared memory: the bits
// moe_route gives), then row_expert_qmm_glu's work for pair p = r*TOPK + j on expert
// inds[r, j]; the blocks with blockIdx.x == 0 also store inds[r, j] and scores[r, j].
// inputs: x [R, K] (T), wg / wu [E, N, K*BITS/32] uint32, sg, bg, su, bu [E, N, K/GS] (S),
//         logits [R, E] float.   outputs: h [R*TOPK, N] (T), inds [R, TOPK] int32,
//         scores [R, TOPK] float.
// template: T, S, K, N, E, TOPK, GS, BITS, NORM.   launch: as row_expert_qmm; TOPK <= 32,
// E <= 1024.
__shared__ int s_inds[TOPK];
__shared__ float s_scores[TOPK];
const int j = tf_route_pair<E, TOPK, NORM>(logits, s_inds, s_scores, inds, scores);
tf_qmm_glu_block<T, S, K, N, E, GS, BITS>(x, wg, sg, bg, wu, su, bu, s_inds[j], blockIdx.y / TOPK, h);

// @@body row_expert_mm_glu
// row_expert_qmm_glu for unquantized expert weights (row_expert_mm's arithmetic).
// inputs: x [R, K] (T), wg / wu [E, N, K] (W), indices [R*TOPK] int32.  output: h [R*TOPK, N] (T).
// template: T, W, K, N, E, TOPK.   launch: as row_expert_qmm.
tf_mm_glu_block<T, W, K, N, E>(x, wg, wu, indices[blockIdx.y], blockIdx.y / TOPK, h);

// @@body row_expert_mm_glu_route
// row_expert_qmm_glu_route for unquantized expert weights.
// inputs: x [R, K] (T), wg / wu [E, N, K] (W), logits [R, E] float.   outputs: as
// row_expert_qmm_glu_route.   template: T, W, K, N, E, TOPK, NORM.   launch: as row_expert_qmm.
__shared__ int s_inds[TOPK];
__shared__ float s_scores[TOPK];
const int j = tf_route_pair<E, TOPK, NORM>(logits, s_inds, s_scores, inds, scores);
tf_mm_glu_block<T, W, K, N, E>(x, wg, wu, s_inds[j], blockIdx.y / TOPK, h);

// @@body row_expert_qmm_sum
// The down projection of the routed experts, their score-weighted sum and the residual add
// in one launch (MoE decode): warp j of a block computes pair p = r*TOPK + j's dot products
// (row_expert_qmm's arithmetic, rounded to T) for the block's NCW columns; then one thread per
// column combines them in rank order (tf_expert_combine). Row r's bits depend on its own
// h rows, experts and scores only.
// inputs: h [R*TOPK, K] (T), w [E, N, K*BITS/32] uint32, scales / biases [E, N, K/GS] (S),
//         indices [R*TOPK] int32, scores [R*TOPK] float, res [R, N] (T; read only when RES).
// output: out [R, N] (T).   template: T, S, K, N, E, TOPK, GS, BITS, RES.
// launch: grid (ceil(N/2)*32*TOPK, R, 1), threadgroup (32*TOPK, 1, 1); TOPK <= 32.
constexpr int NCW = 2;
__shared__ float ys[NCW][TOPK];
const int lane = threadIdx.x & 31;
const int j = threadIdx.x >> 5;
const int n0 = blockIdx.x * NCW;
const int r = blockIdx.y;
const int p = r * TOPK + j;
const int e = indices[p];
const bool bad = e < 0 || e >= E;
float acc[NCW];
#pragma unroll
for (int c = 0; c < NCW; ++c) acc[c] = 0.0f;
if (!bad) {
  const unsigned int* wr[NCW];
  const S* sr[NCW];
  const S* br[NCW];
  tf_qrows<S, K, N, GS, BITS, NCW>(w, scales, biases, e, n0, wr, sr, br);
  tf_expert_qdot<T, S, K, GS, BITS, NCW>(h + (size_t)p * K, wr, sr, br, lane, acc);
}
tf_sum_store<T, TOPK, NCW, RES>(acc, bad, lane, j, n0, N, r, ys, scores, res, out);

// @@body row_expert_mm_sum
// row_expert_qmm_sum for unquantized expert weights (row_expert_mm's arithmetic).
// inputs: h [R*TOPK, K] (T), w [E, N, K] (W), indices [R*TOPK] int32, scores [R*TOPK] float,
//         res [R, N] (T).   output: out [R, N] (T).   template: T, W, K, N, E, TOPK, RES.
// launch: as row_expert_qmm_sum.
constexpr int NCW = 2;
__shared__ float ys[NCW][TOPK];
const int lane = threadIdx.x & 31;
const int j = threadIdx.x >> 5;
const int n0 = blockIdx.x * NCW;
const int r = blockIdx.y;
const int p = r * TOPK + j;
const int e = indices[p];
const bool bad = e < 0 || e >= E;
float acc[NCW];
#pragma unroll
for (int c = 0; c < NCW; ++c) acc[c] = 0.0f;
if (!bad) {
  const W* wr[NCW];
  tf_rows<W, K, N, NCW>(w, e, n0, wr);
  tf_expert_dot<T, W, K, NCW>(h + (size_t)p * K, wr, lane, acc);
}
tf_sum_store<T, TOPK, NCW, RES>(acc, bad, lane, j, n0, N, r, ys, scores, res, out);

// @@body moe_route
// The router's softmax and top-k of MoE decode (tf_route), one warp per row: row r's result
// depends on row r's logits only.
// inputs: logits [R, E] float.   outputs: inds [R, TOPK] int32, scores [R, TOPK] float.
// template: E, TOPK, NORM.   launch: grid (32*R, 1, 1), threadgroup (32, 1, 1); TOPK <= min(E, 32).
tf_route<E, TOPK, NORM>(logits, blockIdx.x, threadIdx.x & 31, inds, scores);
