// Row-exact routed-expert GEMMs for MLX's Metal backend (mx.fast.metal_kernel, JIT): the
// Metal face of tensorfold.kernels.row_expert_matmul (launched by
// tensorfold.kernels._metal_expert_matmul).
//
// NEVER COMPILED BY APPLE'S COMPILER OR RUN ON A GPU in this project (no Apple GPU here; CI
// runs it on the CPU emulation of tests/metal_emu): a reviewed sketch with the
// arithmetic of metal/row_ops.metal's row_qmm / row_mm (which mirror csrc/cuda/row_gemm.cu):
// K in 32-element chunks, lane l of the simdgroup takes chunks l, l+32, ... ; in a chunk
// j = 0..31: acc = fma(w_hat_j, x_j, acc) with w_hat = fma(scale, q, bias); butterfly over
// lanes with simd_shuffle_xor 16, 8, 4, 2, 1 (never simd_sum).
// One simdgroup per (output column n, pair p = r * TOPK + j); expert e = indices[p]; an id
// outside [0, E) writes NaN. A pair's bits depend on K / group size / bits only.

// @@header
// (metal_stdlib and the shared helpers tf_extract, tf_simd_sum, tf_simd_max come from
// common.h, prepended by _sources.py)

// @@body row_expert_qmm
// inputs x [R, K] (T), w [E, N, K*BITS/32] uint32, scales/biases [E, N, K/GS] (S),
// indices [R, TOPK] int32; output out [R, TOPK, N] (T)
// template T, S, K, N, E, TOPK, GS, BITS; grid (32, N, R*TOPK), threadgroup (32, 1, 1)
const int NCHUNK = K / 32;
const int KW = K * BITS / 32;
const int NG = K / GS;
const uint lane = thread_index_in_simdgroup;
const int n = threadgroup_position_in_grid.y;
const int p = threadgroup_position_in_grid.z;
const int r = p / TOPK;
const int e = indices[p];
const bool bad = e < 0 || e >= E;
float acc = 0.0f;
if (!bad) {
  const size_t row = (size_t)e * N + n;
  for (int ch = lane; ch < NCHUNK; ch += 32) {
    uint words[BITS];
    for (int i = 0; i < BITS; ++i) words[i] = w[row * KW + (size_t)ch * BITS + i];
    const int g = (ch * 32) / GS;
    const float s = static_cast<float>(scales[row * NG + g]);
    const float b = static_cast<float>(biases[row * NG + g]);
    for (int j = 0; j < 32; ++j) {
      const float wh = fma(s, static_cast<float>(tf_extract<BITS>(words, j)), b);
      acc = fma(wh, static_cast<float>(x[(size_t)r * K + ch * 32 + j]), acc);
    }
  }
}
const float v = tf_simd_sum(acc);
if (lane == 0) out[(size_t)p * N + n] = static_cast<T>(bad ? NAN : v);

// @@body row_expert_mm
// inputs x [R, K] (T), w [E, N, K] (W), indices [R, TOPK] int32; output out [R, TOPK, N] (T)
// template T, W, K, N, E, TOPK; grid (32, N, R*TOPK), threadgroup (32, 1, 1)
const int NCHUNK = K / 32;
const uint lane = thread_index_in_simdgroup;
const int n = threadgroup_position_in_grid.y;
const int p = threadgroup_position_in_grid.z;
const int r = p / TOPK;
const int e = indices[p];
const bool bad = e < 0 || e >= E;
float acc = 0.0f;
if (!bad) {
  const size_t row = (size_t)e * N + n;
  for (int ch = lane; ch < NCHUNK; ch += 32) {
    for (int j = 0; j < 32; ++j) {
      const float wh = static_cast<float>(w[row * K + ch * 32 + j]);
      acc = fma(wh, static_cast<float>(x[(size_t)r * K + ch * 32 + j]), acc);
    }
  }
}
const float v = tf_simd_sum(acc);
if (lane == 0) out[(size_t)p * N + n] = static_cast<T>(bad ? NAN : v);
