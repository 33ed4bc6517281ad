"""What is done to the raw logits row before the temperature and the filters: OpenAI's logit_bias,
then the presence, frequency and repetition penalties as vLLM defines them (OpenAI's two, and the
Hugging Face repetition penalty).

In this order (the bias first, as mlx-lm's make_logits_processors has it; the penalties in vLLM's):
- logit_bias: a token's bias (-100 to 100) is added to its logit, at every position alike;
- repetition r (1 = off): a token seen in the prompt or the reply so far has its logit divided by r
  where positive, multiplied by r where not;
- then frequency f and presence p (0 = off): logit -= f * count + p * (count > 0), count = the token's
  occurrences in the reply so far (not the prompt).

The counts at a position are the reply's tokens before it, whichever call computes the row: row j of
a verify round counts the drafts before it, which are the tokens a serial step at that position has
seen. So drafted == serial holds with penalties, and the token stays a pure function of (logits,
seed, position, the tokens before it). Computed in float64 on the host (engine/sampling.py takes the
row from there); a request with a bias or penalties takes the host loop, not the pipelined greedy
steps. The bias depends on the token id only, so drafted == serial holds with it as without it.
Logprobs are taken from the raw row, before all of this (engine/logprobs.py).

Last, vLLM's min_tokens (`hold`): while the reply has fewer than n tokens, the ids that would end it
(EOS, stop_token_ids) are set to -inf, so they are never sampled. The count at a row is its own
position's (the tokens pushed and the drafts before it), like the penalties' counts."""

from __future__ import annotations

import numpy as np


class Penalties:
    def __init__(self, presence: float = 0.0, frequency: float = 0.0, repetition: float = 1.0, prompt=(),
                 bias: dict | None = None):
        self.presence, self.frequency, self.repetition = float(presence), float(frequency), float(repetition)
        # logit_bias as two arrays, ids ascending ({id: bias}, checked by engine/args.py)
        items = sorted((bias or {}).items())
        self.bias_ids = np.array([i for i, _ in items], dtype=np.int64)
        self.bias_vals = np.array([v for _, v in items], dtype=np.float64)
        self.penalised = self.presence != 0.0 or self.frequency != 0.0 or self.repetition != 1.0
        self.active = self.penalised or self.bias_ids.size > 0
        self.counts: dict[int, int] = {}
        self.prompt = np.asarray(prompt, dtype=np.int64) if self.repetition != 1.0 else None
        self._seen = None        # repetition: a mask over the vocabulary of the ids seen (prompt and reply)
        self.n = 0                      # reply tokens pushed
        self.min_tokens, self.held_ids = 0, np.zeros(0, dtype=np.int64)

    def hold(self, min_tokens: int, ids) -> None:
        """min_tokens: the ids that end a reply (`ids`) are out of the rows of its first n positions."""
        if min_tokens > 0 and ids:
            self.min_tokens, self.held_ids = int(min_tokens), np.array(sorted(ids), dtype=np.int64)
            self.active = True

    @classmethod
    def of(cls, sampling, prompt) -> "Penalties":
        return cls(sampling.presence_penalty, sampling.frequency_penalty, sampling.repetition_penalty, prompt,
                   sampling.logit_bias)

    def push(self, token: int) -> None:
        """A token joins the reply."""
        self.n += 1
        if self.penalised:
            self.counts[token] = self.counts.get(token, 0) + 1
            if self._seen is not None:
                self._seen[token] = True

    def apply(self, row: np.ndarray, before=()) -> np.ndarray:
        """The penalised row (float64) for the next position; `before`: reply tokens not pushed yet
        that precede it (a verify round's earlier drafts). The row itself when nothing is on."""
        if not self.active:
            return row
        counts = self.counts
        if len(before):
            counts = dict(counts)
            for t in before:
                counts[t] = counts.get(t, 0) + 1
        x = np.array(row, dtype=np.float64).reshape(-1)
        if self.bias_ids.size:
            x[self.bias_ids] += self.bias_vals
        if self.repetition != 1.0:
            # one mask kept up to date, not the union of the prompt's ids and the reply's made again
            # at every token (a sort of the whole prompt a token)
            if self._seen is None:
                self._seen = np.zeros(x.shape[0], dtype=bool)
                self._seen[self.prompt] = True
                self._seen[list(self.counts)] = True
            seen = self._seen
            if len(before):
                seen = seen.copy()
                seen[list(before)] = True
            v = x[seen]
            with np.errstate(over="ignore"):
                x[seen] = np.where(v > 0, v / self.repetition, v * self.repetition)
        if counts and (self.frequency != 0.0 or self.presence != 0.0):
            ids = np.fromiter(counts.keys(), dtype=np.int64, count=len(counts))
            c = np.fromiter(counts.values(), dtype=np.float64, count=len(counts))
            x[ids] -= self.frequency * c + self.presence
        # a logit pushed past float64's range (a repetition penalty of 1e-310 divides by it) stays
        # the largest finite value: +inf was greedy's choice and, non-finite, out of sampling's
        np.minimum(x, np.finfo(np.float64).max, out=x)
        if self.n + len(before) < self.min_tokens:
            x[self.held_ids] = -np.inf
        return x
