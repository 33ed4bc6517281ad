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

// Loader: void(int64_t n, int64_t k0, int64_t len, float* dst) writes w_hat[n, k0:k0+len].
template <class Loader>
void row_gemm(const float* xf, int64_t R, int64_t K, int64_t N, void* out, FType ot,
              const Loader& load) {
  if (K % 16 != 0) {
    throw std::invalid_argument("row kernels need K to be a multiple of 16");
  }
  const int64_t n_tasks = (N + kTaskCols - 1) / kTaskCols;
  parallel_for(n_tasks, [&](int64_t task) {
    alignas(64) float wbuf[kNC][kKC];
    alignas(64) float acc[kRB][kNC][16];
    const int64_t nt0 = task * kTaskCols;
    const int64_t nt1 = std::min(N, nt0 + kTaskCols);
    for (int64_t n0 = nt0; n0 < nt1; n0 += kNC) {
      const int nc = static_cast<int>(std::min<int64_t>(kNC, nt1 - n0));
      for (int64_t r0 = 0; r0 < R; r0 += kRB) {
        const int64_t rb = std::min(kRB, R - r0);
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
            const float* xr = xf + (r0 + m) * K + k0;
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
            store_scalar(out, ot, (r0 + m) * N + n0 + c, v);
          }
        }
      }
    }
  });
}

} // namespace tensorfold::cpu
