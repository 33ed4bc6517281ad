"""row_check: on the real loaded weights, k single decode steps against one k-row call."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .. import kernels


def row_check(model, k: int = 8, prompt_len: int = 5, seed: int = 0) -> bool:
    """True when every row of one k-row exact call equals the same row computed alone, bit for bit."""
    rng = np.random.default_rng(seed)
    vocab = model.cfg.vocab_size
    prompt = rng.integers(3, vocab, size=prompt_len).tolist()
    steps = rng.integers(3, vocab, size=k).tolist()

    def start():
        c = model.new_cache()
        model.forward(mx.array([prompt]), c, exact=False, logits=False)
        return c

    with kernels.compiles_batched():       # the CUDA face's kernels missing from the cache compiled side by side first
        c1 = start()
        serial = []
        for t in steps:
            serial.append(model.forward(mx.array([[t]]), c1, exact=True, all_logits=True)[0])
        c2 = start()
        block = model.forward(mx.array([steps]), c2, exact=True, all_logits=True)
    mx.eval(serial, block)
    return all(bool(mx.array_equal(serial[i], block[i]).item()) for i in range(k))
