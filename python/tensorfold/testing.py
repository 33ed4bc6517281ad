"""Small but real checkpoints with random seeded weights, for tests.

`write_checkpoint(path, ...)` writes a complete model directory (config.json, safetensors weights,
tokenizer.json, tokenizer_config.json, chat_template.jinja, generation_config.json) in either the
Hugging Face layout (float weights, names exactly as transformers writes them) or the MLX layout
(mlx-lm converter / mlx-community: affine-quantized Linear and Embedding weights as
``.weight``/``.scales``/``.biases`` plus ``"quantization"`` in config.json, optionally per-module
overrides). Everything is deterministic: the same arguments give byte-identical files.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
from typing import Any

import numpy as np

__all__ = [
    "write_checkpoint",
    "write_default_set",
    "build_tokenizer_json",
    "CHAT_TEMPLATE",
    "SPECIAL_TOKENS",
    "FAMILIES",
]

FAMILIES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "deepseek_v32": "DeepseekV32ForCausalLM",
}

# deepseek_v32's own sizes (write_checkpoint(dsa={...}) overrides any of them). index_topk is
# small so that short test prompts already use the sparse selected-key attention.
DSA_DEFAULTS: dict[str, Any] = dict(
    q_lora_rank=64, kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
    index_n_heads=8, index_head_dim=32, index_topk=20, n_group=2, topk_group=1,
    n_shared_experts=1, routed_scaling_factor=2.5, first_k_dense_replace=1, moe_layer_freq=1,
)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
EOS_TOKEN_IDS = [2, 0]

# A Qwen3-style ChatML template: system/tools block, <think> stripping from earlier assistant turns,
# tool calls / tool responses, and the enable_thinking toggle on the generation prompt.
CHAT_TEMPLATE = r"""{%- macro render_content(content) -%}
{%- if content is string -%}
{{- content -}}
{%- elif content is not none -%}
{%- for part in content -%}
{%- if part.type == 'text' -%}{{- part.text -}}{%- endif -%}
{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0].role == 'system' %}
{{- render_content(messages[0].content) + '\n\n' }}
{%- endif %}
{{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
{%- for tool in tools %}
{{- "\n" }}
{{- tool | tojson }}
{%- endfor %}
{{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + render_content(messages[0].content) + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}
{%- continue %}
{%- endif %}
{%- if message.role in ['system', 'developer', 'user'] %}
{{- '<|im_start|>' + message.role + '\n' + render_content(message.content) + '<|im_end|>\n' }}
{%- elif message.role == 'assistant' %}
{%- set content = render_content(message.content) %}
{%- if '</think>' in content %}
{%- set content = content.split('</think>')[-1].lstrip('\n') %}
{%- endif %}
{{- '<|im_start|>assistant\n' + content }}
{%- if message.tool_calls %}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function %}
{%- set tool_call = tool_call.function %}
{%- endif %}
{%- if (loop.first and content) or not loop.first %}
{{- '\n' }}
{%- endif %}
{{- '<tool_call>\n{"name": "' + tool_call.name + '", "arguments": ' }}
{%- if tool_call.arguments is string %}
{{- tool_call.arguments }}
{%- else %}
{{- tool_call.arguments | tojson }}
{%- endif %}
{{- '}\n</tool_call>' }}
{%- endfor %}
{%- endif %}
{{- '<|im_end|>\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
{{- '<|im_start|>user' }}
{%- endif %}
{{- '\n<tool_response>\n' + render_content(message.content) + '\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
{{- '<|im_end|>\n' }}
{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}
{{- '<think>\n\n</think>\n\n' }}
{%- endif %}
{%- endif %}
"""

_TRAIN_TEXT = r'''
The quick brown fox jumps over the lazy dog. A small language model reads text one token at a time
and predicts the next token. The server batches many requests together, keeps a cache of keys and
values for every layer, and streams the answer back to the client as soon as each token is ready.
When two requests share a prefix, the cache for that prefix can be reused, which saves time and
memory. Exact decoding means that the same prompt and the same seed always give the same tokens,
whether the request was resumed, batched with others, or drafted by a smaller model and verified.
Hello, world! How are you today? I am fine, thank you. What is the weather like in the city?
It is sunny and warm, with a light breeze from the west. Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2024.
The user asked a question, and the assistant thought about it before giving a short, clear answer.
Please write a function that returns the sum of a list of numbers, and explain how it works.
Tokens, tensors, layers, heads, attention, softmax, normalization, embeddings, logits, sampling.

def add(a, b):
    """Return the sum of a and b."""
    return a + b


def fibonacci(n: int) -> list[int]:
    result = [0, 1]
    while len(result) < n:
        result.append(result[-1] + result[-2])
    return result[:n]


class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        if not self.items:
            raise IndexError("pop from empty stack")
        return self.items.pop()

    def __len__(self):
        return len(self.items)


import json
import os
from typing import Any, Dict, List, Optional


def load_config(path: str) -> Dict[str, Any]:
    with open(os.path.join(path, "config.json"), "r") as f:
        return json.load(f)


for i in range(10):
    if i % 2 == 0:
        print(f"{i} is even")
    else:
        print(f"{i} is odd")

numbers = [x * x for x in range(20) if x > 3]
total = sum(numbers)
mapping = {"key": "value", "count": 3, "items": [1, 2, 3], "enabled": True, "other": None}
try:
    value = mapping["missing"]
except KeyError as exc:
    value = None
finally:
    pass

async def fetch(client, url):
    response = await client.get(url)
    return response.json()

The model answered: "Here is the function you asked for." Then it printed the code and stopped.
'''


_TOKENIZER_CACHE: dict[int, str] = {}


def build_tokenizer_json(vocab_size: int = 512) -> str:
    """Train (once per process, deterministically) a byte-level BPE and return its tokenizer.json text."""
    if vocab_size in _TOKENIZER_CACHE:
        return _TOKENIZER_CACHE[vocab_size]
    if not (len(SPECIAL_TOKENS) + 256 < vocab_size <= 1024):
        raise ValueError(f"vocab_size must be in ({len(SPECIAL_TOKENS) + 256}, 1024], got {vocab_size}")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Repeat the text a few times so merges are well-defined (same counts → same merges).
    lines = _TRAIN_TEXT.splitlines(keepends=True)
    tok.train_from_iterator(lines * 3, trainer=trainer)
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    for i, s in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
    text = tok.to_str(pretty=True)
    _TOKENIZER_CACHE[vocab_size] = text
    return text


# --------------------------------------------------------------------------------------------------
# weights


def _np_dtype_to_mx(dtype: str):
    import mlx.core as mx

    try:
        return {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}[dtype]
    except KeyError:
        raise ValueError(f"dtype must be bfloat16, float16 or float32, got {dtype!r}") from None


def _draws(seed: int):
    """(normal(shape, std), norm_w(n)): float32 draws from one seeded generator, in call order."""
    rng = np.random.default_rng(seed)

    def normal(shape, std):
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(std)).astype(np.float32)

    def norm_w(n):
        return (1.0 + normal((n,), 0.05)).astype(np.float32)

    return normal, norm_w


def _mlp_weights(w: dict, prefix: str, normal, hidden: int, f: int, resid: float,
                 lead: tuple = ()) -> None:
    """gate / up / down projections of a SwiGLU MLP under `prefix` (lead: stacked experts)."""
    w[prefix + "gate_proj.weight"] = normal((*lead, f, hidden), 1 / math.sqrt(hidden))
    w[prefix + "up_proj.weight"] = normal((*lead, f, hidden), 1 / math.sqrt(hidden))
    w[prefix + "down_proj.weight"] = normal((*lead, hidden, f), resid / math.sqrt(f))


def _final_weights(w: dict, normal, norm_w, vocab: int, hidden: int, tie_embeddings: bool) -> None:
    w["model.norm.weight"] = norm_w(hidden)
    if not tie_embeddings:
        # std 2/sqrt(hidden) on RMS-normed states: logits with std ~2, peaked but not one-hot.
        w["lm_head.weight"] = normal((vocab, hidden), 2 / math.sqrt(hidden))


def _make_weights(
    *,
    family: str,
    vocab: int,
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    intermediate: int,
    tie_embeddings: bool,
    seed: int,
    moe: dict | None = None,
) -> dict[str, np.ndarray]:
    normal, norm_w = _draws(seed)

    resid = 1.0 / math.sqrt(2 * layers)
    w: dict[str, np.ndarray] = {}
    # 2/sqrt(hidden): as a tied lm_head on RMS-normed states this gives logits with std ~2.
    w["model.embed_tokens.weight"] = normal((vocab, hidden), 2 / math.sqrt(hidden))
    for i in range(layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm_w(hidden)
        w[p + "self_attn.q_proj.weight"] = normal((heads * head_dim, hidden), 1 / math.sqrt(hidden))
        w[p + "self_attn.k_proj.weight"] = normal((kv_heads * head_dim, hidden), 1 / math.sqrt(hidden))
        w[p + "self_attn.v_proj.weight"] = normal((kv_heads * head_dim, hidden), 1 / math.sqrt(hidden))
        if family == "qwen2":
            w[p + "self_attn.q_proj.bias"] = normal((heads * head_dim,), 0.1)
            w[p + "self_attn.k_proj.bias"] = normal((kv_heads * head_dim,), 0.1)
            w[p + "self_attn.v_proj.bias"] = normal((kv_heads * head_dim,), 0.1)
        w[p + "self_attn.o_proj.weight"] = normal(
            (hidden, heads * head_dim), resid / math.sqrt(heads * head_dim)
        )
        if family in ("qwen3", "qwen3_moe"):
            w[p + "self_attn.q_norm.weight"] = norm_w(head_dim)
            w[p + "self_attn.k_norm.weight"] = norm_w(head_dim)
        w[p + "post_attention_layernorm.weight"] = norm_w(hidden)
        if moe is not None and _moe_layer(moe, i):
            E, f = moe["num_experts"], moe["moe_intermediate_size"]
            # std 2/sqrt(hidden) on RMS-normed states: router logits with std ~2, so the
            # routing is neither uniform nor one-hot
            w[p + "mlp.gate.weight"] = normal((E, hidden), 2 / math.sqrt(hidden))
            # stacked [E, out, in] as mlx-lm's SwitchGLU holds them (split per expert for "hf")
            _mlp_weights(w, p + "mlp.switch_mlp.", normal, hidden, f, resid, lead=(E,))
            continue
        _mlp_weights(w, p + "mlp.", normal, hidden, intermediate, resid)
    _final_weights(w, normal, norm_w, vocab, hidden, tie_embeddings)
    return w


def _make_dsa_weights(*, vocab: int, hidden: int, layers: int, heads: int, intermediate: int,
                      tie_embeddings: bool, seed: int, moe: dict, d: dict) -> dict[str, np.ndarray]:
    """deepseek_v32 weights under mlx-lm's names (embed_q / unembed_out, stacked switch_mlp)."""
    normal, norm_w = _draws(seed)

    ql, kvr, rd = d["q_lora_rank"], d["kv_lora_rank"], d["qk_rope_head_dim"]
    nope, vh, Hi, ihd = d["qk_nope_head_dim"], d["v_head_dim"], d["index_n_heads"], d["index_head_dim"]
    resid = 1.0 / math.sqrt(2 * layers)
    w: dict[str, np.ndarray] = {}
    w["model.embed_tokens.weight"] = normal((vocab, hidden), 2 / math.sqrt(hidden))
    for i in range(layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        w[p + "input_layernorm.weight"] = norm_w(hidden)
        w[a + "q_a_proj.weight"] = normal((ql, hidden), 1 / math.sqrt(hidden))
        w[a + "q_a_layernorm.weight"] = norm_w(ql)
        w[a + "q_b_proj.weight"] = normal((heads * (nope + rd), ql), 1 / math.sqrt(ql))
        w[a + "kv_a_proj_with_mqa.weight"] = normal((kvr + rd, hidden), 1 / math.sqrt(hidden))
        w[a + "kv_a_layernorm.weight"] = norm_w(kvr)
        w[a + "embed_q.weight"] = normal((heads, kvr, nope), 1 / math.sqrt(kvr))
        w[a + "unembed_out.weight"] = normal((heads, vh, kvr), 1 / math.sqrt(kvr))
        w[a + "o_proj.weight"] = normal((hidden, heads * vh), resid / math.sqrt(heads * vh))
        w[a + "indexer.wq_b.weight"] = normal((Hi * ihd, ql), 1 / math.sqrt(ql))
        w[a + "indexer.wk.weight"] = normal((ihd, hidden), 1 / math.sqrt(hidden))
        w[a + "indexer.k_norm.weight"] = norm_w(ihd)
        w[a + "indexer.k_norm.bias"] = normal((ihd,), 0.05)
        w[a + "indexer.weights_proj.weight"] = normal((Hi, hidden), 1 / math.sqrt(hidden))
        w[p + "post_attention_layernorm.weight"] = norm_w(hidden)
        if i >= d["first_k_dense_replace"] and i % d["moe_layer_freq"] == 0:
            E, f = moe["num_experts"], moe["moe_intermediate_size"]
            w[p + "mlp.gate.weight"] = normal((E, hidden), 2 / math.sqrt(hidden))
            w[p + "mlp.gate.e_score_correction_bias"] = normal((E,), 0.1)
            _mlp_weights(w, p + "mlp.switch_mlp.", normal, hidden, f, resid, lead=(E,))
            if d["n_shared_experts"]:
                _mlp_weights(w, p + "mlp.shared_experts.", normal, hidden,
                             f * d["n_shared_experts"], resid)
            continue
        _mlp_weights(w, p + "mlp.", normal, hidden, intermediate, resid)
    _final_weights(w, normal, norm_w, vocab, hidden, tie_embeddings)
    return w


def _dsa_to_hf(raw: dict[str, np.ndarray], d: dict, heads: int) -> dict[str, np.ndarray]:
    """mlx-lm's sanitize in reverse: embed_q / unembed_out -> kv_b_proj, per-expert tensors."""
    out = {}
    nope = d["qk_nope_head_dim"]
    for k, v in raw.items():
        if k.endswith("self_attn.unembed_out.weight"):
            continue
        if k.endswith("self_attn.embed_q.weight"):
            pre = k[: -len("embed_q.weight")]
            wv = raw[pre + "unembed_out.weight"]                       # [H, v_head, kv_lora]
            kv = np.concatenate([v.swapaxes(-1, -2), wv], axis=1)      # [H, nope + v_head, kv_lora]
            assert kv.shape[1] == nope + wv.shape[1]
            out[pre + "kv_b_proj.weight"] = np.ascontiguousarray(kv.reshape(-1, kv.shape[-1]))
            continue
        if ".mlp.switch_mlp." in k:
            pre, proj = k.split(".mlp.switch_mlp.")
            for e in range(v.shape[0]):
                out[f"{pre}.mlp.experts.{e}.{proj}"] = np.ascontiguousarray(v[e])
            continue
        out[k] = v
    return dict(sorted(out.items()))


def _dsa_quantizable(name: str) -> bool:
    """What mlx-lm's nn.quantize turns quantized in deepseek_v32: every Linear, the per-head
    MultiLinears, stacked experts, embedding, lm_head. Not the router (MoEGate) or norms."""
    if not name.endswith(".weight") or name.endswith(".mlp.gate.weight") or "norm" in name:
        return False
    return (name.endswith("_proj.weight") or name.endswith("_mqa.weight")
            or name.endswith(("indexer.wq_b.weight", "indexer.wk.weight", "embed_q.weight",
                              "unembed_out.weight"))
            or name in ("model.embed_tokens.weight", "lm_head.weight"))


def _moe_layer(moe: dict, i: int) -> bool:
    """mlx-lm's qwen3_moe rule for a sparse layer."""
    return i not in moe["mlp_only_layers"] and (i + 1) % moe["decoder_sparse_step"] == 0


def _quantizable(name: str) -> bool:
    """Linear weights (MoE routers and stacked experts included), the embedding and lm_head
    (what mlx-lm's nn.quantize touches)."""
    return name.endswith(".weight") and (
        name.endswith("_proj.weight") or name.endswith(".mlp.gate.weight")
        or name in ("model.embed_tokens.weight", "lm_head.weight")
    )


def _shard(names: list[str], sizes: dict[str, int], shards: int) -> list[list[str]]:
    """Split `names` (in order) into `shards` contiguous, non-empty groups of about equal bytes."""
    if len(names) < shards:
        raise ValueError(f"cannot split {len(names)} tensors into {shards} shards")
    target = sum(sizes[n] for n in names) / shards
    groups: list[list[str]] = [[] for _ in range(shards)]
    acc = 0
    for n in names:
        groups[min(int(acc // target), shards - 1)].append(n)
        acc += sizes[n]
    if any(not g for g in groups):  # a tensor bigger than a shard: fall back to equal counts
        per, extra = divmod(len(names), shards)
        it = iter(names)
        groups = [[next(it) for _ in range(per + (k < extra))] for k in range(shards)]
    return groups


def write_checkpoint(
    path: str | pathlib.Path,
    *,
    family: str = "qwen3",
    layout: str = "hf",
    bits: int | None = None,
    group_size: int = 64,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int | None = None,
    intermediate: int = 128,
    seed: int = 0,
    tie_embeddings: bool = False,
    dtype: str = "bfloat16",
    max_position: int = 8192,
    rope_theta: float = 10000.0,
    rope_scaling: dict | None = None,
    mixed_bits: dict[str, Any] | None = None,
    shards: int = 1,
    vocab_size: int = 512,
    num_experts: int = 8,
    experts_per_tok: int = 2,
    moe_intermediate: int = 64,
    decoder_sparse_step: int = 1,
    mlp_only_layers: tuple | list = (),
    norm_topk_prob: bool = True,
    router_bits: int | None = 8,
    dsa: dict[str, Any] | None = None,
) -> pathlib.Path:
    """Write a tiny random-weight model directory and return its path.

    layout="hf": float weights named as transformers writes them, safetensors metadata format "pt".
    layout="mlx": metadata format "mlx"; with `bits`, every Linear (q/k/v/o, gate/up/down), the
    embedding and lm_head are affine-quantized with ``mx.quantize(w, group_size, bits)`` and
    config.json gets ``quantization``/``quantization_config``. `mixed_bits` maps module paths
    (e.g. "model.layers.0.mlp.down_proj") to {"group_size", "bits"} overrides (or False: keep that
    module in float), written into config["quantization"][path] as mlx-lm does.

    family="qwen3_moe" (Qwen3-30B-A3B layout): `num_experts`, `experts_per_tok`,
    `moe_intermediate`, `decoder_sparse_step`, `mlp_only_layers` (those layers get the dense MLP
    of size `intermediate`), `norm_topk_prob`. layout="hf" writes per-expert tensors
    ``mlp.experts.{e}.{gate,up,down}_proj.weight`` (as transformers does); layout="mlx" writes
    them stacked as ``mlp.switch_mlp.{gate,up,down}_proj.weight`` [E, out, in] (as mlx-lm's
    converter / mlx-community do), quantized with `bits` like every Linear; the routers
    ``mlp.gate`` get `router_bits` (8, group 64: mlx-lm's qwen3_moe quant_predicate; None: the
    default bits) recorded per module in config["quantization"].

    family="deepseek_v32" (mlx-lm's deepseek_v32): MLA + lightning indexer + group-limited
    sigmoid MoE; `dsa` overrides DSA_DEFAULTS (q/kv LoRA ranks, rope/nope/v head dims,
    index_n_heads / index_head_dim / index_topk, n_group, topk_group, n_shared_experts,
    routed_scaling_factor, first_k_dense_replace); `num_experts`, `experts_per_tok`,
    `moe_intermediate`, `norm_topk_prob` as for qwen3_moe. layout="mlx" writes mlx-lm's names
    (``self_attn.embed_q`` / ``unembed_out`` [H, out, in], stacked ``mlp.switch_mlp``), with
    `bits` quantizing what mlx-lm's nn.quantize does (not the float router ``mlp.gate`` or its
    float32 ``e_score_correction_bias``); layout="hf" writes ``self_attn.kv_b_proj`` and
    per-expert ``mlp.experts.{e}`` as the Hugging Face checkpoints do.
    """
    import mlx.core as mx

    if family not in FAMILIES:
        raise ValueError(f"family must be one of {sorted(FAMILIES)}, got {family!r}")
    if layout not in ("hf", "mlx"):
        raise ValueError(f"layout must be 'hf' or 'mlx', got {layout!r}")
    if bits is not None and layout != "mlx":
        raise ValueError("quantized checkpoints (bits=...) need layout='mlx'")
    if bits is not None and bits not in (2, 3, 4, 5, 6, 8):
        raise ValueError(f"bits must be one of 2, 3, 4, 5, 6, 8, got {bits}")
    if mixed_bits and bits is None:
        raise ValueError("mixed_bits needs bits (the default quantization)")
    if heads % kv_heads:
        raise ValueError("heads must be a multiple of kv_heads")
    if shards < 1:
        raise ValueError("shards must be >= 1")
    moe = None
    dsa_cfg = None
    if family == "deepseek_v32":
        unknown = set(dsa or {}) - set(DSA_DEFAULTS)
        if unknown:
            raise ValueError(f"unknown dsa keys {sorted(unknown)}")
        dsa_cfg = {**DSA_DEFAULTS, **(dsa or {})}
        if not 0 < experts_per_tok <= num_experts:
            raise ValueError("need 0 < experts_per_tok <= num_experts")
        moe = dict(num_experts=num_experts, num_experts_per_tok=experts_per_tok,
                   moe_intermediate_size=moe_intermediate, norm_topk_prob=bool(norm_topk_prob))
        kv_heads = heads
    elif family == "qwen3_moe":
        if not 0 < experts_per_tok <= num_experts:
            raise ValueError("need 0 < experts_per_tok <= num_experts")
        if any(not 0 <= i < layers for i in mlp_only_layers):
            raise ValueError("mlp_only_layers outside 0..layers-1")
        moe = dict(num_experts=num_experts, num_experts_per_tok=experts_per_tok,
                   moe_intermediate_size=moe_intermediate, decoder_sparse_step=decoder_sparse_step,
                   mlp_only_layers=sorted(set(int(i) for i in mlp_only_layers)),
                   norm_topk_prob=bool(norm_topk_prob))
    mx_dtype = _np_dtype_to_mx(dtype)
    explicit_head_dim = head_dim is not None
    if head_dim is None:
        if hidden % heads:
            raise ValueError("hidden must be divisible by heads (or pass head_dim)")
        head_dim = hidden // heads

    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)

    # ---- tokenizer files
    tok_json = build_tokenizer_json(vocab_size)
    tok_vocab = len(json.loads(tok_json)["model"]["vocab"])
    model_vocab = -(-tok_vocab // 64) * 64
    (path / "tokenizer.json").write_text(tok_json, encoding="utf-8")
    (path / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    tcfg = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(i): {
                "content": s,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for i, s in enumerate(SPECIAL_TOKENS)
        },
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": max_position,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    _write_json(path / "tokenizer_config.json", tcfg)
    _write_json(
        path / "generation_config.json",
        {
            "bos_token_id": 0,
            "eos_token_id": list(EOS_TOKEN_IDS),
            "pad_token_id": 0,
            "do_sample": True,
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": 20,
            "transformers_version": "4.51.0",
        },
    )

    # ---- config.json
    cfg: dict[str, Any] = {
        "architectures": [FAMILIES[family]],
        "attention_bias": family == "qwen2",
        "attention_dropout": 0.0,
        "bos_token_id": 0,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "initializer_range": 0.02,
        "intermediate_size": intermediate,
        "max_position_embeddings": max_position,
        "model_type": family,
        "num_attention_heads": heads,
        "num_hidden_layers": layers,
        "num_key_value_heads": kv_heads,
        "rms_norm_eps": 1e-06,
        "rope_scaling": rope_scaling,
        "rope_theta": float(rope_theta),
        "tie_word_embeddings": bool(tie_embeddings),
        "torch_dtype": dtype,
        "transformers_version": "4.51.0",
        "use_cache": True,
        "vocab_size": model_vocab,
    }
    if family == "llama":
        cfg["mlp_bias"] = False
        cfg["pretraining_tp"] = 1
    if family in ("qwen2", "qwen3"):
        cfg["max_window_layers"] = layers
        cfg["sliding_window"] = None
        cfg["use_sliding_window"] = False
    if family == "qwen3_moe":
        cfg["max_window_layers"] = layers
        cfg["sliding_window"] = None
        cfg["use_sliding_window"] = False
        cfg["output_router_logits"] = False
        cfg["router_aux_loss_coef"] = 0.001
        cfg.update(moe)
    if family in ("qwen3", "qwen3_moe") or explicit_head_dim:
        cfg["head_dim"] = head_dim
    if dsa_cfg is not None:
        cfg["architectures"] = [FAMILIES[family]]
        cfg.update(dsa_cfg)
        cfg.update(n_routed_experts=moe["num_experts"], num_experts_per_tok=moe["num_experts_per_tok"],
                   moe_intermediate_size=moe["moe_intermediate_size"],
                   norm_topk_prob=moe["norm_topk_prob"], topk_method="noaux_tc",
                   scoring_func="sigmoid", indexer_rope_interleave=False)

    # ---- weights
    if dsa_cfg is not None:
        raw = _make_dsa_weights(vocab=model_vocab, hidden=hidden, layers=layers, heads=heads,
                                intermediate=intermediate, tie_embeddings=tie_embeddings,
                                seed=seed, moe=moe, d=dsa_cfg)
        if layout == "hf":
            raw = _dsa_to_hf(raw, dsa_cfg, heads)
    else:
        raw = _make_weights(
            family=family,
            vocab=model_vocab,
            hidden=hidden,
            layers=layers,
            heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate=intermediate,
            tie_embeddings=tie_embeddings,
            seed=seed,
            moe=moe,
        )
    if moe is not None and dsa_cfg is None and layout == "hf":   # transformers' per-expert names
        for k in [k for k in raw if ".mlp.switch_mlp." in k]:
            stacked = raw.pop(k)
            pre, proj = k.split(".mlp.switch_mlp.")
            for e in range(stacked.shape[0]):
                raw[f"{pre}.mlp.experts.{e}.{proj}"] = np.ascontiguousarray(stacked[e])
        raw = dict(sorted(raw.items()))
    weights: dict[str, mx.array] = {}
    if bits is None:
        for k, v in raw.items():
            weights[k] = mx.array(v) if k.endswith("e_score_correction_bias") else mx.array(v).astype(mx_dtype)
    else:
        overrides = dict(mixed_bits or {})
        if moe is not None and dsa_cfg is None and router_bits is not None:
            for i in range(layers):
                if _moe_layer(moe, i):
                    overrides.setdefault(f"model.layers.{i}.mlp.gate", {"group_size": 64, "bits": router_bits})
        quantizable = _dsa_quantizable if dsa_cfg is not None else _quantizable
        known = {k[: -len(".weight")] for k in raw if quantizable(k)}
        for mod in overrides:
            if mod not in known:
                raise ValueError(f"mixed_bits names unknown module {mod!r}")
        quant: dict[str, Any] = {"group_size": group_size, "bits": bits, "mode": "affine"}
        for k in sorted(raw):  # mlx-lm writes weights sorted by name
            v = mx.array(raw[k])
            if not k.endswith("e_score_correction_bias"):   # float32, as the checkpoints keep it
                v = v.astype(mx_dtype)
            mod = k[: -len(".weight")] if k.endswith(".weight") else None
            if mod is not None and quantizable(k):
                spec = overrides.get(mod, {"group_size": group_size, "bits": bits})
                if spec is False:
                    weights[k] = v
                    continue
                gs, b = int(spec.get("group_size", group_size)), int(spec["bits"])
                if v.shape[-1] % gs:
                    raise ValueError(f"{k}: last dim {v.shape[-1]} not divisible by group_size {gs}")
                wq, scales, biases = mx.quantize(v, gs, b)
                weights[k] = wq
                weights[mod + ".scales"] = scales
                weights[mod + ".biases"] = biases
            else:
                weights[k] = v
        for mod, spec in overrides.items():
            quant[mod] = False if spec is False else {
                "group_size": int(spec.get("group_size", group_size)),
                "bits": int(spec["bits"]),
            }
        cfg["quantization"] = quant
        cfg["quantization_config"] = dict(quant)
    mx.eval(weights)
    _write_json(path / "config.json", cfg)

    metadata = {"format": "mlx" if layout == "mlx" else "pt"}
    for old in path.glob("model*.safetensors"):
        old.unlink()
    idx = path / "model.safetensors.index.json"
    if idx.exists():
        idx.unlink()
    if shards == 1:
        mx.save_safetensors(str(path / "model.safetensors"), weights, metadata=metadata)
    else:
        names = list(weights)
        sizes = {n: weights[n].nbytes for n in names}
        groups = _shard(names, sizes, shards)
        weight_map = {}
        for k, group in enumerate(groups):
            fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
            mx.save_safetensors(str(path / fname), {n: weights[n] for n in group}, metadata=metadata)
            for n in group:
                weight_map[n] = fname
        _write_json(
            idx,
            {
                "metadata": {"total_size": sum(sizes.values())},
                "weight_map": dict(sorted(weight_map.items())),
            },
        )
    return path


def _write_json(path: pathlib.Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def llama3_rope_scaling(factor: float = 8.0, original: int = 1024) -> dict:
    return {
        "rope_type": "llama3",
        "factor": float(factor),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": int(original),
    }


def yarn_rope_scaling(factor: float = 40.0, original: int = 4096, beta_fast: float = 32.0,
                      beta_slow: float = 1.0, mscale: float = 1.0, mscale_all_dim: float = 1.0,
                      rope_type: str = "yarn") -> dict:
    """DeepSeek-V3 / V3.2's rope_scaling (``{"type": "yarn", ...}`` as their config.json has it;
    rope_type="deepseek_yarn" writes that spelling): pass as write_checkpoint(rope_scaling=...)
    with family="deepseek_v32"."""
    return {
        "type": rope_type,
        "factor": float(factor),
        "original_max_position_embeddings": int(original),
        "beta_fast": float(beta_fast),
        "beta_slow": float(beta_slow),
        "mscale": float(mscale),
        "mscale_all_dim": float(mscale_all_dim),
    }


DEFAULT_SET: dict[str, dict[str, Any]] = {
    "qwen3_hf_bf16": dict(family="qwen3", layout="hf", seed=0),
    "qwen3_mlx_4bit": dict(family="qwen3", layout="mlx", bits=4, seed=1),
    "qwen3_mlx_8bit": dict(family="qwen3", layout="mlx", bits=8, seed=2),
    "llama_hf_llama3_rope": dict(
        family="llama", layout="hf", seed=3, rope_theta=500000.0, rope_scaling=llama3_rope_scaling()
    ),
    "qwen2_mlx_4bit_tied": dict(family="qwen2", layout="mlx", bits=4, tie_embeddings=True, seed=4),
    "qwen3_mlx_mixed": dict(
        family="qwen3",
        layout="mlx",
        bits=4,
        seed=5,
        mixed_bits={
            "model.layers.0.mlp.down_proj": {"group_size": 64, "bits": 8},
            "model.layers.1.self_attn.v_proj": {"group_size": 32, "bits": 6},
            "lm_head": {"group_size": 64, "bits": 8},
        },
    ),
    "qwen3_hf_sharded": dict(family="qwen3", layout="hf", seed=6, shards=3),
    # MoE (qwen3_moe): mlx-community's stacked 4-bit layout (8-bit routers), and HF per-expert
    # float32 (float32, not bf16: MLX's CPU GatherMM is float32-only, so mlx-lm cannot run an
    # unquantized bf16 MoE on the CPU backend; write_checkpoint(dtype="bfloat16") still works)
    "qwen3_moe_mlx_4bit": dict(family="qwen3_moe", layout="mlx", bits=4, seed=8),
    "qwen3_moe_hf_f32": dict(family="qwen3_moe", layout="hf", dtype="float32", seed=9,
                             mlp_only_layers=[1]),
    # deepseek_v32 (MLA + lightning indexer, index_topk 20: prompts past 20 tokens use the
    # sparse selected-key attention): mlx-lm's converted 4-bit layout (group 32: the 32-wide
    # nope / v head dims quantize too), and the HF layout (kv_b_proj, per-expert) in float32
    "deepseek_v32_mlx_4bit": dict(family="deepseek_v32", layout="mlx", bits=4, group_size=32, seed=12),
    "deepseek_v32_hf_f32": dict(family="deepseek_v32", layout="hf", dtype="float32", seed=13),
}


def write_default_set(root: str | pathlib.Path) -> dict[str, pathlib.Path]:
    """Write the standard small test checkpoints under `root`; returns {name: path}.

    $TF_TEST_HIDDEN (256 in bench/gpu_run.sh) widens the dense/MoE checkpoints that use the
    default hidden size of 64: MLX 0.32.4's own CUDA quantized_matmul is wrong for K = 64 at M >= 2
    (measured on an H200), and from 8 rows reads past its operands wherever K <= 128 at group 64
    (models.loader.mlx_cuda_qmm_overreads), so GPU runs of the suites need it; the CPU suite keeps
    the small default."""
    root = pathlib.Path(root)
    return {name: write_checkpoint(root / name, **widened(kw)) for name, kw in DEFAULT_SET.items()}


def widened(kw: dict[str, Any]) -> dict[str, Any]:
    """write_checkpoint's arguments with $TF_TEST_HIDDEN applied (a copy): where it is set and the
    checkpoint uses the default hidden size, hidden = TF_TEST_HIDDEN, intermediate twice that, and
    the experts' intermediate (where not given) TF_TEST_HIDDEN too: their down projections' K.
    DeepSeek-V3.2 checkpoints also take q_lora_rank = TF_TEST_HIDDEN (q_b's and the indexer's K),
    128-wide nope heads (the prefill's non-transposed embed_q product N = 128, as in the real
    model; MLX 0.32.4's CUDA backend refused N = 32) and 64-wide v heads (o_proj's K = heads x 64);
    kv_lora_rank stays 64, where MLX takes another kernel. Session 46: at 256 no module is left in
    loader.mlx_cuda_qmm_overreads (tests/test_testing.py). At 256 on the CPU, test_dsa.py's
    test_bf16_whole_model_rows_agree_with_mlx_lm fails its 0.8 (0.59): the wider random model
    amplifies bf16 rounding, so that mlx-lm's own bf16 and fp32 logits agree on 0.45 of rows."""
    kw = dict(kw)
    wide = int(os.environ.get("TF_TEST_HIDDEN", "0") or 0)
    if wide and "hidden" not in kw:
        kw.update(hidden=wide, intermediate=2 * wide)
        kw.setdefault("moe_intermediate", wide)
        if kw.get("family") == "deepseek_v32":
            kw["dsa"] = dict(kw.get("dsa") or {}, q_lora_rank=wide, qk_nope_head_dim=128, v_head_dim=64)
    return kw
