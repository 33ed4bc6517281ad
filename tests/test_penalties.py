"""Presence / frequency / repetition penalties (engine/penalties.py): vLLM's definitions, counted at
each row's own position, so drafted == serial and resumed == fresh hold with them."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from tensorfold.engine import Engine, PrefillMode, SamplingParams
from tensorfold.engine.penalties import Penalties


def _reference(row, prompt, reply, presence, frequency, repetition):
    """The definitions, token by token."""
    x = [float(v) for v in row]
    for t in set(prompt) | set(reply):
        x[t] = x[t] / repetition if x[t] > 0 else x[t] * repetition
    for t in set(reply):
        x[t] -= frequency * reply.count(t) + presence
    return np.array(x)


@pytest.mark.parametrize("presence, frequency, repetition", [(0.5, 0.0, 1.0), (0.0, -0.7, 1.0), (0.0, 0.0, 1.3),
                                                             (1.5, 0.4, 0.8), (0.0, 0.0, 1.0)])
def test_penalties_are_the_definitions(presence, frequency, repetition):
    rng = np.random.default_rng(1)
    row = rng.standard_normal(300).astype(np.float32) * 3
    prompt = rng.integers(0, 300, 40).tolist()
    reply = rng.integers(0, 300, 25).tolist() + [7, 7, 7]
    pen = Penalties(presence, frequency, repetition, prompt)
    for t in reply[:-5]:
        pen.push(t)
    got = pen.apply(row, before=reply[-5:])
    assert np.array_equal(got, _reference(row, prompt, reply, presence, frequency, repetition))   # the same operations
    for t in reply[-5:]:                    # pushed or pending: the same row
        pen.push(t)
    assert np.array_equal(pen.apply(row), got)
    assert pen.active == ((presence, frequency, repetition) != (0.0, 0.0, 1.0))


REPEAT = "def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n    return a + b\n\n\ndef add("


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_penalties_drafted_equal_serial(tinycode_path, temperature):
    """Drafts accepted under penalties (18 of 33 with the mild set, 2 of 4 with the strong one, on
    the CPU) give the serial reply; the strong set changes the reply."""
    eng = Engine(tinycode_path, snapshot_dir=None)
    plain = SamplingParams(temperature=temperature, seed=3)
    for kw in (dict(frequency_penalty=0.2, repetition_penalty=1.05),
               dict(presence_penalty=0.5, frequency_penalty=1.0, repetition_penalty=1.3)):
        pen = SamplingParams(temperature=temperature, seed=3, **kw)
        drafted = eng.generate_text(prompt=REPEAT, max_tokens=48, sampling=pen)
        serial = eng.generate_text(prompt=REPEAT, max_tokens=48, sampling=pen, draft=False)
        assert drafted[2].accepted > 0 and drafted[1] == serial[1], kw
    assert eng.generate_text(prompt=REPEAT, max_tokens=48, sampling=plain)[1] != drafted[1]   # they act


def test_penalties_resumed_equal_fresh(checkpoints):
    path, mode = checkpoints["qwen3_mlx_4bit"], PrefillMode(grid=16)
    p = SamplingParams(temperature=0.0, frequency_penalty=1.0, repetition_penalty=1.2)
    eng = Engine(path, prefill_mode=mode, snapshot_dir=None)
    first = list(range(5, 45))
    second = first + eng.generate_text(prompt=first, max_tokens=6, sampling=p)[1] + [9, 9]
    resumed = eng.generate_text(prompt=second, max_tokens=12, sampling=p)
    fresh = Engine(path, prefill_mode=mode, snapshot_dir=None).generate_text(prompt=second, max_tokens=12, sampling=p)
    assert resumed[2].cached_tokens > 0 and resumed[:2] == fresh[:2]


def test_penalty_ranges_and_generation_config(checkpoints, tmp_path):
    from tensorfold.errors import RequestError
    d = tmp_path / "m"
    shutil.copytree(checkpoints["qwen3_mlx_4bit"], d)
    (d / "generation_config.json").write_text(json.dumps({"repetition_penalty": 1.05, "temperature": 0.7}))
    eng = Engine(d, drafts=False)
    assert eng.generation_defaults == {"repetition_penalty": 1.05, "temperature": 0.7}
    for bad in (dict(presence_penalty=2.1), dict(frequency_penalty=-2.5), dict(repetition_penalty=0.0),
                dict(repetition_penalty=float("nan"))):
        with pytest.raises(RequestError) as e:
            eng.generate_text(prompt=[5, 6], max_tokens=2, sampling=SamplingParams(**bad))
        assert e.value.param == next(iter(bad))


def test_logit_bias_is_added_first():
    """logit_bias adds to the raw logits, before the penalties (mlx-lm's order): the repetition penalty
    divides the biased value. Only the bias: the row plus the bias; none: the row itself."""
    rng = np.random.default_rng(2)
    row = rng.standard_normal(50).astype(np.float32)
    bias = {3: 100.0, 10: -100.0, 11: 0.5}
    got = Penalties(bias=bias).apply(row)
    want = row.astype(np.float64)
    for i, b in bias.items():
        want[i] += b
    assert np.array_equal(got, want) and Penalties(bias=bias).active
    both = Penalties(repetition=2.0, prompt=[3, 10], bias=bias).apply(row)
    assert both[3] == (float(row[3]) + 100.0) / 2.0 and both[10] == (float(row[10]) - 100.0) * 2.0
    assert both[11] == want[11]
    assert Penalties(bias=None).apply(row) is row and not Penalties(bias=None).active


def test_min_tokens_holds_the_ending_ids_at_each_rows_own_position():
    """hold(n, ids): the ids are -inf in the rows of positions 0..n-1 (pushed tokens and pending
    drafts both count), the row as it is from position n on; with a bias, after it."""
    row = np.arange(10, dtype=np.float32)
    pen = Penalties(bias={2: 50.0})
    pen.hold(3, {2, 9})
    assert pen.active
    for pos in range(5):
        got = pen.apply(row, before=[4] * (pos - pen.n))
        held = pos < 3
        assert (got[[2, 9]] == -np.inf).all() == held and got[2] == (-np.inf if held else 52.0), pos
        if pos < 2:
            pen.push(4)
    off = Penalties()
    off.hold(0, {2})
    assert not off.active and off.apply(row) is row


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logit_bias_drafted_equal_serial(tinycode_path, temperature):
    """With a bias that bans the serial reply's most frequent token and pushes another, drafts still
    run and are accepted (the bias depends on the id only), the reply equals the serial one and
    differs from the unbiased reply; the banned token never appears."""
    eng = Engine(tinycode_path, snapshot_dir=None)
    plain = eng.generate_text(prompt=REPEAT, max_tokens=48, sampling=SamplingParams(temperature=temperature, seed=3))
    top = max(set(plain[1]), key=plain[1].count)
    p = SamplingParams(temperature=temperature, seed=3, logit_bias={top: -100, (top + 1) % 100: 2.0})
    drafted = eng.generate_text(prompt=REPEAT, max_tokens=48, sampling=p)
    serial = eng.generate_text(prompt=REPEAT, max_tokens=48, sampling=p, draft=False)
    assert drafted[1] == serial[1] and drafted[2].drafted > 0
    assert top not in drafted[1] and drafted[1] != plain[1]


def test_logit_bias_arguments(checkpoints):
    from tensorfold.errors import RequestError
    eng = Engine(checkpoints["qwen3_mlx_4bit"], drafts=False, snapshot_dir=None)
    V = eng.model.cfg.vocab_size
    for bad in ([1, 2], {"5": 1.0}, {-1: 1.0}, {True: 1.0}, {5: 100.5}, {5: float("nan")}, {5: "1"}, {5: True},
                {V: 1.0}):
        with pytest.raises(RequestError) as e:
            eng.generate_text(prompt=[5, 6], max_tokens=2, sampling=SamplingParams(logit_bias=bad))
        assert e.value.param == "logit_bias", bad
    ok = eng.generate_text(prompt=[5, 6], max_tokens=3, sampling=SamplingParams(logit_bias={np.int64(9): 100}))
    assert ok[1] == [9, 9, 9]
    assert eng.generate_text(prompt=[5, 6], max_tokens=3, sampling=SamplingParams(logit_bias={}))[1] == \
        eng.generate_text(prompt=[5, 6], max_tokens=3)[1]


def test_an_overflowing_penalty_is_the_largest_logit_for_every_sampler():
    """A repetition penalty of 1e-310 divides a positive logit past float64's range: +inf was
    greedy's choice but, not finite, left out of sampling's candidates (the preference flipped)."""
    from tensorfold.engine.sampling import sample
    row = np.array([1.0, 3.0, 2.0, -1.0], np.float32)
    pen = Penalties(repetition=1e-310, prompt=[2])
    x = pen.apply(row)
    assert np.isfinite(x).all() and int(np.argmax(x)) == 2
    assert {sample(x, s, 9, SamplingParams(temperature=0.8, seed=s)) for s in range(10)} == {2}
    assert sample(x, 0, 9, SamplingParams(temperature=0.0)) == 2
