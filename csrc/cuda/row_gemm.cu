// Row-exact GEMMs for MLX's CUDA backend (mx.fast.cuda_kernel, NVRTC JIT).
//
// This file is cut into sections by "// @@" marker lines; tensorfold.kernels loads it:
//   "// @@header"          helpers, passed as cuda_kernel(header=...)
//   "// @@body <name>"     the body of kernel <name>; MLX generates the signature from the
//                          input / output names and the template arguments.
// tensorfold/kernels/_cuda.py builds the same signature for a standalone nvcc syntax check.
//
// Arithmetic of one output element out[r, n] (fixed by K, group size, bits only):
//   K is cut into 32-element chunks c = 0 .. K/32-1; lane l of the warp owning column n
//   takes chunks c = l, l+32, l+64, ... in that order; inside a chunk, elements
//   j = 0..31 in order: acc = fma(w_hat[j], x[r, 32c+j], acc), with
//   w_hat = fma(scale, q, bias) (quantised) or the widened weight (dense);
//   then a butterfly over lanes (xor 16, 8, 4, 2, 1) with round-to-nearest adds.
//   Every lane ends with the same value (fp add is commutative), lane 0 stores it.
// M only decides how many rows (<= 16 per block; more rows -> more blocks along y) the
// loops visit. All arithmetic uses __fmaf_rn / __fadd_rn, which the compiler never
// re-associates or contracts, so the code path of one row is the same for every M.
//
// Work layout: 8 warps per block, 2 output columns per warp (16 per block). Every weight
// word is read once per block of 16 rows; the block stages a 1024-wide K tile of its rows
// of x in shared memory (fp32, XOR-swizzled so that lane l reading element j hits bank
// (l ^ j) -- no conflicts), and every lane dots its dequantised chunk with all rows.

// @@header
// (the shared helpers tf_to_float, tf_from_float, tf_load8, tf_extract, tf_load_chunk,
// tf_warp_sum, TF_FULL_MASK, TF_NEG_INF come from common.cuh, prepended by _sources.py)

// @@body row_qmm
// inputs: x [R, K] (T), w [N, K*BITS/32] uint32, scales / biases [N, K/GS] (S)
// output: out [R, N] (T).   template: T, S, K, N, GS, BITS
// launch: grid (ceil(N/16)*256, ceil(R/16), 1), threadgroup (256, 1, 1),
//         dynamic shared memory = min(MAXM, R rounded up to a power of 2) * 1024 * sizeof(T) bytes
constexpr int WARPS = 8;
constexpr int NCW = 2;
constexpr int MAXM = sizeof(T) == 4 ? 8 : 16;   // x staged as T: <= 32 KB shared
constexpr int KT = 1024;
constexpr int NCHUNK = K / 32;
constexpr int KW = K * BITS / 32;
constexpr int NG = K / GS;
extern __shared__ float xs_raw[];
T* xs = reinterpret_cast<T*>(xs_raw);
const int R = x_shape[0];
const int lane = threadIdx.x & 31;
const int warp = threadIdx.x >> 5;
const int n0 = (blockIdx.x * WARPS + warp) * NCW;
const int r0 = blockIdx.y * MAXM;
const int rows = min(MAXM, R - r0);
float acc[MAXM][NCW];
#pragma unroll
for (int m = 0; m < MAXM; ++m) {
#pragma unroll
  for (int c = 0; c < NCW; ++c) acc[m][c] = 0.0f;
}
for (int kt = 0; kt < K; kt += KT) {
  __syncthreads();
  for (int e = threadIdx.x; e < rows * KT; e += blockDim.x) {
    const int m = e / KT;
    const int kk = e % KT;
    T v = tf_from_float<T>(0.0f);
    if (kt + kk < K) v = x[(size_t)(r0 + m) * K + kt + kk];
    const int ln = kk >> 5, j = kk & 31;
    xs[m * KT + j * 32 + (ln ^ j)] = v;
  }
  __syncthreads();
  const int ch = (kt >> 5) + lane;
  if (ch < NCHUNK && n0 < N) {
    unsigned int words[NCW][BITS];
    float sc[NCW], bi[NCW];
#pragma unroll
    for (int c = 0; c < NCW; ++c) {
      const int n = min(n0 + c, N - 1); // a missing column repeats the last; never stored
      tf_load_chunk<BITS>(w + (size_t)n * KW + (size_t)ch * BITS, words[c]);
      const int g = (ch * 32) / GS;
      sc[c] = tf_to_float(scales[(size_t)n * NG + g]);
      bi[c] = tf_to_float(biases[(size_t)n * NG + g]);
    }
#pragma unroll
    for (int jb = 0; jb < 32; jb += 8) {
      float wh[NCW][8];
#pragma unroll
      for (int c = 0; c < NCW; ++c) {
#pragma unroll
        for (int jj = 0; jj < 8; ++jj) {
          wh[c][jj] = __fmaf_rn(sc[c], (float)tf_extract<BITS>(words[c], jb + jj), bi[c]);
        }
      }
#pragma unroll
      for (int m = 0; m < MAXM; ++m) {
        if (m < rows) {
#pragma unroll
          for (int jj = 0; jj < 8; ++jj) {
            const int j = jb + jj;
            const float xv = tf_to_float(xs[m * KT + j * 32 + (lane ^ j)]);
#pragma unroll
            for (int c = 0; c < NCW; ++c) acc[m][c] = __fmaf_rn(wh[c][jj], xv, acc[m][c]);
          }
        }
      }
    }
  }
}
#pragma unroll
for (int m = 0; m < MAXM; ++m) {
  if (m < rows) {
#pragma unroll
    for (int c = 0; c < NCW; ++c) {
      const float v = tf_warp_sum(acc[m][c]);
      if (lane == 0 && n0 + c < N) out[(size_t)(r0 + m) * N + n0 + c] = tf_from_float<T>(v);
    }
  }
}

// @@body row_mm
// inputs: x [R, K] (T), w [N, K] (W)      output: out [R, N] (T).  template: T, W, K, N
// launch: as row_qmm.
constexpr int WARPS = 8;
constexpr int NCW = 2;
constexpr int MAXM = sizeof(T) == 4 ? 8 : 16;   // x staged as T: <= 32 KB shared
constexpr int KT = 1024;
constexpr int NCHUNK = K / 32;
extern __shared__ float xs_raw[];
T* xs = reinterpret_cast<T*>(xs_raw);
const int R = x_shape[0];
const int lane = threadIdx.x & 31;
const int warp = threadIdx.x >> 5;
const int n0 = (blockIdx.x * WARPS + warp) * NCW;
const int r0 = blockIdx.y * MAXM;
const int rows = min(MAXM, R - r0);
float acc[MAXM][NCW];
#pragma unroll
for (int m = 0; m < MAXM; ++m) {
#pragma unroll
  for (int c = 0; c < NCW; ++c) acc[m][c] = 0.0f;
}
for (int kt = 0; kt < K; kt += KT) {
  __syncthreads();
  for (int e = threadIdx.x; e < rows * KT; e += blockDim.x) {
    const int m = e / KT;
    const int kk = e % KT;
    T v = tf_from_float<T>(0.0f);
    if (kt + kk < K) v = x[(size_t)(r0 + m) * K + kt + kk];
    const int ln = kk >> 5, j = kk & 31;
    xs[m * KT + j * 32 + (ln ^ j)] = v;
  }
  __syncthreads();
  const int ch = (kt >> 5) + lane;
  if (ch < NCHUNK && n0 < N) {
#pragma unroll
    for (int jb = 0; jb < 32; jb += 8) {
      float wh[NCW][8];
#pragma unroll
      for (int c = 0; c < NCW; ++c) {
        const int n = min(n0 + c, N - 1);
        tf_load8(w + (size_t)n * K + (size_t)ch * 32 + jb, wh[c]);
      }
#pragma unroll
      for (int m = 0; m < MAXM; ++m) {
        if (m < rows) {
#pragma unroll
          for (int jj = 0; jj < 8; ++jj) {
            const int j = jb + jj;
            const float xv = tf_to_float(xs[m * KT + j * 32 + (lane ^ j)]);
#pragma unroll
            for (int c = 0; c < NCW; ++c) acc[m][c] = __fmaf_rn(wh[c][jj], xv, acc[m][c]);
          }
        }
      }
    }
  }
}
#pragma unroll
for (int m = 0; m < MAXM; ++m) {
  if (m < rows) {
#pragma unroll
    for (int c = 0; c < NCW; ++c) {
      const float v = tf_warp_sum(acc[m][c]);
      if (lane == 0 && n0 + c < N) out[(size_t)(r0 + m) * N + n0 + c] = tf_from_float<T>(v);
    }
  }
}
