"""DeepSeek V3.2 family (``deepseek_v32``): MLA attention with the lightning indexer's sparse
key selection (DSA), group-limited sigmoid MoE (routed + shared experts), dense first layers.
Weights and math follow mlx-lm 0.32.2's deepseek_v32.py.

- Weights: mlx-lm's layout (``self_attn.embed_q`` / ``unembed_out`` per-head [H, out, in]
  weights, stacked experts ``mlp.switch_mlp.*``; MLX affine quantization as mlx-lm's
  nn.quantize writes it) or the Hugging Face layout (``self_attn.kv_b_proj`` split per head
  and per-expert ``mlp.experts.{e}.*`` stacked at load, as mlx-lm's sanitize does). FP8
  (``weight_scale_inv``) checkpoints are refused with a CheckpointError.
- RoPE: default, linear, or yarn / deepseek_yarn as mlx-lm's initialize_rope builds YarnRoPE
  (`make_dsa_rope`; DeepSeek-V3.2's config.json has type "yarn", factor 40).
- KV cache (models/kv.py, one KV head): per layer ``keys`` hold the MLA latent and the rotary
  key concatenated ([kv_lora_rank + qk_rope_head_dim], what the absorbed attention reads) and
  ``values`` hold the indexer's keys ([index_head_dim]); both go through snapshot / restore
  and the disk format (``k.{i}`` / ``v.{i}``) unchanged.
- Prefill (`exact=False`): mlx-lm's ops while a chunk sees at most ``index_topk`` keys
  (``kernels.use_sparse(chunk_end, topk)`` false: the same bits as mlx-lm). Once it is true,
  the indexer's scores are mlx-lm's ops taken head by head over blocks of INDEX_ROWS rows (so a
  chunk's transient memory is rows x keys, not index heads x chunk rows x keys; session 50),
  the selection is ``kernels.select_topk`` (ties to
  the lower position; mlx-lm's argpartition leaves ties unspecified) and attention is
  ``kernels.sparse_attention`` over the selected latent keys (absorbed form: q = [embed_q(q_nope)
  | q_pe] against [latent | k_pe]), never an L x S mask: fp32 softmax, so logits differ
  from mlx-lm's masked bf16 sdpa within rounding (tests/test_dsa.py states the tolerance).
- Each prefill layer's outputs (hidden state and its cache writes: latent + rotary keys and
  the indexer's keys) go to a native ``LayerQueue(2)``, as in models/moe.py: at most two layers
  are queued ahead of the device; the logits are the same bits as without it.
- Decode (`exact=True`): row-exact throughout: every Linear / per-head MultiLinear through
  the row matmuls, indexer scores per head through ``row_matmul`` summed in a fixed order,
  ``select_topk``, ``sparse_attention`` (or ``row_attention`` while ``use_sparse`` is false:
  the same bits, see docs/kernels.md), fp32 router (sigmoid + correction bias, group-limited,
  deterministic top-k), kernels/moe.py's ``expert_glu`` and ``expert_sum`` for the routed experts.
"""

from __future__ import annotations

import math

import mlx.core as mx

from ..errors import CheckpointError
from .bounded import BoundedPrefill
from .config import ModelConfig
from .dense import DenseModel, _out, rope_of, swiglu
from .kv import KVCache
from .loader import Linear, fuse_linears, take_linear, take_vector
from ..kernels.moe import topk_deterministic
from .moe import PROJS, _gather_sort, _scatter_unsort, take_experts


class MultiLinear:
    """mlx-lm's (Quantized)MultiLinear: a per-head weight [H, out, in]."""

    __slots__ = ("weight", "scales", "biases", "group_size", "bits")

    def __init__(self, weight, scales=None, biases=None, group_size=None, bits=None):
        self.weight, self.scales, self.biases = weight, scales, biases
        self.group_size, self.bits = group_size, bits

    @property
    def quantized(self) -> bool:
        return self.scales is not None

    def arrays(self) -> list:
        return [a for a in (self.weight, self.scales, self.biases) if a is not None]

    def __call__(self, x, transpose: bool = True):
        if self.quantized:
            return mx.quantized_matmul(x, self.weight, scales=self.scales, biases=self.biases,
                                       transpose=transpose, group_size=self.group_size,
                                       bits=self.bits, mode="affine")
        return x @ self.weight.swapaxes(-1, -2) if transpose else x @ self.weight

    def exact(self, x):
        """Row-exact ``self(x)`` (transpose=True) for x [B, H, M, in], head by head."""
        from .. import kernels
        outs = []
        for h in range(self.weight.shape[0]):
            xh = mx.contiguous(x[:, h])
            if self.quantized:
                outs.append(kernels.row_quantized_matmul(xh, self.weight[h], self.scales[h],
                                                         self.biases[h], self.group_size, self.bits))
            else:
                outs.append(kernels.row_matmul(xh, self.weight[h]))
        return mx.stack(outs, axis=1)


def _take_multilinear(cfg: ModelConfig, w: dict, name: str, shape) -> MultiLinear:
    H, out_dim, in_dim = shape
    weight, scales, biases = w.get(f"{name}.weight"), w.get(f"{name}.scales"), w.get(f"{name}.biases")
    if weight is None:
        raise CheckpointError(f"{cfg.path}: missing tensor {name}.weight")
    if scales is None:
        if tuple(weight.shape) != shape:
            raise CheckpointError(f"{cfg.path}: {name}.weight has shape {tuple(weight.shape)}, expected {shape}")
        if weight.dtype not in (mx.bfloat16, mx.float16, mx.float32):
            raise CheckpointError(f"{cfg.path}: {name}.weight has unsupported dtype {weight.dtype}")
        return MultiLinear(weight)
    q = cfg.quant_of_stored(name, in_dim, weight, scales)
    if q is None:
        raise CheckpointError(f"{cfg.path}: {name} is quantized but config.json has no quantization for it")
    gs, bits = q
    want_w, want_s = (H, out_dim, in_dim * bits // 32), (H, out_dim, in_dim // gs)
    if weight.dtype != mx.uint32 or tuple(weight.shape) != want_w or tuple(scales.shape) != want_s \
            or biases is None or tuple(biases.shape) != want_s:
        raise CheckpointError(f"{cfg.path}: {name} does not match {bits}-bit group-{gs} quantization of "
                              f"{H} heads {out_dim}x{in_dim} (weight {tuple(weight.shape)} {weight.dtype})")
    return MultiLinear(weight, scales, biases, gs, bits)


def _split_kv_b(cfg: ModelConfig, w: dict, layer: int) -> None:
    """Hugging Face ``kv_b_proj`` -> mlx-lm's ``embed_q`` / ``unembed_out`` (its sanitize, op for op)."""
    p = f"model.layers.{layer}.self_attn"
    if f"{p}.kv_b_proj.weight" not in w or f"{p}.embed_q.weight" in w:
        return
    v = w.pop(f"{p}.kv_b_proj.weight")
    quantized = f"{p}.kv_b_proj.scales" in w
    if quantized:
        dims = cfg.kv_lora_rank
        scales, biases = w.pop(f"{p}.kv_b_proj.scales"), w.pop(f"{p}.kv_b_proj.biases", None)
        if biases is None:
            raise CheckpointError(f"{cfg.path}: {p}.kv_b_proj.biases missing")
        bits = (v.shape[-1] * 32) // dims
        group_size = dims // scales.shape[-1]
        v = mx.dequantize(v, scales, biases, bits=bits, group_size=group_size)
    want = (cfg.num_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)
    if tuple(v.shape) != want:
        raise CheckpointError(f"{cfg.path}: {p}.kv_b_proj.weight has shape {tuple(v.shape)}, expected {want}")
    v = v.reshape(cfg.num_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, -1)
    wk = mx.contiguous(v[:, : cfg.qk_nope_head_dim, :].swapaxes(-1, -2))
    wv = mx.contiguous(v[:, cfg.qk_nope_head_dim:, :])
    if quantized:
        wk, wks, wkb = mx.quantize(wk, bits=bits, group_size=group_size)
        wv, wvs, wvb = mx.quantize(wv, bits=bits, group_size=group_size)
        w[f"{p}.embed_q.scales"], w[f"{p}.embed_q.biases"] = wks, wkb
        w[f"{p}.unembed_out.scales"], w[f"{p}.unembed_out.biases"] = wvs, wvb
    w[f"{p}.embed_q.weight"], w[f"{p}.unembed_out.weight"] = wk, wv


@mx.compile
def group_expert_select(gates, e_score_correction_bias, top_k, n_group, topk_group,
                        routed_scaling_factor, norm_topk_prob):
    """mlx-lm's deepseek_v32.group_expert_select, op for op (compiled as there)."""
    scores = mx.sigmoid(gates.astype(mx.float32))
    orig_scores = scores
    scores = scores + e_score_correction_bias
    if n_group > 1:
        scores = mx.unflatten(scores, axis=-1, shape=(n_group, -1))
        group_scores = mx.topk(scores, 2, axis=-1).sum(axis=-1, keepdims=True)
        k = n_group - topk_group
        group_idx = mx.argpartition(group_scores, kth=k - 1, axis=-2)[..., :k, :]
        scores = mx.put_along_axis(scores, mx.stop_gradient(group_idx), mx.array(0.0), axis=-2)
        scores = mx.flatten(scores, -2, -1)
    k = top_k
    inds = mx.argpartition(-scores, kth=k - 1, axis=-1)[..., :k]
    inds = mx.stop_gradient(inds)
    scores = mx.take_along_axis(orig_scores, inds, axis=-1)
    if top_k > 1 and norm_topk_prob:
        denominator = scores.sum(axis=-1, keepdims=True)
        scores = scores / denominator
    scores = scores * routed_scaling_factor
    return inds, scores


def causal_mask(N: int, offset: int) -> mx.array:
    """mlx-lm's create_causal_mask(N, offset) (bool [N, offset + N])."""
    rinds = mx.arange(offset + N)
    linds = mx.arange(offset, offset + N) if offset else rinds
    return linds[:, None] >= rinds[None]


def make_dsa_rope(cfg: ModelConfig, traditional: bool):
    """RoPE over the first qk_rope_head_dim features as mlx-lm's initialize_rope builds it for
    deepseek_v32: nn.RoPE (default / linear) or YarnRoPE (yarn / deepseek_yarn: the input
    scaled by mscale / mscale_all_dim's ratio, then custom frequencies)."""
    return rope_of(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling, traditional)


class DSALayer:
    def __init__(self, cfg: ModelConfig, w: dict, i: int):
        p = f"model.layers.{i}"
        a = f"{p}.self_attn"
        d = cfg.hidden_size
        if cfg.attention_bias:
            raise CheckpointError(f"{cfg.path}: deepseek_v32 with attention_bias is not supported")
        self.q_a = take_linear(cfg, w, f"{a}.q_a_proj")
        self.q_a_norm = take_vector(cfg, w, f"{a}.q_a_layernorm.weight", cfg.q_lora_rank)
        self.q_b = take_linear(cfg, w, f"{a}.q_b_proj")
        self.kv_a = take_linear(cfg, w, f"{a}.kv_a_proj_with_mqa")
        self.kv_a_norm = take_vector(cfg, w, f"{a}.kv_a_layernorm.weight", cfg.kv_lora_rank)
        _split_kv_b(cfg, w, i)
        ml = cfg.multilinear_shapes()
        self.embed_q = _take_multilinear(cfg, w, f"{a}.embed_q", ml[f"{a}.embed_q"])
        self.unembed_out = _take_multilinear(cfg, w, f"{a}.unembed_out", ml[f"{a}.unembed_out"])
        self.o = take_linear(cfg, w, f"{a}.o_proj")
        self.wq_b = take_linear(cfg, w, f"{a}.indexer.wq_b")
        self.wk = take_linear(cfg, w, f"{a}.indexer.wk")
        self.k_norm_w = take_vector(cfg, w, f"{a}.indexer.k_norm.weight", cfg.index_head_dim)
        self.k_norm_b = take_vector(cfg, w, f"{a}.indexer.k_norm.bias", cfg.index_head_dim)
        self.weights_proj = take_linear(cfg, w, f"{a}.indexer.weights_proj")
        self.in_norm = take_vector(cfg, w, f"{p}.input_layernorm.weight", d)
        self.post_norm = take_vector(cfg, w, f"{p}.post_attention_layernorm.weight", d)
        self.q_norm = self.k_norm = None
        self.gate = self.up = self.down = self.gate_up = None
        self.router = self.router_bias = self.router32 = None
        self.experts = None
        self.shared = None
        if not cfg.moe_layer(i):
            self.gate = take_linear(cfg, w, f"{p}.mlp.gate_proj")
            self.up = take_linear(cfg, w, f"{p}.mlp.up_proj")
            self.down = take_linear(cfg, w, f"{p}.mlp.down_proj")
            self.gate_up = fuse_linears(w, [f"{p}.mlp.gate_proj", f"{p}.mlp.up_proj"], [self.gate, self.up])
            return
        if f"{p}.mlp.gate.scales" in w:
            raise CheckpointError(f"{cfg.path}: {p}.mlp.gate is quantized (mlx-lm keeps the "
                                  "deepseek_v32 router in float)")
        self.router = take_linear(cfg, w, f"{p}.mlp.gate")
        self.router_bias = take_vector(cfg, w, f"{p}.mlp.gate.e_score_correction_bias", cfg.num_experts)
        self.router32 = self.router.weight.astype(mx.float32)
        self.experts = tuple(take_experts(cfg, w, i, proj) for proj in PROJS)   # gate, up, down
        if cfg.n_shared_experts:
            s = f"{p}.mlp.shared_experts"
            self.shared = tuple(take_linear(cfg, w, f"{s}.{proj}") for proj in PROJS)
        elif any(k.startswith(f"{p}.mlp.shared_experts.") for k in w):
            raise CheckpointError(f"{cfg.path}: {p}.mlp.shared_experts is stored but config.json's "
                                  "n_shared_experts is 0 or null (its output would be dropped)")

    def linears(self) -> list[Linear]:
        out = [self.q_a, self.q_b, self.kv_a, self.o, self.wq_b, self.wk, self.weights_proj]
        out += [t for t in (self.gate, self.up, self.down, self.router) if t is not None]
        return out + list(self.shared or ())


class DSAModel(BoundedPrefill, DenseModel):
    """deepseek_v32 with DenseModel's interface (cfg, dtype, new_cache, forward, parameters)."""

    compiled_decode = False     # the exact attention reads the offset on the host (dense vs sparse)

    def __init__(self, cfg: ModelConfig, weights: dict):
        if any(k.endswith("weight_scale_inv") for k in weights):
            raise CheckpointError(f"{cfg.path}: FP8 (weight_scale_inv) checkpoints are not supported; "
                                  "convert with mlx-lm first")
        weights = weights.copy()   # kv_b_proj is split in place (a TrackedWeights copy shares its record)
        super().__init__(cfg, weights)
        sc = cfg.rope_scaling
        self.rope = make_dsa_rope(cfg, traditional=True)
        self.irope = make_dsa_rope(cfg, traditional=cfg.indexer_rope_interleave)
        self.scale = cfg.head_dim ** -0.5
        mscale_all_dim = (sc or {}).get("mscale_all_dim", 0)
        if mscale_all_dim and sc["factor"] > 1:
            s = 0.1 * mscale_all_dim * math.log(sc["factor"]) + 1.0
            self.scale = self.scale * s * s

    def _make_layer(self, cfg: ModelConfig, weights: dict, i: int) -> DSALayer:
        return DSALayer(cfg, weights, i)

    def new_cache(self) -> KVCache:
        c = self.cfg
        return KVCache(c.num_layers, 1, c.kv_lora_rank + c.qk_rope_head_dim, self.dtype,
                       value_dim=c.index_head_dim)

    def _layer_linears(self, ly: DSALayer) -> list[Linear]:
        return ly.linears()

    def _stream_arrays(self, ly: DSALayer) -> list[mx.array]:
        # deepseek_v32 keeps the embedding's dtype: its float32 router biases (and an indexer's
        # float32 parts, where a checkpoint has them) do not reach the residual stream's dtype
        return []

    def _layer_arrays(self, ly: DSALayer) -> list[mx.array]:
        out = [ly.in_norm, ly.post_norm, ly.q_a_norm, ly.kv_a_norm, ly.k_norm_w, ly.k_norm_b]
        out += ly.embed_q.arrays() + ly.unembed_out.arrays()
        if ly.experts is not None:
            out.append(ly.router_bias)
            for e in ly.experts:
                out += e.arrays()
        return out

    # ---- attention -------------------------------------------------------------------------
    # A sparse prefill chunk's rows are indexed and attended INDEX_ROWS at a time (blocks at fixed
    # offsets from the chunk's start, so fresh and resumed prompts cut them alike), each block's
    # scores summed head by head: its transient memory is ~INDEX_ROWS x keys (scores and
    # select_topk's sort keys), not index heads x chunk rows x keys (mlx-lm's [Hi, L, S], ~0.3 GiB
    # per 1k prompt tokens for DeepSeek-V3.2's 64 heads and 2,048-row chunks).
    INDEX_ROWS = 128

    def _index_q(self, ly: DSALayer, x, qr, off: int, exact: bool):
        """The indexer's queries [B, Hi, L, hd] (RoPE'd at off..) and head weights [B, L, Hi]."""
        B, L, _ = x.shape
        Hi, hd = self.cfg.index_n_heads, self.cfg.index_head_dim
        lin = Linear.exact if exact else Linear.__call__
        q = lin(ly.wq_b, qr).reshape(B, L, Hi, hd).swapaxes(1, 2)
        q = self.irope(q, off)
        wscale = Hi ** -0.5 * hd ** -0.5
        return q, lin(ly.weights_proj, x) * wscale

    def _sparse_rows(self, ly: DSALayer, x, qr, qa, kb, ib, off: int):
        """Prefill (not exact) of a chunk past top-k: the rows' selected keys and their sparse
        attention, INDEX_ROWS rows at a time. Each head's scores are mlx-lm's ops on that head
        (relu(q_h k^T) * w_h, summed over heads in order as mlx-lm sums them); a row's selection and
        attention depend on its own scores only (select_topk and sparse_attention are per row)."""
        from .. import kernels
        B, L, _ = x.shape
        q, weights = self._index_q(ly, x, qr, off, False)
        parts = []
        for r0 in range(0, L, self.INDEX_ROWS):
            r1 = min(L, r0 + self.INDEX_ROWS)
            k = ib[..., :off + r1, :]                       # the keys these rows can see
            qb, wb = q[:, :, r0:r1], weights[:, r0:r1]
            heads = (mx.maximum(qb[:, h:h + 1] @ k.swapaxes(-1, -2), 0) * wb[..., h:h + 1][:, None]
                     for h in range(q.shape[1]))
            scores = sum(heads)[:, 0]                       # [B, rows, off + r1]
            sel = kernels.select_topk(scores, self.cfg.index_topk, off + r0)
            parts.append(kernels.sparse_attention(qa[:, :, r0:r1], kb, kb, sel, off + r0, self.scale))
            mx.eval(parts[-1])         # one block's transients at a time
        return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=2)

    def _index_scores(self, ly: DSALayer, x, qr, ib, off: int):
        """The indexer's scores [B, L, S] over keys 0..off+L-1 for an exact (decode / verify)
        call: row-exact products, heads summed in a fixed order. Prefill chunks: _sparse_rows."""
        from .. import kernels
        L = x.shape[1]
        S = off + L
        q, weights = self._index_q(ly, x, qr, off, True)                   # weights [B, L, Hi]
        keys = mx.contiguous(ib[0, 0, :S, :])                              # [S, hd]
        scores = None
        for h in range(self.cfg.index_n_heads):                            # fixed order
            s = mx.maximum(kernels.row_matmul(mx.contiguous(q[:, h]), keys), 0)
            s = s * weights[..., h:h + 1]
            scores = s if scores is None else scores + s
        return scores

    def _attention(self, ly: DSALayer, i: int, x, cache: KVCache, exact: bool, residual=None):
        from .. import kernels
        cfg = self.cfg
        B, L, _ = x.shape
        H, nope, rd, kvr = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
        lin = Linear.exact if exact else Linear.__call__
        off = cache.offset
        S = off + L
        qr = mx.fast.rms_norm(lin(ly.q_a, x), ly.q_a_norm, 1e-6)
        q = lin(ly.q_b, qr).reshape(B, L, H, nope + rd).transpose(0, 2, 1, 3)
        q_nope, q_pe = mx.split(q, [nope], axis=-1)
        ckv = lin(ly.kv_a, x)
        ckv, k_pe = mx.split(ckv, [kvr], axis=-1)
        k_pe = k_pe.reshape(B, L, 1, rd).transpose(0, 2, 1, 3)
        kv_latent = mx.fast.rms_norm(ckv, ly.kv_a_norm, 1e-6)
        q_pe = self.rope(q_pe, off)
        k_pe = self.rope(k_pe, off)
        kv_latent = mx.expand_dims(kv_latent, axis=1)
        # the indexer's keys (cached as this layer's "values")
        ik = mx.fast.layer_norm(lin(ly.wk, x), ly.k_norm_w, ly.k_norm_b, 1e-5)
        ik = self.irope(mx.reshape(ik, (B, 1, L, cfg.index_head_dim)), off)
        kb, ib = cache.write(i, mx.concatenate([kv_latent, k_pe], axis=-1), ik)
        sparse = kernels.use_sparse(S, cfg.index_topk)

        if exact or sparse:
            emb = ly.embed_q.exact if exact else ly.embed_q
            qa = mx.concatenate([emb(q_nope), q_pe], axis=-1)             # [B, H, L, kvr + rd]
            # rows 0..b-1 attend densely, rows b.. sparsely. The exact path decides per row
            # (use_sparse(p + 1) for the row at position p), so a verify window that crosses
            # top-k gives each row the kernel its one-row decode step uses: on CUDA the two
            # kernels' bits differ. Prefill chunks (not exact) decide per chunk, as mlx-lm does.
            b = min(L, max(0, cfg.index_topk - off)) if exact else (0 if sparse else L)
            parts = []
            if b > 0:
                parts.append(kernels.row_attention(qa[:, :, :b], kb, kb, off, self.scale))
            if not exact and b == 0:
                parts.append(self._sparse_rows(ly, x, qr, qa, kb, ib, off))
            elif b < L:
                sel = kernels.select_topk(self._index_scores(ly, x, qr, ib, off), cfg.index_topk, off)
                parts.append(kernels.sparse_attention(qa[:, :, b:], kb, kb, sel[:, b:], off + b,
                                                      self.scale))
            o = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=2)
            o = o[..., :kvr]
            o = ly.unembed_out.exact(o) if exact else ly.unembed_out(o)
        else:   # mlx-lm's dense path, op for op
            # on operands laid out as mlx-lm's: its cache keeps the latent and the rope keys in two
            # buffers; ours keeps them side by side in one. As a strided slice of that row (leading
            # dimension kvr + rd, at column kvr) the rope keys gave MLX's CUDA float32 q_pe @ k_pe.T
            # other bits than a contiguous copy (session 47, H200, bench/mlx_strided_matmul_probe.py;
            # the latent's products were the same there, copied too so that no layout differs)
            lat, kpe = mx.contiguous(kb[..., :S, :kvr]), mx.contiguous(kb[..., :S, kvr:])
            pe_scores = (q_pe * self.scale) @ kpe.swapaxes(-1, -2)
            if L > 1:
                pe_scores = mx.where(causal_mask(L, off), pe_scores,
                                     mx.array(mx.finfo(pe_scores.dtype).min, pe_scores.dtype))
                k, v = ly.embed_q(lat, transpose=False), ly.unembed_out(lat)
                o = mx.fast.scaled_dot_product_attention(q_nope, k, v, scale=self.scale, mask=pe_scores)
            else:
                o = mx.fast.scaled_dot_product_attention(ly.embed_q(q_nope), lat, lat,
                                                         scale=self.scale, mask=pe_scores)
                o = ly.unembed_out(o)
        o = o.transpose(0, 2, 1, 3).reshape(B, L, -1)
        return _out(ly.o, o, exact, residual)

    # ---- MLP ---------------------------------------------------------------------------------
    def _mlp(self, ly: DSALayer, x, exact: bool, residual=None):
        if ly.experts is None:
            return super()._mlp(ly, x, exact, residual)
        y = self._moe_exact(ly, x) if exact else self._moe_prefill(ly, x)
        if ly.shared is not None:
            lin = Linear.exact if exact else Linear.__call__
            g, u, d = ly.shared
            y = y + lin(d, swiglu(lin(g, x), lin(u, x)))
        return y if residual is None else residual + y

    def _moe_prefill(self, ly: DSALayer, x):
        """mlx-lm's DeepseekV32MoE (gate + SwitchGLU), op for op."""
        c = self.cfg
        inds, scores = group_expert_select(x @ ly.router.weight.T, ly.router_bias, c.num_experts_per_tok,
                                           c.n_group, c.topk_group, c.routed_scaling_factor,
                                           c.norm_topk_prob)
        gate, up, down = ly.experts
        xe = mx.expand_dims(x, (-2, -3))
        do_sort = inds.size >= 64
        idx, inv_order = inds, None
        if do_sort:
            xe, idx, inv_order = _gather_sort(xe, inds)
        x_up = up.gather(xe, idx, do_sort)
        x_gate = gate.gather(xe, idx, do_sort)
        y = down.gather(swiglu(x_gate, x_up), idx, do_sort)
        if do_sort:
            y = _scatter_unsort(y, inv_order, inds.shape)
        y = y.squeeze(-2)
        return (y * scores[..., None]).sum(axis=-2).astype(y.dtype)

    def _moe_exact(self, ly: DSALayer, x):
        """Row-exact: fp32 router (sigmoid + correction bias, group limit, deterministic top-k,
        ties to the lower id), then kernels/moe.py's expert_glu and expert_sum (the experts' fp32
        combination in rank order)."""
        from .. import kernels
        from ..kernels import moe as kmoe
        c = self.cfg
        k, E = c.num_experts_per_tok, c.num_experts
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        R = x2.shape[0]
        orig = mx.sigmoid(kernels.row_matmul(x2.astype(mx.float32), ly.router32))   # [R, E]
        scores = orig + ly.router_bias.astype(mx.float32)
        if c.n_group > 1:
            g = scores.reshape(R, c.n_group, E // c.n_group)
            srt = mx.sort(g, axis=-1)
            gscore = srt[..., -1] + srt[..., -2]                                      # [R, G]
            keep = topk_deterministic(gscore, c.topk_group)                         # [R, tg]
            kept = (mx.expand_dims(keep, -1) == mx.arange(c.n_group, dtype=mx.int32)).any(axis=-2)
            scores = mx.where(mx.expand_dims(kept, -1), g, mx.array(0.0, mx.float32)).reshape(R, E)
        inds = topk_deterministic(scores, k)
        sc = mx.take_along_axis(orig, inds, axis=-1)
        if k > 1 and c.norm_topk_prob:
            sc = sc / sc.sum(axis=-1, keepdims=True)
        sc = sc * c.routed_scaling_factor
        gate, up, down = ly.experts
        h = kmoe.expert_glu(x2, gate.weights(), up.weights(), inds)              # [R, k, F]
        return kmoe.expert_sum(h, down.weights(), inds, sc).reshape(shape)
