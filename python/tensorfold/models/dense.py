"""Dense decoder family: llama, qwen2 (qkv bias), qwen3 (q/k RMSNorm). One module, two paths.

- Prefill (`exact=False`): MLX's own ops, as mlx-lm's llama/qwen2/qwen3 compute them
  (quantized_matmul / matmul, fast.rms_norm, fast.rope, fast.scaled_dot_product_attention).
- Decode (`exact=True`): every matmul (LM head included) and the attention go through the
  row-exact kernels; norms, RoPE and elementwise ops are per-row by construction. Row i's bits
  then do not depend on how many rows share the call — what makes drafted == serial.
  Every exact forward that returns all logits runs one `mx.compile`d step (`_exact_step`):
  traced once per (rows, KV capacity), then replayed without Python building the graph. The
  offset reaches the step as an array (RoPE, cache writes and the attention take it at run
  time), so one trace serves every position. Serial steps and verify calls all go through
  the same path: one code path for every M (`compiled_decode` says where and why).
"""

from __future__ import annotations

import functools
import math
import os
from functools import partial

import mlx.core as mx

from .. import kernels
from .config import YARN_TYPES, ModelConfig, rope_type_of
from .kv import KVCache
from .loader import Linear, fuse_linears, take_linear, take_vector

_DTYPES = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}


@partial(mx.compile, shapeless=True)
def swiglu(gate, up):
    return gate * mx.sigmoid(gate) * up


def _out(lin: Linear, x, exact: bool, residual=None):
    """An output projection plus the residual (h + f(h), as mlx-lm adds it): the exact path
    passes the residual to the row-exact kernel (fused into its store on CUDA)."""
    if exact:
        return lin.exact(x, residual)
    y = lin(x)
    return y if residual is None else residual + y


def _llama3_freqs(cfg: ModelConfig):
    dims, base, sc = cfg.head_dim, cfg.rope_theta, cfg.rope_scaling
    factor = sc["factor"]
    low, high = sc.get("low_freq_factor", 1.0), sc.get("high_freq_factor", 4.0)
    old = sc.get("original_max_position_embeddings", 8192)
    low_wl, high_wl = old / low, old / high
    freqs = base ** (mx.arange(0, dims, 2) / dims)
    wavelens = 2 * mx.pi * freqs
    freqs = mx.where(wavelens > low_wl, freqs * factor, freqs)
    medium = (wavelens > high_wl) & (wavelens < low_wl)
    smooth = (old / wavelens - low) / (high - low)
    return mx.where(medium, freqs / ((1 - smooth) / factor + smooth), freqs)


def yarn_freqs(dims: int, base: float, sc: dict):
    """mlx-lm's YarnRoPE (rope_utils.py) constants, op for op: (input mscale, freqs [dims // 2])."""
    factor = sc["factor"]
    orig = sc.get("original_max_position_embeddings", 4096)
    beta_fast, beta_slow = sc.get("beta_fast", 32), sc.get("beta_slow", 1)
    mscale, mscale_all_dim = sc.get("mscale", 1), sc.get("mscale_all_dim", 0)

    def correction_dim(num_rotations):
        return (dims * math.log(orig / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    def get_mscale(scale=1, m=1):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dims - 1)
    if low == high:
        high += 0.001
    ramp = mx.clip((mx.arange(dims // 2, dtype=mx.float32) - low) / (high - low), 0, 1)
    freq_extra = base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)
    freq_inter = factor * freq_extra
    freq_mask = 1.0 - ramp
    freqs = (freq_inter * freq_extra) / (freq_inter * freq_mask + freq_extra * (1 - freq_mask))
    return get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim), freqs


def _rope_type(cfg: ModelConfig) -> str:
    return rope_type_of(cfg.rope_scaling)


def rope_inv_freq(cfg: ModelConfig):
    """(inverse frequencies [head_dim / 2] float32, position scale) of make_rope's RoPE, for the
    fused decode kernel (kernels.fused_qk_norm_rope): theta_i = (pos * scale) * inv_freq[i]. None
    where that kernel cannot give it: interleaved pairs (rope_traditional; it rotates split
    halves) and yarn (YarnRoPE scales its input too)."""
    dims, base, sc = cfg.head_dim, cfg.rope_theta, cfg.rope_scaling
    if cfg.rope_traditional or _rope_type(cfg) in YARN_TYPES:
        return None
    if _rope_type(cfg) == "llama3":
        inv = 1.0 / _llama3_freqs(cfg).astype(mx.float32)
        scale = 1.0
    else:
        inv = mx.array([base ** (-i / dims) for i in range(0, dims, 2)], dtype=mx.float32)
        scale = 1.0 / sc["factor"] if _rope_type(cfg) == "linear" else 1.0
    mx.eval(inv)
    return inv, scale


def rope_of(dims: int, base: float, sc: dict | None, traditional: bool, llama3_freqs=None):
    """RoPE over the first `dims` features exactly as mlx-lm's initialize_rope builds it: nn.RoPE
    (default, linear), Llama3RoPE (its freqs given) or YarnRoPE (the input scaled by the mscale
    ratio, then custom frequencies). Returns f(x, offset). Shared by every family (dsa.py)."""
    rtype = rope_type_of(sc)
    if rtype in YARN_TYPES:
        ms, freqs = yarn_freqs(dims, base, sc)
        mx.eval(freqs)

        def rope(x, offset):
            if ms != 1.0:
                x = x.at[..., :dims].multiply(ms)
            return mx.fast.rope(x, dims, traditional=traditional, base=None, scale=1.0, offset=offset,
                                freqs=freqs)
        return rope
    if rtype == "llama3":
        return lambda x, offset: mx.fast.rope(x, dims, traditional=traditional, base=None, scale=1.0,
                                              offset=offset, freqs=llama3_freqs)
    scale = 1.0 / sc["factor"] if rtype == "linear" else 1.0
    return lambda x, offset: mx.fast.rope(x, dims, traditional=traditional, base=base, scale=scale,
                                          offset=offset)


def make_rope(cfg: ModelConfig):
    """The dense families' RoPE over head_dim (default, linear, llama3, yarn; rope_traditional)."""
    llama3 = _llama3_freqs(cfg) if _rope_type(cfg) == "llama3" else None
    return rope_of(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.rope_traditional, llama3)


class Layer:
    def __init__(self, cfg: ModelConfig, w: dict, i: int, dense_mlp: bool = True):
        p = f"model.layers.{i}"
        bias = cfg.attention_bias
        self.q = take_linear(cfg, w, f"{p}.self_attn.q_proj", bias=bias)
        self.k = take_linear(cfg, w, f"{p}.self_attn.k_proj", bias=bias)
        self.v = take_linear(cfg, w, f"{p}.self_attn.v_proj", bias=bias)
        # llama's attention_bias covers o_proj too (mlx-lm's llama); qwen2's o_proj has none
        self.o = take_linear(cfg, w, f"{p}.self_attn.o_proj", bias=bias and cfg.family == "llama")
        self.gate = self.up = self.down = None     # dense_mlp=False: a family's own MLP (moe.py)
        if dense_mlp:
            mb = cfg.mlp_bias
            self.gate = take_linear(cfg, w, f"{p}.mlp.gate_proj", bias=mb)
            self.up = take_linear(cfg, w, f"{p}.mlp.up_proj", bias=mb)
            self.down = take_linear(cfg, w, f"{p}.mlp.down_proj", bias=mb)
        # decode: q/k/v in one row-exact launch, gate/up in one (q, k, v, gate, up become row
        # views of the fused weights; prefill runs MLX's ops on those views, bits unchanged)
        self.qkv = fuse_linears(w, [f"{p}.self_attn.{n}_proj" for n in "qkv"], [self.q, self.k, self.v])
        self.gate_up = None if not dense_mlp else fuse_linears(
            w, [f"{p}.mlp.gate_proj", f"{p}.mlp.up_proj"], [self.gate, self.up])
        self.in_norm = take_vector(cfg, w, f"{p}.input_layernorm.weight", cfg.hidden_size)
        self.post_norm = take_vector(cfg, w, f"{p}.post_attention_layernorm.weight", cfg.hidden_size)
        if cfg.qk_norm:
            self.q_norm = take_vector(cfg, w, f"{p}.self_attn.q_norm.weight", cfg.head_dim)
            self.k_norm = take_vector(cfg, w, f"{p}.self_attn.k_norm.weight", cfg.head_dim)
        else:
            self.q_norm = self.k_norm = None


@functools.lru_cache(maxsize=4)
def _fence0(dtype) -> mx.array:
    """The first step's fences (StepCache.in_place). In the dtype of the fences the step returns
    (the attention output's, the model's dtype): with another dtype the compiled step would be
    traced twice per KV capacity, once for the first step and again for the second (the H200,
    session 46: float32 here against bf16 returned). Evaluated here: MLX's streams are per thread,
    and an unevaluated array made on one thread cannot be evaluated on another ("There is no
    Stream(cpu, 0) in current thread": an engine built on the main thread left it for the
    server's engine thread)."""
    a = mx.zeros((1,), dtype)
    mx.eval(a)
    return a


def kernels_row_attention(q, kb, vb, off, scale):
    from .. import kernels
    return kernels.row_attention(q, kb, vb, off, scale)


class StepCache:
    """KVCache's interface inside the compiled exact step: the offset is an int32 [1] array, so the
    traced graph does not depend on the position. Writes scatter the new rows at positions
    offset..offset+L-1 along the sequence axis (mx.put_along_axis): work in proportion to the
    rows written. Not mx.slice_update with an array start: MLX 0.32's CUDA kernel for that
    launches one thread per element of the whole KV buffer (copy_general_dynamic sizes its grid
    by the output), measured 35 us per write at 2.3k capacity on the H200, growing with it."""

    def __init__(self, keys, values, offset, rows: int, fences=None):
        self.keys, self.values, self.offset = list(keys), list(values), offset
        # at least 4 positions computed, so that the array is not one of MLX's <= 8-byte
        # (managed memory) allocations (kernels._cuda.device_array)
        pos = offset + mx.arange(max(rows, 4), dtype=mx.int32)
        self.pos = pos[:rows].reshape(1, 1, rows, 1)
        self.fences = None if fences is None else list(fences)

    def in_place(self, layer: int):
        """(k buffer, v buffer, fence) for a fused kernel that writes the layer's new KV rows
        into the buffers itself (CUDA's qk_norm_rope_kv; then write() is skipped), when the step
        was given fences (the default; TENSORFOLD_INPLACE_KV=0 turns it off: DenseModel.inplace_kv);
        else None.

        MLX's CUDA graphs order kernels by the buffers each declares as outputs
        (CommandEncoder::set_output_array), and an in-place write into an input declares none:
        with several steps queued lazily in one graph (row_check builds its k one-row steps
        before evaluating them), a later step's attention could run before an earlier step's
        write. So the writer also takes the layer's fence, a view of the previous step's
        attention output for this layer (fenced(), returned by the step): write(t) -> q(t) ->
        attention(t) -> fence -> write(t + 1) -> attention(t + 1). Without the fence, row_check
        failed on the H200 (mx.depends does not help: it orders MLX's evaluation, not the
        graph's edges). With it, on the H200 (session 8): row_check passes, drafted == serial
        8/8 with drafts accepted, resumed == fresh 3/3, the lazily-queued-steps test passes for
        all four families; decode 236.8 vs 194.8 tok/s with the scatters at 2k (8B 4-bit)."""
        if self.fences is None:
            return None
        return self.keys[layer], self.values[layer], self.fences[layer]

    def fenced(self, layer: int, o) -> None:
        """After the attention that read the in-place rows: its output becomes the fence of
        the next write into this layer's buffers (a 1-element view: no copy, one trace)."""
        self.fences[layer] = o.reshape(-1)[:1]

    def write(self, layer: int, k, v):
        def put(buf, rows):
            return mx.put_along_axis(buf, mx.broadcast_to(self.pos, rows.shape), rows, axis=2)
        self.keys[layer] = put(self.keys[layer], k)
        self.values[layer] = put(self.values[layer], v)
        return self.keys[layer], self.values[layer]


class DenseModel:
    # None: the exact step is mx.compile'd on every backend. Measured: CPU tinycode decode 317 vs
    # 262 tok/s eager; H200 8B-shaped 4-bit at 2k, scatter cache writes (StepCache): 100.9 vs
    # 54.2 tok/s eager on a host with a slow CPU (session 4), where the eager path's graph
    # building dominates; drafted == serial and resumed == fresh held with both (gpu_exact.py).
    # deepseek_v32 sets False (its exact forward reads the offset on the host).
    # With None, TENSORFOLD_COMPILE_DECODE=0 turns it off (the eager path, same bits).
    compiled_decode = None

    def uses_compiled_step(self) -> bool:
        if self.compiled_decode is not None:
            return bool(self.compiled_decode)
        return os.environ.get("TENSORFOLD_COMPILE_DECODE") != "0"

    def __init__(self, cfg: ModelConfig, weights: dict):
        self.cfg = cfg
        self.dtype = _DTYPES[cfg.dtype]
        self.embed = take_linear(cfg, weights, "model.embed_tokens")
        self.layers = [self._make_layer(cfg, weights, i) for i in range(cfg.num_layers)]
        self.norm = take_vector(cfg, weights, "model.norm.weight", cfg.hidden_size)
        self.lm_head = self.embed if cfg.tie_embeddings else take_linear(cfg, weights, "lm_head")
        self.rope = make_rope(cfg)
        self.rope_freq = rope_inv_freq(cfg)     # the same RoPE for the fused decode kernel
        self.scale = cfg.head_dim ** -0.5
        self.eps = cfg.rms_norm_eps
        # the activation dtype (the KV cache's): what the embedding produces, promoted as MLX's ops
        # promote it through the layers' weights (mlx-lm's forward: a float32 norm beside bf16
        # weights makes q, k, v and the residual stream float32, and its cache float32; a bf16 cache
        # rounded them, session 52). bf16 with fp16 promotes to float32 too.
        emb = self.embed.scales.dtype if self.embed.quantized else self.embed.weight.dtype
        floats = {a.dtype for ly in self.layers for a in self._stream_arrays(ly)} | {emb}
        self.dtype = emb if len(floats) == 1 else mx.float32

    def _make_layer(self, cfg: ModelConfig, weights: dict, i: int) -> Layer:
        return Layer(cfg, weights, i)

    def new_cache(self) -> KVCache:
        return KVCache(self.cfg.num_layers, self.cfg.num_kv_heads, self.cfg.head_dim, self.dtype)

    def parameters(self) -> list[mx.array]:
        """Every weight array once: the linears', the final norm, then each layer's others."""
        out = []
        for lin in self._linears():
            out += [a for a in (lin.weight, lin.scales, lin.biases, lin.bias) if a is not None]
        out.append(self.norm)
        for ly in self.layers:
            out += self._layer_arrays(ly)
        return out

    def _linears(self) -> list[Linear]:
        lins = [self.embed] + ([] if self.lm_head is self.embed else [self.lm_head])
        for ly in self.layers:
            lins += self._layer_linears(ly)
        return lins

    # a family with other layers overrides these two
    def _layer_linears(self, ly) -> list[Linear]:
        return [t for t in (ly.q, ly.k, ly.v, ly.o, ly.gate, ly.up, ly.down) if t is not None]

    def _layer_arrays(self, ly) -> list[mx.array]:
        """A layer's weights that are not in its linears (norms)."""
        return [a for a in (ly.in_norm, ly.post_norm, ly.q_norm, ly.k_norm) if a is not None]

    def _stream_arrays(self, ly) -> list[mx.array]:
        """A layer's float arrays whose dtype MLX's ops carry into q, k, v and the residual stream
        (norms, the attention and MLP linears; a family's router only picks experts)."""
        out = self._layer_arrays(ly)
        for lin in (ly.q, ly.k, ly.v, ly.o, ly.gate, ly.up, ly.down):
            if lin is not None:
                w = None if lin.quantized else lin.weight
                out += [a for a in (w, lin.scales, lin.biases, lin.bias) if a is not None]
        return out

    def _attention(self, ly: Layer, i: int, x, cache: KVCache, exact: bool, residual=None):
        """The attention block's output, plus `residual` where given (the layer's residual add;
        the exact path hands it to the output projection's kernel, which fuses it on CUDA)."""
        # x [B, L, D], or [L, D] (B = 1) inside the compiled exact step (_exact_body)
        B, L = (1, x.shape[0]) if x.ndim == 2 else x.shape[:2]
        lead = x.shape[:-1]
        lin = Linear.exact if exact else Linear.__call__
        H, Hk, hd = self.cfg.num_heads, self.cfg.num_kv_heads, self.cfg.head_dim
        off = cache.offset
        qk = None
        if exact and ly.qkv is not None:
            qkv = ly.qkv.exact(x)
            if qkv.ndim == 2:                   # the fused norm + RoPE kernel takes [B, L, C]
                qkv = qkv.reshape(1, L, -1)
            kv = cache.in_place(i)
            # norms + RoPE in one launch (CUDA), or None; with kv it also writes the KV rows
            qk = self._fused_qk(ly, qkv, off, kv)
            if qk is not None and kv is not None:
                o = kernels_row_attention(qk, kv[0], kv[1], off, self.scale)
                cache.fenced(i, o)
                return _out(ly.o, o.transpose(0, 2, 1, 3).reshape(*lead, H * hd), exact, residual)
            if qk is None:
                q, k = qkv[..., : H * hd], qkv[..., H * hd: (H + Hk) * hd]
            v = qkv[..., (H + Hk) * hd:]
        else:
            q, k, v = lin(ly.q, x), lin(ly.k, x), lin(ly.v, x)
        v = v.reshape(B, L, Hk, hd).transpose(0, 2, 1, 3)
        if qk is not None:
            q, k = qk
        else:
            q, k = q.reshape(B, L, H, hd), k.reshape(B, L, Hk, hd)
            if ly.q_norm is not None:
                q = mx.fast.rms_norm(q, ly.q_norm, self.eps)
                k = mx.fast.rms_norm(k, ly.k_norm, self.eps)
            q, k = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3)
            q, k = self.rope(q, off), self.rope(k, off)
        kb, vb = cache.write(i, k, v)
        if exact:
            o = kernels_row_attention(q, kb, vb, off, self.scale)
        else:
            o = mx.fast.scaled_dot_product_attention(
                q, kb[..., : off + L, :], vb[..., : off + L, :], scale=self.scale,
                mask="causal" if L > 1 else None)
        o = o.transpose(0, 2, 1, 3).reshape(*lead, H * hd)
        return _out(ly.o, o, exact, residual)

    def _fused_qk(self, ly: Layer, qkv, off, kv=None):
        """Decode's q, k through kernels.fused_qk_norm_rope where the face has it (CUDA), else
        None; with kv (the layer's KV buffers, StepCache.in_place) q alone, the key and value
        rows written into kv. TENSORFOLD_FUSED_QK=0 turns it off (MLX's rms_norm and rope,
        other bits)."""
        if os.environ.get("TENSORFOLD_FUSED_QK") == "0" or self.rope_freq is None:
            return None     # (rope_inv_freq: a RoPE the fused kernel cannot give)
        from .. import kernels
        inv, scale = self.rope_freq
        return kernels.fused_qk_norm_rope(qkv, self.cfg.num_heads, self.cfg.num_kv_heads,
                                          ly.q_norm, ly.k_norm, self.eps, inv, scale, off, kv=kv)

    def _mlp(self, ly: Layer, x, exact: bool, residual=None):
        if exact and ly.gate_up is not None:
            gu = ly.gate_up.exact(x)
            n = ly.gate.shape[0]
            return ly.down.exact(swiglu(gu[..., :n], gu[..., n:]), residual)
        lin = Linear.exact if exact else Linear.__call__
        return _out(ly.down, swiglu(lin(ly.gate, x), lin(ly.up, x)), exact, residual)

    def _layer_done(self, i: int, h, cache: KVCache, exact: bool) -> None:
        """Called after layer i is built (a family may schedule evaluation here)."""

    def _layers(self, h, cache, exact: bool):
        for i, ly in enumerate(self.layers):
            h = self._attention(ly, i, mx.fast.rms_norm(h, ly.in_norm, self.eps), cache, exact,
                                residual=h)
            h = self._mlp(ly, mx.fast.rms_norm(h, ly.post_norm, self.eps), exact, residual=h)
            self._layer_done(i, h, cache, exact)
        return h

    def forward(self, ids: mx.array, cache: KVCache, *, exact: bool, all_logits: bool = False,
                logits: bool = True):
        """Run ids [1, L] at positions cache.offset.. and advance the cache by L.

        Returns logits [L, vocab] (all rows) or [1, vocab] (last row only), or None. An exact forward
        builds its graph inside kernels.compiles_batched(): on the CUDA face, the kernel instances it is
        the first to need compile side by side before anything evaluates them (kernels/_kcache.py)."""
        if not exact:
            return self._forward(ids, cache, exact=False, all_logits=all_logits, logits=logits)
        with kernels.compiles_batched():
            return self._forward(ids, cache, exact=True, all_logits=all_logits, logits=logits)

    def _forward(self, ids, cache, *, exact: bool, all_logits: bool, logits: bool):
        L = ids.shape[1]
        cache.reserve(cache.offset + L)
        if exact and logits and all_logits and self.uses_compiled_step():
            return self._exact_compiled(ids, cache)
        h = self._layers(self.embed.embed(ids), cache, exact)
        cache.offset += L
        if not logits:
            return None
        if not all_logits:
            h = h[:, -1:, :]
        h = mx.fast.rms_norm(h, self.norm, self.eps)
        head = (lambda t: self.lm_head.exact(t)) if exact else (
            (lambda t: mx.quantized_matmul(t, self.lm_head.weight, self.lm_head.scales, self.lm_head.biases,
                                           transpose=True, group_size=self.lm_head.group_size,
                                           bits=self.lm_head.bits))
            if self.lm_head.quantized else (lambda t: t @ self.lm_head.weight.T))
        return head(h)[0]

    # ---- the compiled exact step ------------------------------------------------------------
    def _exact_body(self, ids, offset, keys, values, fences=None):
        """forward(exact=True, all_logits=True) as a pure function of (ids, offset, KV buffers);
        offset is an int32 [4] array (KVCache.step_offset) and the step returns offset + L.
        With fences (one 1-element array per layer) the KV rows are written in place where the
        face can (StepCache.in_place) and the step also returns the next fences."""
        L = ids.shape[1]
        cache = StepCache(keys, values, offset[:1], L, fences)
        # the hidden state is carried as [L, D]: the row kernels take [rows, K], so no reshape
        # of it sits between two of them (bench/step_graph.py; the bits are the same)
        h = self._layers(self.embed.embed(ids[0]), cache, True)
        h = mx.fast.rms_norm(h, self.norm, self.eps)
        out = (self.lm_head.exact(h), cache.keys, cache.values, offset + L)
        return out if fences is None else out + (cache.fences,)

    @staticmethod
    def inplace_kv() -> bool:
        """The compiled step writes KV rows in place where the face has the fused kernel (CUDA;
        StepCache.in_place); TENSORFOLD_INPLACE_KV=0 turns it off (scatters, same bits)."""
        return os.environ.get("TENSORFOLD_INPLACE_KV") != "0"

    def _exact_compiled(self, ids, cache: KVCache):
        step = self.__dict__.get("_exact_step")
        if step is None:
            step = self._exact_step = mx.compile(self._exact_body)
        args = (ids, cache.step_offset(), cache.keys, cache.values)
        if self.inplace_kv():
            if cache.fences is None:    # any array: the buffers' own producers order the first write
                cache.fences = [_fence0(self.dtype) for _ in range(self.cfg.num_layers)]
            logits, keys, values, nxt, cache.fences = step(*args, cache.fences)
        else:
            logits, keys, values, nxt = step(*args)
        # rebinding drops the old buffers' last host references: the scatters can write in
        # place (MLX donates a buffer nothing else holds; peak memory measured unchanged)
        cache.keys, cache.values = keys, values
        cache.offset += ids.shape[1]
        cache.set_step_offset(nxt)
        return logits
