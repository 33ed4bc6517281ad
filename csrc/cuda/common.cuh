// Helpers shared by every CUDA kernel file (row_gemm.cu, row_expert.cu, row_attention.cu,
// sparse_attention.cu). tensorfold.kernels._sources prepends this file's "// @@header"
// section to the header of each of them (each file is JIT-compiled on its own through
// mx.fast.cuda_kernel(header=...), and csrc/cuda/nvcc_check.py builds the same text).
// Moved verbatim from those files' headers: no expression changed.

// @@header
#define TF_FULL_MASK 0xffffffffu
#define TF_NEG_INF (-__int_as_float(0x7f800000))

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
// Two fp32 values rounded to T (f16 / bf16, to nearest even: tf_from_float's bits) in one word, a in
// the low half, by one paired conversion (F2FP) where two tf_from_float take two F2F (16 a clock an
// SM, as MUFU's exponentials); and the two halves back to fp32.
template <typename T> __device__ __forceinline__ unsigned int tf_pack2(float a, float b);
template <> __device__ __forceinline__ unsigned int tf_pack2<__half>(float a, float b) {
  const __half2 h = __floats2half2_rn(a, b);
  return *reinterpret_cast<const unsigned int*>(&h);
}
template <> __device__ __forceinline__ unsigned int tf_pack2<__nv_bfloat16>(float a, float b) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<const unsigned int*>(&h);
}
template <typename T> __device__ __forceinline__ float tf_half_of(unsigned int w, int hi) {
  const unsigned short u = hi ? w >> 16 : w & 0xffffu;
  return tf_to_float(*reinterpret_cast<const T*>(&u));
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

// mma.sync m16n8k16, fp32 accumulate. Fragment layout (PTX ISA, "Matrix fragments for
// mma.m16n8k16"): lane = 4 * g + t.  A (16 x 16, row): a0 = A[g][2t, 2t+1],
// a1 = A[g+8][2t, 2t+1], a2 = A[g][2t+8, 2t+9], a3 = A[g+8][2t+8, 2t+9].
// B (16 x 8, col): b0 = B[2t, 2t+1][g], b1 = B[2t+8, 2t+9][g].
// C/D (16 x 8): c0 = D[g][2t], c1 = D[g][2t+1], c2 = D[g+8][2t], c3 = D[g+8][2t+1].
// Each element of D is its own dot product in the tensor core: its bits depend on its row
// of A, its column of B and its C only, never on other rows or columns.
__device__ __forceinline__ void tf_mma(float* c, const unsigned int* a, const unsigned int* b,
                                       __nv_bfloat16) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ __forceinline__ void tf_mma(float* c, const unsigned int* a, const unsigned int* b,
                                       __half) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// 16 bytes global -> shared without a register round trip (sm_80+), and the wait for all of
// this thread's copies in flight.
__device__ __forceinline__ void tf_cp_async16(void* dst, const void* src) {
  const unsigned int s = static_cast<unsigned int>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(src));
}
// f(tf_ic<0>{}), ..., f(tf_ic<N - 1>{}): a loop whose index is a constant in each body (for
// template arguments such as tf_cp_async16s's offset)
template <int I> struct tf_ic { static constexpr int value = I; };
template <int N, int I = 0, typename F>
__device__ __forceinline__ void tf_unroll(F&& f) {
  if constexpr (I < N) {
    f(tf_ic<I>{});
    tf_unroll<N, I + 1>(f);
  }
}
// tf_cp_async16 to a shared-memory address already in the shared window (__cvta_generic_to_shared)
// from src + OFF bytes (OFF a constant: the copy instruction carries it, no address arithmetic)
template <int OFF>
__device__ __forceinline__ void tf_cp_async16s(unsigned int s, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1+%2], 16;\n" ::"r"(s), "l"(src), "n"(OFF));
}
__device__ __forceinline__ void tf_cp_async_wait_all() {
  asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;\n" ::: "memory");
}
// B bytes (4, 8 or 16) global -> shared (through L1), the end of a group of copies, and the
// wait until at most N of this thread's groups are still in flight.
template <int B>
__device__ __forceinline__ void tf_cp_async_ca(void* dst, const void* src) {
  const unsigned int s = static_cast<unsigned int>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(s), "l"(src), "n"(B));
}
__device__ __forceinline__ void tf_cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void tf_cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
// Four 8x8 matrices of 16-bit values from shared memory (ldmatrix, sm_75+): lanes 8i..8i+7
// give the row addresses (16 bytes each) of matrix i; lane 4g + t receives, in d[i], the 32-bit
// word t of row g of matrix i.
__device__ __forceinline__ void tf_ldmatrix4(const void* row, unsigned int (&d)[4]) {
  const unsigned int s = static_cast<unsigned int>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
               : "r"(s));
}
// The same four matrices transposed (ldmatrix .trans): lane 4g + t receives, in d[i], the 16-bit
// values of rows 2t and 2t + 1 of matrix i at column g (an mma B fragment from row-major rows).
__device__ __forceinline__ void tf_ldmatrix4t(const void* row, unsigned int (&d)[4]) {
  const unsigned int s = static_cast<unsigned int>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
               : "r"(s));
}

// Hopper's warpgroup MMA (wgmma, sm_90a: MLX's JIT compiles for sm_90a on Hopper), for 16-bit
// inputs and fp32 accumulators: m64n64k16 for the warpgroup's 64 rows, D = A B (Z: a chain's first
// step, the accumulators written only) or D += A B. Warp w of the warpgroup holds rows 16 w .. 16 w
// + 15 of A (from registers) and of D, in mma.sync m16n8k16's fragment layouts (D's n-tile j in
// d[4 j .. 4 j + 3]). Each output is the dot product of mma.sync.m16n8k16 in the same k16 steps
// (session 27: the same bits; a first step that writes A B where mma.sync adds it to +0 can only
// differ in the sign of a zero sum, which row_attn_wg's fold turns into +0 as tcr's does). The
// accumulators and A fragments must not be touched between the issue and tf_wg_wait + tf_wg_hold.
#define TF_WG_I(t, rest) "wgmma.mma_async.sync.aligned.m64n64k16.f32." t "." t " {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}," rest
#define TF_WG_OPS(c) c(d[0]),c(d[1]),c(d[2]),c(d[3]),c(d[4]),c(d[5]),c(d[6]),c(d[7]),c(d[8]),c(d[9]),c(d[10]),c(d[11]),c(d[12]),c(d[13]),c(d[14]),c(d[15]),c(d[16]),c(d[17]),c(d[18]),c(d[19]),c(d[20]),c(d[21]),c(d[22]),c(d[23]),c(d[24]),c(d[25]),c(d[26]),c(d[27]),c(d[28]),c(d[29]),c(d[30]),c(d[31])
__device__ __forceinline__ void tf_wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void tf_wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void tf_wg_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
// after the wait: the compiler may neither read the accumulators nor reuse an A fragment's
// registers before this point
template <int N>
__device__ __forceinline__ void tf_wg_hold(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
__device__ __forceinline__ void tf_wg_hold(unsigned int (&a)[4]) {
  asm volatile("" : "+r"(a[0]), "+r"(a[1]), "+r"(a[2]), "+r"(a[3])::"memory");
}
// A and B from shared memory (descriptors; B K-major)
template <bool Z>
__device__ __forceinline__ void tf_wgmma_ss(float (&d)[32], unsigned long long a, unsigned long long b, __nv_bfloat16) {
  if (Z) asm volatile(TF_WG_I("bf16", "%32,%33,0,1,1,0,0;\n") : TF_WG_OPS("=f") : "l"(a), "l"(b) : "memory");
  else asm volatile(TF_WG_I("bf16", "%32,%33,1,1,1,0,0;\n") : TF_WG_OPS("+f") : "l"(a), "l"(b) : "memory");
}
template <bool Z>
__device__ __forceinline__ void tf_wgmma_ss(float (&d)[32], unsigned long long a, unsigned long long b, __half) {
  if (Z) asm volatile(TF_WG_I("f16", "%32,%33,0,1,1,0,0;\n") : TF_WG_OPS("=f") : "l"(a), "l"(b) : "memory");
  else asm volatile(TF_WG_I("f16", "%32,%33,1,1,1,0,0;\n") : TF_WG_OPS("+f") : "l"(a), "l"(b) : "memory");
}
// A from registers, B from shared memory MN-major (trans-b)
template <bool Z>
__device__ __forceinline__ void tf_wgmma_rs(float (&d)[32], const unsigned int (&a)[4], unsigned long long b, __nv_bfloat16) {
  if (Z) asm volatile(TF_WG_I("bf16", "{%32,%33,%34,%35},%36,0,1,1,1;\n") : TF_WG_OPS("=f") : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b) : "memory");
  else asm volatile(TF_WG_I("bf16", "{%32,%33,%34,%35},%36,1,1,1,1;\n") : TF_WG_OPS("+f") : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b) : "memory");
}
template <bool Z>
__device__ __forceinline__ void tf_wgmma_rs(float (&d)[32], const unsigned int (&a)[4], unsigned long long b, __half) {
  if (Z) asm volatile(TF_WG_I("f16", "{%32,%33,%34,%35},%36,0,1,1,1;\n") : TF_WG_OPS("=f") : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b) : "memory");
  else asm volatile(TF_WG_I("f16", "{%32,%33,%34,%35},%36,1,1,1,1;\n") : TF_WG_OPS("+f") : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b) : "memory");
}
// A shared-memory descriptor with the 128-byte swizzle: atoms of 8 rows x 128 bytes (1024-byte
// aligned), the 16-byte chunk c of row r at chunk c ^ (r % 8); SBO the step between 8-row atoms
// (K-major: along M / N, LBO unused; MN-major: along K, LBO then between 64-element blocks along MN).
// The address sits in the low 14 bits (bytes / 16, shared memory < 256 KB): p + n bytes is
// desc + n / 16.
__device__ __forceinline__ unsigned long long tf_wg_desc(const void* p, unsigned int lbo, unsigned int sbo) {
  const unsigned int s = static_cast<unsigned int>(__cvta_generic_to_shared(p));
  return (unsigned long long)((s & 0x3FFFF) >> 4) | ((unsigned long long)(lbo >> 4) << 16) |
         ((unsigned long long)(sbo >> 4) << 32) | (1ull << 62);
}
// generic-proxy writes to shared memory (st.shared, cp.async) made visible to wgmma's reads
__device__ __forceinline__ void tf_fence_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// 2^x in one instruction (ex2.approx.ftz.f32: 2^-inf = +0): row_attention.cu's exponential, whose
// scores are in base 2 (the softmax scale times log2(e), rounded to fp32 by the host).
__device__ __forceinline__ float tf_ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// The maximum a softmax subtracts: -inf (no finite score on either side yet, e.g. a chunk of
// all -inf scores) gives 0, so 2^(-inf - 0) = 0 weighs nothing where -inf - -inf was NaN and made
// the row NaN (the CPU spec's rule, cpu_attention.h). Any other maximum is returned as it is, so
// the bits are unchanged wherever a score is finite.
__device__ __forceinline__ float tf_zmax(float m) { return m == TF_NEG_INF ? 0.0f : m; }

// Attention partials (row_attention.cu): (o[0..D), m, l) stored as D + 2 floats, lane owning
// o[lane + 32 t], m in base 2; and the one merge formula, folding a stored partial into (m, l, o):
//   m' = max(m, m2); a = 2^(m - m'); b = 2^(m2 - m'); l = l*a + l2*b; o = fma(o2, b, o*a).
template <int D, int NT>
__device__ __forceinline__ void tf_put_partial(float* dst, const float (&o)[NT], float m, float l,
                                               int lane) {
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    const int d = lane + 32 * t;
    if (d < D) dst[d] = o[t];
  }
  if (lane == 0) {
    dst[D] = m;
    dst[D + 1] = l;
  }
}
template <int D, int NT>
__device__ __forceinline__ void tf_merge_partial(float& m, float& l, float (&o)[NT], const float* src,
                                                 int lane) {
  const float m2 = src[D], l2 = src[D + 1];
  const float mn = fmaxf(m, m2);
  const float mz = tf_zmax(mn);
  const float fa = tf_ex2(__fsub_rn(m, mz)), fb = tf_ex2(__fsub_rn(m2, mz));
  l = __fadd_rn(__fmul_rn(l, fa), __fmul_rn(l2, fb));
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    const int d = lane + 32 * t;
    if (d < D) o[t] = __fmaf_rn(src[d], fb, __fmul_rn(o[t], fa));
  }
  m = mn;
}

__device__ __forceinline__ float tf_warp_sum(float v) {
#pragma unroll
  for (int off = 16; off >= 1; off >>= 1) {
    v = __fadd_rn(v, __shfl_xor_sync(TF_FULL_MASK, v, off));
  }
  return v;
}

// The 8 dequantised weights jb .. jb+7 of each of NCW columns' 32-element chunks:
// wh[c][jj] = fma(scale_c, q, bias_c) (fp32, round to nearest).
template <int BITS, int NCW>
__device__ __forceinline__ void tf_dequant8(const unsigned int (&words)[NCW][BITS],
                                            const float (&sc)[NCW], const float (&bi)[NCW],
                                            int jb, float (&wh)[NCW][8]) {
#pragma unroll
  for (int c = 0; c < NCW; ++c) {
#pragma unroll
    for (int jj = 0; jj < 8; ++jj) {
      wh[c][jj] = __fmaf_rn(sc[c], (float)tf_extract<BITS>(words[c], jb + jj), bi[c]);
    }
  }
}

// One 64-key chunk of a warp's online softmax (row_attn_partial, sparse_attn): lane holds the
// scores sa (key lane) and sb (key lane + 32) of the chunk's n valid keys. Writes the chunk's
// weights exp(s - mc) to es[0..63]; returns the chunk's weight sum lc, the new running maximum
// mn and the factors fa = exp(mrun - mn), fb = exp(mc - mn) that rescale the running state and
// the chunk. The caller then does o = fma(chunk_o, fb, o * fa), l = l * fa + lc * fb, m = mn.
struct TfChunkSoftmax {
  float lc, mn, fa, fb;
};
__device__ __forceinline__ TfChunkSoftmax tf_chunk_softmax(float sa, float sb, int n, int lane,
                                                           float* es, float mrun) {
  float mc = fmaxf(sa, sb);
#pragma unroll
  for (int sh = 16; sh >= 1; sh >>= 1) mc = fmaxf(mc, __shfl_xor_sync(TF_FULL_MASK, mc, sh));
  const float mcz = tf_zmax(mc);
  const float ea = lane < n ? expf(__fsub_rn(sa, mcz)) : 0.0f;
  const float eb = lane + 32 < n ? expf(__fsub_rn(sb, mcz)) : 0.0f;
  es[lane] = ea;
  es[lane + 32] = eb;
  float lc = __fadd_rn(ea, eb);
#pragma unroll
  for (int sh = 16; sh >= 1; sh >>= 1) lc = __fadd_rn(lc, __shfl_xor_sync(TF_FULL_MASK, lc, sh));
  __syncwarp();
  const float mn = fmaxf(mrun, mc);
  const float mnz = tf_zmax(mn);
  return {lc, mn, expf(__fsub_rn(mrun, mnz)), expf(__fsub_rn(mc, mnz))};
}
