"""Keyed sampling: a pure function of (logits, seed, absolute position, token id)."""

from __future__ import annotations

import numpy as np

from tensorfold.engine.sampling import filtered_logits, keyed_uniforms, prompt_seed, sample
from tensorfold.engine.types import SamplingParams


def test_same_key_same_token_whatever_the_order():
    rng = np.random.default_rng(0)
    rows = rng.normal(size=(16, 300)).astype(np.float32)
    p = SamplingParams(temperature=1.0, top_p=0.95, min_p=0.01)
    forward = [sample(rows[i], 7, 100 + i, p) for i in range(16)]
    backward = [sample(rows[i], 7, 100 + i, p) for i in reversed(range(16))][::-1]
    window = []
    for chunk in np.split(np.arange(16), [3, 4, 11]):          # any split of the window
        window += [sample(rows[i], 7, 100 + i, p) for i in chunk]
    assert forward == backward == window
    assert [sample(rows[0], 7, 100, p) for _ in range(5)] == [forward[0]] * 5


def test_uniforms_depend_on_seed_and_position_only():
    a = keyed_uniforms(1, 5, 1000)
    assert np.array_equal(a, keyed_uniforms(1, 5, 1000))
    assert np.array_equal(a[:10], keyed_uniforms(1, 5, 10))       # independent of vocab size
    assert not np.array_equal(a, keyed_uniforms(1, 6, 1000))
    assert not np.array_equal(a, keyed_uniforms(2, 5, 1000))
    assert a.min() > 0 and a.max() < 1


def test_a_uniform_is_never_one():
    """((h >> 11) + 0.5) / 2^53 rounded to exactly 1.0 at the top 53-bit value (a tie, to even):
    -log(-log(1)) = inf, and that id won against any logits. This (seed, position) hits it for
    id 0 (found by inverting SplitMix64: session 56's sampling audit). Every other uniform keeps
    its bits (the neighbours here, and the draws the other tests pin)."""
    seed, pos = -2635710908111322571, 10
    u = keyed_uniforms(seed, pos, 3)
    assert u[0] == np.nextafter(1.0, 0.0) and 0 < u.min() and u.max() < 1
    row = np.array([-30.0, 30.0, 29.0], dtype=np.float32)      # id 0: probability 6e-27
    assert sample(row, seed, pos, SamplingParams(temperature=1.0)) in (1, 2)


def test_greedy_ties_go_to_lower_id():
    logits = np.array([0.0, 3.0, 1.0, 3.0], dtype=np.float32)
    assert sample(logits, 0, 0, SamplingParams(temperature=0.0)) == 1
    # top_k=1 keeps the lower of two tied ids
    x = filtered_logits(logits, SamplingParams(temperature=1.0, top_k=1))
    assert np.isfinite(x).tolist() == [False, True, False, False]


def test_filters():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    keep = lambda **kw: np.isfinite(filtered_logits(logits, SamplingParams(temperature=1.0, **kw))).tolist()
    assert keep(top_p=0.5) == [True, False, False, False]
    assert keep(top_p=0.75) == [True, True, False, False]
    assert keep(top_p=0.81) == [True, True, True, False]
    assert keep(top_k=2) == [True, True, False, False]
    assert keep(min_p=0.2) == [True, True, True, False]   # 0.15 >= 0.2 * 0.5
    assert keep(min_p=0.31) == [True, True, False, False]


def test_distribution_matches_softmax_chi_square():
    logits = np.array([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2], dtype=np.float32)
    T = 0.8
    n = 6000
    counts = np.zeros(len(logits))
    for seed in range(n):
        counts[sample(logits, seed, 42, SamplingParams(temperature=T))] += 1
    p = np.exp(logits / T - np.max(logits / T))
    p /= p.sum()
    chi2 = float(((counts - n * p) ** 2 / (n * p)).sum())
    assert chi2 < 24.32, (chi2, counts, n * p)   # df=7, p=0.001
    # and over positions with one seed (the stream a single reply sees)
    counts[:] = 0
    for pos in range(n):
        counts[sample(logits, 12345, pos, SamplingParams(temperature=T))] += 1
    chi2 = float(((counts - n * p) ** 2 / (n * p)).sum())
    assert chi2 < 24.32, chi2


def test_prompt_seed_is_a_hash_of_the_prompt():
    assert prompt_seed([1, 2, 3]) == prompt_seed([1, 2, 3])
    assert prompt_seed([1, 2, 3]) != prompt_seed([1, 2, 4])


def _reference_keep(logits, p):
    """Brute force: full sort by (value desc, id asc), then the same rules."""
    x = logits.astype(np.float64)
    x = (x - x.max()) / p.temperature
    ids = np.arange(len(x))
    keep = np.ones(len(x), bool)
    if p.top_k:
        order = np.lexsort((ids, -x))
        keep[:] = False
        keep[order[: p.top_k]] = True
    if p.min_p:
        keep &= (x - x[keep].max()) >= np.log(p.min_p)
    if p.top_p < 1.0:
        top = x[keep].max()
        z = np.sum(np.exp(x[keep] - top))
        order = [i for i in np.lexsort((ids, -x)) if keep[i]]
        cum = np.cumsum(np.exp(x[order] - top)) / z
        n = int(np.searchsorted(cum, p.top_p, side="left")) + 1
        keep[:] = False
        keep[order[:n]] = True
    return keep


def test_filters_match_brute_force_on_large_vocab_with_ties():
    rng = np.random.default_rng(5)
    for trial in range(12):
        v = int(rng.choice([50, 3000, 40000]))
        logits = np.round(rng.normal(size=v) * float(rng.choice([0.5, 3.0])), 1).astype(np.float32)  # many ties
        p = SamplingParams(temperature=float(rng.choice([0.5, 1.0, 4.0])),
                           top_p=float(rng.choice([1.0, 0.5, 0.9, 0.999])),
                           top_k=int(rng.choice([0, 1, 7, 2000])), min_p=float(rng.choice([0.0, 0.02])))
        got = np.isfinite(filtered_logits(logits, p))
        assert np.array_equal(got, _reference_keep(logits, p)), (trial, p)


def test_unfiltered_rows_take_the_same_tokens_as_the_gathered_form():
    """sample() skips the gather of kept ids when no filter took an id out; the token must be
    the one the gathered form (keyed uniforms of the kept ids, argmax, lowest id on ties) gives."""
    def gathered(logits, seed, position, p):
        x = filtered_logits(logits, p)
        ids = np.flatnonzero(np.isfinite(x))
        g = x[ids] - np.log(-np.log(keyed_uniforms(seed, position, x.shape[0], ids)))
        return int(ids[np.argmax(g)])

    rng = np.random.default_rng(11)
    for _ in range(400):
        V = int(rng.choice([3, 64, 4096]))
        x = (rng.standard_normal(V) * rng.choice([0.01, 1.0, 8.0])).astype(np.float32)
        if rng.random() < 0.3:
            x[rng.integers(0, V, size=max(1, V // 8))] = -np.inf
        if rng.random() < 0.3:
            x = np.round(x)                      # ties
        p = SamplingParams(temperature=float(rng.choice([0.5, 1.0, 1.7])),
                           top_p=float(rng.choice([1.0, 0.8])), top_k=int(rng.choice([0, 5])))
        seed, pos = int(rng.integers(0, 2**62)), int(rng.integers(0, 10**6))
        assert sample(x, seed, pos, p) == gathered(x, seed, pos, p)


def test_tiny_temperatures_sample_the_best_ids():
    """logit / T overflowed for a tiny positive T (1e-310 is a valid request): the best ids went
    to +inf and were dropped as non-finite, so a near-greedy request sampled noise or, with every
    id gone, raised. Scaled from the row's maximum, only the maxima survive."""
    rng = np.random.default_rng(3)
    for T in (1e-3, 1e-30, 1e-200, 1e-310, 5e-324):
        for trial in range(20):
            x = (rng.standard_normal(500) * 4).astype(np.float32)
            x[rng.integers(0, 500, size=20)] = -np.inf
            best = int(np.argmax(x))
            for top_p, top_k, min_p in ((1.0, 0, 0.0), (0.9, 40, 0.05)):
                p = SamplingParams(temperature=T, top_p=top_p, top_k=top_k, min_p=min_p)
                assert sample(x, trial, 7, p) == best, (T, trial)
            tied = x.copy()
            tied[best + 1 if best < 499 else best - 1] = x[best]
            pair = sorted((best, best + 1 if best < 499 else best - 1))
            assert sample(tied, trial, 7, SamplingParams(temperature=T)) in pair
    huge = np.array([3e38, -3e38, 1.0, 3e38], dtype=np.float32)       # float32's range, T < 1
    assert sample(huge, 0, 0, SamplingParams(temperature=1e-300)) in (0, 3)


def test_stop_matcher_holds_back_exactly_the_longest_stop_prefix():
    """StopMatcher emits text as soon as it cannot be the start of a stop string: the held tail is
    the longest one that is a proper prefix of some stop string; the reply ends at the stop
    completed first in the text, whatever the pieces (the earliest start made "ret" + "urn" and
    "return" end differently with the stops "return" and "u"). Checked against the direct
    definitions on random texts over a small alphabet (many partial matches), fed in random
    pieces, and against the text fed whole."""
    from tensorfold.engine.stops import StopMatcher

    def reference(stops, pieces):
        out, held = [], ""
        for p in pieces:
            held += p
            hits = [(i + len(s), i) for s in stops if (i := held.find(s)) >= 0]
            if hits:
                out.append(held[:min(hits)[1]])
                return "".join(out), True
            keep = max([n for s in stops for n in range(1, min(len(s) - 1, len(held)) + 1)
                        if held.endswith(s[:n])], default=0)
            out.append(held[:len(held) - keep])
            held = held[len(held) - keep:]
        return "".join(out) + held, False

    rng = np.random.default_rng(5)
    for _ in range(3000):
        stops = ["".join(rng.choice(list("aab\u00e9"), int(rng.integers(1, 6)))) for _ in range(int(rng.integers(1, 4)))]
        text = "".join(rng.choice(list("aab\u00e9c"), int(rng.integers(0, 30))))
        cuts = sorted(rng.integers(0, len(text) + 1, int(rng.integers(0, 6))).tolist())
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        m, got, stopped = StopMatcher(stops), [], False
        for p in pieces:
            t, stopped = m.push(p)
            got.append(t)
            if stopped:
                break
        got = "".join(got) + ("" if stopped else m.flush())
        assert (got, stopped) == reference(stops, pieces), (stops, pieces)
        assert (got, stopped) == reference(stops, [text]), (stops, pieces)     # however it was cut
    m = StopMatcher(["return", "u"])
    assert m.push("x = ret") == ("x = ", False) and m.push("urn 1") == ("ret", True)
    assert StopMatcher(["return", "u"]).push("x = return 1") == ("x = ret", True)


def test_a_row_without_a_finite_logit_samples_as_greedy_does():
    """A broken checkpoint's row of NaN (or of -inf) left no candidate: sampling raised on the
    argmax of nothing (the request failed with a 500) where greedy gave a token. Now both give the
    greedy rule's token, whatever the filters."""
    for row in (np.full(50, np.nan, np.float32), np.full(50, -np.inf, np.float32),
                np.array([np.nan, -np.inf, np.nan] * 10, np.float32)):
        want = sample(row, 0, 0, SamplingParams(temperature=0.0))
        for p in (SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, top_p=0.5, top_k=5, min_p=0.1)):
            assert sample(row, 3, 9, p) == want


def test_positive_infinite_logits_outweigh_the_finite_ones():
    """A row with +inf logits: greedy takes the first +inf id; sampling had dropped them (as NaN)
    and picked among the finite ids. Now the +inf ids alone are candidates, equally likely."""
    row = np.linspace(-1, 5, 40).astype(np.float32)
    row[7] = np.inf
    for p in (SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, top_p=0.5, top_k=5, min_p=0.1)):
        assert {sample(row, seed, 3, p) for seed in range(20)} == {7}
    row[30] = np.inf
    got = {sample(row, seed, 3, SamplingParams(temperature=1.0)) for seed in range(40)}
    assert got == {7, 30}
    assert sample(row, 0, 0, SamplingParams(temperature=0.0)) == 7
