"""Logprobs of generated tokens: the model's raw distribution, a pure function of each token's
logits row, so drafted == serial and resumed == fresh hold for them bit for bit (engine/logprobs.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tensorfold.engine import Engine, PrefillMode, SamplingParams
from tensorfold.engine.logprobs import FLOOR, log_softmax, token_logprob, top_ids


def test_log_softmax_and_the_top_ids():
    rng = np.random.default_rng(0)
    row = rng.standard_normal(1000).astype(np.float32) * 4
    row[[7, 300, 999]] = row.max() + 1          # three equal maxima
    lp = log_softmax(row)
    x = row.astype(np.float64)
    assert np.allclose(lp, x - np.logaddexp.reduce(x), rtol=0, atol=1e-12)
    top = top_ids(lp, 5)
    assert list(top[:3]) == [7, 300, 999]          # ties: the lower id first
    assert list(top[3:]) == list(np.argsort(-lp, kind="stable")[3:5])
    assert len(top_ids(lp, 0)) == 0 and len(top_ids(lp, 5000)) == 1000
    t = token_logprob(row, 42, 3)
    assert t.id == 42 and t.logprob == float(lp[42]) and [i for i, _ in t.top] == [7, 300, 999]
    # no infinities or NaN reach JSON: -9999.0 (OpenAI's value for no measurable probability)
    masked = row.copy()
    masked[42] = -np.inf
    assert token_logprob(masked, 42, 0).logprob == FLOOR
    assert token_logprob(np.full(8, -np.inf, np.float32), 3, 2).logprob == FLOOR
    broken = token_logprob(np.array([0.0, np.nan, 1.0], np.float32), 2, 3)
    assert broken.logprob == FLOOR and all(v == FLOOR for _, v in broken.top)
    assert all(math.isfinite(v) for _, v in token_logprob(row, 1, 20).top)


def _run(eng, prompt, *, n=3, draft=True, temperature=0.0, max_tokens=40, logprobs=True):
    evs = list(eng.generate(prompt=prompt, max_tokens=max_tokens, draft=draft, logprobs=n if logprobs else None,
                            sampling=SamplingParams(temperature=temperature, seed=5)))
    toks = [t for ev in evs for t in ev.token_ids]
    lps = [lp for ev in evs if ev.logprobs for lp in ev.logprobs]
    for ev in evs:
        assert ev.logprobs is None if not logprobs else len(ev.logprobs or []) == len(ev.token_ids)
    return toks, lps, evs[-1].stats


REPEAT = "def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n    return a + b\n\n\ndef add("


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_drafted_equal_serial(tinycode_path, temperature):
    """A verify round's rows give each token the logprobs a one-row step gives (the real model, so
    that drafts are accepted); the tokens are those of a request without logprobs (the greedy
    pipeline, which never reads the logits, is left for the host loop)."""
    eng = Engine(tinycode_path, snapshot_dir=None)
    drafted = _run(eng, REPEAT, temperature=temperature)
    serial = _run(eng, REPEAT, temperature=temperature, draft=False)
    assert drafted[2].accepted > 0
    assert drafted[0] == serial[0] and drafted[1] == serial[1]
    assert _run(eng, REPEAT, temperature=temperature, logprobs=False)[0] == drafted[0]
    assert [lp.id for lp in drafted[1]] == drafted[0]
    for lp in drafted[1]:
        assert len(lp.top) == 3 and [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
        if temperature == 0.0:      # greedy: the sampled token is the most likely one
            assert lp.top[0] == (lp.id, lp.logprob)


def test_logprobs_resumed_equal_fresh(checkpoints):
    """A turn resumed from a grid-point snapshot gives the logprobs a fresh engine gives."""
    path, mode = checkpoints["qwen3_mlx_4bit"], PrefillMode(grid=16)
    eng = Engine(path, prefill_mode=mode, snapshot_dir=None)
    first = list(range(5, 45))
    toks, _, _ = _run(eng, first, max_tokens=8, n=2)
    second = first + toks + list(range(50, 60))
    resumed = _run(eng, second, max_tokens=8, n=2)
    assert resumed[2].cached_tokens > 0
    fresh = _run(Engine(path, prefill_mode=mode, snapshot_dir=None), second, max_tokens=8, n=2)
    assert fresh[2].cached_tokens == 0
    assert resumed[:2] == fresh[:2]


def test_logprobs_argument_is_checked(checkpoints):
    from tensorfold.errors import RequestError
    eng = Engine(checkpoints["qwen3_mlx_4bit"], snapshot_dir=None)
    for bad in (-1, 21, 2.0, True, "3"):
        with pytest.raises(RequestError) as e:
            list(eng.generate(prompt=[5, 6, 7], max_tokens=2, logprobs=bad))
        assert e.value.param == "logprobs"


def test_token_bytes(tinycode_path, tmp_path):
    """The bytes a logprobs entry gives each token: joined, they are the decoded text (byte-level
    BPE, a character split over tokens included; SentencePiece pieces with byte fallback, where the
    decoder strips the first space; added tokens as typed)."""
    from tensorfold.tokenizer import Tokenizer
    from test_tokenizer import _spm_dir

    tok = Tokenizer.from_dir(tinycode_path)
    text = "def f(x):\n    return 'é€😀'  # ok\t<|im_end|>"
    ids = tok.encode(text)
    assert any(len(tok.token_bytes(i)) == 1 and tok.token_bytes(i)[0] >= 0x80 for i in ids)
    assert b"".join(tok.token_bytes(i) for i in ids) == tok.decode(ids).encode() == text.encode()
    spm = Tokenizer.from_dir(_spm_dir(tmp_path / "spm"))
    ids = spm.encode("The quick é€ brown")
    assert any(spm.is_byte_token(i) for i in ids)
    assert b"".join(spm.token_bytes(i) for i in ids) == b" " + spm.decode(ids).encode()


def test_prompt_logprobs(tmp_path, checkpoints):
    """echo's prompt logprobs (Engine.prompt_logprobs_of): the row-exact kernels make them the same
    whatever rows a call holds; they are the model's (close to MLX's own forward on a float32
    model); a request that scores its prompt generates what it would without; max_tokens 0 scores
    the prompt alone."""
    import mlx.core as mx
    from tensorfold.testing import write_checkpoint

    path = write_checkpoint(tmp_path / "f32", family="qwen3", dtype="float32", seed=4)
    eng = Engine(path, snapshot_dir=None)
    ids = list(np.random.default_rng(2).integers(3, 500, 70))
    ids = [int(t) for t in ids]
    whole = eng.prompt_logprobs_of(ids, 3)
    eng.PROMPT_LOGPROB_ROWS = 7
    assert eng.prompt_logprobs_of(ids, 3) == whole
    assert whole[0].logprob is None and whole[0].top is None and [t.id for t in whole] == ids
    m = eng.model
    rows = np.asarray(m.forward(mx.array([ids]), m.new_cache(), exact=False, all_logits=True).astype(mx.float32))
    for i in range(1, len(ids)):
        ref = rows[i - 1].astype(np.float64)
        ref = ref - np.logaddexp.reduce(ref)
        assert abs(whole[i].logprob - ref[ids[i]]) < 1e-3
        assert {t for t, _ in whole[i].top} == set(np.argsort(-ref)[:3].tolist())

    q = Engine(checkpoints["qwen3_mlx_4bit"], snapshot_dir=None)
    evs = list(q.generate(prompt=ids, max_tokens=6, logprobs=2, prompt_logprobs=2))
    assert evs[0].prompt_logprobs == q.prompt_logprobs_of(ids, 2) and not evs[0].token_ids
    plain = list(q.generate(prompt=ids, max_tokens=6, logprobs=2))
    assert [t for e in evs for t in e.token_ids] == [t for e in plain for t in e.token_ids]
    assert [x for e in evs if e.logprobs for x in e.logprobs] == [x for e in plain if e.logprobs for x in e.logprobs]
    only = list(q.generate(prompt=ids, max_tokens=0, prompt_logprobs=0))
    assert len(only) == 1 and only[0].finish_reason == "length" and only[0].stats.completion_tokens == 0
    assert [t.logprob for t in only[0].prompt_logprobs] == [t.logprob for t in evs[0].prompt_logprobs]
    with pytest.raises(Exception):
        list(q.generate(prompt=ids, max_tokens=0))


def test_completion_text_offsets_are_positions_in_the_text(tinycode_path):
    """text_offset gives where each token's bytes start in the text (a token that is part of a
    character: where that character starts); it counted the length of the tokens' names, so
    'bytes:\\xf0' moved every later offset by 10."""
    from tensorfold.engine.logprobs import TokenLogprob
    from tensorfold.server.responses import ReplyBuilder
    from tensorfold.tokenizer import Tokenizer
    tok = Tokenizer.from_dir(tinycode_path)
    text = "a 😀! é中x"
    ids = tok.encode(text)
    assert any(tok.token_bytes(i)[0] >= 0x80 and len(tok.token_bytes(i)) == 1 for i in ids)
    reply = ReplyBuilder("completion", "m", tokenizer=tok)
    half = len(ids) // 2               # two chunks, as a stream sends them
    offsets = [o for part in (ids[:half], ids[half:])
               for o in reply.logprobs([TokenLogprob(i, -1.0) for i in part])["text_offset"]]
    want = [len(b"".join(tok.token_bytes(j) for j in ids[:k]).decode("utf-8", "ignore")) for k in range(len(ids))]
    assert offsets == want and want[-1] == len(text) - 1


def test_choices_share_one_prefill(checkpoints, monkeypatch):
    """A request's n choices prefill and score their prompt once (Engine.generate(keep_prompt=True));
    choice i then equals the same choice on a fresh engine: the kept state is that prefill's."""
    path = checkpoints["qwen3_mlx_4bit"]
    eng = Engine(path, snapshot_dir=None)
    calls = {"prefill": 0, "score": 0}
    prefill, score = eng._prefill, eng.prompt_logprobs_of
    monkeypatch.setattr(eng, "_prefill", lambda *a, **k: calls.__setitem__("prefill", calls["prefill"] + 1) or prefill(*a, **k))
    monkeypatch.setattr(eng, "prompt_logprobs_of", lambda *a, **k: calls.__setitem__("score", calls["score"] + 1) or score(*a, **k))
    ids = list(range(5, 60))
    out = []
    for i in range(3):
        evs = list(eng.generate(prompt=ids, max_tokens=6, logprobs=1, prompt_logprobs=1, keep_prompt=i < 2,
                                sampling=SamplingParams(temperature=0.9, seed=4, choice=i)))
        out.append(([t for e in evs for t in e.token_ids], evs[0].prompt_logprobs))
    eng.forget_prompt()
    assert calls == {"prefill": 1, "score": 1} and eng._kept is None
    for i in (1, 2):
        fresh = list(Engine(path, snapshot_dir=None).generate(
            prompt=ids, max_tokens=6, logprobs=1, prompt_logprobs=1, sampling=SamplingParams(temperature=0.9, seed=4, choice=i)))
        assert out[i] == ([t for e in fresh for t in e.token_ids], fresh[0].prompt_logprobs)
    assert out[0][0] != out[1][0] or out[1][0] != out[2][0]


def test_echo_offsets_are_positions_in_the_echoed_text(tmp_path, tinycode_path):
    """text_offset of an echoed prompt counts in the text echo returns (responses.echo_text: the
    prompt as its ids decode, less a BOS the tokenizer added): a BOS took 3 characters, a typed <s>
    (after which SentencePiece decodes a space) and a normalised prompt (NFD sent, NFC decoded)
    moved every later offset by one."""
    import unicodedata
    from tensorfold.engine.logprobs import TokenLogprob
    from tensorfold.server.responses import ReplyBuilder, echo_text
    from tensorfold.tokenizer import IncrementalDetokenizer, Tokenizer
    from test_tokenizer import _spm_dir
    spm = Tokenizer.from_dir(_spm_dir(tmp_path / "spm"))
    tiny = Tokenizer.from_dir(tinycode_path)
    cases = [(spm, p) for p in ("The quick é brown", "<s>The quick", "é€ start", "  two  spaces", "a\n\nb")]
    cases.append((tiny, unicodedata.normalize("NFD", "café bar = 1")))
    for tok, prompt in cases:
        ids = tok.encode_prompt(prompt)
        comp = tok.encode(" fox é€ over")
        d = IncrementalDetokenizer(tok, context=ids[-64:])
        text = echo_text(tok, prompt, ids) + "".join(d.add(t) for t in comp) + d.flush()
        skip = tok.added_bos(prompt, ids)
        reply = ReplyBuilder("completion", "m", tokenizer=tok, prompt_ids=ids, echo=echo_text(tok, prompt, ids),
                             skip_bos=skip)
        offs = reply.logprobs([TokenLogprob(ids[0], None, None)] + [TokenLogprob(i, -1.0) for i in ids[1:] + comp])[
            "text_offset"]
        assert offs == sorted(offs) and offs[-1] < len(text), (prompt, offs)
        for k, (t, o) in enumerate(zip(ids + comp, offs)):
            own = tok.token_bytes(t).decode("utf-8", "ignore")
            if (k == 0 and skip) or not own:
                continue
            assert text[o:].startswith(own) or (o == 0 and text.startswith(own.lstrip(" "))), (prompt, tok.id_to_token(t), o, text)
    assert echo_text(spm, "The quick", spm.encode_prompt("The quick")) == "The quick"


def test_a_prompt_that_fills_the_context_can_be_scored(checkpoints):
    eng = Engine(checkpoints["qwen3_mlx_4bit"], context=40, snapshot_dir=None, drafts=False)
    ids = list(range(5, 45))
    only = list(eng.generate(prompt=ids, max_tokens=0, prompt_logprobs=0))
    assert len(only[0].prompt_logprobs) == 40 and only[0].finish_reason == "length"
    from tensorfold.errors import RequestError
    with pytest.raises(RequestError):
        list(eng.generate(prompt=ids, max_tokens=1, prompt_logprobs=0))
    assert len(eng.prepare(prompt=ids, room=0).ids) == 40
