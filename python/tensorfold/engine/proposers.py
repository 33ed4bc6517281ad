"""Draft proposers for speculative decoding.

A proposer only guesses. The target verifies every guess in one row-exact call and keeps a draft
only while it equals the target's own keyed sample at that position, so what a proposer says can
change speed, never the reply."""

from __future__ import annotations

import mlx.core as mx


class Proposer:
    name = "proposer"
    max_width = 8

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        """A new request's start: its width and silence are its own (a drafter the engine keeps
        across requests stayed silenced for later, shorter ones: silent_until counts tokens)."""
        self.width = 4
        self.misses = 0          # consecutive rounds with nothing accepted
        self.silent_until = -1   # token count before which this proposer stays quiet

    def propose(self, tokens: list[int], k: int) -> list[int]:
        raise NotImplementedError

    def feedback(self, n_tokens: int, drafted: int, accepted: int) -> None:
        """Adapt the width to acceptance; silence a proposer that keeps missing."""
        if drafted == 0:
            return
        if accepted == drafted:
            self.width = min(self.width + 2, self.max_width)
            self.misses = 0
        elif accepted == 0:
            self.width = max(1, self.width // 2)
            self.misses += 1
            if self.misses >= 4:
                self.silent_until = n_tokens + 16 * self.misses
        else:
            self.width = max(1, min(self.max_width, accepted + 1))
            self.misses = 0

    def active(self, n_tokens: int) -> bool:
        return n_tokens >= self.silent_until


class ContextCopy(Proposer):
    """n-gram suffix match over prompt and reply so far: copy what followed the latest match."""
    name = "context"

    def __init__(self, ngram_max: int = 4, ngram_min: int = 2):
        super().__init__()
        self.nmax, self.nmin = ngram_max, ngram_min
        self._n = 0                          # tokens indexed so far
        self._last = None                    # the last of them (detects a new sequence)
        self._index: dict[tuple, int] = {}   # n-gram -> end position of its latest occurrence

    def _sync(self, tokens: list[int]) -> None:
        """Index the n-grams that end at positions added since the last call (append-only)."""
        n = self._n
        if n > len(tokens) or (n and self._last != tokens[n - 1]):   # a new sequence
            self._index, n = {}, 0
        for end in range(max(n, 1), len(tokens)):   # an occurrence needs a continuation
            for m in range(self.nmin, self.nmax + 1):
                if end - m >= 0:
                    self._index[tuple(tokens[end - m:end])] = end
        self._n, self._last = len(tokens), (tokens[-1] if tokens else None)

    def propose(self, tokens: list[int], k: int) -> list[int]:
        self._sync(tokens)
        for m in range(self.nmax, self.nmin - 1, -1):
            if len(tokens) < m + 1:
                continue
            pos = self._index.get(tuple(tokens[-m:]))
            if pos is not None and pos < len(tokens):
                return tokens[pos: pos + k]
        return []


class DraftModel(Proposer):
    """A smaller checkpoint with the same tokenizer, run greedily with its own KV cache."""
    name = "draft-model"

    def __init__(self, model, mode):
        super().__init__()
        self.model, self.mode = model, mode
        self.cache = model.new_cache()
        self.fed: list[int] = []
        self._oob = None         # (position, id) of a token past this model's vocab, if any
        self.cancel = None       # the request's cancel event (the engine sets it at each request)

    def propose(self, tokens: list[int], k: int) -> list[int]:
        from .prefill import PrefillCancelled, prefill
        # keep the longest common prefix of what the cache holds, feed the rest
        n = 0
        lim = min(len(self.fed), len(tokens) - 1)
        while n < lim and self.fed[n] == tokens[n]:
            n += 1
        if n < len(self.fed):
            if n == 0:
                self.cache = self.model.new_cache()
            else:
                self.cache.trim(n)
            self.fed = self.fed[:n]
        todo = tokens[n:]
        V = self.model.cfg.vocab_size
        oob = self._oob
        if oob is not None and len(tokens) > oob[0] and tokens[oob[0]] == oob[1]:
            return []                       # this sequence holds an id we cannot embed
        bad = next((n + j for j, t in enumerate(todo) if t >= V), None)
        if bad is not None:
            # a padding id of the target's larger vocab: not in this model's embedding (MLX's
            # gather does not check). No drafts for this sequence; the target decodes on alone.
            self._oob = (bad, tokens[bad])
            self.cache, self.fed = self.model.new_cache(), []
            return []
        if len(todo) > 1:
            # catch up on what the cache lacks (a drafter's bits never reach the reply): the few
            # tokens a verify round adds in one call of the decode kernels (MLX's own one-row
            # quantized matmul took ~70 ms a call on the CPU); a prompt through the grid prefill
            # from a grid point, else in grid-sized MLX forwards (it was one MLX call a token)
            # (a request cancelled meanwhile stops it between grid pieces: no drafts, and the
            # engine ends the request at its next step; the whole prompt's catch-up kept a
            # cancelled request busy for a prefill)
            rest = todo[:-1]
            try:
                if len(rest) <= 2 * self.max_width:
                    self.model.forward(mx.array([rest]), self.cache, exact=True, logits=False)
                elif self.cache.offset % self.mode.grid:
                    for a in range(0, len(rest), self.mode.grid):
                        if self.cancel is not None and self.cancel.is_set():
                            raise PrefillCancelled
                        piece = rest[a:a + self.mode.grid]
                        self.model.forward(mx.array([piece]), self.cache, exact=False, logits=False)
                        mx.eval(self.cache.arrays())
                else:
                    prefill(self.model, self.cache, tokens[:-1], self.mode, cancel=self.cancel)
            except PrefillCancelled:
                self.cache, self.fed = self.model.new_cache(), []
                return []
            self.fed = list(tokens[:-1])
        out: list[int] = []
        last = tokens[-1]
        for _ in range(k):
            # the drafter's one-row steps through the decode kernels, as the target's: MLX's own
            # one-row quantized matmul made a drafted request ~24x slower than serial on the CPU
            logits = self.model.forward(mx.array([[last]]), self.cache, exact=True, all_logits=True)
            self.fed.append(last)
            last = int(mx.argmax(logits[-1]).item())
            out.append(last)
        return out
