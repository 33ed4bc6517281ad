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

// ---- helpers of the staged GEMMs (row_qmm, row_mm) --------------------------------------
// Rows r0 .. r0+rows-1, columns kt .. kt+KT-1 of x into shared memory, XOR swizzled so that
// lane l reading element j of its chunk hits bank (l ^ j); zeros past K.
template <typename T, int K, int KT>
__device__ __forceinline__ void tf_stage_x(const T* x, T* xs, int r0, int rows, int kt) {
  for (int e = threadIdx.x; e < rows * KT; e += blockDim.x) {
    const int m = e / KT;
    const int kk = e % KT;
    T v = tf_from_float<T>(0.0f);
    if (kt + kk < K) v = x[(size_t)(r0 + m) * K + kt + kk];
    const int ln = kk >> 5, j = kk & 31;
    xs[m * KT + j * 32 + (ln ^ j)] = v;
  }
}

// acc[m][c] = fma(wh[c][jj], x[m][jb + jj], acc[m][c]) for jj = 0..7 in order, each staged row.
template <typename T, int KT, int MAXM, int NCW>
__device__ __forceinline__ void tf_fma_rows(float (&acc)[MAXM][NCW], const float (&wh)[NCW][8],
                                            const T* xs, int rows, int lane, int jb) {
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

// The butterfly over lanes, then lane 0 stores out[r0 + m, n0 + c] (rounded to the output's
// type O, which may differ from x's: the MoE router's fp32 logits of bf16 rows).
template <int MAXM, int NCW, typename O>
__device__ __forceinline__ void tf_store_rows(float (&acc)[MAXM][NCW], O* out, int rows, int r0,
                                              int n0, int N, int lane) {
#pragma unroll
  for (int m = 0; m < MAXM; ++m) {
    if (m < rows) {
#pragma unroll
      for (int c = 0; c < NCW; ++c) {
        const float v = tf_warp_sum(acc[m][c]);
        if (lane == 0 && n0 + c < N) out[(size_t)(r0 + m) * N + n0 + c] = tf_from_float<O>(v);
      }
    }
  }
}

// ---- tensor-core helpers (row_qmm_tc, row_mm_tc) ---------------------------------------
// Two packed 16-bit ones (the A operand that turns an mma into a row sum of B).
__device__ __forceinline__ unsigned int tf_ones2(__nv_bfloat16) { return 0x3F803F80u; }
__device__ __forceinline__ unsigned int tf_ones2(__half) { return 0x3C003C00u; }

// Nibbles j and j+4 of a 4-bit word as two exact 16-bit values (low half: nibble j), offset by
// a magic: 0x4300 is bf16 128.0 and 0x6400 is fp16 1024.0, so OR-ing a nibble q into the mantissa
// gives 128 + q (1024 + q) exactly. (a & 0x000F000F) | magic is one lop3 (nvcc otherwise emits
// an AND and an OR). The 4-bit GEMMs feed these pairs to the mma as they are (P' = P + MAGIC * X,
// X the group's sum of x, from the mma with ones) and fold the group with bias' = bias - MAGIC *
// scale (tf_q4_bias), so no pair is ever converted back: acc += scale * P' + bias' * X.
template <unsigned int MAGIC>
__device__ __forceinline__ unsigned int tf_nib_or(unsigned int a) {
  unsigned int d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "n"(0x000F000Fu), "n"(MAGIC));
  return d;
}
__device__ __forceinline__ unsigned int tf_q4raw(unsigned int w, int j, __nv_bfloat16) {
  return tf_nib_or<0x43004300u>(w >> (4 * j));
}
__device__ __forceinline__ unsigned int tf_q4raw(unsigned int w, int j, __half) {
  return tf_nib_or<0x64006400u>(w >> (4 * j));
}
__device__ __forceinline__ float tf_q4_bias(float scale, float bias, __nv_bfloat16) {
  return __fmaf_rn(-128.0f, scale, bias);
}
__device__ __forceinline__ float tf_q4_bias(float scale, float bias, __half) {
  return __fmaf_rn(-1024.0f, scale, bias);
}
// G consecutive 2-byte scales (or biases) of one weight row with one vector load.
__device__ __forceinline__ void tf_set_bits(__nv_bfloat16& v, unsigned int b) {
  v = __ushort_as_bfloat16(static_cast<unsigned short>(b & 0xffffu));
}
__device__ __forceinline__ void tf_set_bits(__half& v, unsigned int b) {
  v = __ushort_as_half(static_cast<unsigned short>(b & 0xffffu));
}
template <int G, typename S>
__device__ __forceinline__ void tf_load_vec(const S* p, S* out) {
  if constexpr (G == 1) {
    out[0] = p[0];
  } else if constexpr (G == 2) {
    const unsigned int u = __ldg(reinterpret_cast<const unsigned int*>(p));
    tf_set_bits(out[0], u); tf_set_bits(out[1], u >> 16);
  } else if constexpr (G == 4) {
    const uint2 u = __ldg(reinterpret_cast<const uint2*>(p));
    tf_set_bits(out[0], u.x); tf_set_bits(out[1], u.x >> 16);
    tf_set_bits(out[2], u.y); tf_set_bits(out[3], u.y >> 16);
  } else {
    static_assert(G == 8, "tf_load_vec: 1, 2, 4 or 8 values");
    const uint4 u = __ldg(reinterpret_cast<const uint4*>(p));
    const unsigned int v[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) { tf_set_bits(out[2 * i], v[i]); tf_set_bits(out[2 * i + 1], v[i] >> 16); }
  }
}

// The chunk loop of the tensor-core GEMMs: chunks 0..CPW-1 in order; with DB, chunk ci + 1's
// loads are issued before chunk ci is computed (two register buffers), same arithmetic.
template <int CPW, bool DB, typename Buf, typename Load, typename Compute>
__device__ __forceinline__ void tf_chunks(Load&& load, Compute&& compute) {
  if constexpr (DB) {
    Buf ca, cb;
    load(0, ca);
#pragma unroll 1
    for (int ci = 0; ci < CPW; ci += 2) {
      if (ci + 1 < CPW) load(ci + 1, cb);
      compute(ci, ca);
      if (ci + 1 < CPW) {
        if (ci + 2 < CPW) load(ci + 2, ca);
        compute(ci + 1, cb);
      }
    }
  } else {
    Buf ca;
#pragma unroll 1
    for (int ci = 0; ci < CPW; ++ci) {
      load(ci, ca);
      compute(ci, ca);
    }
  }
}

// Split-K reduction in warp order ((w0 + w1) + w2) + ..., then warp 0 stores its fragments:
// acc[nt][mt][i] is out[r0 + 8 mt + 2 t + (i & 1), nbase + 16 nt + 8 (i >> 1) + g].
// With RES, out = T(T(acc) + res) (the residual add of the layer, fused: row_qmm_cp).
template <typename T, int NT, int SPLIT, bool RES = false>
__device__ __forceinline__ void tf_tc_finish(float (&acc)[NT][2][4], float* red, T* out,
                                             int warp, int lane, bool two, int rows, int r0,
                                             int nbase, int N, const T* res = nullptr) {
  if constexpr (SPLIT > 1) {
    if (warp > 0) {
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            red[((((warp - 1) * NT + nt) * 2 + mt) * 4 + i) * 32 + lane] = acc[nt][mt][i];
          }
        }
      }
    }
    __syncthreads();
    if (warp == 0) {
      for (int v = 1; v < SPLIT; ++v) {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
          for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              acc[nt][mt][i] = __fadd_rn(acc[nt][mt][i],
                                         red[((((v - 1) * NT + nt) * 2 + mt) * 4 + i) * 32 + lane]);
            }
          }
        }
      }
    }
  }
  if (warp != 0) return;
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
      if (mt == 1 && !two) continue;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int m = mt * 8 + 2 * t + (i & 1);
        const int n = nbase + nt * 16 + 8 * (i >> 1) + g;
        if (m < rows && n < N) {
          T y = tf_from_float<T>(acc[nt][mt][i]);
          if constexpr (RES) {
            y = tf_from_float<T>(__fadd_rn(tf_to_float(y), tf_to_float(res[(size_t)(r0 + m) * N + n])));
          }
          out[(size_t)(r0 + m) * N + n] = y;
        }
      }
    }
  }
}

// The accumulators of the tensor-core GEMMs, zeroed.
template <int NT>
__device__ __forceinline__ void tf_tc_zero(float (&acc)[NT][2][4]) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[nt][mt][i] = 0.0f;
    }
  }
}

// One 32-element block of the dense tensor-core GEMMs (row_mm_tc, row_mm_cp), the one place
// their arithmetic order is written: wv[nt][h] holds elements 8t..8t+7 of the block for weight
// row 16 nt + 8 h + g, xb[mt] the same elements of x row 8 mt + g (tf_tc_xrows); each
// accumulator takes the k half s = 0, then s = 1.
template <typename T, int NT>
__device__ __forceinline__ void tf_mm_block(float (&acc)[NT][2][4], const uint4 (&wv)[NT][2],
                                            const unsigned int (&xb)[2][4], bool two, T tag) {
#pragma unroll
  for (int s = 0; s < 2; ++s) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const unsigned int* w0 = reinterpret_cast<const unsigned int*>(&wv[nt][0]);
      const unsigned int* w1 = reinterpret_cast<const unsigned int*>(&wv[nt][1]);
      const unsigned int a[4] = {w0[2 * s], w1[2 * s], w0[2 * s + 1], w1[2 * s + 1]};
      tf_mma(acc[nt][0], a, &xb[0][2 * s], tag);
      if (two) tf_mma(acc[nt][1], a, &xb[1][2 * s], tag);
    }
  }
}

// The group fold of the quantized tensor-core GEMMs (row_qmm_tc, row_qmm_cp), the one place it
// is written: per output element acc = fma(scale, P, acc), then acc = fma(bias, X, acc), tiles
// and elements in order. sb(nt, h) gives (scale, bias) as floats for weight row 16 nt + 8 h + gq
// (for 4 bits the bias is already bias' = bias - MAGIC scale: P and bias' go together).
// C0 (a one-row launch): column 0's elements only (i = 0, 2); the others are never stored.
template <int NT, bool C0 = false, typename SB>
__device__ __forceinline__ void tf_tc_fold(float (&acc)[NT][2][4], const float (&P)[NT][2][4],
                                           const float (&X)[2][4], bool two, SB sb) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
      if (mt == 0 || two) {
#pragma unroll
        for (int i = 0; i < 4; i += C0 ? 2 : 1) {
          const float2 v = sb(nt, i >> 1);
          acc[nt][mt][i] = __fmaf_rn(v.x, P[nt][mt][i], acc[nt][mt][i]);
          acc[nt][mt][i] = __fmaf_rn(v.y, X[mt][i & 1], acc[nt][mt][i]);
        }
      }
    }
  }
}

// Rows r0 + gq and r0 + 8 + gq of x (the two 8-row tiles' B fragments), from this lane's quad
// column tq * 8; rows past `rows` repeat the last row and are marked not ok (never stored).
template <typename T, int K>
__device__ __forceinline__ void tf_tc_xrows(const T* x, int r0, int rows, int gq, int tq,
                                            const T* (&xrow)[2], bool (&xok)[2]) {
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) {
    const int m = mt * 8 + gq;
    xok[mt] = m < rows;
    xrow[mt] = x + (size_t)(r0 + min(m, rows - 1)) * K + tq * 8;
  }
}
// 8 consecutive x values (one 16-byte load) as the pairs (x_j, x_{j+4}), j = 0..3, matching
// tf_q4raw / tf_q8pair.
__device__ __forceinline__ void tf_xpairs(const uint4 u, unsigned int (&xb)[4]) {
  xb[0] = __byte_perm(u.x, u.z, 0x5410);
  xb[1] = __byte_perm(u.x, u.z, 0x7632);
  xb[2] = __byte_perm(u.y, u.w, 0x5410);
  xb[3] = __byte_perm(u.y, u.w, 0x7632);
}

// Byte j of w0 and byte j of w1 (8-bit values) as two exact 16-bit integers.
__device__ __forceinline__ float tf_byte_f(unsigned int w, int j) {
  return __fsub_rn(__uint_as_float(__byte_perm(w, 0x4B000000u, 0x7650u + j)), 8388608.0f);
}
template <typename T>
__device__ __forceinline__ unsigned int tf_q8pair(unsigned int w0, unsigned int w1, int j, T) {
  return tf_pack2<T>(tf_byte_f(w0, j), tf_byte_f(w1, j));
}

// Shared-memory position of 16-byte unit u of weight row r in a stage of 16 rows x UPR units
// (row_qmm_cp): XOR-swizzled so that the 8 rows one ldmatrix reads of a unit fall on 8
// different 16-byte bank groups.
template <int UPR>
__device__ __forceinline__ int tf_swz(int r, int u) {
  const int sw = UPR >= 8 ? (r & 7) : ((r * UPR / 8) & (UPR - 1));
  return r * UPR + (u ^ sw);
}

// @@body row_qmm
// inputs: x [R, K] (T), w [N, K*BITS/32] uint32, scales / biases [N, K/GS] (S)
// output: out [R, N] (T, or float: x's values are read exactly as they would be from a float
// copy of x, so a float output has the bits of this kernel on x.astype(float)).
// template: T, S, K, N, GS, BITS
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
  tf_stage_x<T, K, KT>(x, xs, r0, rows, kt);
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
      tf_dequant8<BITS, NCW>(words, sc, bi, jb, wh);
      tf_fma_rows<T, KT, MAXM, NCW>(acc, wh, xs, rows, lane, jb);
    }
  }
}
tf_store_rows<MAXM, NCW>(acc, out, rows, r0, n0, N, lane);

// @@body row_mm
// inputs: x [R, K] (T), w [N, K] (W)      output: out [R, N] (T or float, as row_qmm).
// template: T, W, K, N
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
  tf_stage_x<T, K, KT>(x, xs, r0, rows, kt);
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
      tf_fma_rows<T, KT, MAXM, NCW>(acc, wh, xs, rows, lane, jb);
    }
  }
}
tf_store_rows<MAXM, NCW>(acc, out, rows, r0, n0, N, lane);

// ============================================================================================
// Tensor-core faces (bf16 / fp16 activations; 4- and 8-bit or same-dtype dense weights).
//
// Arithmetic of out[r, n], fixed by (K, GS, BITS, CB, SPLIT), which the wrapper derives from
// the weight shape only:
//   K is cut into 32-element blocks; blocks are grouped into chunks of CB blocks; chunk c
//   belongs to warp c / (NCHUNK / SPLIT) of the block (split K). Inside a block, lane t of
//   each quad holds the 8 consecutive elements 32 * blk + 8 t .. + 7 of its weight rows and
//   of its x rows, so each mma k-step of 16 covers 16 fixed elements of one 32-block.
//   Quantized: per group, P = sum q * x (q as exact 16-bit integers, fp32 accumulation in
//   the tensor core, C chained through the group's k-steps in order) and X = sum x (the
//   same mma with A = ones); then acc = fma(scale, P, acc); acc = fma(bias, X, acc) per
//   group in order. Dense: acc chained through every k-step in order.
//   The SPLIT warp partials are added in warp order: ((w0 + w1) + w2) + ...
// A call with M rows runs the same instructions for row r whatever M is: rows are the N
// side of the mma (8 per tile; a second tile for rows 8..15 of the 16-row block), and each
// mma output element depends only on its own row of x.
//
// Memory: each block owns 16 * NT weight rows; each lane issues all CB blocks' weight loads
// (and the chunk's scales / biases) before using them, so a warp keeps 4 KB in flight; x
// (tiny, shared by all blocks) comes through L1 / L2.

// @@body row_qmm_tc
// inputs: x [R, K] (T = bf16 / fp16), w [N, K*BITS/32] uint32, scales / biases [N, K/GS] (S,
// 2 bytes)   output: out [R, N] (T).
// template: T, S, K, N, GS, BITS (4 / 8), NT, CB, SPLIT, DB (double-buffered chunk loads)
// launch: grid (ceil(N / (16 NT)) * 32 SPLIT, ceil(R / 16), 1), threadgroup (32 SPLIT, 1, 1),
//         dynamic shared memory (SPLIT - 1) * NT * 1024 bytes.
constexpr int KW = K * BITS / 32;
constexpr int NG = K / GS;
constexpr int BPG = GS / 32;
constexpr int GPC = CB / BPG;
constexpr int NCHUNK = K / (32 * CB);
constexpr int CPW = NCHUNK / SPLIT;
constexpr int WPB = BITS / 4;
static_assert(BITS == 4 || BITS == 8, "row_qmm_tc: 4 or 8 bits");
static_assert(CB % BPG == 0 && K % (32 * CB) == 0 && NCHUNK % SPLIT == 0, "row_qmm_tc: plan");
static_assert(sizeof(S) == 2, "row_qmm_tc: 2-byte scales");
extern __shared__ float red[];
const int R = x_shape[0];
const int lane = threadIdx.x & 31;
const int warp = threadIdx.x >> 5;
const int gq = lane >> 2, tq = lane & 3;
const int nbase = blockIdx.x * (16 * NT);
const int r0 = blockIdx.y * 16;
const int rows = min(16, R - r0);
const bool two = rows > 8;  // warp-uniform
int nrow[NT][2];
#pragma unroll
for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
  for (int h = 0; h < 2; ++h) nrow[nt][h] = min(nbase + nt * 16 + 8 * h + gq, N - 1);
}
const T* xrow[2];
bool xok[2];
tf_tc_xrows<T, K>(x, r0, rows, gq, tq, xrow, xok);
const T tag = tf_from_float<T>(0.0f);
unsigned int ones[4];
#pragma unroll
for (int i = 0; i < 4; ++i) ones[i] = tf_ones2(tag);
float acc[NT][2][4];
tf_tc_zero<NT>(acc);
// one chunk's weight words and scales / biases, loaded before any of them is used
struct Chunk {
  unsigned int wq[CB][NT][2][WPB];
  S sc[NT][2][GPC], bi[NT][2][GPC];
};
auto load = [&](int ci, Chunk& c) {
  const int chunk = warp * CPW + ci;
  const int blk0 = chunk * CB;
  const int grp0 = chunk * GPC;
#pragma unroll
  for (int b = 0; b < CB; ++b) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const unsigned int* p = w + (size_t)nrow[nt][h] * KW + (size_t)(blk0 + b) * BITS + tq * WPB;
        if constexpr (WPB == 1) {
          c.wq[b][nt][h][0] = __ldg(p);
        } else {
          const uint2 u = __ldg(reinterpret_cast<const uint2*>(p));
          c.wq[b][nt][h][0] = u.x;
          c.wq[b][nt][h][1] = u.y;
        }
      }
    }
  }
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      tf_load_vec<GPC>(scales + (size_t)nrow[nt][h] * NG + grp0, c.sc[nt][h]);
      tf_load_vec<GPC>(biases + (size_t)nrow[nt][h] * NG + grp0, c.bi[nt][h]);
    }
  }
};
auto compute = [&](int ci, const Chunk& c) {
  const int blk0 = (warp * CPW + ci) * CB;
#pragma unroll
  for (int gi = 0; gi < GPC; ++gi) {
    float P[NT][2][4], X[2][4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      X[0][i] = 0.0f;
      X[1][i] = 0.0f;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        P[nt][0][i] = 0.0f;
        P[nt][1][i] = 0.0f;
      }
    }
#pragma unroll
    for (int bb = 0; bb < BPG; ++bb) {
      const int b = gi * BPG + bb;
      unsigned int xb[2][4];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
        uint4 u = make_uint4(0u, 0u, 0u, 0u);
        if ((mt == 0 || two) && xok[mt]) {
          u = __ldg(reinterpret_cast<const uint4*>(xrow[mt] + (size_t)(blk0 + b) * 32));
        }
        tf_xpairs(u, xb[mt]);
      }
#pragma unroll
      for (int s = 0; s < 2; ++s) {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          unsigned int a[4];
          if constexpr (BITS == 4) {
            a[0] = tf_q4raw(c.wq[b][nt][0][0], 2 * s, tag);
            a[1] = tf_q4raw(c.wq[b][nt][1][0], 2 * s, tag);
            a[2] = tf_q4raw(c.wq[b][nt][0][0], 2 * s + 1, tag);
            a[3] = tf_q4raw(c.wq[b][nt][1][0], 2 * s + 1, tag);
          } else {
            a[0] = tf_q8pair(c.wq[b][nt][0][0], c.wq[b][nt][0][WPB - 1], 2 * s, tag);
            a[1] = tf_q8pair(c.wq[b][nt][1][0], c.wq[b][nt][1][WPB - 1], 2 * s, tag);
            a[2] = tf_q8pair(c.wq[b][nt][0][0], c.wq[b][nt][0][WPB - 1], 2 * s + 1, tag);
            a[3] = tf_q8pair(c.wq[b][nt][1][0], c.wq[b][nt][1][WPB - 1], 2 * s + 1, tag);
          }
          tf_mma(P[nt][0], a, &xb[0][2 * s], tag);
          if (two) tf_mma(P[nt][1], a, &xb[1][2 * s], tag);
        }
        tf_mma(X[0], ones, &xb[0][2 * s], tag);
        if (two) tf_mma(X[1], ones, &xb[1][2 * s], tag);
      }
    }
    tf_tc_fold<NT>(acc, P, X, two, [&](int nt, int h) {
      const float sc = tf_to_float(c.sc[nt][h][gi]);
      float bi = tf_to_float(c.bi[nt][h][gi]);
      if constexpr (BITS == 4) bi = tf_q4_bias(sc, bi, tag);
      return make_float2(sc, bi);
    });
  }
};
tf_chunks<CPW, DB, Chunk>(load, compute);
tf_tc_finish<T, NT, SPLIT>(acc, red, out, warp, lane, two, rows, r0, nbase, N);

// @@body row_qmm_cp
// The arithmetic of row_qmm_tc with the same SPLIT (bit-identical output, whatever NT), with the
// 4-bit weights brought in by a cp.async pipeline through shared memory instead of registers:
// each warp streams its K slice (K / SPLIT) in stages of CB 32-element blocks for its block's
// 16 NT weight rows (16 NT x CB x 16 bytes), NS stages in flight, and reads a stage with ldmatrix, which
// hands lane 4g + t word t of a block of row g -- the register layout row_qmm_tc loads from
// global memory. The warp's scales and biases are copied once, with the first stage.
// inputs: as row_qmm_tc (BITS = 4), and res [R, N] (T; read only with RES: out = T(T(acc) + res),
// the layer's residual add in the same launch)   output: out [R, N] (T).
// template: T, S, K, N, GS, SPLIT, CB, NS, RES, NT, XE, CA, UR, PRO, ONE, XS, C0, F2, TWO (false: the launch has at most 8 rows, so the
// second 8-row mma tile is compiled out; rows 0..7 run the same operations either way), XE (when
// a chunk's x rows are loaded: 0 after its weight stage has landed, 1 before waiting for it,
// 2 one chunk ahead, during the previous chunk's mmas; data movement only, the same bits), NT
// (16-row weight tiles per block: each x fragment and each X = sum x mma serve NT tiles, as in
// row_qmm_tc; the same bits), CA (a stage's copies from one pointer and constant offsets, see
// issue: data movement only), UR (chunks a turn of the loop: with 2, XE 2's hand-over of the
// next chunk's x rows is register renaming, not moves; the same operations in the same order).
// ONE (a one-row launch, GPC even): x column 1 is never stored, so lane group gq = 1 reads group
// gi ^ 1's blocks, and the X mmas of an even group give, in column 1, the odd group's X -- the
// same chain of mmas on the same values (a column depends on its own inputs only): the odd
// group runs no X mma. The same bits; fewer mmas.
// XS (a one-row launch): the warp's x slice is staged once in shared memory, already as the
// pairs tf_xpairs makes (unit 4 b + t: block b, quad column t), while the first stage is in
// flight; a chunk then reads its x with shared loads after its stage wait (XE 0) and makes no
// pair moves. The same values.
// C0 (a one-row launch): the group fold of column 0 only (tf_tc_fold): the other columns are
// never stored. Row 0's operations are the same.
// F2 (a launch of 9..16 rows): the second tile always has rows, so `two` is a constant and its
// branches and accumulator zeroing compile away. The same operations.
// (Removed in session 18, measured slower: XE 3, rows 8..15's x at their use, session 15; PF,
// stages asked of L2 ahead of the ring, session 17. Session 25: H8, a launch past 8 rows as
// 8-row blocks of this kernel without TWO, 26-51% slower at 16 rows.)
// launch: grid (ceil(N / (16 NT)) * 32 SPLIT, ceil(R / 16), 1), threadgroup (32 SPLIT, 1, 1),
//         dynamic shared memory NT * ((SPLIT - 1) * 1024 + SPLIT * (NS * CB * 256 + 64 * (K / SPLIT / GS)))
//         + (XS ? 2 K : 0).
constexpr int KW = K / 8;
constexpr int NG = K / GS;
constexpr int BPG = GS / 32;
constexpr int GPC = CB / BPG;
constexpr int KSL = K / SPLIT;
constexpr int CPW = KSL / (32 * CB);
constexpr int NGW = KSL / GS;
constexpr int UPR = CB;
constexpr int STAGE = 16 * NT * UPR;
constexpr int CPL = STAGE / 32;
static_assert(KSL % (32 * CB) == 0 && CB % BPG == 0 && CB % 2 == 0 && STAGE % 32 == 0);
static_assert(NG % 2 == 0 && NGW % 2 == 0 && NS >= 2);   // 4-byte scale copies at least
static_assert(sizeof(S) == 2);   // 2-byte scales
static_assert(!ONE || (GPC % 2 == 0 && !TWO));
static_assert(!XS || (!TWO && XE == 0 && sizeof(T) == 2));
static_assert(!C0 || !TWO);
static_assert(!F2 || TWO);
// every block full (the real shapes): no row clamp, so the copies of a stage are constant strides apart
constexpr bool NFULL = N % (16 * NT) == 0;
extern __shared__ uint4 smem_cp[];
float* red = reinterpret_cast<float*>(smem_cp);
const int R = x_shape[0];
const int lane = threadIdx.x & 31;
const int warp = threadIdx.x >> 5;
const int gq = lane >> 2, tq = lane & 3;
const int nbase = blockIdx.x * (16 * NT);
const int r0 = blockIdx.y * 16;
const int rows = min(16, R - r0);
const bool two = TWO && (F2 || rows > 8);
uint4* ring = smem_cp + (SPLIT - 1) * 64 * NT + warp * NS * STAGE;
S* sall = reinterpret_cast<S*>(smem_cp + (SPLIT - 1) * 64 * NT + SPLIT * NS * STAGE);   // every warp's scales
S* ssc = sall + warp * 32 * NT * NGW;
S* sbi = ssc + 16 * NT * NGW;
uint4* xsm = reinterpret_cast<uint4*>(sall + SPLIT * 32 * NT * NGW) + warp * (KSL / 8);   // XS
auto wrow = [&](int r) { return NFULL ? nbase + r : min(nbase + r, N - 1); };
const int blkw = warp * (KSL / 32);
// this lane's copies of every stage: unit e = lane + 32 i -> row e / UPR, unit e % UPR
const unsigned int* wsrc[CPL];
int wdst[CPL];
#pragma unroll
for (int i = 0; i < CPL; ++i) {
  const int e = lane + 32 * i;
  const int r = e / UPR, u = e % UPR;
  wsrc[i] = w + (size_t)wrow(r) * KW + (size_t)(blkw + u) * 4;
  wdst[i] = tf_swz<UPR>(r, u);
}
// CA (every block full): the same copies addressed as one pointer and one shared base a stage
// plus constants. Copy i takes row r0 + RPC i (r0 = lane / UPR < RPC), so its source is RPC i
// rows past copy 0's, and its swizzle repeats every SP copies (8 rows from CB 8; none below):
// its destination is wdst[i % SP] plus the 32 (i - i % SP) units of the rows between -- offsets
// the copy instructions carry as immediates.
constexpr int RPC = 32 / UPR;
constexpr int SP = UPR >= 8 ? 8 / RPC : 1;
static_assert(!CA || (32 % UPR == 0 && CPL % SP == 0 && NFULL));
auto issue = [&](int ci) {
  uint4* st = ring + (ci % NS) * STAGE;
  if constexpr (CA) {
    const unsigned int sb = static_cast<unsigned int>(__cvta_generic_to_shared(st));
    const unsigned int* src = wsrc[0] + (size_t)ci * CB * 4;
    tf_unroll<CPL>([&](auto ic) {
      constexpr int i = decltype(ic)::value;
      tf_cp_async16s<i * RPC * KW * 4>(sb + 16 * (wdst[i % SP] + 32 * (i - i % SP)), src);
    });
  } else {
#pragma unroll
    for (int i = 0; i < CPL; ++i) tf_cp_async16(st + wdst[i], wsrc[i] + (size_t)ci * CB * 4);
  }
};
// scales and biases of the warp's slice: [16 NT rows][NGW] each, SE a copy: pairs, or with PRO
// 8 (16 bytes) where a row and a slice hold whole 16-byte units
constexpr int SE = PRO && NG % 8 == 0 && NGW % 8 == 0 ? 8 : 2;
constexpr int SC = NGW / SE;
auto scp = [&]() {
  for (int e = lane; e < 32 * NT * SC; e += 32) {
    const int a = e / (16 * NT * SC), rem = e % (16 * NT * SC);
    const int r = rem / SC, p = rem % SC;
    tf_cp_async_ca<2 * SE>((a ? sbi : ssc) + r * NGW + SE * p, (a ? biases : scales) + (size_t)wrow(r) * NG + warp * NGW + SE * p);
  }
};
// PRO: the first stage's weight copies go out before the scale copies (the same group: the
// first wait covers both), so the weights' round trip overlaps the scales' instructions
if (!PRO) scp();
#pragma unroll
for (int st = 0; st < NS - 1; ++st) {
  if (st < CPW) issue(st);
  if (PRO && st == 0) scp();
  tf_cp_async_commit();
}
const T* xrow[2];
bool xok[2];
tf_tc_xrows<T, K>(x, r0, rows, gq, tq, xrow, xok);
const T tag = tf_from_float<T>(0.0f);
xrow[0] += (size_t)blkw * 32;     // the warp's K slice: chunk ci's block b is at (ci CB + b) 32
xrow[1] += (size_t)blkw * 32;
const int xo = ONE && gq == 1 ? BPG * 32 : 0;   // ONE: lanes 4..7 read group gi ^ 1's blocks
if constexpr (XS) {
  for (int e = lane; e < KSL / 8; e += 32) {
    unsigned int p[4];
    tf_xpairs(__ldg(reinterpret_cast<const uint4*>(x + (size_t)r0 * K + (size_t)blkw * 32 + e * 8)), p);
    xsm[e] = make_uint4(p[0], p[1], p[2], p[3]);
  }
  __syncwarp();
}
unsigned int ones[4];
#pragma unroll
for (int i = 0; i < 4; ++i) ones[i] = tf_ones2(tag);
float acc[NT][2][4];
tf_tc_zero<NT>(acc);
// ldmatrix row of this lane: matrix l / 8 = (block pair member, row half)
const int lm = lane >> 3;
const int lrow = 8 * (lm & 1) + (lane & 7);
// x rows of chunk ci (this lane's 16-byte pieces of its two rows). A missing row holds the last
// row's values (tf_tc_xrows): column m of an mma's result depends on column m of x only, and a
// missing row's outputs are never stored, so no load needs a predicate or a zero fill.
auto loadx = [&](int ci, uint4 (&dst)[CB][2]) {
#pragma unroll
  for (int b = 0; b < CB; ++b) {
    const int xof = (b / BPG) & 1 ? -xo : xo;   // ONE's other group (0 otherwise)
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
      if (XS && mt == 0) {
        dst[b][0] = xsm[(ci * CB + b + xof / 32) * 4 + tq];
      } else if (mt == 0 || two) {
        dst[b][mt] = __ldg(reinterpret_cast<const uint4*>(xrow[mt] + (size_t)ci * CB * 32 + b * 32 + xof));
      } else {
        dst[b][mt] = make_uint4(0u, 0u, 0u, 0u);
      }
    }
  }
};
uint4 xv[CB][2], xn[CB][2];
if constexpr (XE == 2) loadx(0, xn);
#pragma unroll UR
for (int ci = 0; ci < CPW; ++ci) {
  if constexpr (XE == 1) loadx(ci, xv);
  if constexpr (XE == 2) {
#pragma unroll
    for (int b = 0; b < CB; ++b) { xv[b][0] = xn[b][0]; xv[b][1] = xn[b][1]; }
    if (ci + 1 < CPW) loadx(ci + 1, xn);
  }
  tf_cp_async_wait<NS - 2>();
  __syncwarp();
  if (ci + NS - 1 < CPW) issue(ci + NS - 1);
  tf_cp_async_commit();
  if constexpr (XE == 0) loadx(ci, xv);
  const uint4* st = ring + (ci % NS) * STAGE;
  unsigned int wq[CB][NT][2];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
    for (int b = 0; b < CB; b += 2) {
      unsigned int d[4];
      tf_ldmatrix4(st + tf_swz<UPR>(16 * nt + lrow, b + (lm >> 1)), d);
      wq[b][nt][0] = d[0]; wq[b][nt][1] = d[1]; wq[b + 1][nt][0] = d[2]; wq[b + 1][nt][1] = d[3];
    }
  }
  float xodd = 0.0f;   // ONE: the odd group's X, column 1 of the even group's X mmas
#pragma unroll
  for (int gi = 0; gi < GPC; ++gi) {
    float P[NT][2][4], X[2][4];
    const bool xmma = !ONE || gi % 2 == 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      X[0][i] = 0.0f; X[1][i] = 0.0f;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) { P[nt][0][i] = 0.0f; P[nt][1][i] = 0.0f; }
    }
#pragma unroll
    for (int bb = 0; bb < BPG; ++bb) {
      const int b = gi * BPG + bb;
      unsigned int xb[2][4];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
        if (XS && mt == 0) memcpy(xb[0], &xv[b][0], 16);
        else tf_xpairs(xv[b][mt], xb[mt]);
      }
#pragma unroll
      for (int s = 0; s < 2; ++s) {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          unsigned int a[4];
          a[0] = tf_q4raw(wq[b][nt][0], 2 * s, tag);
          a[1] = tf_q4raw(wq[b][nt][1], 2 * s, tag);
          a[2] = tf_q4raw(wq[b][nt][0], 2 * s + 1, tag);
          a[3] = tf_q4raw(wq[b][nt][1], 2 * s + 1, tag);
          tf_mma(P[nt][0], a, &xb[0][2 * s], tag);
          if (two) tf_mma(P[nt][1], a, &xb[1][2 * s], tag);
        }
        if (xmma) tf_mma(X[0], ones, &xb[0][2 * s], tag);
        if (two) tf_mma(X[1], ones, &xb[1][2 * s], tag);
      }
    }
    if (ONE && xmma) xodd = X[0][1];
    if (!xmma) X[0][0] = X[0][1] = xodd;
    const int g = ci * GPC + gi;
    tf_tc_fold<NT, C0>(acc, P, X, two, [&](int nt, int h) {
      const int r = 16 * nt + 8 * h + gq;
      const float sc = tf_to_float(ssc[r * NGW + g]);
      return make_float2(sc, tf_q4_bias(sc, tf_to_float(sbi[r * NGW + g]), tag));
    });
  }
}
tf_tc_finish<T, NT, SPLIT, RES>(acc, red, out, warp, lane, two, rows, r0, nbase, N, res);

// @@body row_mm_tc
// inputs: x [R, K] (T = bf16 / fp16), w [N, K] (T)   output: out [R, N] (T).
// template: T, K, N, NT, CB, SPLIT, DB.   launch: as row_qmm_tc.
constexpr int NCHUNK = K / (32 * CB);
constexpr int CPW = NCHUNK / SPLIT;
static_assert(K % (32 * CB) == 0 && NCHUNK % SPLIT == 0, "row_mm_tc: plan");
extern __shared__ float red[];
const int R = x_shape[0];
const int lane = threadIdx.x & 31;
const int warp = threadIdx.x >> 5;
const int gq = lane >> 2, tq = lane & 3;
const int nbase = blockIdx.x * (16 * NT);
const int r0 = blockIdx.y * 16;
const int rows = min(16, R - r0);
const bool two = rows > 8;
const T* wrow[NT][2];
#pragma unroll
for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    wrow[nt][h] = w + (size_t)min(nbase + nt * 16 + 8 * h + gq, N - 1) * K + tq * 8;
  }
}
const T* xrow[2];
bool xok[2];
tf_tc_xrows<T, K>(x, r0, rows, gq, tq, xrow, xok);
const T tag = tf_from_float<T>(0.0f);
float acc[NT][2][4];
tf_tc_zero<NT>(acc);
struct Chunk {
  uint4 wv[CB][NT][2];
};
auto load = [&](int ci, Chunk& c) {
  const int blk0 = (warp * CPW + ci) * CB;
#pragma unroll
  for (int b = 0; b < CB; ++b) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        c.wv[b][nt][h] = __ldg(reinterpret_cast<const uint4*>(wrow[nt][h] + (size_t)(blk0 + b) * 32));
      }
    }
  }
};
auto compute = [&](int ci, const Chunk& c) {
  const int blk0 = (warp * CPW + ci) * CB;
#pragma unroll
  for (int b = 0; b < CB; ++b) {
    unsigned int xb[2][4];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
      uint4 u = make_uint4(0u, 0u, 0u, 0u);
      if ((mt == 0 || two) && xok[mt]) {
        u = __ldg(reinterpret_cast<const uint4*>(xrow[mt] + (size_t)(blk0 + b) * 32));
      }
      xb[mt][0] = u.x; xb[mt][1] = u.y; xb[mt][2] = u.z; xb[mt][3] = u.w;
    }
    tf_mm_block<T, NT>(acc, c.wv[b], xb, two, tag);
  }
};
tf_chunks<CPW, DB, Chunk>(load, compute);
tf_tc_finish<T, NT, SPLIT>(acc, red, out, warp, lane, two, rows, r0, nbase, N);

// @@body row_mm_cp
// The arithmetic of row_mm_tc with the same SPLIT (bit-identical output, whatever CB, NS, XE,
// NT), with the weights brought in by a cp.async pipeline through shared memory instead of
// registers: each warp streams its K slice (K / SPLIT) in stages of CB 32-element blocks of its
// block's 16 NT weight rows (16 NT x CB x 64 bytes), NS stages in flight. A stage is laid out
// [block][row][64 bytes]; lane 4g + t reads the 16 bytes (elements 8t..8t+7 of a block) of rows g
// and g + 8 of each tile -- the registers row_mm_tc loads from global memory -- and the 32 lanes'
// reads of one (block, 8 rows) cover 512 contiguous bytes (no bank conflict). Every
// accumulator takes its mmas in row_mm_tc's order (block by block, k halves s = 0, 1).
// inputs: x [R, K] (T = bf16 / fp16), w [N, K] (T)   output: out [R, N] (T).
// template: T, K, N, SPLIT, CB, NS, XE (0: a block's x rows loaded at their use, as row_mm_tc;
// 1: a chunk's x rows loaded before waiting for its stage), NT (16-row weight tiles per block),
// TWO (false: at most 8 rows, the second 8-row mma tile compiled out; rows 0..7 run the same
// operations either way).
// launch: grid (ceil(N / (16 NT)) * 32 SPLIT, ceil(R / 16), 1), threadgroup (32 SPLIT, 1, 1),
//         dynamic shared memory NT * 1024 * ((SPLIT - 1) + SPLIT * NS * CB).
constexpr int KSL = K / SPLIT;
constexpr int CPW = KSL / (32 * CB);
constexpr int ROWS = 16 * NT;
constexpr int STAGE = ROWS * CB * 4;
constexpr int CPL = STAGE / 32;
static_assert(KSL % (32 * CB) == 0 && CPW >= 1 && STAGE % 32 == 0 && NS >= 2, "row_mm_cp: plan");
extern __shared__ uint4 smem_mm[];
float* red = reinterpret_cast<float*>(smem_mm);
const int R = x_shape[0];
const int lane = threadIdx.x & 31;
const int warp = threadIdx.x >> 5;
const int gq = lane >> 2, tq = lane & 3;
const int nbase = blockIdx.x * ROWS;
const int r0 = blockIdx.y * 16;
const int rows = min(16, R - r0);
const bool two = TWO && rows > 8;
uint4* ring = smem_mm + (SPLIT - 1) * 64 * NT + warp * NS * STAGE;
const int blkw = warp * (KSL / 32);
// this lane's copies of every stage: unit e = lane + 32 i -> row e / (4 CB), block (e / 4) % CB,
// 16-byte piece e % 4 (a row's CB * 64 contiguous bytes from consecutive lanes)
const T* wsrc[CPL];
int wdst[CPL];
#pragma unroll
for (int i = 0; i < CPL; ++i) {
  const int e = lane + 32 * i;
  const int r = e / (4 * CB), b = (e / 4) % CB, c = e % 4;
  wsrc[i] = w + (size_t)min(nbase + r, N - 1) * K + (size_t)(blkw + b) * 32 + c * 8;
  wdst[i] = (b * ROWS + r) * 4 + c;
}
auto issue = [&](int ci) {
  uint4* st = ring + (ci % NS) * STAGE;
#pragma unroll
  for (int i = 0; i < CPL; ++i) tf_cp_async16(st + wdst[i], wsrc[i] + (size_t)ci * CB * 32);
};
#pragma unroll
for (int st = 0; st < NS - 1; ++st) {
  if (st < CPW) issue(st);
  tf_cp_async_commit();
}
const T* xrow[2];
bool xok[2];
tf_tc_xrows<T, K>(x, r0, rows, gq, tq, xrow, xok);
const T tag = tf_from_float<T>(0.0f);
float acc[NT][2][4];
tf_tc_zero<NT>(acc);
auto loadx = [&](int blk, int mt) {
  uint4 u = make_uint4(0u, 0u, 0u, 0u);
  if ((mt == 0 || two) && xok[mt]) u = __ldg(reinterpret_cast<const uint4*>(xrow[mt] + (size_t)blk * 32));
  return u;
};
uint4 xv[CB][2];
#pragma unroll 1
for (int ci = 0; ci < CPW; ++ci) {
  if constexpr (XE == 1) {
#pragma unroll
    for (int b = 0; b < CB; ++b) {
      xv[b][0] = loadx(blkw + ci * CB + b, 0);
      if constexpr (TWO) xv[b][1] = loadx(blkw + ci * CB + b, 1);
    }
  }
  tf_cp_async_wait<NS - 2>();
  __syncwarp();
  if (ci + NS - 1 < CPW) issue(ci + NS - 1);
  tf_cp_async_commit();
  const uint4* st = ring + (ci % NS) * STAGE;
#pragma unroll
  for (int b = 0; b < CB; ++b) {
    unsigned int xb[2][4];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
      uint4 u = make_uint4(0u, 0u, 0u, 0u);
      if (mt == 0 || TWO) {
        if constexpr (XE == 1) u = xv[b][mt]; else u = loadx(blkw + ci * CB + b, mt);
      }
      xb[mt][0] = u.x; xb[mt][1] = u.y; xb[mt][2] = u.z; xb[mt][3] = u.w;
    }
    uint4 wv[NT][2];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
      for (int h = 0; h < 2; ++h) wv[nt][h] = st[(b * ROWS + 16 * nt + 8 * h + gq) * 4 + tq];
    }
    tf_mm_block<T, NT>(acc, wv, xb, two, tag);
  }
}
tf_tc_finish<T, NT, SPLIT>(acc, red, out, warp, lane, two, rows, r0, nbase, N);
