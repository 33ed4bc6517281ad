// The decode step's query / key preparation in one launch (CUDA face only): from the fused
// q|k|v projection's output, each query and key head gets its RMSNorm (qwen3's q_norm /
// k_norm, when NORM) and its RoPE (non-traditional: element i pairs with i + HD/2), written in
// the [B, heads, L, HD] layout the attention and the KV cache take. It replaces four MLX
// launches per layer (two rms_norm, two rope). The CPU and Metal faces run those MLX ops; the
// bits differ between faces, never between calls of one face: one warp per (row, head), every
// value a function of that head's HD inputs and the row's position only.
//
// Arithmetic of one head vector x (fp32 from T), lane l holding elements l + 32 j and
// HD/2 + l + 32 j (j = 0 .. HD/64 - 1):
//   NORM: ss = fma chain over the lane's elements (first halves j = 0.., then second halves),
//         butterfly sum over lanes (xor 16..1); r = rsqrt(ss * (1/HD) + eps);
//         x_i = T(x_i * r * w_i) (rounded to T, as the unfused rms_norm's output is)
//   RoPE: theta_i = (pos * scale) * inv_freq[i], pos = offset + row's index in the call;
//         out_i = T(x_i cos - x_{i+HD/2} sin), out_{i+HD/2} = T(x_{i+HD/2} cos + x_i sin).

// @@header
// One head vector of row `row` (head < H: a query head, else a key head) from qkv, normed and
// rotated as above; lane l gets its outputs i = l + 32 j and HALF + i in oa[j], ob[j] (fp32
// values of T). Shared by qk_norm_rope and qk_norm_rope_kv (same arithmetic).
template <typename T, int H, int HK, int HD, bool NORM>
__device__ __forceinline__ void tf_qk_head(const T* qkv, const T* qn, const T* kn,
                                           const float* inv_freq, const float* params, int pos_i,
                                           int row, int head, int lane, float (&oa)[HD / 64],
                                           float (&ob)[HD / 64]) {
  constexpr int HALF = HD / 2;
  constexpr int PL = HALF / 32;
  const T* src = qkv + (size_t)row * ((H + 2 * HK) * HD) + head * HD;
  float xa[PL], xb[PL];
#pragma unroll
  for (int j = 0; j < PL; ++j) {
    xa[j] = tf_to_float(src[lane + 32 * j]);
    xb[j] = tf_to_float(src[HALF + lane + 32 * j]);
  }
  if constexpr (NORM) {
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < PL; ++j) ss = __fmaf_rn(xa[j], xa[j], ss);
#pragma unroll
    for (int j = 0; j < PL; ++j) ss = __fmaf_rn(xb[j], xb[j], ss);
    ss = tf_warp_sum(ss);
    const float r = rsqrtf(__fadd_rn(__fmul_rn(ss, 1.0f / HD), params[0]));
    const T* wn = head < H ? qn : kn;
#pragma unroll
    for (int j = 0; j < PL; ++j) {
      const int i = lane + 32 * j;
      xa[j] = tf_to_float(tf_from_float<T>(__fmul_rn(__fmul_rn(xa[j], r), tf_to_float(wn[i]))));
      xb[j] = tf_to_float(tf_from_float<T>(__fmul_rn(__fmul_rn(xb[j], r), tf_to_float(wn[HALF + i]))));
    }
  }
  const float pos = __fmul_rn((float)pos_i, params[1]);
#pragma unroll
  for (int j = 0; j < PL; ++j) {
    const int i = lane + 32 * j;
    float sn, cs;
    sincosf(__fmul_rn(pos, inv_freq[i]), &sn, &cs);
    oa[j] = __fsub_rn(__fmul_rn(xa[j], cs), __fmul_rn(xb[j], sn));
    ob[j] = __fadd_rn(__fmul_rn(xb[j], cs), __fmul_rn(xa[j], sn));
  }
}

// The two halves of one head vector (tf_qk_head's outputs) rounded to T into dst[0 .. HD).
template <typename T, int HD>
__device__ __forceinline__ void tf_qk_store(T* dst, const float (&oa)[HD / 64],
                                            const float (&ob)[HD / 64], int lane) {
#pragma unroll
  for (int j = 0; j < HD / 64; ++j) {
    dst[lane + 32 * j] = tf_from_float<T>(oa[j]);
    dst[HD / 2 + lane + 32 * j] = tf_from_float<T>(ob[j]);
  }
}

// @@body qk_norm_rope
// inputs: qkv [B, L, (H + 2 HK) * HD] (T), qn, kn [HD] (T; read only with NORM),
//         inv_freq [HD/2] float32, params [2] float32 (eps, rope scale), offset [1] int32
// outputs: q [B, H, L, HD] (T), k [B, HK, L, HD] (T).   template: T, H, HK, HD, NORM
// launch: grid (ceil(B L (H + HK) / 4) * 128, 1, 1), threadgroup (128, 1, 1)
constexpr int HALF = HD / 2;
constexpr int PL = HALF / 32;
static_assert(HALF % 32 == 0, "qk_norm_rope: HD a multiple of 64");
const int B = qkv_shape[0], L = qkv_shape[1];
const int lane = threadIdx.x & 31;
const int gw = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
if (gw >= B * L * (H + HK)) return;
const int head = gw % (H + HK);
const int row = gw / (H + HK);
const int b = row / L, l = row % L;
float oa[PL], ob[PL];
tf_qk_head<T, H, HK, HD, NORM>(qkv, qn, kn, inv_freq, params, offset[0] + l, row, head, lane, oa, ob);
T* dst = head < H ? q + (((size_t)b * H + head) * L + l) * HD
                  : k + (((size_t)b * HK + (head - H)) * L + l) * HD;
tf_qk_store<T, HD>(dst, oa, ob, lane);

// @@body qk_norm_rope_kv
// qk_norm_rope that writes the key and value rows straight into the KV cache buffers (the
// compiled decode step's cache write, which otherwise takes two scatter launches per layer):
// inputs: as qk_norm_rope, plus kc, vc [B, HK, cap, HD] (T): rows offset + l are overwritten
//         IN PLACE (the buffers are inputs; MLX is not told -- the step's attention, which reads
//         them, depends on this kernel's q, so it runs after it), and fence (any array, never
//         read: MLX's CUDA graph runs this launch after the kernel that produced it, the
//         previous step's attention; dense.StepCache.in_place). Rows outside the buffer are
//         not written.
// output: q [B, H, L, HD] (T).   template: T, H, HK, HD, NORM
// launch: as qk_norm_rope. Same arithmetic (tf_qk_head); v rows are copied unchanged.
constexpr int HALF = HD / 2;
constexpr int PL = HALF / 32;
static_assert(HALF % 32 == 0, "qk_norm_rope_kv: HD a multiple of 64");
const int B = qkv_shape[0], L = qkv_shape[1];
const int cap = kc_shape[2];
const int lane = threadIdx.x & 31;
const int gw = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
if (gw >= B * L * (H + HK)) return;
const int head = gw % (H + HK);
const int row = gw / (H + HK);
const int b = row / L, l = row % L;
const int p = offset[0] + l;
float oa[PL], ob[PL];
tf_qk_head<T, H, HK, HD, NORM>(qkv, qn, kn, inv_freq, params, p, row, head, lane, oa, ob);
T* dst;
if (head < H) {
  dst = q + (((size_t)b * H + head) * L + l) * HD;
} else {
  if (p < 0 || p >= cap) return;
  const size_t at = (((size_t)b * HK + (head - H)) * cap + p) * HD;
  dst = const_cast<T*>(kc) + at;
  const T* vsrc = qkv + (size_t)row * ((H + 2 * HK) * HD) + (H + HK + head - H) * HD;
  T* vdst = const_cast<T*>(vc) + at;
#pragma unroll
  for (int j = 0; j < HD / 32; ++j) vdst[lane + 32 * j] = vsrc[lane + 32 * j];
}
tf_qk_store<T, HD>(dst, oa, ob, lane);
