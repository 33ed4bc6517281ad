import json
import logging
import random
import shutil
import time

import pytest

from tensorfold.testing import CHAT_TEMPLATE, SPECIAL_TOKENS, build_tokenizer_json
from tensorfold.tokenizer import IncrementalDetokenizer, TemplateError, Tokenizer

MULTIBYTE = "héllo wörld — 你好，世界 😀🎉👩‍💻 naïve café ∑∫√ 日本語のテキスト 🇯🇵"


def _write_tok_dir(path, *, template=CHAT_TEMPLATE, tcfg=None, gcfg=None, mcfg=None, jinja=True):
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.json").write_text(build_tokenizer_json())
    if jinja and template is not None:
        (path / "chat_template.jinja").write_text(template)
    base = {"eos_token": "<|im_end|>", "bos_token": None}
    if not jinja and template is not None:
        base["chat_template"] = template
    base.update(tcfg or {})
    (path / "tokenizer_config.json").write_text(json.dumps(base))
    if gcfg is not None:
        (path / "generation_config.json").write_text(json.dumps(gcfg))
    if mcfg is not None:
        (path / "config.json").write_text(json.dumps(mcfg))
    return path


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = _write_tok_dir(tmp_path_factory.mktemp("tok"), gcfg={"eos_token_id": [2, 0]})
    return Tokenizer.from_dir(d)


@pytest.mark.parametrize("name, text", [
    ("tokenizer_config.json", '{"eos_token": "<|im_end|>",}'),
    ("generation_config.json", '{"eos_token_id": 2'),
    ("chat_template.json", '["not an object"]'),
])
def test_unreadable_side_files_are_errors(tmp_path, name, text):
    """A side file that is there but is not a JSON object is an error at load naming it (as
    transformers / mlx-lm make it). Read as empty, a trailing comma in tokenizer_config.json
    dropped the chat template and the eos token: no stop token, and chat requests refused with
    'this model has no chat template'."""
    d = _write_tok_dir(tmp_path / "t", template=None)   # chat_template.json is read where no other is
    (d / name).write_text(text)
    with pytest.raises(ValueError, match=name):
        Tokenizer.from_dir(d)


# ---------------------------------------------------------------------------------------------
# basics


def test_round_trip(tok):
    for text in ["", "hello world", "def f(x):\n    return x + 1\n", MULTIBYTE, "  spaces\t\ttabs\n\n"]:
        ids = tok.encode(text)
        assert all(isinstance(i, int) for i in ids)
        assert tok.decode(ids) == text


def test_special_tokens(tok):
    for i, s in enumerate(SPECIAL_TOKENS):
        assert tok.encode(s) == [i]
        assert tok.id_to_token(i) == s
        assert tok.token_to_id(s) == i
    assert tok.special_ids == frozenset(range(len(SPECIAL_TOKENS)))
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.decode(ids) == "<|im_start|>user\nhi<|im_end|>"
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi"
    # nothing added automatically
    assert tok.encode("hi")[0] not in tok.special_ids
    assert tok.vocab_size == len(json.loads(build_tokenizer_json())["model"]["vocab"])
    assert tok.think_tags == ("<think>", "</think>")
    assert tok.has_thinking_toggle


# ---------------------------------------------------------------------------------------------
# chat template


def test_chatml_basic(tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    out = tok.apply_chat_template(msgs)
    assert out == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    )
    # list-of-parts content renders the same as the string
    parts = [{"role": "user", "content": [{"type": "text", "text": "H"}, {"type": "text", "text": "i"}]}]
    assert tok.apply_chat_template(parts) == tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    ids = tok.encode(out)
    assert ids.count(1) == 3 and ids.count(2) == 2


def test_chatml_thinking_toggle(tok):
    msgs = [{"role": "user", "content": "Hi"}]
    default = tok.apply_chat_template(msgs)
    assert default.endswith("<|im_start|>assistant\n")
    assert tok.apply_chat_template(msgs, enable_thinking=True) == default
    off = tok.apply_chat_template(msgs, enable_thinking=False)
    assert off == default + "<think>\n\n</think>\n\n"
    # no generation prompt → no empty think block
    assert "<think>" not in tok.apply_chat_template(msgs, add_generation_prompt=False, enable_thinking=False)


def test_chatml_strips_earlier_thinking(tok):
    msgs = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
        {"role": "user", "content": "and 3+3?"},
    ]
    out = tok.apply_chat_template(msgs)
    assert "add them" not in out
    assert "<|im_start|>assistant\n4<|im_end|>\n" in out


def test_chatml_tools_tool_calls(tok):
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Météo in a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    msgs = [
        {"role": "system", "content": "You help."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": "sunny"},
    ]
    out = tok.apply_chat_template(msgs, tools=tools)
    assert out.startswith("<|im_start|>system\nYou help.\n\n# Tools")
    assert json.dumps(tools[0], ensure_ascii=False) in out  # tojson, not HTML-escaped, unicode kept
    assert "Météo" in out
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in out
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n" in out
    assert out.endswith("<|im_start|>assistant\n")


def test_tojson_indent_and_kwargs(tmp_path):
    t = Tokenizer.from_dir(
        _write_tok_dir(
            tmp_path,
            template="{{ messages[0] | tojson(indent=2) }}|{{ extra }}|{{ strftime_now('%Y') | length }}|"
            "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.role }}{% endfor %}",
        )
    )
    out = t.apply_chat_template([{"role": "user", "content": "é<b>"}, {"role": "user", "content": "x"}], extra=7)
    assert out == json.dumps({"role": "user", "content": "é<b>"}, indent=2, ensure_ascii=False) + "|7|4|user"


def test_raise_exception_is_clean_error(tmp_path):
    tmpl = "{% if messages[0].role != 'user' %}{{ raise_exception('first message must be from the user') }}{% endif %}ok"
    t = Tokenizer.from_dir(_write_tok_dir(tmp_path, template=tmpl))
    assert t.apply_chat_template([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(TemplateError, match="^first message must be from the user$"):
        t.apply_chat_template([{"role": "assistant", "content": "x"}])
    assert issubclass(TemplateError, ValueError)


def test_template_bugs_become_template_errors(tmp_path, monkeypatch):
    """Any error a template raises is a TemplateError (the request's 400): ZeroDivisionError and
    OverflowError were a 500 with a traceback. A template that renders past RENDER_LIMIT_S (a loop
    without end) is one too, where it held its thread and request forever."""
    from tensorfold import tokenizer as tkm
    msgs = [{"role": "user", "content": "x"}]
    for i, tmpl in enumerate(("{{ messages[0].content.nope() }}", "{{ 1 / 0 }}", "{{ 10.0 ** 400 }}",
                              "{{ (messages|length) // (messages|length - 1) }}")):
        t = Tokenizer.from_dir(_write_tok_dir(tmp_path / str(i), template=tmpl))
        with pytest.raises(TemplateError, match="^chat template error"):
            t.apply_chat_template(msgs)
    monkeypatch.setattr(tkm, "RENDER_LIMIT_S", 0.2)
    t = Tokenizer.from_dir(_write_tok_dir(tmp_path / "loop", template=(
        "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}")))
    t0 = time.monotonic()
    with pytest.raises(TemplateError, match="took more than 0.2 s"):
        t.apply_chat_template(msgs)
    assert time.monotonic() - t0 < 5
    # generate()'s pieces joined are render()'s text
    t = Tokenizer.from_dir(_write_tok_dir(tmp_path / "ok", template="{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"))
    assert t.apply_chat_template(msgs + [{"role": "assistant", "content": "y"}]) == "[user]x[assistant]y"



def test_a_template_that_does_not_parse_is_refused_at_load(tmp_path):
    """A chat template with a syntax error: the server started without a word, and then every chat
    request got a 400 blaming its messages. It is now a one-line error at load naming the file,
    whichever of the three places the template came from (a Python chat_template_type, which
    takes the Jinja one's place, leaves it unread)."""
    with pytest.raises(ValueError, match=r"tokenizer_config\.json: chat template syntax error \(line 1\)"):
        Tokenizer.from_dir(_write_tok_dir(tmp_path / "b", template="{% if %}", jinja=False))
    d = _write_tok_dir(tmp_path / "c", template="{{ 'x' }}")
    (d / "chat_template.jinja").write_text("ok\n{% for %}")
    with pytest.raises(ValueError, match=r"chat_template\.jinja: chat template syntax error \(line 2\)"):
        Tokenizer.from_dir(d)
    d = _write_tok_dir(tmp_path / "d", template=None)
    (d / "chat_template.json").write_text(json.dumps({"chat_template": "{{ x + }}"}))
    with pytest.raises(ValueError, match=r"chat_template\.json: chat template syntax error"):
        Tokenizer.from_dir(d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps(dict(cfg, chat_template_type="deepseek_v32")))
    assert Tokenizer.from_dir(d).apply_chat_template([{"role": "user", "content": "x"}])


@pytest.mark.parametrize(
    "messages",
    [
        "hello",
        [],
        ["hello"],
        [{"role": "robot", "content": "x"}],
        [{"content": "x"}],
        [{"role": "user", "content": 5}],
        [{"role": "user"}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        [{"role": "user", "content": [{"type": "text", "text": 3}]}],
    ],
)
def test_bad_messages(tok, messages, tmp_path):
    # a Python template (deepseek_v32's) too: its messages are checked before it runs, so bad ones are
    # not the template's errors
    d = _write_tok_dir(tmp_path / "py", template=None)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps(dict(cfg, chat_template_type="deepseek_v32")))
    for t in (tok, Tokenizer.from_dir(d)):
        with pytest.raises(ValueError) as ei:
            t.apply_chat_template(messages)
        assert "\n" not in str(ei.value)
        assert not isinstance(ei.value, TemplateError)


def test_no_template(tmp_path):
    t = Tokenizer.from_dir(_write_tok_dir(tmp_path, template=None))
    assert not t.has_chat_template and t.think_tags is None and not t.has_thinking_toggle
    with pytest.raises(ValueError, match="no chat template"):
        t.apply_chat_template([{"role": "user", "content": "x"}])


def test_template_sources(tmp_path):
    # tokenizer_config string
    t = Tokenizer.from_dir(_write_tok_dir(tmp_path / "a", template="A{{ bos_token }}", jinja=False))
    assert t.apply_chat_template([{"role": "user", "content": "x"}]) == "A"
    # list of named templates → "default"
    t = Tokenizer.from_dir(
        _write_tok_dir(
            tmp_path / "b",
            template=[{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}],
            jinja=False,
        )
    )
    assert t.apply_chat_template([{"role": "user", "content": "x"}]) == "D"
    # chat_template.jinja wins over tokenizer_config
    d = _write_tok_dir(tmp_path / "c", template="J")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "C"
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert Tokenizer.from_dir(d).apply_chat_template([{"role": "user", "content": "x"}]) == "J"
    # a template without <think> → no think tags even though the tokens exist
    assert Tokenizer.from_dir(d).think_tags is None


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


def test_a_named_tool_use_template_renders_requests_with_tools(tmp_path, caplog):
    """Hermes-2-Pro / Command-R checkpoints name two templates, "default" and "tool_use": where a
    request has tools transformers (so mlx-lm) renders "tool_use". Both of its layouts: the named
    list in tokenizer_config.json, and chat_template.jinja with additional_chat_templates/
    tool_use.jinja (what mlx_lm.convert writes with transformers 5). Only "default" was read, so a
    request with tools got a 400 (the default template reads no tools) or the wrong prompt."""
    msgs = [{"role": "user", "content": "x"}]
    tool_use = "T{% for t in tools %}[{{ t.function.name }}]{% endfor %}"
    listed = _write_tok_dir(tmp_path / "list", jinja=False, template=[
        {"name": "default", "template": "D"}, {"name": "tool_use", "template": tool_use}])
    files = _write_tok_dir(tmp_path / "files", template="D")
    (files / "additional_chat_templates").mkdir()
    (files / "additional_chat_templates" / "tool_use.jinja").write_text(tool_use)
    for d in (listed, files):
        t = Tokenizer.from_dir(d)
        assert t.takes_tools and t.tool_template == tool_use
        assert t.apply_chat_template(msgs) == "D"
        assert t.apply_chat_template(msgs, tools=TOOLS) == "T[f]"
    # without a tool_use template, tools render the default one, as before
    t = Tokenizer.from_dir(_write_tok_dir(tmp_path / "plain", template="D{{ tools | length }}"))
    assert t.tool_template is None and t.apply_chat_template(msgs, tools=TOOLS) == "D1"
    # a tool_use template that does not parse is left out with a warning naming its file (transformers
    # fails only when it renders it): the model serves, tools render the default template
    bad = _write_tok_dir(tmp_path / "bad", template="D")
    (bad / "additional_chat_templates").mkdir()
    (bad / "additional_chat_templates" / "tool_use.jinja").write_text("{{ x + }}")
    with caplog.at_level(logging.WARNING, logger="tensorfold"):
        t = Tokenizer.from_dir(bad)
    assert t.tool_template is None and t.apply_chat_template(msgs, tools=TOOLS) == "D"
    assert "additional_chat_templates/tool_use.jinja" in caplog.text
    # a one-entry list without a name is the default, as before named templates were read
    t = Tokenizer.from_dir(_write_tok_dir(tmp_path / "unnamed", jinja=False, template=[{"template": "U"}]))
    assert t.apply_chat_template(msgs) == "U"


def test_eos_and_bos_ids(tmp_path):
    d = _write_tok_dir(
        tmp_path,
        tcfg={"eos_token": {"content": "<|endoftext|>", "special": True}, "bos_token": "<|im_start|>"},
        gcfg={"eos_token_id": 2, "bos_token_id": 4},
        mcfg={"eos_token_id": [3], "bos_token_id": 4},
    )
    t = Tokenizer.from_dir(d)
    # generation_config's eos ids replace config.json's (transformers, mlx-lm's load_config); the
    # tokenizer's eos_token joins them
    assert t.eos_ids == frozenset({0, 2})
    assert t.bos_ids == frozenset({1, 4})
    assert Tokenizer.from_dir(_write_tok_dir(tmp_path / "m", mcfg={"eos_token_id": [3]}, gcfg={"top_k": 5},
                                             tcfg={"eos_token": None})).eos_ids == frozenset({3})
    assert t.eos_token == "<|endoftext|>" and t.bos_token == "<|im_start|>"
    assert t.bos_id == 1
    assert isinstance(t.eos_ids, frozenset)
    # bos_token is passed to the template
    d2 = _write_tok_dir(tmp_path / "x", template="{{ bos_token }}|{{ eos_token }}", tcfg={"bos_token": "<|im_start|>"})
    assert Tokenizer.from_dir(d2).apply_chat_template([{"role": "user", "content": "x"}]) == "<|im_start|>|<|im_end|>"
    # only tokenizer_config
    t3 = Tokenizer.from_dir(_write_tok_dir(tmp_path / "y"))
    assert t3.eos_ids == frozenset({2}) and t3.bos_ids == frozenset()


def test_missing_tokenizer(tmp_path):
    with pytest.raises(FileNotFoundError):
        Tokenizer.from_dir(tmp_path)


# ---------------------------------------------------------------------------------------------
# incremental detokenization


def _stream(tok, ids, **kw):
    d = IncrementalDetokenizer(tok, **kw)
    pieces = [d.add(i) for i in ids]
    pieces.append(d.flush())
    assert d.text == "".join(pieces)
    assert d.generated_ids == list(ids)
    return pieces


def test_incremental_multibyte(tok):
    ids = tok.encode(MULTIBYTE)
    # the small BPE splits multi-byte chars across byte tokens
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    pieces = _stream(tok, ids)
    assert "".join(pieces) == MULTIBYTE
    assert not any("\ufffd" in p for p in pieces)  # never emits a half character
    assert pieces[-1] == ""  # everything was final before flush


def test_incremental_random_text(tok):
    rng = random.Random(0)
    alphabet = list("abcdefgh ijk\n\t()=:_.,'\"") + list("éü中文字😀🎉") + ["def ", "return ", "<|im_end|>"]
    for _ in range(200):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 60)))
        ids = tok.encode(text)
        assert "".join(_stream(tok, ids)) == tok.decode(ids) == text
        assert "".join(_stream(tok, ids, skip_special_tokens=True)) == tok.decode(ids, skip_special_tokens=True)


def test_incremental_random_token_sequences(tok):
    """Arbitrary id sequences, including invalid UTF-8 byte soup: output == full decode."""
    rng = random.Random(1)
    V = tok.vocab_size
    for _ in range(500):
        ids = [rng.randrange(V) if rng.random() < 0.5 else rng.randrange(5, 5 + 256) for _ in range(rng.randrange(1, 80))]
        assert "".join(_stream(tok, ids)) == tok.decode(ids)


def test_incremental_window_is_bounded(tok):
    rng = random.Random(2)
    d = IncrementalDetokenizer(tok)
    ids = [rng.randrange(5, 5 + 256) for _ in range(3000)]  # mostly raw bytes, lots of broken UTF-8
    worst = 0
    for i in ids:
        d.add(i)
        worst = max(worst, len(d.token_ids) - d._prefix)
    d.flush()
    assert d.text == tok.decode(ids)
    assert worst <= IncrementalDetokenizer.MAX_PENDING + 8


# ---------------------------------------------------------------------------------------------
# the real tinycode model


def test_tinycode_tokenizer(tinycode_path):
    t = Tokenizer.from_dir(tinycode_path)
    assert t.vocab_size == 8192
    assert t.eos_ids == frozenset({0, 2})
    assert t.think_tags is None and not t.has_thinking_toggle
    code = (
        "import json\n\n\ndef dumps(obj, *, indent=None):\n"
        '    """Serialize ``obj`` to a JSON formatted ``str``."""\n'
        "    return json.dumps(obj, indent=indent)  # naïve 😀\n"
    )
    ids = t.encode(code)
    assert len(ids) < len(code)
    assert t.decode(ids) == code
    assert "".join(_stream(t, ids)) == code
    out = t.apply_chat_template([{"role": "user", "content": "Show the function dumps from json."}])
    assert out == "<|im_start|>user\nShow the function dumps from json.<|im_end|>\n<|im_start|>assistant\n"
    ids = t.encode(out)
    assert ids[0] == 1 and 2 in ids
    assert t.decode(ids) == out


def test_tinycode_tokenizer_config_fallback(tinycode_path, tmp_path):
    """Without chat_template.jinja the same directory still loads (template from tokenizer_config if any)."""
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "config.json"):
        shutil.copy(tinycode_path / f, tmp_path / f)
    t = Tokenizer.from_dir(tmp_path)
    assert t.eos_ids == frozenset({0, 2})
    assert t.encode("<|im_start|>") == [1]


# ---------------------------------------------------------------------------------------------
# SentencePiece-style tokenizers (Llama 2 / Mistral): byte fallback, metaspace, a BOS post-processor


def _spm_dir(path):
    """A small Llama-2-style tokenizer directory: BPE with byte fallback (<0x00>..<0xFF> at ids
    3..258), '▁' for spaces, a decoder that strips the first leading space, <s> added by the
    post-processor, add_bos_token in tokenizer_config.json."""
    from tokenizers import Tokenizer as HF, decoders, models, normalizers, processors, trainers
    from tensorfold.testing import _TRAIN_TEXT
    tok = HF(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tok.train_from_iterator(_TRAIN_TEXT.splitlines(keepends=True) * 3, trainer=trainers.BpeTrainer(
        vocab_size=600, min_frequency=2, special_tokens=specials, show_progress=False))
    j = json.loads(tok.to_str())
    j["added_tokens"] = [a for a in j["added_tokens"] if a["content"] in specials[:3]]  # bytes: plain vocab
    tok = HF.from_str(json.dumps(j))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.json").write_text(tok.to_str())
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"add_bos_token": True, "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
         "pad_token": "<unk>", "chat_template": "{% for m in messages %}{{ bos_token }}[{{ m.role }}] "
         "{{ m.content }}{% endfor %}[{{ pad_token }}|{{ unk_token }}]"}))
    return path


@pytest.fixture(scope="module")
def spm(tmp_path_factory):
    return Tokenizer.from_dir(_spm_dir(tmp_path_factory.mktemp("spm")))


def test_completion_prompts_get_the_post_processors_bos(spm, tok):
    """A completions prompt gets what the post-processor adds: <s> first for a Llama-style tokenizer
    (it was missing), once even where the text starts with it (mlx-lm's generate's rule; its server
    and transformers' tokenizer(text) give two there); nothing added for the Qwen-style test tokenizer."""
    ids = spm.encode_prompt("The quick brown")
    assert ids[0] == 1 and ids[1:] == spm.encode("The quick brown")
    assert spm.encode_prompt("<s>The quick brown") == ids
    assert tok.encode_prompt("def f():") == tok.encode("def f():")


def test_a_bos_counts_as_added_only_where_the_post_processor_adds_it(spm, tmp_path):
    """added_bos (what echo leaves out): the Llama-style <s> the post-processor puts before a
    prompt, not a typed one; and never, for a Qwen-style tokenizer, a BOS id the text itself starts
    with: "<|endoftext|>def f(" on a checkpoint whose config.json names that id the BOS lost it from
    echo's text while its logprobs still listed it."""
    for text in ("The quick brown", "<s>The quick brown"):
        assert spm.added_bos(text, spm.encode_prompt(text)) == (not text.startswith("<s>"))
    probe = Tokenizer.from_dir(_write_tok_dir(tmp_path / "q"))
    eot = probe.encode("<|endoftext|>")
    assert len(eot) == 1, eot
    qwen = Tokenizer.from_dir(_write_tok_dir(tmp_path / "q2", gcfg={"bos_token_id": eot[0]}))
    text = "<|endoftext|>def f("
    ids = qwen.encode_prompt(text)
    assert ids[0] == eot[0] and ids[0] in qwen.bos_ids and not qwen.added_bos(text, ids)
    from tensorfold.server.responses import echo_text
    assert echo_text(qwen, text, ids) == text
    assert echo_text(spm, "The quick brown", spm.encode_prompt("The quick brown")) == "The quick brown"


def test_completion_detokenizer_keeps_the_first_tokens_space(spm):
    """Continuing "The quick brown" with '▁fox': the streamed completion is ' fox ...' (prompt +
    completion == decode(prompt + reply)); without the prompt as context the decoder stripped
    the space ('brownfox')."""
    prompt = spm.encode_prompt("The quick brown")
    reply = spm.encode("fox jumps over it")
    assert spm.id_to_token(reply[0]).startswith("▁")
    d = IncrementalDetokenizer(spm, context=prompt[-4:])
    text = "".join(d.add(i) for i in reply) + d.flush()
    assert text == " fox jumps over it" == spm.decode(prompt + reply)[len(spm.decode(prompt)):]
    assert d.generated_ids == reply and d.text == text
    # chat keeps no context: the reply's first space is dropped, as mlx-lm does
    assert "".join(_stream(spm, reply)) == "fox jumps over it"


def test_completion_context_ending_in_byte_tokens_keeps_the_first_space(spm):
    """A completions prompt ending in a character the vocab lacks ("The café": [.., f, <0xC3>,
    <0xA9>]) gave no context at all, so ' is good' came back as 'is good'. The byte run is left
    out of the context and the tokens before it are kept; fuzzed against decode(prompt + reply)."""
    prompt = spm.encode_prompt("The caf\u00e9")
    assert spm.is_byte_token(prompt[-1])
    reply = spm.encode("is good")
    d = IncrementalDetokenizer(spm, context=prompt[-64:])
    text = "".join(d.add(i) for i in reply) + d.flush()
    assert text == " is good" == spm.decode(prompt + reply)[len(spm.decode(prompt)):]
    assert d.generated_ids == reply
    rng = random.Random(5)
    V = spm.vocab_size
    checked = 0
    for _ in range(600):
        prompt = spm.encode_prompt(rng.choice(["The caf\u00e9", "na\u00efve \u4e2d", "x \U0001F600",
                                               "plain text", "\U0001F600\U0001F600"]))
        reply = [rng.randrange(V) if rng.random() < 0.6 else rng.randrange(3, 259)
                 for _ in range(rng.randrange(1, 12))]
        full, head = spm.decode(prompt + reply), spm.decode(prompt)
        if not full.startswith(head) or spm.is_byte_token(reply[0]):
            continue        # the reply continues the prompt's last character: no text of its own
        d = IncrementalDetokenizer(spm, context=prompt[-64:])
        assert "".join(d.add(i) for i in reply) + d.flush() == full[len(head):], (prompt, reply)
        checked += 1
    assert checked > 150


def test_byte_fallback_stream_equals_the_full_decode(spm):
    """The tokenizers library decodes an invalid run of byte tokens as one U+FFFD a byte, so an
    earlier byte of the run changes when a later one arrives ([<0x78>, <0xDE>, ▁]: 'x' was
    streamed, the decode is two U+FFFD). The stream now holds a run until it ends."""
    x, de = spm.token_to_id("<0x78>"), spm.token_to_id("<0xDE>")
    space = spm.encode(" a")[0]
    assert spm.is_byte_token(x) and not spm.is_byte_token(space)
    assert "".join(_stream(spm, [x, de, space])) == spm.decode([x, de, space])
    rng = random.Random(3)
    V = spm.vocab_size
    for _ in range(400):
        ids = [rng.randrange(V) if rng.random() < 0.4 else rng.randrange(3, 259)
               for _ in range(rng.randrange(1, 40))]
        assert "".join(_stream(spm, ids)) == spm.decode(ids), ids


QWEN3_LIKE = ("{%- for message in messages %}{%- if message.content is string %}{%- set content = "
              "message.content %}{%- else %}{%- set content = '' %}{%- endif %}<|im_start|>{{ message.role }}\n"
              "{{ content }}{%- if message.tool_calls %}{%- for tc in message.tool_calls %}"
              "{{ tc.function.arguments | tojson }}{%- endfor %}{%- endif %}<|im_end|>\n{%- endfor %}"
              "{%- generation %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
              "{%- endgeneration %}")


def test_messages_reach_the_template_as_mlx_lm_hands_them(tmp_path):
    """Text parts joined into a string (Qwen3's template renders list content as '': the question
    vanished), tool-call arguments sent as a JSON string parsed (a template's tojson encoded them
    twice), a developer message rendered as system where the template has no developer role,
    `{% generation %}` blocks (transformers' training-mask tag) rendered, pad / unk tokens given."""
    t = Tokenizer.from_dir(_write_tok_dir(tmp_path / "q", template=QWEN3_LIKE))
    parts = [{"role": "developer", "content": "be brief"},
             {"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "2+2?"}]},
             {"role": "assistant", "content": None,
              "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": '{"city": "Paris"}'}}]},
             {"role": "tool", "content": "4"}]
    text = t.apply_chat_template(parts)
    assert text == ('<|im_start|>system\nbe brief<|im_end|><|im_start|>user\nWhat is 2+2?<|im_end|>'
                    '<|im_start|>assistant\n{"city": "Paris"}<|im_end|><|im_start|>tool\n4<|im_end|>'
                    '<|im_start|>assistant')
    spm_t = Tokenizer.from_dir(_spm_dir(tmp_path / "s"))
    assert spm_t.apply_chat_template([{"role": "user", "content": "hi"}]) == "<s>[user] hi[<unk>|<unk>]"


def test_encode_is_the_backends_encode_and_lets_the_gil_go(tinycode_path, spm, tok):
    """Tokenizer.encode / encode_prompt give the ids of tokenizers' own encode (special tokens,
    the post-processor's BOS) but run through encode_batch, which releases the GIL: another
    Python thread keeps running while a large prompt is tokenized (tokenizers' encode held the
    GIL, so a server tokenizing on any thread stopped the engine's thread for its whole length)."""
    import threading
    t = Tokenizer.from_dir(tinycode_path)
    texts = ["", " ", MULTIBYTE, "<|im_start|>user\nhi<|im_end|>\n", "def f(x):\n\treturn x  # \u00e9\n" * 50]
    for tk in (t, spm, tok):
        for s in texts:
            assert tk.encode(s) == tk.backend.encode(s, add_special_tokens=False).ids
            want = tk.backend.encode(s, add_special_tokens=True).ids
            if tk.bos_token and s.startswith(tk.bos_token):
                want = tk.backend.encode(s, add_special_tokens=False).ids
            assert tk.encode_prompt(s) == want
    big = "def foo(x):\n    return x + 1\n" * 40000          # ~1.2 MB, about a second here
    ticks, done = [], threading.Event()

    def work():
        t.encode(big)
        done.set()
    th = threading.Thread(target=work)
    th.start()
    while not done.is_set():
        ticks.append(1)
        done.wait(0.001)
    th.join()
    assert len(ticks) >= 20, len(ticks)


def test_saved_truncation_and_padding_do_not_cut_or_pad_prompts(tinycode_path, tmp_path):
    """A tokenizer.json saved with truncation / padding (a fine-tune script's last setting; the
    tokenizers backend applies it to every encode) cut a chat prompt mid-message, before its
    assistant header, and padded short prompts with pad ids. transformers turns both off unless a
    call asks for them; so does Tokenizer.from_dir."""
    for f in ("tokenizer_config.json", "generation_config.json", "config.json", "chat_template.jinja"):
        if (tinycode_path / f).is_file():
            shutil.copy(tinycode_path / f, tmp_path / f)
    tj = json.loads((tinycode_path / "tokenizer.json").read_text())
    tj["truncation"] = {"direction": "Right", "max_length": 8, "strategy": "LongestFirst", "stride": 0}
    tj["padding"] = {"strategy": {"Fixed": 64}, "direction": "Right", "pad_to_multiple_of": None,
                     "pad_id": 0, "pad_type_id": 0, "pad_token": "<|endoftext|>"}
    (tmp_path / "tokenizer.json").write_text(json.dumps(tj))
    plain, saved = Tokenizer.from_dir(tinycode_path), Tokenizer.from_dir(tmp_path)
    msgs = [{"role": "user", "content": "Show the function dumps from json, with every argument."}]
    text = plain.apply_chat_template(msgs)
    assert saved.apply_chat_template(msgs) == text
    assert saved.encode(text) == plain.encode(text) and len(plain.encode(text)) > 8
    for p in ("Hello", "x " * 100):
        assert saved.encode_prompt(p) == plain.encode_prompt(p)


def test_null_message_keys_are_dropped_before_the_template(tmp_path):
    """OpenAI clients send "tool_calls": null on plain assistant turns; Llama 3's template tests
    `'tool_calls' in message` and iterated None (a 400). transformers drops null keys first."""
    llama3_like = ("{% for m in messages %}{{ m.role }}: {% if 'tool_calls' in m %}"
                   "{% for c in m.tool_calls %}[call]{% endfor %}{% else %}{{ m.content }}{% endif %}\n"
                   "{% endfor %}{% if documents is not none %}DOCS{% endif %}")
    t = Tokenizer.from_dir(_write_tok_dir(tmp_path / "l", template=llama3_like))
    msgs = [{"role": "user", "content": "hi", "name": None},
            {"role": "assistant", "content": "hello", "tool_calls": None},
            {"role": "user", "content": "again"}]
    # (trim_blocks, as transformers: the newline after a block tag goes)
    assert t.apply_chat_template(msgs, add_generation_prompt=False) == "user: hiassistant: hellouser: again"


DSV32_CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "S"}, {"role": "user", "content": "a"},
     {"role": "assistant", "content": "b", "reasoning_content": "r1"}, {"role": "user", "content": "c 你好 😀"}],
    [{"role": "user", "content": "weather?"},
     {"role": "assistant", "content": "", "reasoning_content": "call it",
      "tool_calls": [{"type": "function", "function": {"name": "get", "arguments": '{"city": "Paris", "days": 2}'}},
                     {"type": "function", "function": {"name": "alt", "arguments": '{"q": [1, 2]}'}}]},
     {"role": "tool", "content": "sunny"}, {"role": "tool", "content": "ok"}],
    [{"role": "developer", "content": "use metric units"}],
    [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y", "reasoning_content": "why"}],
]


@pytest.mark.parametrize("case", range(len(DSV32_CONVERSATIONS)))
def test_chat_template_type_deepseek_v32_renders_as_mlx_lm(tinycode_path, tmp_path, case):
    """tokenizer_config.json's "chat_template_type": "deepseek_v32" (mlx-lm's Python template for
    DeepSeek-V3.2, whose checkpoints ship no Jinja one): chat requests got a 400 "no chat template"
    (or the Jinja one, where mlx-lm takes the Python one). The text equals mlx-lm's, thinking on,
    off and unset, with and without the generation prompt."""
    import copy

    from mlx_lm.chat_templates import deepseek_v32 as ref
    for f in ("tokenizer.json", "generation_config.json", "config.json"):
        shutil.copy(tinycode_path / f, tmp_path / f)
    cfg = json.loads((tinycode_path / "tokenizer_config.json").read_text())
    cfg.update(chat_template_type="deepseek_v32", chat_template="{{ 'jinja' }}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    t = Tokenizer.from_dir(tmp_path)
    assert t.has_chat_template and t.has_thinking_toggle
    msgs = DSV32_CONVERSATIONS[case]
    for think in (None, True, False):
        for gen in (True, False):
            kw = {} if think is None else {"enable_thinking": think}
            try:
                want = ref.apply_chat_template(copy.deepcopy(msgs), add_generation_prompt=gen, **kw)
            except AssertionError:      # mlx-lm refuses it (an assistant turn past the last user one
                with pytest.raises(ValueError):    # without reasoning in thinking mode, ...)
                    t.apply_chat_template(msgs, add_generation_prompt=gen, enable_thinking=think)
                continue
            assert t.apply_chat_template(msgs, add_generation_prompt=gen, enable_thinking=think) == want, (think, gen)


def test_incremental_ids_that_decode_leaves_out(spm):
    """Ids decode drops wherever they stand -- ids the tokenizer lacks (a model's embedding padded
    past its vocabulary) and, when skipped, special tokens -- never start the window: as its first
    id one made the next token first, and SentencePiece's decoder took that token's space ('x   '
    for 'x    '); a skipped special inside a byte run ended the run ('\ufffd' for '中')."""
    V = spm.vocab_size
    sp4 = spm.token_to_id("\u2581" * 4) or next(i for i in range(V) if (spm.id_to_token(i) or "").startswith("\u2581\u2581"))
    x, eos = spm.token_to_id("x"), spm.token_to_id("</s>")
    e4, b8, ad = (spm.token_to_id(f"<0x{b:02X}>") for b in (0xE4, 0xB8, 0xAD))
    assert "".join(_stream(spm, [x, V + 3, sp4])) == spm.decode([x, V + 3, sp4]) == "x" + spm.decode([x, sp4])[1:]
    for ids in ([x, eos, sp4], [e4, eos, b8, ad], [eos, sp4, x]):
        assert "".join(_stream(spm, ids, skip_special_tokens=True)) == spm.decode(ids, skip_special_tokens=True)
    rng = random.Random(7)
    specials = sorted(spm.special_ids)
    for _ in range(400):
        ids = [rng.choice([rng.randrange(V), rng.randrange(3, 259), V + rng.randrange(40), rng.choice(specials)])
               for _ in range(rng.randrange(1, 40))]
        assert "".join(_stream(spm, ids)) == spm.decode(ids), ids
        assert "".join(_stream(spm, ids, skip_special_tokens=True)) == spm.decode(ids, skip_special_tokens=True), ids


def test_a_byte_run_is_decoded_once(spm, monkeypatch):
    """A run of byte tokens was decoded whole at every token (6,000 tokens: 7.4 s); it is decoded
    when it ends. Its text still comes out only then: decode takes a run as a whole (one U+FFFD a
    byte where any of it is not UTF-8), so none of it is final before."""
    text = "中文字" * 1000
    ids = [spm.token_to_id(f"<0x{b:02X}>") for b in text.encode()]
    calls = []
    real = Tokenizer.decode
    monkeypatch.setattr(Tokenizer, "decode", lambda self, i, **kw: calls.append(len(i)) or real(self, i, **kw))
    d = IncrementalDetokenizer(spm)
    assert [d.add(i) for i in ids] == [""] * len(ids)
    assert d.flush() == text and len(calls) <= 4


def test_far_past_counts_a_long_text_in_slices_and_stops_early(tok, monkeypatch):
    """A text far past a limit is counted slice by slice, stopping once the count passes 2 limit + 64
    (a 15 MB prompt to a 4k-context server was tokenized whole to be refused: 2.3 GB, 11-17 s);
    a text that fits, or one not long enough to be looked at, gives None."""
    import tensorfold.tokenizer as T
    text = "def f(x):\n    return x + 1\n" * 20000            # ~540k characters
    whole = len(tok.encode(text))
    seen = []
    real = T.Tokenizer._encode
    monkeypatch.setattr(T.Tokenizer, "_encode", lambda self, t, sp: seen.append(len(t)) or real(self, t, sp))
    n = tok.far_past(text, 4096)
    assert n is not None and n > 2 * 4096 + 64 and max(seen) <= T.SLICE_CHARS + 1024
    assert sum(seen) < len(text) / 2          # stopped after the first slices
    assert tok.far_past(text, whole) is None          # it fits: tokenized whole, checked exactly
    assert tok.far_past(text[:1000], 10) is None      # short texts are not looked at
    # past 2 limit + 64 but under the whole count: found, by slices that add up near enough
    assert whole > 2 * 30000 + 64 and len(text) > 8 * 30000 + T.SLICE_CHARS
    assert tok.far_past(text, 30000) is not None


def test_continue_final_message_cuts_after_the_last_content(tinycode_path):
    """continue_final_message (transformers' rule): the text ends right after the last message's
    content, its trailing whitespace kept where the template wrote it; it needs
    add_generation_prompt false, and a final message with text the template writes."""
    t = Tokenizer.from_dir(tinycode_path)
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "def foo "}]
    closed = t.apply_chat_template(msgs, add_generation_prompt=False)
    got = t.apply_chat_template(msgs, add_generation_prompt=False, continue_final_message=True)
    assert closed.startswith(got) and got.endswith("assistant\ndef foo ")
    parts = [msgs[0], {"role": "assistant", "content": [{"type": "text", "text": "def "},
                                                        {"type": "text", "text": "foo "}]}]
    assert t.apply_chat_template(parts, add_generation_prompt=False, continue_final_message=True) == got
    with pytest.raises(ValueError, match="add_generation_prompt"):
        t.apply_chat_template(msgs, continue_final_message=True)
    with pytest.raises(ValueError, match="no text to continue"):
        t.apply_chat_template([msgs[0], {"role": "assistant", "content": " "}], add_generation_prompt=False,
                              continue_final_message=True)
    # the content's text again in the template's closing tag, or in an earlier turn: cut after the content
    for last in ("end", "im", "hi"):
        m = [msgs[0], {"role": "assistant", "content": last}]
        assert t.apply_chat_template(m, add_generation_prompt=False, continue_final_message=True).endswith(
            "<|im_start|>assistant\n" + last), last
    t.chat_template = "{% for m in messages %}[{{ m['content'] | upper }}]{% endfor %}"
    with pytest.raises(ValueError, match="cannot be continued"):
        t.apply_chat_template(msgs, add_generation_prompt=False, continue_final_message=True)
