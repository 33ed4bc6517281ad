// C++ op functions of the row-exact kernels (CPU primitives). Each returns a lazy MLX
// array whose primitive runs on the CPU stream; see docs/kernels.md for the contract.
#pragma once

#include <optional>

#include "mlx/array.h"

namespace nanobind {
class module_;
} // namespace nanobind

namespace tensorfold {

// x [..., M, K] (f32/bf16/f16) @ dequant(w)^T -> [..., M, N] in x's dtype.
// w uint32 [N, K*bits/32]; scales, biases [N, K/group_size]. MLX affine format.
mlx::core::array row_quantized_matmul(const mlx::core::array& x, const mlx::core::array& w,
                                      const mlx::core::array& scales,
                                      const mlx::core::array& biases, int group_size,
                                      int bits);

// x [..., M, K] @ w^T, w [N, K] -> [..., M, N] in x's dtype.
mlx::core::array row_matmul(const mlx::core::array& x, const mlx::core::array& w);

// q [B, Hq, M, D]; k, v [B, Hkv, cap, D]; offset int32 scalar array. Causal: query row i
// sits at position offset+i and attends to keys 0..offset+i. Output [B, Hq, M, D].
mlx::core::array row_attention(const mlx::core::array& q, const mlx::core::array& k,
                               const mlx::core::array& v, const mlx::core::array& offset,
                               float scale);

// q [B, Hq, M, D]; k, v [B, Hkv, cap, D]; indices [B, M, T] int32 (per query row, the key
// positions it attends to, shared by its heads; < 0 = padding, > offset+i ignored);
// offset int32 scalar array. Output [B, Hq, M, D]. See csrc/sparse_attention.cpp.
mlx::core::array sparse_attention(const mlx::core::array& q, const mlx::core::array& k,
                                  const mlx::core::array& v, const mlx::core::array& indices,
                                  const mlx::core::array& offset, float scale);

// x [..., K] with indices [..., k] int32 (x's leading dims) -> [..., k, N] in x's dtype:
// out[..., j, :] = x @ dequant(w[indices[..., j]])^T. w uint32 [E, N, K*bits/32] with
// scales / biases [E, N, K/group_size], or (no scales) a float w [E, N, K]. Row-exact; an
// index outside [0, E) gives a NaN row. See csrc/row_expert_matmul.cpp.
mlx::core::array row_expert_matmul(const mlx::core::array& x, const mlx::core::array& w,
                                   const std::optional<mlx::core::array>& scales,
                                   const std::optional<mlx::core::array>& biases,
                                   const mlx::core::array& indices, int group_size, int bits);
void register_row_expert_matmul(nanobind::module_& m);

} // namespace tensorfold
