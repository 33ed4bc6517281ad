"""Sparse MoE family: qwen3_moe (the Qwen3-30B-A3B layout). Attention, norms, RoPE, embedding,
LM head and the two-path structure are DenseModel's (dense.py); only the MLP differs.

- Weights: stacked experts ``model.layers.{i}.mlp.switch_mlp.{gate,up,down}_proj.weight``
  [E, out, in] (quantized: uint32 + scales / biases stacked likewise, as mlx-community stores
  them) or Hugging Face's per-expert ``mlp.experts.{e}.{gate,up,down}_proj.weight`` (stacked at
  load, as mlx-lm's sanitize does). Router ``mlp.gate`` [E, hidden]. Layers listed in
  ``mlp_only_layers`` (or off the ``decoder_sparse_step`` pattern) have the dense MLP.
- Prefill (`exact=False`): mlx-lm's Qwen3MoeSparseMoeBlock / SwitchGLU op for op (softmax,
  argpartition top-k, gather_qmm / gather_mm with the same sort / unsort), so the logits equal
  mlx-lm's bit for bit -- except on the CUDA face for chunks of >= DEQUANT_MIN_PAIRS routed
  pairs, whose quantized experts go through dequantize + gather_mm (MLX's grouped GEMM; equal
  within bf16 rounding, 4-7x faster than gather_qmm there). Each layer's outputs (hidden state
  and its KV writes) go to a native ``LayerQueue(2)``: at most two layers are queued ahead of
  the device, so the live graph and its intermediates stay bounded by two layers of one grid
  chunk. On the dequantized path each expert projection's product is pushed too (a piece of
  the layer: at most two projections' dequantized copies are queued ahead).
- Decode (`exact=True`): kernels/moe.py: the router's fp32 logits (``router_logits``, a
  row-exact matmul), softmax in fp32 per row and a deterministic top-k (score descending, ties
  to the lower expert id) followed by the routed experts' gate/up and SwiGLU (``route_glu``),
  their down projection combined in fp32 in rank order plus the residual (``expert_sum``); on
  CUDA one kernel each.
  Row i's bits do not depend on the other rows or on the experts they chose.
"""

from __future__ import annotations

import os

import mlx.core as mx

from ..errors import CheckpointError
from .bounded import BoundedPrefill
from .config import ModelConfig
from .dense import DenseModel, Layer, swiglu
from .loader import Linear, check_scales, take_linear

PROJS = ("gate_proj", "up_proj", "down_proj")


class Experts:
    """One stacked expert projection [E, out, in], quantized (MLX affine) or not."""

    __slots__ = ("weight", "scales", "biases", "group_size", "bits", "shape")

    def __init__(self, weight, scales=None, biases=None, group_size=None, bits=None, shape=None):
        self.weight, self.scales, self.biases = weight, scales, biases
        self.group_size, self.bits, self.shape = group_size, bits, shape

    @property
    def quantized(self) -> bool:
        return self.scales is not None

    def arrays(self) -> list:
        return [a for a in (self.weight, self.scales, self.biases) if a is not None]

    def gather(self, x, indices, sorted_indices: bool):
        """mlx-lm's (Quantized)SwitchLinear.__call__ (no bias)."""
        if self.quantized:
            return mx.gather_qmm(x, self.weight, self.scales, self.biases, rhs_indices=indices,
                                 transpose=True, group_size=self.group_size, bits=self.bits,
                                 mode="affine", sorted_indices=sorted_indices)
        return _gather_mm(x, self.weight.swapaxes(-1, -2), indices, sorted_indices)

    def gather_dequantized(self, x, indices):
        """The product of gather(x, indices, sorted_indices=True) through MLX's grouped GEMM:
        the stacked experts dequantized to x's dtype (one transient [E, out, in] copy per call),
        then gather_mm over the expert-sorted rows. MLX's CUDA gather_qmm runs a sorted list of
        one-row products as that many one-row GEMMs, each re-reading its expert's weights; its
        gather_mm over sorted rows is one grouped GEMM (docs/benchmarks.md, "Session 11").
        Unquantized experts: gather() itself (already gather_mm)."""
        if not self.quantized:
            return self.gather(x, indices, True)
        w = mx.dequantize(self.weight, self.scales, self.biases, group_size=self.group_size,
                          bits=self.bits, mode="affine", dtype=x.dtype)
        return _gather_mm(x, w.swapaxes(-1, -2), indices, True)

    def weights(self) -> tuple:
        """(weight, scales, biases, group_size, bits): kernels/moe.py's expert weight set."""
        return (self.weight, self.scales, self.biases, self.group_size or 64, self.bits or 0)


def _gather_mm(x, w, indices, sorted_indices: bool):
    """mx.gather_mm(x, w, rhs_indices=indices). MLX's CPU GatherMM is float32-only (mlx-lm itself
    raises there): on the CPU the same op runs in fp32, rounded once to x's dtype; GPU backends
    take mlx-lm's exact call."""
    if x.dtype != mx.float32 and mx.default_device() == mx.cpu:
        return mx.gather_mm(x.astype(mx.float32), w.astype(mx.float32), rhs_indices=indices,
                            sorted_indices=sorted_indices).astype(x.dtype)
    return mx.gather_mm(x, w, rhs_indices=indices, sorted_indices=sorted_indices)


# Quantized experts in a prefill chunk of at least this many (token, expert) pairs go through
# dequantize + gather_mm on the CUDA face (Experts.gather_dequantized). H200, one Qwen3-30B-A3B
# layer (bench/bench_moe_prefill.py): gather_qmm 2.3 / 8.4 / 32.0 ms at 1,024 / 4,096 / 16,384
# pairs, the dequantized path 3.4 / 3.6 / 4.4 ms (its dequantize alone ~2.8 ms). The choice
# depends on the chunk's length only, which the 2,048 grid fixes by position: a resumed prompt
# and a fresh one take the same path for the same chunk.
DEQUANT_MIN_PAIRS = 2048


def dequantized_prefill(pairs: int) -> bool:
    """Whether a prefill chunk with `pairs` routed (token, expert) pairs takes the dequantized
    grouped GEMM. TENSORFOLD_MOE_PREFILL=dequant / gather_qmm forces one path (tests, bench);
    by default: the CUDA face, from DEQUANT_MIN_PAIRS pairs up (elsewhere mlx-lm's gather_qmm,
    bit for bit)."""
    mode = os.environ.get("TENSORFOLD_MOE_PREFILL", "")
    if mode == "dequant":
        return True
    if mode == "gather_qmm":
        return False
    from ..kernels import backend_face
    return pairs >= DEQUANT_MIN_PAIRS and backend_face() == "cuda"


def _stacked(cfg: ModelConfig, w: dict, layer: int, proj: str, suffix: str):
    """The stacked tensor, or the per-expert HF tensors stacked (None when absent)."""
    p = f"model.layers.{layer}.mlp"
    t = w.get(f"{p}.switch_mlp.{proj}.{suffix}")
    if t is not None:
        return t
    parts = [w.get(f"{p}.experts.{e}.{proj}.{suffix}") for e in range(cfg.num_experts)]
    if all(a is None for a in parts):
        return None
    missing = [e for e, a in enumerate(parts) if a is None]
    if missing:
        raise CheckpointError(f"{cfg.path}: {p}.experts.{{e}}.{proj}.{suffix} missing for experts "
                              f"{missing[:8]}{'...' if len(missing) > 8 else ''}")
    if len({(tuple(a.shape), a.dtype) for a in parts}) != 1:
        raise CheckpointError(f"{cfg.path}: {p}.experts.*.{proj}.{suffix} differ in shape or dtype")
    return mx.stack(parts)


def take_experts(cfg: ModelConfig, w: dict, layer: int, proj: str) -> Experts:
    name = f"model.layers.{layer}.mlp.switch_mlp.{proj}"
    E, out_dim, in_dim = cfg.expert_shapes()[name]
    weight = _stacked(cfg, w, layer, proj, "weight")
    if weight is None:
        raise CheckpointError(f"{cfg.path}: missing tensor {name}.weight "
                              f"(or model.layers.{layer}.mlp.experts.{{e}}.{proj}.weight)")
    scales = _stacked(cfg, w, layer, proj, "scales")
    if scales is None:
        if tuple(weight.shape) != (E, out_dim, in_dim):
            raise CheckpointError(f"{cfg.path}: {name}.weight has shape {tuple(weight.shape)}, "
                                  f"expected {(E, out_dim, in_dim)}")
        if weight.dtype not in (mx.bfloat16, mx.float16, mx.float32):
            raise CheckpointError(f"{cfg.path}: {name}.weight has unsupported dtype {weight.dtype}")
        return Experts(weight, shape=(E, out_dim, in_dim))
    q = cfg.quant_of_stored(name, in_dim, weight, scales)
    if q is None:
        raise CheckpointError(f"{cfg.path}: {name} is quantized but config.json has no quantization for it")
    gs, bits = q
    biases = _stacked(cfg, w, layer, proj, "biases")
    want_w = (E, out_dim, in_dim * bits // 32)
    want_s = (E, out_dim, in_dim // gs)
    if weight.dtype != mx.uint32 or tuple(weight.shape) != want_w or tuple(scales.shape) != want_s \
            or biases is None or tuple(biases.shape) != want_s:
        raise CheckpointError(
            f"{cfg.path}: {name} does not match {bits}-bit group-{gs} quantization of {E} experts "
            f"{out_dim}x{in_dim} (weight {tuple(weight.shape)} {weight.dtype}, scales "
            f"{tuple(scales.shape) if scales is not None else None})")
    check_scales(cfg, name, scales, biases)
    return Experts(weight, scales, biases, group_size=gs, bits=bits, shape=(E, out_dim, in_dim))


class MoEBlock:
    def __init__(self, cfg: ModelConfig, w: dict, i: int):
        self.router = take_linear(cfg, w, f"model.layers.{i}.mlp.gate")
        self.gate, self.up, self.down = (take_experts(cfg, w, i, p) for p in PROJS)
        # whether the dequantized prefill path applies (it makes a transient bf16 copy per projection)
        self.quantized = self.gate.quantized or self.up.quantized or self.down.quantized


# ---- mlx-lm's SwitchGLU helpers (switch_layers.py), same ops ---------------------------------

def _gather_sort(x, indices):
    *_, M = indices.shape
    indices = indices.flatten()
    order = mx.argsort(indices)
    inv_order = mx.argsort(order)
    return x.flatten(0, -3)[order // M], indices[order], inv_order


def _scatter_unsort(x, inv_order, shape=None):
    x = x[inv_order]
    if shape is not None:
        x = mx.unflatten(x, 0, shape)
    return x


class MoEModel(BoundedPrefill, DenseModel):
    """qwen3_moe with DenseModel's interface (cfg, dtype, new_cache, forward, parameters)."""

    def _make_layer(self, cfg: ModelConfig, weights: dict, i: int) -> Layer:
        if not cfg.moe_layer(i):
            return Layer(cfg, weights, i)
        ly = Layer(cfg, weights, i, dense_mlp=False)
        ly.moe = MoEBlock(cfg, weights, i)
        return ly

    def _linears(self) -> list[Linear]:
        lins = super()._linears()
        return lins + [ly.moe.router for ly in self.layers if getattr(ly, "moe", None) is not None]

    def _stream_arrays(self, ly) -> list[mx.array]:
        out = super()._stream_arrays(ly)
        m = getattr(ly, "moe", None)
        for e in (m.gate, m.up, m.down) if m is not None else ():
            out += [e.scales, e.biases] if e.quantized else [e.weight]
        return out

    def parameters(self) -> list[mx.array]:
        out = super().parameters()
        for ly in self.layers:
            m = getattr(ly, "moe", None)
            if m is not None:
                for e in (m.gate, m.up, m.down):
                    out += e.arrays()
        return out

    # ---- the MLP of a layer ----------------------------------------------------------------
    def _mlp(self, ly: Layer, x, exact: bool, residual=None):
        m = getattr(ly, "moe", None)
        if m is None:
            return super()._mlp(ly, x, exact, residual)
        if exact:
            return self._moe_exact(m, x, residual)
        y = self._moe_prefill(m, x)
        return y if residual is None else residual + y

    def _moe_prefill(self, m: MoEBlock, x):
        """mlx-lm's Qwen3MoeSparseMoeBlock.__call__ + SwitchGLU.__call__, op for op, except that
        where `dequantized_prefill` says so the quantized experts' products go through
        Experts.gather_dequantized (same routing, sort and combination; products equal within
        bf16 rounding, not bit for bit)."""
        k = self.cfg.num_experts_per_tok
        gates = m.router(x)
        gates = mx.softmax(gates, axis=-1, precise=True)
        inds = mx.argpartition(gates, kth=-k, axis=-1)[..., -k:]
        scores = mx.take_along_axis(gates, inds, axis=-1)
        if self.cfg.norm_topk_prob:
            scores = scores / mx.sum(scores, axis=-1, keepdims=True)
        xe = mx.expand_dims(x, (-2, -3))
        do_sort = inds.size >= 64
        idx, inv_order = inds, None
        if do_sort:
            xe, idx, inv_order = _gather_sort(xe, inds)
        if do_sort and m.quantized and dequantized_prefill(inds.size):
            x_up = m.up.gather_dequantized(xe, idx)
            self._piece_done([x_up])        # each projection a piece of the LayerQueue
            x_gate = m.gate.gather_dequantized(xe, idx)
            self._piece_done([x_gate])
            y = m.down.gather_dequantized(swiglu(x_gate, x_up), idx)
            self._piece_done([y])
        else:
            x_up = m.up.gather(xe, idx, do_sort)
            x_gate = m.gate.gather(xe, idx, do_sort)
            y = m.down.gather(swiglu(x_gate, x_up), idx, do_sort)
        if do_sort:
            y = _scatter_unsort(y, inv_order, inds.shape)
        y = y.squeeze(-2)
        return (y * scores[..., None]).sum(axis=-2).astype(y.dtype)

    def _moe_exact(self, m: MoEBlock, x, residual=None):
        """Row-exact routed MLP (kernels/moe.py): the router's fp32 logits (a row-exact matmul),
        route_glu (softmax, deterministic top-k, then gate, up and SwiGLU of the chosen experts)
        and expert_sum (down, the fp32 score-weighted sum in rank order, the residual): three
        kernels on CUDA."""
        from ..kernels import moe as kmoe
        k = self.cfg.num_experts_per_tok
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])                                   # [R, D]
        r = m.router                 # no bias (take_linear without one)
        logits = kmoe.router_logits(x2, (r.weight, r.scales, r.biases, r.group_size, r.bits))
        h, inds, scores = kmoe.route_glu(x2, logits, m.gate.weights(), m.up.weights(), k,
                                         self.cfg.norm_topk_prob)       # h [R, k, F]
        res = None if residual is None else residual.reshape(x2.shape)
        return kmoe.expert_sum(h, m.down.weights(), inds, scores, res).reshape(shape)
