// Row-exact routed-expert GEMMs for MLX's CUDA backend (mx.fast.cuda_kernel, NVRTC JIT):
// the CUDA face of tensorfold.kernels.row_expert_matmul (MoE decode).
//
// Sections as in row_gemm.cu ("// @@header", "// @@body <name>"); launched from
// tensorfold/kernels/_cuda.py (expert_matmul). The header repeats row_gemm.cu's helpers
// (each file is JIT-compiled on its own).
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

// @@header"          helpers, passed as cuda_kernel(header=...)
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
#define TF_FULL_MASK 0xffffffffu

__device__ __forceinline__ float tf_to_float(float v) { return v; }
__device__ __forceinline__ float tf_to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float tf_to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T tf_from_float(float v);
template <> __device__ __forceinline__ float tf_from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __half tf_from_float<__half>(float v) {
  return __float2half_rn(v);
}
template <> __device__ __forceinline__ __nv_bfloat16 tf_from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// 8 consecutive weights (16-byte aligned for 2-byte types, 32-byte for float) -> fp32.
__device__ __forceinline__ void tf_load8(const float* p, float* out) {
  const float4 a = *reinterpret_cast<const float4*>(p);
  const float4 b = *reinterpret_cast<const float4*>(p + 4);
  out[0] = a.x; out[1] = a.y; out[2] = a.z; out[3] = a.w;
  out[4] = b.x; out[5] = b.y; out[6] = b.z; out[7] = b.w;
}
__device__ __forceinline__ void tf_load8(const __nv_bfloat16* p, float* out) {
  const uint4 u = *reinterpret_cast<const uint4*>(p);
  const unsigned int w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    out[2 * i] = __uint_as_float(w[i] << 16);
    out[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}
__device__ __forceinline__ void tf_load8(const __half* p, float* out) {
  const uint4 u = *reinterpret_cast<const uint4*>(p);
  const unsigned int w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    out[2 * i] = __half2float(__ushort_as_half(static_cast<unsigned short>(w[i] & 0xffffu)));
    out[2 * i + 1] = __half2float(__ushort_as_half(static_cast<unsigned short>(w[i] >> 16)));
  }
}

// The BITS-bit integer number e (0..31) of a 32-element chunk held in BITS words
// (little-endian bit stream, values may straddle words for 3/5/6 bits).
template <int BITS>
__device__ __forceinline__ unsigned int tf_extract(const unsigned int* words, int e) {
  const int bit = e * BITS;
  const int wi = bit >> 5;
  const int sh = bit & 31;
  unsigned int q = words[wi] >> sh;
  if (sh + BITS > 32) q |= words[wi + 1] << (32 - sh);
  return q & ((1u << BITS) - 1u);
}

template <int BITS>
__device__ __forceinline__ void tf_load_chunk(const unsigned int* p, unsigned int* words) {
  if constexpr (BITS == 4) {
    const uint4 u = *reinterpret_cast<const uint4*>(p);
    words[0] = u.x; words[1] = u.y; words[2] = u.z; words[3] = u.w;
  } else if constexpr (BITS == 8) {
    const uint4 u = *reinterpret_cast<const uint4*>(p);
    const uint4 v = *reinterpret_cast<const uint4*>(p + 4);
    words[0] = u.x; words[1] = u.y; words[2] = u.z; words[3] = u.w;
    words[4] = v.x; words[5] = v.y; words[6] = v.z; words[7] = v.w;
  } else if constexpr (BITS == 2) {
    const uint2 u = *reinterpret_cast<const uint2*>(p);
    words[0] = u.x; words[1] = u.y;
  } else {
#pragma unroll
    for (int i = 0; i < BITS; ++i) words[i] = p[i];
  }
}

__device__ __forceinline__ float tf_warp_sum(float v) {
#pragma unroll
  for (int off = 16; off >= 1; off >>= 1) {
    v = __fadd_rn(v, __shfl_xor_sync(TF_FULL_MASK, v, off));
  }
  return v;
}


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
#pragma unroll
        for (int c = 0; c < NCW; ++c) {
#pragma unroll
          for (int jj = 0; jj < 8; ++jj) {
            wh[c][jj] = __fmaf_rn(sc[c], (float)tf_extract<BITS>(words[c], jb + jj), bi[c]);
          }
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
