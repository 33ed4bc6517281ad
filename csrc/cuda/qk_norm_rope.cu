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
const float pos = __fmul_rn((float)(offset[0] + l), params[1]);
T* dst = head < H ? q + (((size_t)b * H + head) * L + l) * HD
                  : k + (((size_t)b * HK + (head - H)) * L + l) * HD;
#pragma unroll
for (int j = 0; j < PL; ++j) {
  const int i = lane + 32 * j;
  float sn, cs;
  sincosf(__fmul_rn(pos, inv_freq[i]), &sn, &cs);
  dst[i] = tf_from_float<T>(__fsub_rn(__fmul_rn(xa[j], cs), __fmul_rn(xb[j], sn)));
  dst[HALF + i] = tf_from_float<T>(__fadd_rn(__fmul_rn(xb[j], cs), __fmul_rn(xa[j], sn)));
}
