"""Helpers shared by the tests that compare with mlx-lm (tests/test_models.py, test_moe.py, test_dsa.py).
Imported by both; pytest puts tests/ on sys.path (rootdir-relative, no package)."""

from __future__ import annotations

import mlx.core as mx


def mlx_lm_last_row_logits(ref, x: mx.array, cache=None) -> mx.array:
    """mlx-lm's logits [1, vocab] for the prompt's last row with that row alone through its LM
    head: mlx-lm's hidden state's last row, then its own head (tied or not). This is what our
    last-row prefill computes, with the same ops, so the two are equal on every backend; the
    last row of mlx-lm's all-rows call equals it only where MLX's matmuls are row-invariant
    (its CPU backend; not its CUDA one, where the LM head's bits depend on how many rows share
    the call). With `cache` (mlx-lm's prompt cache), x is the next chunk after what it holds."""
    h = ref.model(x, cache=cache)[:, -1:]
    tied = getattr(ref.args, "tie_word_embeddings", False)     # deepseek_v32's args have no such field
    head = ref.model.embed_tokens.as_linear if tied else ref.lm_head
    return head(h)[0]
