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
// Work layout (speed only): one block = 8 warps x 2 columns = 16 output columns of ONE
// (row, expert) pair, blockIdx.y = pair. No shared-memory staging: each lane reads its x
// chunk straight from global memory (decode has few pairs: R <= 16 rows x TOPK experts),
// so an expert used by several pairs is read once per pair.

// @@header
// (the shared helpers tf_to_float, tf_from_float, tf_load8, tf_extract, tf_load_chunk,
// tf_warp_sum, TF_FULL_MASK, TF_NEG_INF come from common.cuh, prepended by _sources.py)

// @@body row_expert_qmm
// inputs: x [R, K] (T), w [E, N, K*BITS/32] uint32, scales / biases [E, N, K/GS] (S),
//         indices [R*TOPK] int32.    output: out [R*TOPK, N] (T).
// template: T, S, K, N, E, TOPK, GS, BITS
// launch: grid (ceil(N/16)*256, R*TOPK, 1), threadgroup (256, 1, 1), no shared memory
constexpr int WARPS = 8;
constexpr int NCW = 2;
constexpr int NCHUNK = K / 32;
constexpr int KW = K * BITS / 32;
constexpr int NG = K / GS;
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
    const T* xr = x + (size_t)r * K;
    for (int ch = lane; ch < NCHUNK; ch += 32) {
      unsigned int words[NCW][BITS];
      float sc[NCW], bi[NCW];
#pragma unroll
      for (int c = 0; c < NCW; ++c) {
        const int n = min(n0 + c, N - 1); // a missing column repeats the last; never stored
        const size_t row = (size_t)e * N + n;
        tf_load_chunk<BITS>(w + row * KW + (size_t)ch * BITS, words[c]);
        const int g = (ch * 32) / GS;
        sc[c] = tf_to_float(scales[row * NG + g]);
        bi[c] = tf_to_float(biases[row * NG + g]);
      }
#pragma unroll
      for (int jb = 0; jb < 32; jb += 8) {
        float wh[NCW][8];
        tf_dequant8<BITS, NCW>(words, sc, bi, jb, wh);
#pragma unroll
        for (int jj = 0; jj < 8; ++jj) {
          const float xv = tf_to_float(xr[ch * 32 + jb + jj]);
#pragma unroll
          for (int c = 0; c < NCW; ++c) acc[c] = __fmaf_rn(wh[c][jj], xv, acc[c]);
        }
      }
    }
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
constexpr int NCHUNK = K / 32;
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
    const T* xr = x + (size_t)r * K;
    for (int ch = lane; ch < NCHUNK; ch += 32) {
#pragma unroll
      for (int jb = 0; jb < 32; jb += 8) {
        float wh[NCW][8];
#pragma unroll
        for (int c = 0; c < NCW; ++c) {
          const int n = min(n0 + c, N - 1);
          tf_load8(w + ((size_t)e * N + n) * K + (size_t)ch * 32 + jb, wh[c]);
        }
#pragma unroll
        for (int jj = 0; jj < 8; ++jj) {
          const float xv = tf_to_float(xr[ch * 32 + jb + jj]);
#pragma unroll
          for (int c = 0; c < NCW; ++c) acc[c] = __fmaf_rn(wh[c][jj], xv, acc[c]);
        }
      }
    }
  }
#pragma unroll
  for (int c = 0; c < NCW; ++c) {
    const float v = bad ? __int_as_float(0x7fc00000) : tf_warp_sum(acc[c]);
    if (lane == 0 && n0 + c < N) out[(size_t)p * N + n0 + c] = tf_from_float<T>(v);
  }
}
