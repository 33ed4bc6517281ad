// The one GEMM skeleton behind row_matmul and row_quantized_matmul (CPU faces).
//
// out[r, n] = sum_k x[r, k] * w_hat[n, k] with w_hat produced on the fly by a "loader"
// (a dtype conversion for row_matmul, affine dequantisation for row_quantized_matmul).
//
// Fixed arithmetic for ONE output element (r, n), independent of R (the number of rows),
// of the thread count and of which tile (n) falls into:
//   a0, a1 = 8-lane fp32 accumulators, zero
//   for k in 0, 16, 32, ... K-16:               (K is a multiple of 16)
//     a0 = fma(w_hat[n, k   .. k+8 ], x[r, k   .. k+8 ], a0)
//     a1 = fma(w_hat[n, k+8 .. k+16], x[r, k+8 .. k+16], a1)
//   out = hsum(a0 + a1)   with hsum = ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7))
// w_hat values themselves are computed per element by the loader with fixed arithmetic.
//
// Work layout (affects speed only): threads own tiles of kTaskCols whole columns (split over
// N only). Within a task, columns go kNC at a time; K is walked in chunks of kKC; for
// each chunk the loader writes kNC columns of w_hat into a small fp32 buffer (each weight
// read from memory once per row block), which is then dotted with every row of the block.
// Rows go kRB at a time; accumulators persist across K chunks in a small buffer.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu_common.h"

namespace tensorfold::cpu {

constexpr int kNC = 4;          // columns dequantised together
constexpr int kTaskCols = 16;   // columns per thread-pool task
constexpr int64_t kKC = 512;    // K chunk (multiple of 16 and of every group size)
constexpr int64_t kRB = 32;     // rows per row block

// One tile of the GEMM: columns [nt0, nt1) for cnt rows; row i of the tile reads x row
// row_of(i) and writes output row dst_of(i) (identity for row_gemm, gathered / scattered
// pairs for row_expert_matmul). The arithmetic of each output element is the one above.
template <class RowOf, class DstOf, class Loader>
inline void row_gemm_tile(const float* xf, int64_t K, int64_t N, int64_t cnt, int64_t nt0,
                          int64_t nt1, void* out, FType ot, const RowOf& row_of,
                          const DstOf& dst_of, const Loader& load) {
  alignas(64) float wbuf[kNC][kKC];
  alignas(64) float acc[kRB][kNC][16];
  for (int64_t n0 = nt0; n0 < nt1; n0 += kNC) {
    const int nc = static_cast<int>(std::min<int64_t>(kNC, nt1 - n0));
    for (int64_t r0 = 0; r0 < cnt; r0 += kRB) {
      const int64_t rb = std::min(kRB, cnt - r0);
      std::memset(acc, 0, sizeof(float) * rb * kNC * 16);
      for (int64_t k0 = 0; k0 < K; k0 += kKC) {
        const int64_t len = std::min(kKC, K - k0);
        for (int c = 0; c < kNC; ++c) {
          if (c < nc) {
            load(n0 + c, k0, len, wbuf[c]);
          } else {
            std::memset(wbuf[c], 0, sizeof(float) * len);
          }
        }
        for (int64_t m = 0; m < rb; ++m) {
          const float* xr = xf + row_of(r0 + m) * K + k0;
          float* am = &acc[m][0][0];
          v8 a00 = v8_load(am + 0), a01 = v8_load(am + 8);
          v8 a10 = v8_load(am + 16), a11 = v8_load(am + 24);
          v8 a20 = v8_load(am + 32), a21 = v8_load(am + 40);
          v8 a30 = v8_load(am + 48), a31 = v8_load(am + 56);
          for (int64_t k = 0; k < len; k += 16) {
            const v8 x0 = v8_load(xr + k), x1 = v8_load(xr + k + 8);
            a00 = v8_fma(v8_load(wbuf[0] + k), x0, a00);
            a01 = v8_fma(v8_load(wbuf[0] + k + 8), x1, a01);
            a10 = v8_fma(v8_load(wbuf[1] + k), x0, a10);
            a11 = v8_fma(v8_load(wbuf[1] + k + 8), x1, a11);
            a20 = v8_fma(v8_load(wbuf[2] + k), x0, a20);
            a21 = v8_fma(v8_load(wbuf[2] + k + 8), x1, a21);
            a30 = v8_fma(v8_load(wbuf[3] + k), x0, a30);
            a31 = v8_fma(v8_load(wbuf[3] + k + 8), x1, a31);
          }
          v8_store(am + 0, a00), v8_store(am + 8, a01);
          v8_store(am + 16, a10), v8_store(am + 24, a11);
          v8_store(am + 32, a20), v8_store(am + 40, a21);
          v8_store(am + 48, a30), v8_store(am + 56, a31);
        }
      }
      for (int64_t m = 0; m < rb; ++m) {
        for (int c = 0; c < nc; ++c) {
          const float* a = acc[m][c];
          const float v = v8_hsum(v8_add(v8_load(a), v8_load(a + 8)));
          store_scalar(out, ot, dst_of(r0 + m) * N + n0 + c, v);
        }
      }
    }
  }
}

// Loader: void(int64_t n, int64_t k0, int64_t len, float* dst) writes w_hat[n, k0:k0+len].
template <class Loader>
void row_gemm(const float* xf, int64_t R, int64_t K, int64_t N, void* out, FType ot,
              const Loader& load) {
  if (K % 16 != 0) {
    throw std::invalid_argument("row kernels need K to be a multiple of 16");
  }
  const int64_t n_tasks = (N + kTaskCols - 1) / kTaskCols;
  parallel_for(n_tasks, [&](int64_t task) {
    const int64_t nt0 = task * kTaskCols;
    const int64_t nt1 = std::min(N, nt0 + kTaskCols);
    const auto same = [](int64_t i) { return i; };
    row_gemm_tile(xf, K, N, R, nt0, nt1, out, ot, same, same, load);
  });
}

// MLX affine quantisation (row_quantized_matmul, row_expert_matmul): the bytes of a row of
// w form a little-endian bit stream, element k occupies bits [k*bits, (k+1)*bits).
// Writes the 8 quantised integers of elements k..k+7 (k % 8 == 0) of a row, as floats.
template <int bits>
inline void unpack8(const uint8_t* row, int64_t k, float* q) {
  const uint8_t* p = row + (k * bits) / 8; // byte aligned because k % 8 == 0
#if TF_AVX2
  if constexpr (bits == 4) {
    uint32_t u;
    std::memcpy(&u, p, 4);
    const __m256i sh = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    __m256i v = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(u)), sh),
                                 _mm256_set1_epi32(0xf));
    _mm256_storeu_ps(q, _mm256_cvtepi32_ps(v));
    return;
  } else if constexpr (bits == 8) {
    uint64_t u;
    std::memcpy(&u, p, 8);
    __m256i v = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>(u)));
    _mm256_storeu_ps(q, _mm256_cvtepi32_ps(v));
    return;
  } else if constexpr (bits == 2) {
    uint16_t u;
    std::memcpy(&u, p, 2);
    const __m256i sh = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
    __m256i v = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(u), sh),
                                 _mm256_set1_epi32(0x3));
    _mm256_storeu_ps(q, _mm256_cvtepi32_ps(v));
    return;
  }
#endif
  uint64_t u = 0;
  std::memcpy(&u, p, bits); // 8 values * bits = `bits` bytes
  constexpr uint64_t mask = (uint64_t(1) << bits) - 1;
  for (int j = 0; j < 8; ++j) {
    q[j] = static_cast<float>((u >> (j * bits)) & mask);
  }
}

// Loader body of the affine-quantised weights: w_hat[k0:k0+len] of one row (packed bytes
// `row`, its groups' scales / biases starting at flat index sg), w_hat = fma(scale, q, bias).
template <int bits>
inline void dequant_row(const uint8_t* row, const void* scales, const void* biases, FType st,
                        int64_t sg, int group_size, int64_t k0, int64_t len, float* dst) {
  alignas(32) float q[8];
  for (int64_t k = k0; k < k0 + len; k += group_size) {
    const int64_t g = k / group_size;
    const v8 s = v8_set1(load_scalar(scales, st, sg + g));
    const v8 b = v8_set1(load_scalar(biases, st, sg + g));
    for (int64_t j = 0; j < group_size; j += 8) {
      unpack8<bits>(row, k + j, q);
      v8_store(dst + (k - k0) + j, v8_fma(s, v8_load(q), b)); // scale*q + bias, fused
    }
  }
}

} // namespace tensorfold::cpu
