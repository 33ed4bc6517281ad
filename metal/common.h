// Helpers shared by every Metal kernel file (row_ops.metal, row_expert.metal,
// sparse_attention.metal), parallel to csrc/cuda/common.cuh: tensorfold.kernels._sources
// prepends this file's "// @@header" section to the header of each of them.
// Moved verbatim from those files' headers: no expression changed.

// @@header
#include <metal_stdlib>
using namespace metal;

template <int BITS>
inline uint tf_extract(thread const uint* words, int e) {
  const int bit = e * BITS;
  const int wi = bit >> 5;
  const int sh = bit & 31;
  uint q = words[wi] >> sh;
  if (sh + BITS > 32) q |= words[wi + 1] << (32 - sh);
  return q & ((1u << BITS) - 1u);
}

inline float tf_simd_sum(float v) {
  for (ushort off = 16; off >= 1; off >>= 1) v = v + simd_shuffle_xor(v, off);
  return v;
}

// The maximum a softmax subtracts: -inf (no finite score yet on either side) gives 0, so
// exp(-inf - 0) = 0 weighs nothing where -inf - -inf was NaN (cpu_attention.h's rule).
inline float tf_zmax(float m) { return m == -INFINITY ? 0.0f : m; }

inline float tf_simd_max(float v) {
  for (ushort off = 16; off >= 1; off >>= 1) v = max(v, simd_shuffle_xor(v, off));
  return v;
}
