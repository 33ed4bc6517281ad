// Shared pieces of the CPU faces of the row-exact kernels: a small persistent thread
// pool, scalar dtype conversions, and 8-lane float vectors with an explicit lane order.
//
// Determinism rule for everything built on this file: how work is split across threads
// never changes the arithmetic of one output element. Threads only ever own whole output
// columns (matmuls) or whole query rows (attention); every reduction runs inside one
// thread in an order fixed by the weight / head shapes alone.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/array.h"
#include "mlx/dtype.h"
#include "mlx/stream.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define TF_AVX2 1
#else
#define TF_AVX2 0
#endif

namespace tensorfold::cpu {

// ---------------------------------------------------------------- thread pool

// Runs fn(task) for task in [0, n_tasks) on the calling thread plus the pool's workers,
// and returns when all are done. Tasks are claimed dynamically; results must not depend
// on which thread ran a task (they don't: each task writes disjoint outputs with its own
// fixed-order arithmetic).
void parallel_for(int64_t n_tasks, const std::function<void(int64_t)>& fn);

// Number of threads parallel_for uses (workers + caller). TF_CPU_THREADS overrides.
int num_threads();

// ---------------------------------------------------------------- scalars

inline float bf16_to_f32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round to nearest even, NaN stays NaN (same rule as MLX's bfloat16 conversion).
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    return static_cast<uint16_t>((u >> 16) | 0x40);
  }
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float f16_to_f32(uint16_t h) {
#if TF_AVX2
  return _cvtsh_ss(h);
#else
  return static_cast<float>(*reinterpret_cast<const _Float16*>(&h));
#endif
}

inline uint16_t f32_to_f16(float f) {
#if TF_AVX2
  return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
  _Float16 h = static_cast<_Float16>(f);
  uint16_t u;
  std::memcpy(&u, &h, 2);
  return u;
#endif
}

enum class FType { f32, bf16, f16 };

inline FType ftype_of(mlx::core::Dtype d, const char* what) {
  if (d == mlx::core::float32) return FType::f32;
  if (d == mlx::core::bfloat16) return FType::bf16;
  if (d == mlx::core::float16) return FType::f16;
  throw std::invalid_argument(std::string(what) + " must be float32, bfloat16 or float16");
}

inline float load_scalar(const void* p, FType t, int64_t i) {
  switch (t) {
    case FType::f32: return static_cast<const float*>(p)[i];
    case FType::bf16: return bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
    default: return f16_to_f32(static_cast<const uint16_t*>(p)[i]);
  }
}

inline void store_scalar(void* p, FType t, int64_t i, float v) {
  switch (t) {
    case FType::f32: static_cast<float*>(p)[i] = v; break;
    case FType::bf16: static_cast<uint16_t*>(p)[i] = f32_to_bf16(v); break;
    default: static_cast<uint16_t*>(p)[i] = f32_to_f16(v); break;
  }
}

// Converts n values (any FType) to float32, exactly (all three widen exactly).
void convert_to_f32(const void* src, FType t, int64_t n, float* dst);

// The rows of x (all of it, contiguous) as fp32: x's own data when it is fp32, else widened
// exactly into buf.
inline const float* rows_as_f32(const mlx::core::array& x, FType xt, std::vector<float>& buf) {
  if (xt == FType::f32) return x.data<float>();
  buf.resize(x.size());
  convert_to_f32(x.data<void>(), xt, static_cast<int64_t>(x.size()), buf.data());
  return buf.data();
}

// ---------------------------------------------------------------- 8-lane vectors
// Lane j of an accumulator always holds the partial sum of elements k with k % 8 == j
// (or k % 16 == j for the paired accumulators), and the horizontal sum is always
// ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)).  The scalar fallback computes the same thing
// with the same fused multiply-adds.

#if TF_AVX2
using v8 = __m256;
inline v8 v8_zero() { return _mm256_setzero_ps(); }
inline v8 v8_load(const float* p) { return _mm256_loadu_ps(p); }
inline void v8_store(float* p, v8 a) { _mm256_storeu_ps(p, a); }
inline v8 v8_set1(float a) { return _mm256_set1_ps(a); }
inline v8 v8_fma(v8 a, v8 b, v8 c) { return _mm256_fmadd_ps(a, b, c); }
inline v8 v8_add(v8 a, v8 b) { return _mm256_add_ps(a, b); }
inline v8 v8_mul(v8 a, v8 b) { return _mm256_mul_ps(a, b); }
inline float v8_hsum(v8 a) {
  __m128 lo = _mm256_castps256_ps128(a);      // l0 l1 l2 l3
  __m128 hi = _mm256_extractf128_ps(a, 1);    // l4 l5 l6 l7
  __m128 s = _mm_add_ps(lo, hi);              // l0+l4, l1+l5, l2+l6, l3+l7
  __m128 sh = _mm_movehl_ps(s, s);            // (l2+l6), (l3+l7)
  __m128 s2 = _mm_add_ps(s, sh);              // (l0+l4)+(l2+l6), (l1+l5)+(l3+l7)
  __m128 s3 = _mm_shuffle_ps(s2, s2, 0x55);
  return _mm_cvtss_f32(_mm_add_ss(s2, s3));
}
#else
struct v8 {
  float l[8];
};
inline v8 v8_zero() { return v8{}; }
inline v8 v8_load(const float* p) {
  v8 r;
  std::memcpy(r.l, p, 32);
  return r;
}
inline void v8_store(float* p, v8 a) { std::memcpy(p, a.l, 32); }
inline v8 v8_set1(float a) {
  v8 r;
  for (int i = 0; i < 8; ++i) r.l[i] = a;
  return r;
}
inline v8 v8_fma(v8 a, v8 b, v8 c) {
  v8 r;
  for (int i = 0; i < 8; ++i) r.l[i] = std::fma(a.l[i], b.l[i], c.l[i]);
  return r;
}
inline v8 v8_add(v8 a, v8 b) {
  v8 r;
  for (int i = 0; i < 8; ++i) r.l[i] = a.l[i] + b.l[i];
  return r;
}
inline v8 v8_mul(v8 a, v8 b) {
  v8 r;
  for (int i = 0; i < 8; ++i) r.l[i] = a.l[i] * b.l[i];
  return r;
}
inline float v8_hsum(v8 a) {
  const float* l = a.l;
  return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
}
#endif

// ---------------------------------------------------------------- misc

inline mlx::core::Stream cpu_stream() {
  return mlx::core::default_stream(mlx::core::Device(mlx::core::Device::cpu));
}

} // namespace tensorfold::cpu
