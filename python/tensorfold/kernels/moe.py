"""Row-exact MoE decode ops: the router's logits and top-k, the routed experts' gate/up +
SwiGLU, and their down projection + score-weighted sum + residual. models/moe.py's exact path
is ``router_logits``, ``route_glu`` and ``expert_sum`` per layer.

* ``router_logits(x, router)`` -- the router's row-exact fp32 logits: ``row_quantized_matmul``
  / ``row_matmul`` of x.astype(float32). The CUDA face reads x as it is and writes fp32 (the
  same bits: a bf16 / fp16 value converts to fp32 exactly), without the fp32 copy of x.
* ``route(logits, k, normalize)`` -- fp32 softmax of each row's router logits, the k largest
  by (probability descending, expert id ascending), their probabilities (divided by their sum
  when ``normalize``).
* ``expert_glu(x, gate, up, indices)`` -- ``h[r, j] = silu(g) * u`` with g, u the row's
  ``row_expert_matmul`` outputs for expert ``indices[r, j]`` (rounded to x's dtype), SwiGLU
  in fp32, rounded once.
* ``route_glu(x, logits, gate, up, k, normalize)`` -- ``route`` then ``expert_glu``: (h,
  indices, scores). The CUDA face is one kernel (each block runs moe_route's code for its row,
  then its share of expert_glu), bit-identical to the two.
* ``expert_sum(h, down, indices, scores, residual)`` -- ``y[r, j]`` = ``row_expert_matmul`` of
  h[r, j] on expert ``indices[r, j]``, then ``sum_j y[r, j] * scores[r, j]`` in fp32 in rank
  order (each product and sum rounded), rounded to h's dtype, plus the residual (fp32, rounded).

Weights (router, gate, up, down) are ``(weight, scales, biases, group_size, bits)``: scales =
biases = None and bits = 0 when unquantized; experts stacked [E, N, K] as checkpoints store them.

Contract: row r's outputs depend on row r's inputs only, whatever the call's row count and
whatever experts the other rows chose. Faces: CUDA runs one kernel per op
(csrc/cuda/row_expert.cu: moe_route, row_expert_*_glu, row_expert_*_glu_route,
row_expert_*_sum); the CPU and Metal faces compose ``row_expert_matmul`` with MLX's per-row ops
(softmax along the row, comparisons, elementwise math), which are row-invariant there. The CUDA
kernels take the same definitions; their softmax sums in another order, so CUDA and CPU bits
differ (the contract is per face).
"""

from __future__ import annotations

from typing import Optional, Sequence

import mlx.core as mx

Weights = Sequence    # (weight, scales, biases, group_size, bits): scales = biases = None, bits 0 unquantized


def topk_deterministic(scores: mx.array, k: int) -> mx.array:
    """Indices [..., k] (int32) of the k largest scores along the last axis, ordered by
    (score descending, expert id ascending): ties go to the lower id; a NaN ranks below every
    number. Pure comparisons and integer sums, so each row's answer depends on that row only."""
    E = scores.shape[-1]
    scores = mx.where(scores == scores, scores, -mx.inf)
    ids = mx.arange(E, dtype=mx.int32)
    a = mx.expand_dims(scores, -1)          # [..., E, 1]   the expert being ranked
    b = mx.expand_dims(scores, -2)          # [..., 1, E]   every other expert
    before = (b > a) | ((b == a) & (ids < mx.expand_dims(ids, -1)))
    rank = before.astype(mx.int32).sum(axis=-1)                       # [..., E], a permutation
    hit = mx.expand_dims(rank, -2) == mx.arange(k, dtype=mx.int32)[:, None]   # [..., k, E]
    return (hit.astype(mx.int32) * ids).sum(axis=-1)


def _face():
    from . import backend_face
    return backend_face()


def route(logits: mx.array, k: int, normalize: bool):
    """logits [R, E] float32 -> (indices [R, k] int32, scores [R, k] float32)."""
    if logits.ndim != 2 or logits.dtype != mx.float32:
        raise ValueError(f"route: logits must be float32 [R, E], got {logits.dtype} {logits.shape}")
    E = logits.shape[1]
    if not 1 <= k <= E:
        raise ValueError(f"route: k = {k} out of range for {E} experts")
    # (no row: MLX's ops below, not a CUDA grid of 0 blocks, which CUDA refuses; so in each op here)
    if _face() == "cuda" and logits.shape[0] and k <= 32 and E <= 1024:
        from . import _cuda, _gpu_stream
        return _cuda.moe_route(logits, k, normalize, _gpu_stream(None))
    gates = mx.softmax(logits, axis=-1, precise=True)
    inds = topk_deterministic(gates, k)
    scores = mx.take_along_axis(gates, inds, axis=-1)
    if normalize:
        scores = scores / mx.sum(scores, axis=-1, keepdims=True)
    return inds, scores


def router_logits(x: mx.array, router: Weights) -> mx.array:
    """x [R, D] (the MLP's normed input) and the router (weight [E, D] or quantized, scales,
    biases, group_size, bits) -> fp32 logits [R, E]: the row-exact matmul of x.astype(float32)."""
    from . import row_matmul, row_quantized_matmul
    w, sc, bi, gs, bits = router
    if x.ndim != 2 or w.ndim != 2:
        raise ValueError(f"router_logits: x [R, D] and a 2-D router weight expected, got {x.shape} and {w.shape}")
    D = w.shape[1] * 32 // bits if sc is not None else w.shape[1]
    if x.shape[1] != D:
        raise ValueError(f"router_logits: x {x.shape} does not fit the router {w.shape} ({bits} bits)")
    if _face() == "cuda" and x.shape[0] and D % 32 == 0:
        from . import _cuda, _gpu_stream
        if sc is not None:
            return _cuda.quantized_matmul(x, w, sc, bi, gs, bits, _gpu_stream(None), out_float=True)
        return _cuda.matmul(x, w, _gpu_stream(None), out_float=True)
    x32 = x.astype(mx.float32)
    return row_quantized_matmul(x32, w, sc, bi, gs, bits) if sc is not None else row_matmul(x32, w)


def glu_f32(g: mx.array, u: mx.array) -> mx.array:
    """silu(g) * u of two same-dtype arrays in fp32, rounded once to their dtype."""
    g32, u32 = g.astype(mx.float32), u.astype(mx.float32)
    return (g32 * mx.sigmoid(g32) * u32).astype(g.dtype)


def _check_experts(x_shape, w: Weights, indices_shape, what: str):
    from . import check_expert_args
    if len(indices_shape) != 2 or len(x_shape) != 2:
        raise ValueError(f"{what}: x [R, K] and indices [R, k] expected, got {x_shape} and {indices_shape}")
    if len(w) != 5:
        raise ValueError(f"{what}: expert weights are (weight, scales, biases, group_size, bits)")
    check_expert_args(x_shape, w[0], w[1], w[2], indices_shape, w[3], w[4], what)


def _same_quantization(gate: Weights, up: Weights) -> bool:
    """Whether gate and up share shape, dtype, group size and bits (the fused CUDA kernels read
    both with one set of template arguments)."""
    return (tuple(gate[0].shape), gate[0].dtype, gate[3], gate[4]) == \
        (tuple(up[0].shape), up[0].dtype, up[3], up[4])


def _matmul(x, w: Weights, indices):
    from . import row_expert_matmul
    return row_expert_matmul(x, w[0], w[1], w[2], indices, w[3], w[4])


def expert_glu(x: mx.array, gate: Weights, up: Weights, indices: mx.array) -> mx.array:
    """x [R, K], indices [R, k] int32 -> h [R, k, F] in x's dtype."""
    from . import as_int32
    _check_experts(x.shape, gate, indices.shape, "expert_glu")
    _check_experts(x.shape, up, indices.shape, "expert_glu")
    indices = as_int32(indices, "expert_glu: indices")     # clipped, not wrapped: a bad id stays bad
    if _face() == "cuda" and indices.size and _same_quantization(gate, up):
        from . import _cuda, _gpu_stream
        return _cuda.expert_glu(x, gate, up, indices, gate[3], gate[4], _gpu_stream(None))
    # other faces, and gate / up quantized differently: the same definition in separate calls
    return glu_f32(_matmul(x, gate, indices), _matmul(x, up, indices))


def route_glu(x: mx.array, logits: mx.array, gate: Weights, up: Weights, k: int, normalize: bool):
    """x [R, K], logits fp32 [R, E] -> (h [R, k, F] in x's dtype, indices [R, k] int32,
    scores [R, k] float32): route(logits, k, normalize), then expert_glu(x, gate, up, indices)."""
    if logits.ndim != 2 or logits.dtype != mx.float32 or logits.shape[0] != x.shape[0]:
        raise ValueError(f"route_glu: logits must be float32 [R, E] for x {x.shape}, got "
                         f"{logits.dtype} {logits.shape}")
    E = logits.shape[1]
    if gate[0].shape[0] != E or not 1 <= k <= E:
        raise ValueError(f"route_glu: {E} logits per row, {gate[0].shape[0]} experts, k = {k}")
    _check_experts(x.shape, gate, (x.shape[0], k), "route_glu")
    _check_experts(x.shape, up, (x.shape[0], k), "route_glu")
    if _face() == "cuda" and x.shape[0] and _same_quantization(gate, up) and k <= 32 and E <= 1024:
        from . import _cuda, _gpu_stream
        return _cuda.expert_glu_route(x, gate, up, logits, k, normalize, gate[3], gate[4],
                                      _gpu_stream(None))
    inds, scores = route(logits, k, normalize)
    return expert_glu(x, gate, up, inds), inds, scores


def expert_sum(h: mx.array, down: Weights, indices: mx.array, scores: mx.array,
               residual: Optional[mx.array] = None) -> mx.array:
    """h [R, k, F], indices [R, k] int32, scores [R, k] float32 (and residual [R, D]) -> [R, D]
    in h's dtype."""
    if h.ndim != 3 or indices.ndim != 2 or h.shape[:2] != indices.shape:
        raise ValueError(f"expert_sum: h [R, k, F] and indices [R, k] expected, got {h.shape} and "
                         f"{indices.shape}")
    R, k, F = h.shape
    _check_experts((R, F), down, indices.shape, "expert_sum")
    if scores.shape != indices.shape:
        raise ValueError(f"expert_sum: scores {scores.shape} must match indices {indices.shape}")
    D = down[0].shape[1]
    if residual is not None and (residual.size != R * D or residual.shape[-1] != D):
        # [D, R] has R * D elements too: its rows would have been mixed into other rows
        raise ValueError(f"expert_sum: residual {residual.shape} must be [R, D] = [{R}, {D}]")
    from . import as_int32
    indices, scores = as_int32(indices, "expert_sum: indices"), scores.astype(mx.float32)
    if _face() == "cuda" and indices.size and k <= 32:
        from . import _cuda, _gpu_stream
        return _cuda.expert_sum(h, down, indices, scores, residual, down[3], down[4],
                                _gpu_stream(None))
    acc = mx.zeros((R, D), mx.float32)      # k = 0: a sum of nothing
    if k:
        y = _matmul(h.reshape(R * k, F), down, indices.reshape(R * k, 1)).reshape(R, k, D)
        acc = y[:, 0].astype(mx.float32) * scores[:, 0:1]
        for j in range(1, k):
            acc = acc + y[:, j].astype(mx.float32) * scores[:, j:j + 1]
    out = acc.astype(h.dtype)
    return out if residual is None else residual.reshape(out.shape).astype(h.dtype) + out
