// wg_probe: can Hopper's warpgroup MMA (wgmma, sm_90a) run the 4-bit GEMM's 16-row launch with the
// bits of row_qmm_tc, and faster? A standalone program (nvcc, no MLX): issue 3, session 27.
//
// Both kernels compute row_qmm_tc's arithmetic for 4-bit weights, group size 64, bf16 x / scales /
// biases, SPLIT K slices ("quarters"): per quarter, per group, the mma chains P (pairs 128 + q of
// tf_q4raw against x) and X (ones against x) over the group's four k16 steps, then the fold
// acc = fma(scale, P, acc); acc = fma(bias - 128 scale, X, acc); the quarters are summed in order
// ((q0 + q1) + q2) + ... and rounded to bf16. The k16 steps hold the elements row_qmm_tc gives them
// (lane t of block b: nibbles j, j + 4 of word 4 b + t).
//   ref:     row_qmm_tc's mma.sync form (one warp a 16-row tile and a quarter; x pairs from global).
//   wg_q4:   one warpgroup a 64-row tile and QPB quarters; wgmma m64nNXk16 (NX 8 up to 8 rows, 16
//            past them) with the weight pairs as A from registers and x as B from shared memory
//            (no swizzle, K-major core matrices), staged a group ahead; plain loads D groups ahead.
//            COMP 1 / 2: the same loop with no loads past the first D groups, no x staging (and no
//            barrier): its arithmetic alone (those bits are not the GEMM's).
//   wg_comp: arithmetic alone with NP groups' chains issued before one wait.
// Measured on the H200 (docs/benchmarks.md, "Session 27"): wg_q4 == ref bit for bit on six shapes
// at 1, 8, 9 and 16 rows, and == the package's own row_qmm_tc / row_qmm_cp outputs on five (`file`
// mode); wgmma's arithmetic alone is no faster than row_qmm_cp's mma.sync.
// A chain's first step writes its accumulators only (wgmma0): with a read-write first step under
// a scale-d predicate, ptxas moved in-flight accumulators and serialized every wgmma (C7514/C7517).
// Build (on the H200): nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o wg_probe wg_probe.cu
// Run: ./wg_probe file DIR N K   (inputs and the package's outputs from bench/wg_probe_data.py)
//      ./wg_probe [reps] [cases]   (cases: comma-separated of layout, 12288, comp, batch, 24576,
//      6144, 4096x4096, 4096x12288; all by default). Prints bit checks and event times; device
//      times under ncu: bash bench/gpu_run.sh s27a.
#include <cuda_bf16.h>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>
#include <algorithm>

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { \
  printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e_), __FILE__, __LINE__); exit(1); } } while (0)

__device__ __forceinline__ unsigned int nib_or(unsigned int a) {   // tf_q4raw's lop3 (bf16)
  unsigned int d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "n"(0x000F000Fu), "n"(0x43004300u));
  return d;
}
__device__ __forceinline__ unsigned int q4raw(unsigned int w, int j) { return nib_or(w >> (4 * j)); }
__device__ __forceinline__ void xpairs(const uint4 u, unsigned int (&xb)[4]) {
  xb[0] = __byte_perm(u.x, u.z, 0x5410);
  xb[1] = __byte_perm(u.x, u.z, 0x7632);
  xb[2] = __byte_perm(u.y, u.w, 0x5410);
  xb[3] = __byte_perm(u.y, u.w, 0x7632);
}
__device__ __forceinline__ void mma16816(float* c, const unsigned int* a, const unsigned int* b) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
               "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// ---- ref: row_qmm_tc (NT 1, one warp a block, the quarter = blockIdx.y) ----------------------
template <int K, int SPLIT>
__global__ void __launch_bounds__(32) ref_q4(const __nv_bfloat16* x, const unsigned int* w,
                                             const __nv_bfloat16* sc, const __nv_bfloat16* bi,
                                             float* part, int R, int N) {
  constexpr int KW = K / 8, NG = K / 64, KQ = K / SPLIT;
  const int lane = threadIdx.x, gq = lane >> 2, tq = lane & 3;
  const int nbase = blockIdx.x * 16, q = blockIdx.y;
  int nrow[2];
  for (int h = 0; h < 2; ++h) nrow[h] = min(nbase + 8 * h + gq, N - 1);
  const unsigned int ones[4] = {0x3F803F80u, 0x3F803F80u, 0x3F803F80u, 0x3F803F80u};
  float acc[2][4] = {};
  for (int grp = q * KQ / 64; grp < (q + 1) * KQ / 64; ++grp) {
    float P[2][4] = {}, X[2][4] = {};
    for (int b = 0; b < 2; ++b) {
      unsigned int wq[2];
      for (int h = 0; h < 2; ++h) wq[h] = __ldg(w + (size_t)nrow[h] * KW + (grp * 2 + b) * 4 + tq);
      unsigned int xb[2][4];
      for (int mt = 0; mt < 2; ++mt) {
        const int r = mt * 8 + gq;
        uint4 u = make_uint4(0u, 0u, 0u, 0u);
        if (r < R) u = __ldg(reinterpret_cast<const uint4*>(x + (size_t)r * K + (grp * 2 + b) * 32 + tq * 8));
        xpairs(u, xb[mt]);
      }
      for (int s = 0; s < 2; ++s) {
        const unsigned int a[4] = {q4raw(wq[0], 2 * s), q4raw(wq[1], 2 * s), q4raw(wq[0], 2 * s + 1),
                                   q4raw(wq[1], 2 * s + 1)};
        mma16816(P[0], a, &xb[0][2 * s]);
        mma16816(P[1], a, &xb[1][2 * s]);
        mma16816(X[0], ones, &xb[0][2 * s]);
        mma16816(X[1], ones, &xb[1][2 * s]);
      }
    }
    for (int mt = 0; mt < 2; ++mt)
      for (int i = 0; i < 4; ++i) {
        const int n = nrow[i >> 1];
        const float s = __bfloat162float(sc[(size_t)n * NG + grp]);
        const float bb = __fmaf_rn(-128.0f, s, __bfloat162float(bi[(size_t)n * NG + grp]));
        acc[mt][i] = __fmaf_rn(s, P[mt][i], acc[mt][i]);
        acc[mt][i] = __fmaf_rn(bb, X[mt][i & 1], acc[mt][i]);
      }
  }
  // part[q][r][n] (fp32)
  for (int mt = 0; mt < 2; ++mt)
    for (int i = 0; i < 4; ++i) {
      const int r = mt * 8 + 2 * tq + (i & 1), n = nbase + 8 * (i >> 1) + gq;
      if (r < R && n < N) part[((size_t)q * 16 + r) * N + n] = acc[mt][i];
    }
}
template <int SPLIT>
__global__ void ref_sum(const float* part, __nv_bfloat16* out, int R, int N) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= R * N) return;
  const int r = i / N, n = i % N;
  float s = part[(size_t)r * N + n];
  for (int q = 1; q < SPLIT; ++q) s = __fadd_rn(s, part[((size_t)q * 16 + r) * N + n]);
  out[i] = __float2bfloat16_rn(s);
}

// ---- wg: wgmma ----------------------------------------------------------------------------
template <int NX> struct WgAcc { float v[NX / 2]; };

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void wg_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
template <int NX> __device__ __forceinline__ void fence_acc(WgAcc<NX>& a) {
#pragma unroll
  for (int i = 0; i < NX / 2; ++i) asm volatile("" : "+f"(a.v[i])::"memory");
}
__device__ __forceinline__ void wgmma(WgAcc<16>& d, const unsigned int (&a)[4], uint64_t desc, int sd) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7}, "
      "{%8, %9, %10, %11}, %12, p, 1, 1, 0;\n}\n"
      : "+f"(d.v[0]), "+f"(d.v[1]), "+f"(d.v[2]), "+f"(d.v[3]), "+f"(d.v[4]), "+f"(d.v[5]),
        "+f"(d.v[6]), "+f"(d.v[7])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(sd));
}
__device__ __forceinline__ void wgmma(WgAcc<8>& d, const unsigned int (&a)[4], uint64_t desc, int sd) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %9, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7}, %8, p, 1, 1, 0;\n}\n"
      : "+f"(d.v[0]), "+f"(d.v[1]), "+f"(d.v[2]), "+f"(d.v[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(sd));
}
// The first k16 step of a chain: D = A B, the accumulators written only (no loop-carried input,
// so the compiler puts no moves of in-flight accumulators between the wgmmas).
__device__ __forceinline__ void wgmma0(WgAcc<16>& d, const unsigned int (&a)[4], uint64_t desc) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7}, "
      "{%8, %9, %10, %11}, %12, 0, 1, 1, 0;\n"
      : "=f"(d.v[0]), "=f"(d.v[1]), "=f"(d.v[2]), "=f"(d.v[3]), "=f"(d.v[4]), "=f"(d.v[5]),
        "=f"(d.v[6]), "=f"(d.v[7])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}
__device__ __forceinline__ void wgmma0(WgAcc<8>& d, const unsigned int (&a)[4], uint64_t desc) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7}, %8, 0, 1, 1, 0;\n"
      : "=f"(d.v[0]), "=f"(d.v[1]), "=f"(d.v[2]), "=f"(d.v[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}
// No-swizzle K-major descriptor: core matrices (8 rows x 16 bytes, contiguous 128 bytes); LBO the
// step between core matrices along K (128 bytes), SBO along N (256). The two swapped is an illegal
// memory access on the H200 (session 27).
__device__ __forceinline__ uint64_t wg_desc(uint32_t saddr) {
  const uint64_t lbo = 128, sbo = 256;
  return (uint64_t)((saddr & 0x3FFFF) >> 4) | ((lbo >> 4) << 16) | ((sbo >> 4) << 32);
}

// One 64-row tile, quarters blockIdx.y * QPB .. + QPB - 1, a group (64 k) a loop turn, D groups of
// loads in flight. B tile of k16 step S in shared memory: element (x row r, kk) at
// S * NX * 32 + ((r / 8) * 2 + kk / 8) * 128 + (r % 8) * 16 + (kk % 8) * 2.
template <int K, int SPLIT, int QPB, int NX, int D, int MINB = 1, int COMP = 0>
__global__ void __launch_bounds__(128, MINB) wg_q4(const __nv_bfloat16* x, const unsigned int* w,
                                             const __nv_bfloat16* sc, const __nv_bfloat16* bi,
                                             float* ws, int* cnt, __nv_bfloat16* out, int R, int N) {
  constexpr int KW = K / 8, NG = K / 64, KQ = K / SPLIT, GQ = KQ / 64, G = GQ * QPB;
  constexpr int NA = NX / 2, GB = NX * 128;   // accumulators a thread; bytes of a group's B tiles
  constexpr int NBLK = SPLIT / QPB;
  static_assert(KQ % 64 == 0 && SPLIT % QPB == 0 && D >= 2 && D % 2 == 0 && G % D == 0);
  __shared__ __align__(128) unsigned char xs[2 * GB];
  __shared__ int s_last;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int tile = blockIdx.x, n0 = tile * 64;
  const int grp0 = blockIdx.y * QPB * GQ;
  int nrow[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) nrow[h] = min(n0 + 16 * warp + 8 * h + g, N - 1);
  // x staging: thread -> (row xr, 16-byte piece xq of the group)
  const int xr = tid >> 3, xq = tid & 7;
  const bool xld = xr < NX && xr < R;
  const uint32_t xs_base = (uint32_t)__cvta_generic_to_shared(xs);
  // 4 weight words, 16 bytes of x, scale and bias of 2 rows: one group's loads
  struct Slot { unsigned int wq[2][2]; uint4 xv; __nv_bfloat16 s[2], b[2]; };
  Slot sl[D];
  auto load = [&](int gi, Slot& o) {
    const int grp = grp0 + gi;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int b = 0; b < 2; ++b) o.wq[h][b] = __ldg(w + (size_t)nrow[h] * KW + (grp * 2 + b) * 4 + t);
      o.s[h] = sc[(size_t)nrow[h] * NG + grp];
      o.b[h] = bi[(size_t)nrow[h] * NG + grp];
    }
    o.xv = xld ? __ldg(reinterpret_cast<const uint4*>(x + (size_t)xr * K + grp * 64 + xq * 8))
               : make_uint4(0u, 0u, 0u, 0u);
  };
  auto stage_x = [&](int buf, const uint4 xv) {
    if (xr >= NX) return;
    unsigned int pr[4];
    xpairs(xv, pr);
    const int b = xq >> 2, tt = xq & 3;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int S = 2 * b + (j >> 1), kk = 2 * tt + 8 * (j & 1);
      const int off = buf * GB + S * NX * 32 + ((xr >> 3) * 2 + (kk >> 3)) * 128 + (xr & 7) * 16 + (kk & 7) * 2;
      *reinterpret_cast<unsigned int*>(xs + off) = pr[j];
    }
  };
  const unsigned int ones[4] = {0x3F803F80u, 0x3F803F80u, 0x3F803F80u, 0x3F803F80u};
  WgAcc<NX> P, X;
  float acc[NA], tot[NA];
#pragma unroll
  for (int i = 0; i < NA; ++i) { acc[i] = 0.0f; tot[i] = 0.0f; }
  auto finish_quarter = [&](int qi) {   // qi: the block's quarter index
    if constexpr (NBLK == 1) {
#pragma unroll
      for (int i = 0; i < NA; ++i) tot[i] = qi == 0 ? acc[i] : __fadd_rn(tot[i], acc[i]);
    } else {
      float* p = ws + (((size_t)(blockIdx.y * QPB + qi) * gridDim.x + tile) * 128 + tid) * NA;
#pragma unroll
      for (int i = 0; i < NA; ++i) p[i] = acc[i];
    }
#pragma unroll
    for (int i = 0; i < NA; ++i) acc[i] = 0.0f;
  };
  // a group's A fragments (k16 step S = 2 b + s) and fold values (scale, bias - 128 scale)
  struct Frag { unsigned int a[4][4]; float fs[2], fb[2]; };
  auto frag = [&](const Slot& o, Frag& f) {
#pragma unroll
    for (int b = 0; b < 2; ++b)
#pragma unroll
      for (int s = 0; s < 2; ++s) {
        f.a[2 * b + s][0] = q4raw(o.wq[0][b], 2 * s);
        f.a[2 * b + s][1] = q4raw(o.wq[1][b], 2 * s);
        f.a[2 * b + s][2] = q4raw(o.wq[0][b], 2 * s + 1);
        f.a[2 * b + s][3] = q4raw(o.wq[1][b], 2 * s + 1);
      }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      f.fs[h] = __bfloat162float(o.s[h]);
      f.fb[h] = __fmaf_rn(-128.0f, f.fs[h], __bfloat162float(o.b[h]));
    }
  };
#pragma unroll
  for (int i = 0; i < D; ++i)
    if (i < G) load(i, sl[i]);
  stage_x(0, sl[0].xv);
  Frag fr[2];
  frag(sl[0], fr[0]);
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
  // a loop turn: group i's wgmmas; while they run, group i + D's loads, group i + 1's x into the
  // other buffer (group i - 1's, done) and its fragments; then wait and fold group i.
#pragma unroll 1
  for (int i0 = 0; i0 < G; i0 += D) {
#pragma unroll
    for (int u = 0; u < D; ++u) {
      const int i = i0 + u;
      Frag& f = fr[u & 1];
      const uint32_t bb = xs_base + (i & 1) * GB;
      wg_fence();
#pragma unroll
      for (int S = 0; S < 4; ++S) {
        const uint64_t desc = wg_desc(bb + S * NX * 32);
        if (S == 0) { wgmma0(P, f.a[S], desc); wgmma0(X, ones, desc); }
        else { wgmma(P, f.a[S], desc, 1); wgmma(X, ones, desc, 1); }
      }
      wg_commit();
      if (COMP == 0 && i + D < G) load(i + D, sl[u]);
      if (i + 1 < G) {
        if (COMP == 0) stage_x((i + 1) & 1, sl[(u + 1) % D].xv);
        frag(sl[(u + 1) % D], fr[(u + 1) & 1]);
      }
      wg_wait<0>();
      fence_acc(P); fence_acc(X);
#pragma unroll
      for (int k = 0; k < NA; ++k) {
        const int h = (k >> 1) & 1;
        acc[k] = __fmaf_rn(f.fs[h], P.v[k], acc[k]);
        acc[k] = __fmaf_rn(f.fb[h], X.v[k], acc[k]);
      }
      if ((i + 1) % GQ == 0) finish_quarter(i / GQ);
      if (COMP < 2) {
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        __syncthreads();
      }
    }
  }
  // the sum of the quarters in order, rounded; out[r][n]
  if constexpr (NBLK > 1) {
    __threadfence();
    __syncthreads();
    if (tid == 0) s_last = atomicAdd(cnt + tile, 1) == NBLK - 1;
    __syncthreads();
    if (!s_last) return;
    __threadfence();
    if (tid == 0) cnt[tile] = 0;
    for (int q = 0; q < SPLIT; ++q) {
      const float* p = ws + (((size_t)q * gridDim.x + tile) * 128 + tid) * NA;
#pragma unroll
      for (int i = 0; i < NA; ++i) tot[i] = q == 0 ? __ldcg(p + i) : __fadd_rn(tot[i], __ldcg(p + i));
    }
  }
#pragma unroll
  for (int i = 0; i < NA; ++i) {
    const int r = 8 * (i >> 2) + 2 * t + (i & 1), n = n0 + 16 * warp + g + 8 * ((i >> 1) & 1);
    if (r < R && n < N) out[(size_t)r * N + n] = __float2bfloat16_rn(tot[i]);
  }
}


// Arithmetic alone, batched: NP groups' wgmma chains issued back to back (independent
// accumulators), one wait, then their folds in order. No loads past the first group's, no x
// staging, no barriers: how far the wgmma chain's latency hides when NP chains are in flight.
template <int QPB, int NX, int NP, int MINB>
__global__ void __launch_bounds__(128, MINB) wg_comp(const __nv_bfloat16* x, const unsigned int* w,
                                                    const __nv_bfloat16* sc, const __nv_bfloat16* bi,
                                                    float* ws, int* cnt, __nv_bfloat16* out, int R, int N) {
  constexpr int K = 4096, SPLIT = 4, KW = K / 8, GQ = K / SPLIT / 64, G = GQ * QPB;
  constexpr int NA = NX / 2, GB = NX * 128;
  static_assert(G % NP == 0);
  __shared__ __align__(128) unsigned char xs[2 * GB];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int n0 = blockIdx.x * 64;
  const uint32_t xs_base = (uint32_t)__cvta_generic_to_shared(xs);
  for (int i = tid; i < 2 * GB / 4; i += 128) reinterpret_cast<unsigned int*>(xs)[i] = 0x3F803F80u ^ (i * 2654435761u & 0x00FF00FFu);
  unsigned int wq[2][2];
  for (int h = 0; h < 2; ++h)
    for (int b = 0; b < 2; ++b) wq[h][b] = __ldg(w + (size_t)min(n0 + 16 * warp + 8 * h + g, N - 1) * KW + b * 4 + t);
  const float s0 = __bfloat162float(sc[n0]), b0 = __bfloat162float(bi[n0]);
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
  const unsigned int ones[4] = {0x3F803F80u, 0x3F803F80u, 0x3F803F80u, 0x3F803F80u};
  WgAcc<NX> P[NP], X[NP];
  float acc[NA];
#pragma unroll
  for (int i = 0; i < NA; ++i) acc[i] = 0.0f;
#pragma unroll 1
  for (int i = 0; i < G; i += NP) {
    unsigned int a[NP][4][4];
#pragma unroll
    for (int j = 0; j < NP; ++j)
#pragma unroll
      for (int b = 0; b < 2; ++b)
#pragma unroll
        for (int s = 0; s < 2; ++s) {
          const unsigned int v0 = wq[0][b] ^ (unsigned)(i + j), v1 = wq[1][b] ^ (unsigned)(i + j);
          a[j][2 * b + s][0] = q4raw(v0, 2 * s);
          a[j][2 * b + s][1] = q4raw(v1, 2 * s);
          a[j][2 * b + s][2] = q4raw(v0, 2 * s + 1);
          a[j][2 * b + s][3] = q4raw(v1, 2 * s + 1);
        }
    wg_fence();
#pragma unroll
    for (int j = 0; j < NP; ++j) {
      const uint32_t bb = xs_base + (j & 1) * GB;
#pragma unroll
      for (int S = 0; S < 4; ++S) {
        const uint64_t desc = wg_desc(bb + S * NX * 32);
        if (S == 0) { wgmma0(P[j], a[j][S], desc); wgmma0(X[j], ones, desc); }
        else { wgmma(P[j], a[j][S], desc, 1); wgmma(X[j], ones, desc, 1); }
      }
    }
    wg_commit();
    wg_wait<0>();
#pragma unroll
    for (int j = 0; j < NP; ++j) {
      fence_acc(P[j]); fence_acc(X[j]);
      const float fs = s0 + (float)(i + j), fb = b0;
#pragma unroll
      for (int k = 0; k < NA; ++k) {
        acc[k] = __fmaf_rn(fs, P[j].v[k], acc[k]);
        acc[k] = __fmaf_rn(fb, X[j].v[k], acc[k]);
      }
    }
  }
#pragma unroll
  for (int i = 0; i < NA; ++i) {
    const int r = 8 * (i >> 2) + 2 * t + (i & 1), n = n0 + 16 * warp + g + 8 * ((i >> 1) & 1);
    if (r < R && n < N) out[(size_t)r * N + n] = __float2bfloat16_rn(acc[i]);
  }
}

#ifndef WG_KERNEL_ONLY
// ---- host ----------------------------------------------------------------------------------
static uint32_t lcg(uint64_t& s) { s = s * 6364136223846793005ull + 1442695040888963407ull; return (uint32_t)(s >> 33); }
static __nv_bfloat16 bf(float f) { return __float2bfloat16_rn(f); }

struct Case { int N, K, split; };
struct Bufs {
  int N, K, copies;
  __nv_bfloat16 *x, *sc, *bi, *out, *outr; unsigned int* w; float *ws, *part; int* cnt;
  size_t wsz, ssz;
};

template <int K, int SPLIT, int QPB, int NX, int D, int MINB, int COMP = 0>
static void launch_wg(Bufs& b, int copy, int R) {
  dim3 grid(b.N / 64, SPLIT / QPB);
  wg_q4<K, SPLIT, QPB, NX, D, MINB, COMP><<<grid, 128>>>(b.x, b.w + copy * b.wsz, b.sc + copy * b.ssz, b.bi + copy * b.ssz,
                                                   b.ws, b.cnt, b.out, R, b.N);
}
template <int K, int SPLIT>
static void launch_ref(Bufs& b, int copy, int R) {
  ref_q4<K, SPLIT><<<dim3(b.N / 16, SPLIT), 32>>>(b.x, b.w + copy * b.wsz, b.sc + copy * b.ssz, b.bi + copy * b.ssz,
                                                   b.part, R, b.N);
  ref_sum<SPLIT><<<(R * b.N + 255) / 256, 256>>>(b.part, b.outr, R, b.N);
}

static Bufs make_bufs(int N, int K, int copies) {
  Bufs b{}; b.N = N; b.K = K; b.copies = copies;
  b.wsz = (size_t)N * K / 8; b.ssz = (size_t)N * K / 64;
  std::vector<unsigned int> w(b.wsz * copies);
  std::vector<__nv_bfloat16> x((size_t)16 * K), s(b.ssz * copies), bb(b.ssz * copies);
  uint64_t st = 12345 + N + K;
  for (auto& v : w) v = lcg(st);
  for (auto& v : x) v = bf(((int)(lcg(st) % 2001) - 1000) / 1000.0f);
  for (size_t i = 0; i < s.size(); ++i) { s[i] = bf((1 + lcg(st) % 1000) / 40000.0f); bb[i] = bf(((int)(lcg(st) % 2001) - 1000) / 4000.0f); }
  CK(cudaMalloc(&b.w, w.size() * 4)); CK(cudaMemcpy(b.w, w.data(), w.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMalloc(&b.x, x.size() * 2)); CK(cudaMemcpy(b.x, x.data(), x.size() * 2, cudaMemcpyHostToDevice));
  CK(cudaMalloc(&b.sc, s.size() * 2)); CK(cudaMemcpy(b.sc, s.data(), s.size() * 2, cudaMemcpyHostToDevice));
  CK(cudaMalloc(&b.bi, bb.size() * 2)); CK(cudaMemcpy(b.bi, bb.data(), bb.size() * 2, cudaMemcpyHostToDevice));
  CK(cudaMalloc(&b.out, (size_t)16 * N * 2)); CK(cudaMalloc(&b.outr, (size_t)16 * N * 2));
  CK(cudaMalloc(&b.part, (size_t)16 * 16 * N * 4));
  CK(cudaMalloc(&b.ws, (size_t)16 * 16 * N * 4));
  CK(cudaMalloc(&b.cnt, (size_t)N / 64 * 4)); CK(cudaMemset(b.cnt, 0, (size_t)N / 64 * 4));
  return b;
}
static void free_bufs(Bufs& b) {
  cudaFree(b.w); cudaFree(b.x); cudaFree(b.sc); cudaFree(b.bi); cudaFree(b.out); cudaFree(b.outr);
  cudaFree(b.part); cudaFree(b.ws); cudaFree(b.cnt);
}

// bits of out (R rows) against outr; poison out first
template <typename F>
static long check(Bufs& b, int R, F run) {
  CK(cudaMemset(b.out, 0xFF, (size_t)16 * b.N * 2));
  run(0, R);
  CK(cudaDeviceSynchronize());
  std::vector<uint16_t> o((size_t)R * b.N), r((size_t)R * b.N);
  CK(cudaMemcpy(o.data(), b.out, o.size() * 2, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(r.data(), b.outr, r.size() * 2, cudaMemcpyDeviceToHost));
  long bad = 0;
  for (size_t i = 0; i < o.size(); ++i) bad += o[i] != r[i];
  return bad;
}
template <typename F>
static float time_us(Bufs& b, int R, int reps, F run) {
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
  std::vector<float> ts;
  for (int i = 0; i < reps; ++i) {
    CK(cudaEventRecord(e0));
    run(i % b.copies, R);
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    float ms; CK(cudaEventElapsedTime(&ms, e0, e1)); ts.push_back(ms * 1000.0f);
  }
  std::sort(ts.begin(), ts.end());
  return ts[ts.size() / 2];
}

template <int K, int SPLIT, int QPB, int D, int MINB = 1, int COMP = 0>
static void run_wg(Bufs& b, const char* label, int reps) {
  for (int R : {1, 8, 9, 16}) {
    long bad;
    float us;
    auto ref = [&](int c, int r) { launch_ref<K, SPLIT>(b, c, r); };
    ref(0, R);
    CK(cudaDeviceSynchronize());
    if (R <= 8) {
      auto f = [&](int c, int r) { launch_wg<K, SPLIT, QPB, 8, D, MINB, COMP>(b, c, r); };
      bad = check(b, R, f); us = time_us(b, R, reps, f);
    } else {
      auto f = [&](int c, int r) { launch_wg<K, SPLIT, QPB, 16, D, MINB, COMP>(b, c, r); };
      bad = check(b, R, f); us = time_us(b, R, reps, f);
    }
    CK(cudaGetLastError());
    printf("%-24s N %6d K %5d split %d QPB %d D %d minb %d comp %d R %2d: mismatches %ld of %d, %.2f us (events)\n",
           label, b.N, K, SPLIT, QPB, D, MINB, COMP, R, bad, R * b.N, us);
  }
}


template <int QPB, int NP, int MINB>
static void run_comp(Bufs& b, int reps) {
  for (int R : {1, 16}) {
    auto f8 = [&](int c, int r) { wg_comp<QPB, 8, NP, MINB><<<dim3(b.N / 64, 4 / QPB), 128>>>(b.x, b.w, b.sc, b.bi, b.ws, b.cnt, b.out, r, b.N); };
    auto f16 = [&](int c, int r) { wg_comp<QPB, 16, NP, MINB><<<dim3(b.N / 64, 4 / QPB), 128>>>(b.x, b.w, b.sc, b.bi, b.ws, b.cnt, b.out, r, b.N); };
    long bad = R <= 8 ? check(b, R, f8) : check(b, R, f16);
    float us = R <= 8 ? time_us(b, R, reps, f8) : time_us(b, R, reps, f16);
    CK(cudaGetLastError());
    printf("%-24s N %6d QPB %d NP %d minb %d R %2d: mismatches %ld (not the GEMM), %.2f us (events)\n", "batched comp",
           b.N, QPB, NP, MINB, R, bad, us);
  }
}


// `file` mode: the package's inputs and outputs (bench/wg_probe_data.py) against wg_q4 at tc_plan's split.
static std::vector<char> slurp(const std::string& path) {
  FILE* f = fopen(path.c_str(), "rb");
  if (!f) { printf("cannot open %s\n", path.c_str()); exit(1); }
  fseek(f, 0, SEEK_END); long n = ftell(f); fseek(f, 0, SEEK_SET);
  std::vector<char> v(n);
  if (fread(v.data(), 1, n, f) != (size_t)n) { printf("short read %s\n", path.c_str()); exit(1); }
  fclose(f);
  return v;
}
template <int K, int SPLIT>
static void run_file(const std::string& dir, int N) {
  Bufs b = make_bufs(N, K, 1);
  auto up = [&](const char* name, void* dst, size_t bytes) {
    std::vector<char> v = slurp(dir + "/" + name);
    if (v.size() != bytes) { printf("%s: %zu bytes, expected %zu\n", name, v.size(), bytes); exit(1); }
    CK(cudaMemcpy(dst, v.data(), bytes, cudaMemcpyHostToDevice));
  };
  up("x.bin", b.x, (size_t)16 * K * 2); up("w.bin", b.w, b.wsz * 4);
  up("s.bin", b.sc, b.ssz * 2); up("b.bin", b.bi, b.ssz * 2);
  for (int R : {1, 8, 9, 16}) {
    CK(cudaMemset(b.out, 0xFF, (size_t)16 * N * 2));
    if (R <= 8) launch_wg<K, SPLIT, 1, 8, 4, 1>(b, 0, R);
    else launch_wg<K, SPLIT, 1, 16, 4, 1>(b, 0, R);
    CK(cudaDeviceSynchronize());
    std::vector<uint16_t> o((size_t)R * N);
    CK(cudaMemcpy(o.data(), b.out, o.size() * 2, cudaMemcpyDeviceToHost));
    for (const char* which : {"tc", "cp"}) {
      std::vector<char> ref = slurp(dir + "/out_" + which + "_" + std::to_string(R) + ".bin");
      const uint16_t* r = reinterpret_cast<const uint16_t*>(ref.data());
      long bad = 0;
      for (size_t i = 0; i < o.size(); ++i) bad += o[i] != r[i];
      printf("file %s N %d K %d split %d R %2d: wgmma vs the package's row_qmm_%s: %ld of %zu differ\n",
             dir.c_str(), N, K, SPLIT, R, which, bad, o.size());
    }
  }
  free_bufs(b);
}

int main(int argc, char** argv) {
  if (argc > 4 && !strcmp(argv[1], "file")) {   // file DIR N K
    const std::string dir = argv[2];
    const int N = atoi(argv[3]), K = atoi(argv[4]);
    if (K == 4096 && N == 12288) run_file<4096, 4>(dir, N);
    else if (K == 4096 && N == 24576) run_file<4096, 2>(dir, N);
    else if (K == 4096 && (N == 6144 || N == 4096)) run_file<4096, 8>(dir, N);
    else if (K == 12288 && N == 4096) run_file<12288, 8>(dir, N);
    else printf("file: no instantiation for %dx%d\n", N, K);
    return 0;
  }
  const int reps = argc > 1 ? atoi(argv[1]) : 30;
  const char* only = argc > 2 ? argv[2] : "";
  int dev; CK(cudaGetDevice(&dev));
  cudaDeviceProp p; CK(cudaGetDeviceProperties(&p, dev));
  printf("%s, %d SMs\n", p.name, p.multiProcessorCount);
  auto want = [&](const char* s) { return !*only || strstr(only, s); };
  if (want("layout")) {   // the descriptor reading, small
    Bufs b = make_bufs(1024, 4096, 1);
    run_wg<4096, 4, 4, 2>(b, "layout lbo=K", 3);
    free_bufs(b);
  }
  if (want("12288")) {
    Bufs b = make_bufs(12288, 4096, 6);
    for (int R : {1, 16}) { printf("ref 12288 R %d: %.2f us (events)\n", R, time_us(b, R, reps, [&](int c, int r) { launch_ref<4096, 4>(b, c, r); })); }
    run_wg<4096, 4, 1, 4>(b, "12288x4096", reps);
    run_wg<4096, 4, 2, 4>(b, "12288x4096", reps);
    run_wg<4096, 4, 4, 4>(b, "12288x4096", reps);
    run_wg<4096, 4, 2, 2>(b, "12288x4096", reps);
    run_wg<4096, 4, 1, 4, 3>(b, "12288x4096", reps);
    run_wg<4096, 4, 2, 4, 3>(b, "12288x4096", reps);
    run_wg<4096, 4, 1, 2, 4>(b, "12288x4096", reps);
    free_bufs(b);
  }
  if (want("comp")) {   // arithmetic alone: no loads past the first D groups, no x staging (COMP 1),
                        // nor the barrier a group (COMP 2); the bits are then not the GEMM's
    Bufs b = make_bufs(12288, 4096, 6);
    run_wg<4096, 4, 2, 4, 3, 1>(b, "comp 12288x4096", reps);
    run_wg<4096, 4, 2, 4, 3, 2>(b, "comp 12288x4096", reps);
    run_wg<4096, 4, 1, 4, 3, 2>(b, "comp 12288x4096", reps);
    run_wg<4096, 4, 4, 4, 3, 2>(b, "comp 12288x4096", reps);
    free_bufs(b);
  }
  if (want("batch")) {
    Bufs b = make_bufs(12288, 4096, 1);
    run_comp<2, 1, 3>(b, reps); run_comp<2, 2, 3>(b, reps); run_comp<2, 4, 2>(b, reps);
    run_comp<4, 4, 2>(b, reps); run_comp<1, 4, 2>(b, reps); run_comp<2, 8, 1>(b, reps);
    free_bufs(b);
  }
  if (want("24576")) {
    Bufs b = make_bufs(24576, 4096, 3);
    run_wg<4096, 2, 1, 4>(b, "24576x4096", reps);
    run_wg<4096, 2, 2, 4>(b, "24576x4096", reps);
    free_bufs(b);
  }
  if (want("6144")) {
    Bufs b = make_bufs(6144, 4096, 8);
    run_wg<4096, 8, 1, 4>(b, "6144x4096", reps);
    run_wg<4096, 8, 2, 4>(b, "6144x4096", reps);
    run_wg<4096, 8, 4, 4>(b, "6144x4096", reps);
    free_bufs(b);
  }
  if (want("4096x4096")) {
    Bufs b = make_bufs(4096, 4096, 8);
    run_wg<4096, 8, 1, 4>(b, "4096x4096", reps);
    run_wg<4096, 8, 2, 4>(b, "4096x4096", reps);
    free_bufs(b);
  }
  if (want("4096x12288")) {
    Bufs b = make_bufs(4096, 12288, 6);
    run_wg<12288, 8, 1, 4>(b, "4096x12288", reps);
    run_wg<12288, 8, 2, 4>(b, "4096x12288", reps);
    free_bufs(b);
  }
  return 0;
}
#else   // -DWG_KERNEL_ONLY: one kernel alone, for ptxas's report and the SASS (-DWG_MINB=N)
#ifndef WG_MINB
#define WG_MINB 1
#endif
template __global__ void wg_q4<4096, 4, 2, 16, 4, WG_MINB>(const __nv_bfloat16*, const unsigned int*, const __nv_bfloat16*,
    const __nv_bfloat16*, float*, int*, __nv_bfloat16*, int, int);
#endif
