"""The OpenAI-compatible server, end to end: real uvicorn servers on tiny checkpoints, the official openai client.

Server mechanics that need exact timing (client disconnects, queue skipping, errors inside a stream,
reasoning split) use `ScriptedEngine`, a stand-in with the Engine interface; everything else runs the real
Engine."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time

import httpx
import pytest

import openai  # noqa: E402  (test dependencies: missing them must fail, not skip)
import uvicorn  # noqa: E402

from tensorfold.engine.types import GenerationEvent, GenerationStats  # noqa: E402
from tensorfold.errors import RequestError  # noqa: E402
from tensorfold.server import EngineWorker, create_app  # noqa: E402
from tensorfold.server.reasoning import ReasoningSplitter, prompt_opens_think  # noqa: E402

KEY = "test-key"
USER = [{"role": "user", "content": "Write a function that adds two numbers."}]


# -- harness ---------------------------------------------------------------------------------------

@contextlib.contextmanager
def running(app):
    """Serve `app` with uvicorn on 127.0.0.1 on a free port in a background thread; yields the port."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("server did not start")
        time.sleep(0.02)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def engine_factory(path, **kw):
    def build():
        from tensorfold.engine import Engine
        return Engine(str(path), **kw)
    return build


@contextlib.contextmanager
def real_server(path, *, api_key=KEY, engine_kw=None, **app_kw):
    worker = EngineWorker(engine_factory(path, **(engine_kw or {})))
    app = create_app(worker, api_key=api_key, **app_kw)
    with running(app) as port:
        yield Server(port, app, worker)


class Server:
    def __init__(self, port, app, worker):
        self.port, self.app, self.worker = port, app, worker
        self.base = f"http://127.0.0.1:{port}"
        self.client = openai.OpenAI(base_url=f"{self.base}/v1", api_key=KEY, max_retries=0, timeout=120)
        self.name = app.state.model_name

    @property
    def engine(self):
        return self.worker.engine

    def post(self, path, body, *, key=KEY, **kw):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        content = body if isinstance(body, (str, bytes)) else json.dumps(body)
        return httpx.post(self.base + path, content=content, headers=headers, timeout=120, **kw)

    def chat(self, messages=USER, **kw):
        kw.setdefault("max_tokens", 12)
        kw.setdefault("temperature", 0)
        return self.client.chat.completions.create(model=self.name, messages=messages, **kw)

    def complete(self, prompt, **kw):
        kw.setdefault("max_tokens", 12)
        kw.setdefault("temperature", 0)
        return self.client.completions.create(model=self.name, prompt=prompt, **kw)

    def health(self):
        return httpx.get(self.base + "/health", timeout=10).json()


def chat_text(r) -> str:
    return r.choices[0].message.content


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from tensorfold.testing import widened, write_checkpoint
    # widened: $TF_TEST_HIDDEN's width where set (GPU runs: MLX's CUDA quantized matmul gives NaN at 64)
    return write_checkpoint(tmp_path_factory.mktemp("srv") / "tiny-qwen3",
                            **widened(dict(family="qwen3", layout="mlx", bits=4, seed=3)))


@pytest.fixture(scope="module")
def srv(ckpt):
    with real_server(ckpt) as s:
        yield s


# -- basics ----------------------------------------------------------------------------------------

def test_health_and_models(srv):
    h = srv.health()
    assert h["status"] == "ok" and h["model"] == "tiny-qwen3"
    models = srv.client.models.list()
    assert [m.id for m in models.data] == ["tiny-qwen3"]
    assert srv.client.models.retrieve("tiny-qwen3").id == "tiny-qwen3"
    auth = {"Authorization": f"Bearer {KEY}"}           # HEAD as on /health (it was a 405)
    for path in ("/v1/models", "/v1/models/tiny-qwen3"):
        assert httpx.head(srv.base + path, headers=auth, timeout=10).status_code == 200


def test_chat_shape_usage_and_tensorfold_block(srv):
    r = srv.chat(max_tokens=10)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == srv.name
    c = r.choices[0]
    assert c.index == 0 and c.message.role == "assistant" and isinstance(c.message.content, str)
    assert c.finish_reason in ("stop", "length")
    u = r.usage
    assert u.prompt_tokens > 5 and 1 <= u.completion_tokens <= 10
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details.cached_tokens == 0
    tf = r.model_extra["tensorfold"]
    assert set(tf) == {"prefill_s", "ttft_s", "decode_tps", "drafted", "accepted", "token_hash"}
    assert len(tf["token_hash"]) == 16
    # the same request again is the same reply, token for token
    r2 = srv.chat(max_tokens=10)
    assert chat_text(r2) == chat_text(r) and r2.model_extra["tensorfold"]["token_hash"] == tf["token_hash"]


def test_chat_stream_equals_non_stream(srv):
    full = srv.chat(max_tokens=16)
    chunks = list(srv.chat(max_tokens=16, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(ch.object == "chat.completion.chunk" and ch.id == chunks[0].id for ch in chunks)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == chat_text(full)
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage.completion_tokens == full.usage.completion_tokens
    assert usage.usage.prompt_tokens == full.usage.prompt_tokens
    assert usage.model_extra["tensorfold"]["token_hash"] == full.model_extra["tensorfold"]["token_hash"]
    raw = srv.post("/v1/chat/completions", {"messages": USER, "max_tokens": 4, "stream": True,
                                            "stream_options": {"include_usage": True}})
    events = [json.loads(e[len("data: "):]) for e in raw.text.split("\n\n") if e and e != "data: [DONE]"]
    assert all("usage" in e for e in events) and [e["usage"] is None for e in events][:-1] == \
        [True] * (len(events) - 1) and events[-1]["usage"]["completion_tokens"] > 0   # as OpenAI streams
    # without include_usage: no usage chunk
    chunks = list(srv.chat(max_tokens=16, stream=True))
    assert all(ch.usage is None for ch in chunks) and chunks[-1].choices[0].finish_reason


def test_completions_text_token_ids_and_stream(srv, ckpt):
    from tensorfold.tokenizer import Tokenizer
    prompt = "def fibonacci(n):\n    "
    r = srv.complete(prompt, max_tokens=12)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    ids = Tokenizer.from_dir(ckpt).encode(prompt)
    r_ids = srv.complete(ids, max_tokens=12)
    assert r_ids.choices[0].text == r.choices[0].text
    assert r_ids.usage.prompt_tokens == r.usage.prompt_tokens == len(ids)
    chunks = list(srv.complete(prompt, max_tokens=12, stream=True, stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == r.choices[0].text
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_stop_strings(srv):
    base = chat_text(srv.chat(max_tokens=24))
    k = next(i for i in range(3, len(base) - 2) if base.find(base[i:i + 2]) == i and base[i:i + 2].strip())
    stop = base[k:k + 2]
    for stream in (False, True):
        if stream:
            chunks = list(srv.chat(max_tokens=24, stop=[stop, "\x00never"], stream=True))
            text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
            finish = chunks[-1].choices[0].finish_reason
        else:
            r = srv.chat(max_tokens=24, stop=stop)
            text, finish = chat_text(r), r.choices[0].finish_reason
        assert text == base[:k] and finish == "stop"


def test_seeds(srv):
    def sample(seed):
        return chat_text(srv.chat(max_tokens=16, temperature=1.0, seed=seed))
    a = sample(1)
    assert sample(1) == a
    assert sample(2) != a
    r = srv.complete("x = ", max_tokens=16, temperature=1.0, seed=7)
    assert srv.complete("x = ", max_tokens=16, temperature=1.0, seed=7).choices[0].text == r.choices[0].text


def test_cached_tokens_reported(srv):
    grid = srv.engine.mode.grid
    prompt = [10 + (i * 7) % 400 for i in range(grid + 40)]    # past the first grid point
    first = srv.complete(prompt, max_tokens=4)
    second = srv.complete(prompt + [11, 12, 13], max_tokens=4)
    assert first.usage.prompt_tokens == grid + 40
    assert second.usage.prompt_tokens_details.cached_tokens == grid
    again = srv.complete(prompt, max_tokens=4)
    assert again.choices[0].text == first.choices[0].text


def test_enable_thinking_is_passed_to_the_template(srv):
    on = srv.chat(max_tokens=2, extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    off = srv.chat(max_tokens=2, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.usage.prompt_tokens > on.usage.prompt_tokens    # "<think>\n\n</think>\n\n" added


def test_chat_template_kwargs_reach_the_template(srv):
    """chat_template_kwargs other than enable_thinking (DeepSeek-V3.1's `thinking`, ...) reach the
    template as mlx-lm's server passes them (they were dropped: the request was served without
    them); the variables the server sets itself are refused."""
    tok = srv.engine.tokenizer
    saved = tok.chat_template
    tok.chat_template = saved + "{% if custom_flag %}A B C D E F{% endif %}"
    try:
        plain = srv.chat(max_tokens=2)
        flagged = srv.chat(max_tokens=2, extra_body={"chat_template_kwargs": {"custom_flag": True}})
        assert flagged.usage.prompt_tokens > plain.usage.prompt_tokens
    finally:
        tok.chat_template = saved
    for key in ("messages", "bos_token", "add_generation_prompt", "not an identifier"):
        _check_error(srv.post("/v1/chat/completions", _msg(chat_template_kwargs={key: 1})), 400,
                     f"chat_template_kwargs.{key}")


def test_continue_final_message_continues_the_last_message(srv):
    """vLLM's add_generation_prompt / continue_final_message (a prefilled start of the reply). Both
    were ignored: the partial assistant turn was closed, a new one opened, and /tokenize (which read
    add_generation_prompt only) counted other ids than the reply's usage."""
    msgs = [{"role": "user", "content": "Show a function."}, {"role": "assistant", "content": "def foo"}]
    body = dict(messages=msgs, add_generation_prompt=False, continue_final_message=True)
    ids = srv.post("/tokenize", body).json()["tokens"]
    text = srv.engine.tokenizer.decode(ids)
    assert text.endswith("def foo"), text            # the last turn left open
    r = srv.chat(msgs, max_tokens=12, extra_body={"add_generation_prompt": False, "continue_final_message": True})
    assert r.usage.prompt_tokens == len(ids)
    # the reply is the continuation of exactly those ids: a completions request of them gives it
    c = srv.complete(ids, max_tokens=12)
    assert chat_text(r) == c.choices[0].text
    assert r.model_extra["tensorfold"]["token_hash"] == c.model_extra["tensorfold"]["token_hash"]
    # add_generation_prompt false alone: the messages rendered without the assistant's opening
    closed = srv.post("/tokenize", dict(messages=msgs[:1], add_generation_prompt=False)).json()["count"]
    opened = srv.post("/tokenize", dict(messages=msgs[:1])).json()["count"]
    assert closed < opened
    assert srv.chat(msgs[:1], max_tokens=2, extra_body={"add_generation_prompt": False}).usage.prompt_tokens == closed
    # the content's last characters again in the template's closing tag ("<|im_end|>" holds "end"): the
    # text is cut after the content, not inside the tag; nor at an earlier turn holding the same text
    for last in ("end", "im", "Show"):
        m = [msgs[0], {"role": "assistant", "content": last}]
        ids = srv.post("/tokenize", dict(messages=m, add_generation_prompt=False, continue_final_message=True)).json()
        assert srv.engine.tokenizer.decode(ids["tokens"]).endswith("assistant\n" + last), last
    # a prefilled reply still thinking: the reply's text is reasoning (it had come out as content, with
    # the literal closing tag)
    tok = srv.engine.tokenizer
    if tok.think_tags:
        m = [msgs[0], {"role": "assistant", "content": "<think>\nLet me add"}]
        p = srv.engine.prepare(m, add_generation_prompt=False, continue_final_message=True)
        assert p.text.endswith("<think>\nLet me add") and p.final_at == p.text.rindex("<think>")
        assert srv.worker._opens_think({"prepared": p})
    for path in ("/v1/chat/completions", "/tokenize"):
        _check_error(srv.post(path, _msg(continue_final_message=True)), 400, "continue_final_message")
        _check_error(srv.post(path, _msg(add_generation_prompt=False, continue_final_message="yes")), 400,
                     "continue_final_message")
        _check_error(srv.post(path, _msg(messages=[{"role": "user", "content": "x"},
                                                   {"role": "assistant", "content": "  "}],
                                         add_generation_prompt=False, continue_final_message=True)), 400, "messages")


# -- exactness through HTTP ------------------------------------------------------------------------

def test_drafted_equals_serial(srv):
    # a repetitive prompt gives the context-copy proposer something to propose
    msgs = [{"role": "user", "content": "a b c d e f g h a b c d e f g h a b c d e f g h a b c d"}]
    for kind in ("chat", "completion"):
        if kind == "chat":
            d = srv.chat(msgs, max_tokens=40)
            s = srv.chat(msgs, max_tokens=40, extra_body={"draft": False})
            td, ts = chat_text(d), chat_text(s)
        else:
            d = srv.complete(msgs[0]["content"], max_tokens=40)
            s = srv.complete(msgs[0]["content"], max_tokens=40, extra_body={"draft": False})
            td, ts = d.choices[0].text, s.choices[0].text
        assert td == ts
        assert d.model_extra["tensorfold"]["token_hash"] == s.model_extra["tensorfold"]["token_hash"]
        assert s.model_extra["tensorfold"]["drafted"] == 0
        from tensorfold import kernels
        if kernels.backend_face() == "cpu":       # the CPU faces pass row_check: drafts must run
            assert srv.engine.drafts_enabled
        if srv.engine.drafts_enabled:
            assert d.model_extra["tensorfold"]["drafted"] > 0


def test_conversation_resumed_equals_fresh(ckpt):
    from tensorfold.engine.prefill import PrefillMode
    from tensorfold.tokenizer import Tokenizer
    # a system prompt just past the first prefill grid point: later turns resume from a prompt-cache snapshot
    tok, grid, rules = Tokenizer.from_dir(ckpt), PrefillMode().grid, []
    while len(tok.encode(" ".join(rules))) < grid + 32:
        rules += [f"rule{len(rules) + i}: be exact." for i in range(16)]
    system = " ".join(rules)
    turns = ["Write a function that adds two numbers.", "Now make it subtract.", "Add a docstring."]
    replies, cached = [], []
    with real_server(ckpt) as s:
        msgs = [{"role": "system", "content": system}]
        for t in turns:
            msgs.append({"role": "user", "content": t})
            r = s.chat(list(msgs), max_tokens=16, temperature=0.7, seed=5)
            replies.append((chat_text(r), r.model_extra["tensorfold"]["token_hash"]))
            cached.append(r.usage.prompt_tokens_details.cached_tokens)
            msgs.append({"role": "assistant", "content": chat_text(r)})
        assert r.usage.prompt_tokens > s.engine.mode.grid
    assert cached[0] == 0 and cached[1] > 0 and cached[2] > 0
    msgs = [{"role": "system", "content": system}]
    for t, want in zip(turns, replies):
        msgs.append({"role": "user", "content": t})
        with real_server(ckpt) as fresh:
            r = fresh.chat(list(msgs), max_tokens=16, temperature=0.7, seed=5)
        assert r.usage.prompt_tokens_details.cached_tokens == 0
        assert (chat_text(r), r.model_extra["tensorfold"]["token_hash"]) == want
        msgs.append({"role": "assistant", "content": want[0]})


def test_concurrent_clients_get_their_solo_answers(srv):
    reqs = [dict(messages=[{"role": "user", "content": f"Task number {i}: say something."}], max_tokens=10 + i,
                 temperature=(0 if i % 2 else 0.9), seed=i, stream=bool(i % 3 == 0)) for i in range(6)]

    def run(kw):
        r = srv.chat(**kw)
        if kw.get("stream"):
            return "".join(ch.choices[0].delta.content or "" for ch in r if ch.choices)
        return chat_text(r)

    solo = [run(kw) for kw in reqs]
    got = [None] * len(reqs)

    def worker(i):
        got[i] = run(reqs[i])

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(reqs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert got == solo


# -- bad input: 4xx with an OpenAI error body, and the server keeps serving ---------------------------

def _msg(**kw):
    return {"model": "tiny-qwen3", "messages": USER, "max_tokens": 4, **kw}


BAD = [
    ("malformed json", "/v1/chat/completions", '{"messages": [', 400, None, "invalid_json"),
    # JSON is UTF-8 (RFC 8259): json.loads read UTF-16 / UTF-32 bytes as well
    ("a UTF-16 body", "/v1/chat/completions", json.dumps(_msg()).encode("utf-16"), 400, None, "invalid_json"),
    ("a UTF-32 body", "/v1/completions", json.dumps({"prompt": "x"}).encode("utf-32-le"), 400, None,
     "invalid_json"),
    # malformed tools are a 400 whatever tool_choice says (under "none" they went unchecked)
    ("tools malformed under tool_choice none", "/v1/chat/completions", _msg(tools=[5, "junk"], tool_choice="none"),
     400, "tools[0]", "invalid_value"),
    ("not an object", "/v1/chat/completions", "[1, 2]", 400, None, "invalid_json"),
    ("missing messages", "/v1/chat/completions", {"model": "tiny-qwen3"}, 400, "messages", None),
    ("empty messages", "/v1/chat/completions", _msg(messages=[]), 400, "messages", None),
    ("messages not a list", "/v1/chat/completions", _msg(messages="hi"), 400, "messages", None),
    ("message not an object", "/v1/chat/completions", _msg(messages=["hi"]), 400, "messages[0]", None),
    ("unknown role", "/v1/chat/completions", _msg(messages=[{"role": "robot", "content": "x"}]), 400,
     "messages[0].role", None),
    ("content wrong type", "/v1/chat/completions", _msg(messages=[{"role": "user", "content": 5}]), 400,
     "messages[0].content", None),
    ("negative max_tokens", "/v1/chat/completions", _msg(max_tokens=-5), 400, "max_tokens", None),
    ("zero max_completion_tokens", "/v1/chat/completions", _msg(max_completion_tokens=0), 400,
     "max_completion_tokens", None),
    ("huge max_tokens", "/v1/chat/completions", _msg(max_tokens=10**9), 400, "max_tokens", None),
    ("max_tokens wrong type", "/v1/chat/completions", _msg(max_tokens="ten"), 400, "max_tokens", None),
    ("max_tokens wrong type beside max_completion_tokens", "/v1/chat/completions",
     _msg(max_tokens="ten", max_completion_tokens=3), 400, "max_tokens", None),
    ("negative max_tokens beside max_completion_tokens", "/v1/completions",      # was served
     {"prompt": "x", "max_tokens": -5, "max_completion_tokens": 3}, 400, "max_tokens", None),
    ("stream_options without stream", "/v1/completions",                          # was ignored
     {"prompt": "x", "max_tokens": 2, "stream_options": {"include_usage": True}}, 400, "stream_options", None),
    ("n past 128", "/v1/chat/completions", _msg(n=129), 400, "n", None),
    ("n 0", "/v1/chat/completions", _msg(n=0), 400, "n", None),
    # logprobs: chat takes a boolean and top_logprobs 0..20 beside it, completions a count 0..20
    ("top_logprobs without logprobs", "/v1/chat/completions", _msg(top_logprobs=5), 400, "top_logprobs", None),
    ("top_logprobs past 20", "/v1/chat/completions", _msg(logprobs=True, top_logprobs=21), 400, "top_logprobs",
     None),
    ("top_logprobs wrong type", "/v1/chat/completions", _msg(logprobs=True, top_logprobs="5"), 400,
     "top_logprobs", None),
    ("chat logprobs a count", "/v1/chat/completions", _msg(logprobs=3), 400, "logprobs", None),
    ("completions logprobs true", "/v1/completions", {"prompt": "x", "logprobs": True}, 400, "logprobs", None),
    ("completions logprobs past 20", "/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs", None),
    ("completions logprobs negative", "/v1/completions", {"prompt": "x", "logprobs": -1}, 400, "logprobs", None),
    ("completions top_logprobs", "/v1/completions", {"prompt": "x", "top_logprobs": 2}, 400, "top_logprobs",
     None),
    # vLLM's extensions asking for something this server does not do (they were ignored)
    ("min_tokens negative", "/v1/chat/completions", _msg(min_tokens=-1), 400, "min_tokens", None),
    ("min_tokens a string", "/v1/chat/completions", _msg(min_tokens="5"), 400, "min_tokens", None),
    ("min_tokens past max_tokens", "/v1/chat/completions", _msg(min_tokens=5, max_tokens=4), 400, "min_tokens",
     "invalid_value"),     # the engine's check: its errors have the parser's code (they had null)
    ("stop_token_ids not a list", "/v1/completions", {"prompt": "x", "stop_token_ids": 3}, 400, "stop_token_ids",
     None),
    ("stop_token_ids negative", "/v1/completions", {"prompt": "x", "stop_token_ids": [3, -1]}, 400,
     "stop_token_ids", None),
    ("stop_token_ids a bool", "/v1/chat/completions", _msg(stop_token_ids=[True]), 400, "stop_token_ids", None),
    ("stop_token_ids past the vocab", "/v1/chat/completions", _msg(stop_token_ids=[10**6]), 400, "stop_token_ids",
     None),
    ("ignore_eos a string", "/v1/chat/completions", _msg(ignore_eos="yes"), 400, "ignore_eos", None),
    ("typical_p asked", "/v1/chat/completions", _msg(typical_p=0.5), 400, "typical_p", "unsupported_parameter"),
    # each stop string is searched after every token on the engine's thread (100,000 of them:
    # 110 ms a token, for every queued request too)
    ("too many stop strings", "/v1/chat/completions", _msg(stop=[f"Q{i}" for i in range(17)]), 400, "stop", None),
    ("stop string too long", "/v1/completions", {"prompt": "x", "stop": "s" * 1025}, 400, "stop", None),
    ("json nested too deeply", "/v1/chat/completions", '{"messages": ' + "[" * 5000 + "]" * 5000 + "}", 400,
     None, "invalid_json"),
    ("lone surrogate", "/v1/chat/completions", '{"messages": [{"role": "user", "content": "a\\ud83d"}]}', 400,
     None, "invalid_json"),
    ("lone surrogate prompt", "/v1/completions", '{"prompt": "\\udc00"}', 400, None, "invalid_json"),
    ("function role", "/v1/chat/completions", _msg(messages=[{"role": "function", "content": "x"}]), 400,
     "messages[0].role", None),
    ("assistant without content or tool calls", "/v1/chat/completions",
     _msg(messages=[*USER, {"role": "assistant", "content": None}, *USER]), 400, "messages[1].content", None),
    ("negative temperature", "/v1/chat/completions", _msg(temperature=-0.5), 400, "temperature", None),
    ("temperature past a float", "/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], '
     '"temperature": 1' + "0" * 400 + "}", 400, "temperature", "invalid_value"),
    ("min_p past a float", "/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], '
     '"min_p": 1' + "0" * 400 + "}", 400, "min_p", "invalid_value"),
    ("include_usage wrong type", "/v1/chat/completions", _msg(stream=True, stream_options={"include_usage": "yes"}), 400,
     "stream_options.include_usage", None),
    ("enable_thinking wrong type", "/v1/chat/completions", _msg(chat_template_kwargs={"enable_thinking": 1}),
     400, "chat_template_kwargs.enable_thinking", None),
    ("temperature wrong type", "/v1/chat/completions", _msg(temperature="hot"), 400, "temperature", None),
    ("top_p out of range", "/v1/chat/completions", _msg(top_p=1.5), 400, "top_p", None),
    ("stop wrong type", "/v1/chat/completions", _msg(stop=[1, 2]), 400, "stop", None),
    ("stream wrong type", "/v1/chat/completions", _msg(stream="yes"), 400, "stream", None),
    ("seed wrong type", "/v1/chat/completions", _msg(seed="abc"), 400, "seed", None),
    ("seed past int64", "/v1/chat/completions", _msg(seed=2**64), 400, "seed", None),   # was seed 0
    ("seed below int64", "/v1/chat/completions", _msg(seed=-2**63 - 1), 400, "seed", None),
    ("unknown model", "/v1/chat/completions", _msg(model="gpt-9"), 404, "model", "model_not_found"),
    ("missing prompt", "/v1/completions", {"model": "tiny-qwen3"}, 400, "prompt", None),
    ("prompt wrong type", "/v1/completions", {"prompt": {"a": 1}}, 400, "prompt", None),
    ("token id out of vocab", "/v1/completions", {"prompt": [1, 2, 10**6], "max_tokens": 2}, 400, "prompt", None),
    ("two prompts", "/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt", None),
    ("n a string", "/v1/completions", {"prompt": "a", "n": "2"}, 400, "n", None),
    # fields OpenAI has and this server does not implement: refused, never silently dropped
    ("logit_bias not an object", "/v1/chat/completions", _msg(logit_bias=[5, 10]), 400, "logit_bias", None),
    ("logit_bias key not an id", "/v1/chat/completions", _msg(logit_bias={"a5": 10}), 400, "logit_bias", None),
    ("logit_bias key negative", "/v1/completions", {"prompt": "a", "logit_bias": {"-5": 1}}, 400, "logit_bias",
     None),
    ("logit_bias past 100", "/v1/chat/completions", _msg(logit_bias={"5": 100.5}), 400, "logit_bias", None),
    ("logit_bias a string", "/v1/chat/completions", _msg(logit_bias={"5": "10"}), 400, "logit_bias", None),
    ("logit_bias id past the vocab", "/v1/chat/completions", _msg(logit_bias={"1000000": 1}), 400, "logit_bias",
     "invalid_value"),
    ("presence_penalty past 2", "/v1/chat/completions", _msg(presence_penalty=2.5), 400, "presence_penalty", None),
    ("frequency_penalty below -2", "/v1/completions", {"prompt": "a", "frequency_penalty": -3}, 400,
     "frequency_penalty", None),
    ("repetition_penalty 0", "/v1/chat/completions", _msg(repetition_penalty=0), 400, "repetition_penalty", None),
    ("repetition_penalty a string", "/v1/chat/completions", _msg(repetition_penalty="1.1"), 400,
     "repetition_penalty", None),
    ("json mode asked", "/v1/chat/completions", _msg(response_format={"type": "json_object"}), 400,
     "response_format", "unsupported_parameter"),
    # fields served but not read are type-checked as OpenAI checks them (they were taken as they came)
    ("response format without a type", "/v1/chat/completions", _msg(response_format={}), 400,
     "response_format.type", "invalid_value"),
    ("a message name not a string", "/v1/chat/completions", _msg(messages=[{"role": "user", "content": "x",
                                                                          "name": 5}]), 400, "messages[0].name", None),
    ("user not a string", "/v1/chat/completions", _msg(user=5), 400, "user", "invalid_value"),
    ("metadata not an object", "/v1/chat/completions", _msg(metadata="x"), 400, "metadata", "invalid_value"),
    ("reasoning effort not a string", "/v1/chat/completions", _msg(reasoning_effort=5), 400, "reasoning_effort",
     "invalid_value"),
    ("a batch of prompts", "/v1/completions", {"prompt": ["a", "b"], "max_tokens": 2}, 400, "prompt",
     "unsupported_parameter"),
    ("a prompt of nested strings", "/v1/completions", {"prompt": [["a", "b"]], "max_tokens": 2}, 400, "prompt",
     "invalid_value"),
    ("tools on completions", "/v1/completions",
     {"prompt": "a", "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, 400, "tools",
     "unsupported_parameter"),
    ("functions asked", "/v1/chat/completions", _msg(functions=[{"name": "f", "parameters": {}}]), 400,
     "functions", "unsupported_parameter"),
    ("tool_choice required", "/v1/chat/completions", _msg(tool_choice="required"), 400, "tool_choice",
     "unsupported_parameter"),
    # asks a reply would have silently lacked (they had 200s): a legacy named function, audio out, at most
    # one tool call, arguments held to the schema
    ("function_call named", "/v1/chat/completions", _msg(function_call={"name": "f"}), 400, "function_call",
     "unsupported_parameter"),
    ("audio asked", "/v1/chat/completions", _msg(modalities=["text", "audio"], audio={"voice": "alloy"}), 400,
     "modalities", "unsupported_parameter"),
    ("audio settings", "/v1/chat/completions", _msg(audio={"voice": "alloy"}), 400, "audio", "unsupported_parameter"),
    ("parallel_tool_calls false", "/v1/chat/completions",
     _msg(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}], parallel_tool_calls=False),
     400, "parallel_tool_calls", "unsupported_parameter"),
    ("parallel_tool_calls a string", "/v1/chat/completions",
     _msg(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}], parallel_tool_calls="no"),
     400, "parallel_tool_calls", None),
    ("parallel_tool_calls a string, no tools", "/v1/chat/completions", _msg(parallel_tool_calls="no"), 400,
     "parallel_tool_calls", None),
    ("echo on chat", "/v1/chat/completions", _msg(echo=True), 400, "echo", "unsupported_parameter"),
    ("echo a number", "/v1/completions", {"prompt": "a", "echo": 1}, 400, "echo", None),
    ("best_of asked", "/v1/completions", {"prompt": "a", "best_of": 3}, 400, "best_of", "unsupported_parameter"),
    ("suffix asked", "/v1/completions", {"prompt": "a", "suffix": "b"}, 400, "suffix", "unsupported_parameter"),
    # an assistant turn's tool_calls, OpenAI's shape (a template that ignores them took these with a 200)
    ("tool_calls not a list", "/v1/chat/completions", _msg(messages=[
        {"role": "assistant", "content": "x", "tool_calls": "f()"}, {"role": "user", "content": "y"}]), 400,
     "messages[0].tool_calls", None),
    ("tool_calls on a user turn", "/v1/chat/completions", _msg(messages=[
        {"role": "user", "content": "x", "tool_calls": []}]), 400, "messages[0].tool_calls", None),
    ("tool call not an object", "/v1/chat/completions", _msg(messages=[
        {"role": "assistant", "content": None, "tool_calls": [7]}, {"role": "user", "content": "y"}]), 400,
     "messages[0].tool_calls[0]", None),
    ("tool call without a function", "/v1/chat/completions", _msg(messages=[
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function"}]},
        {"role": "user", "content": "y"}]), 400, "messages[0].tool_calls[0].function", None),
    ("tool call without a name", "/v1/chat/completions", _msg(messages=[
        {"role": "assistant", "content": None, "tool_calls": [{"function": {"arguments": "{}"}}]},
        {"role": "user", "content": "y"}]), 400, "messages[0].tool_calls[0].function.name", None),
    ("tool call arguments a number", "/v1/chat/completions", _msg(messages=[
        {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": 3}}]},
        {"role": "user", "content": "y"}]), 400, "messages[0].tool_calls[0].function.arguments", None),
    ("tool call of another type", "/v1/chat/completions", _msg(messages=[
        {"role": "assistant", "content": None, "tool_calls": [{"type": "custom", "function": {"name": "f",
                                                                                               "arguments": "{}"}}]},
        {"role": "user", "content": "y"}]), 400, "messages[0].tool_calls[0].type", None),
]


def _check_error(r, status, param=None, code=None):
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"] and "Traceback" not in r.text
    if param is not None:
        assert body["error"]["param"] == param
    if code is not None:
        assert body["error"]["code"] == code
    return body["error"]


@pytest.mark.parametrize("name,path,body,status,param,code", BAD, ids=[b[0] for b in BAD])
def test_bad_input(srv, name, path, body, status, param, code):
    _check_error(srv.post(path, body), status, param, code)
    assert chat_text(srv.chat(max_tokens=2))     # still serving


def test_bodies_are_json_by_content_type_and_utf8(srv):
    """A Content-Type that is not JSON is a 415 (any body was read as JSON: text/plain, curl -d's form
    type); none, application/json with UTF-8's charset and a +json type are read, and a UTF-8 byte
    order mark is ignored (RFC 8259 lets a parser), where UTF-16 bytes are a 400 (test_bad_input)."""
    body = json.dumps(_msg(max_tokens=1))
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                  "application/json; charset=latin-1"):
        r = httpx.post(srv.base + "/v1/chat/completions", content=body, timeout=60,
                       headers={"Authorization": f"Bearer {KEY}", "Content-Type": ctype})
        e = _check_error(r, 415, code="unsupported_media_type")
        assert "application/json" in e["message"] or "UTF-8" in e["message"], e
    for path, b in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
        r = httpx.post(srv.base + path, content=json.dumps(b), timeout=60,
                       headers={"Authorization": f"Bearer {KEY}", "Content-Type": "text/plain"})
        _check_error(r, 415, code="unsupported_media_type")
    want = srv.post("/v1/chat/completions", body).json()["choices"]
    for ctype, raw in (("application/json; charset=UTF-8", body.encode()), ("application/vnd.api+json", body.encode()),
                       (None, b"\xef\xbb\xbf" + body.encode())):
        headers = {"Authorization": f"Bearer {KEY}"} | ({"Content-Type": ctype} if ctype else {})
        r = httpx.post(srv.base + "/v1/chat/completions", content=raw, headers=headers, timeout=60)
        assert r.status_code == 200 and r.json()["choices"] == want, (ctype, r.text)
    from tensorfold.server.protocol import content_type_error
    assert content_type_error(None) is None and content_type_error(" ") is None
    assert content_type_error("Application/JSON;charset=\"utf-8\"") is None
    assert content_type_error("application/jsonx") and content_type_error("text/json")


def test_min_tokens_past_the_room_the_context_leaves(srv):
    """min_tokens within max_tokens but past what the context leaves after the prompt (max_tokens is
    cut to that room): a 400, where the reply ended short of min_tokens with finish_reason length."""
    ctx = srv.engine.context_length

    def count(m):
        return srv.post("/tokenize", {"prompt": "word " * m}).json()["count"]
    per = (count(200) - count(100)) / 100
    m = int((ctx - 8) / per)
    while count(m) > ctx - 3:
        m -= 1
    prompt, room = "word " * m, ctx - count(m)
    assert 3 <= room <= 40, room
    e = _check_error(srv.post("/v1/completions", {"prompt": prompt, "max_tokens": room + 1, "min_tokens": room + 1}),
                     400, "min_tokens", "context_length_exceeded")
    assert f"the {room} tokens" in e["message"], e
    r = srv.post("/v1/completions", {"prompt": prompt, "max_tokens": room + 1, "min_tokens": room, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == room, r.text   # max_tokens cut to the room
    assert r.json()["choices"][0]["finish_reason"] == "length"


def test_a_huge_integer_is_named_by_its_size(srv):
    """max_tokens 1e300 as an integer: the 400's message repeated its 301 digits."""
    err = _check_error(srv.post("/v1/completions", '{"prompt": "x", "max_tokens": 1' + "0" * 300 + "}"),
                       400, "max_tokens", "invalid_value")
    assert "997-bit number" in err["message"] and len(err["message"]) < 200, err["message"]
    for key in ("n", "min_tokens", "seed"):       # these repeated the number too
        err = _check_error(srv.post("/v1/chat/completions", json.dumps(_msg())[:-1] + f', "{key}": 1e300}}'),
                           400, key, "invalid_value")
        assert "997-bit number" in err["message"] and len(err["message"]) < 200, err["message"]
    err = _check_error(srv.post("/v1/chat/completions", json.dumps(_msg(logprobs=True))[:-1] + ', "top_logprobs": 1e300}'),
                       400, "top_logprobs", "invalid_value")
    assert "997-bit number" in err["message"], err["message"]


def test_tool_arguments_nested_past_the_stack_are_kept_as_text(srv):
    """A tool call's arguments string nested 1,500 deep (past Python's recursion limit): json.loads raised RecursionError (not
    ValueError) and the request got a 500; it is now kept as the string it was, as any
    arguments that do not parse are."""
    args = "[" * 1500 + "]" * 1500
    body = _msg(messages=[{"role": "user", "content": "hi"},
                          {"role": "assistant", "content": None, "tool_calls": [
                              {"id": "c1", "type": "function", "function": {"name": "f", "arguments": args}}]},
                          {"role": "user", "content": "go"}], max_tokens=2)
    for stream in (False, True):
        r = srv.post("/v1/chat/completions", dict(body, stream=stream))
        assert r.status_code == 200 and "Internal" not in r.text, r.text[:200]


def test_logprobs_chat_and_completions(srv):
    """logprobs through the official client: streamed == not streamed, drafted == serial; chat gives
    token / logprob / bytes / top_logprobs entries, completions OpenAI's legacy lists."""
    c = srv.client
    kw = dict(model=srv.name, max_tokens=12, temperature=0.0)
    full = c.chat.completions.create(messages=USER, logprobs=True, top_logprobs=3, **kw)
    entries = [e.model_dump() for e in full.choices[0].logprobs.content]
    assert len(entries) == full.usage.completion_tokens
    for e in entries:
        tops = e["top_logprobs"]
        assert len(tops) == 3 and [t["logprob"] for t in tops] == sorted((t["logprob"] for t in tops), reverse=True)
        assert tops[0] == {k: e[k] for k in ("token", "bytes", "logprob")}          # greedy: the most likely
        assert e["logprob"] <= 0
        try:                        # a token that is part of a character is named by its bytes
            assert e["token"] == bytes(e["bytes"]).decode()
        except UnicodeDecodeError:
            assert e["token"] == "bytes:" + "".join(f"\\x{b:02x}" for b in e["bytes"])
    streamed = [e.model_dump() for ch in c.chat.completions.create(messages=USER, logprobs=True, top_logprobs=3,
                                                                    stream=True, **kw)
                if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert streamed == entries
    serial = c.chat.completions.create(messages=USER, logprobs=True, top_logprobs=3, extra_body={"draft": False},
                                       **kw)
    assert [e.model_dump() for e in serial.choices[0].logprobs.content] == entries
    none = c.chat.completions.create(messages=USER, logprobs=True, **kw)      # top_logprobs 0
    assert [(e.token, e.logprob, e.top_logprobs) for e in none.choices[0].logprobs.content] == \
        [(e["token"], e["logprob"], []) for e in entries]
    assert c.chat.completions.create(messages=USER, **kw).choices[0].logprobs is None

    prompt = "def add(a, b):"
    comp = c.completions.create(prompt=prompt, logprobs=2, **kw)
    lp = comp.choices[0].logprobs
    n = comp.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    for tok, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top[tok] == v and len(top) <= 3
    chunks = list(c.completions.create(prompt=prompt, logprobs=2, stream=True, **kw))
    got = {k: [x for ch in chunks if ch.choices[0].logprobs for x in getattr(ch.choices[0].logprobs, k)]
           for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    assert got == {k: getattr(lp, k) for k in got}
    zero = c.completions.create(prompt=prompt, logprobs=0, **kw).choices[0].logprobs
    assert zero.tokens == lp.tokens and zero.top_logprobs == [{t: v} for t, v in zip(lp.tokens, lp.token_logprobs)]


def test_neutral_values_of_unsupported_fields_are_accepted(srv):
    """What clients send by default (false, 0, 1, {}, [], "none" / "auto", {"type": "text"}) asks for
    nothing, so it is served, and the reply equals the same request without those fields."""
    base = _msg(temperature=0.0)
    neutral = dict(logprobs=False, top_logprobs=0, logit_bias={}, presence_penalty=0.0,
                   frequency_penalty=0, repetition_penalty=1.0, response_format={"type": "text"},
                   tools=[], tool_choice="none", n=1, min_tokens=0, stop_token_ids=[], ignore_eos=False,
                   typical_p=1.0, function_call="auto", modalities=["text"], parallel_tool_calls=False)
    a, b = srv.post("/v1/chat/completions", base), srv.post("/v1/chat/completions", {**base, **neutral})
    assert a.status_code == b.status_code == 200, b.text
    assert a.json()["choices"][0]["message"] == b.json()["choices"][0]["message"]
    r = srv.post("/v1/completions", {"prompt": "a", "max_tokens": 2, "logprobs": None, "echo": False,
                                      "best_of": 1, "suffix": ""})
    assert r.status_code == 200, r.text
    # and through the official client, which leaves unset fields out
    assert chat_text(srv.client.chat.completions.create(model=srv.name, messages=USER, max_tokens=2,
                                                        presence_penalty=0, logprobs=False))


def test_prompt_longer_than_context(srv):
    long = "word " * (srv.engine.context_length + 10)
    for stream in (False, True):
        e = _check_error(srv.post("/v1/completions", {"prompt": long, "max_tokens": 2, "stream": stream}), 400)
        assert e["code"] == "context_length_exceeded"
        e = _check_error(srv.post("/v1/chat/completions", _msg(messages=[{"role": "user", "content": long}],
                                                                stream=stream)), 400)
        assert e["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as ei:
        srv.complete(long, max_tokens=2)
    assert ei.value.code == "context_length_exceeded"
    assert srv.complete("ok", max_tokens=2).choices[0].text is not None


def test_auth_and_not_found(srv):
    e = _check_error(srv.post("/v1/chat/completions", _msg(), key="wrong"), 401, code="invalid_api_key")
    assert "key" in e["message"].lower()
    _check_error(srv.post("/v1/chat/completions", _msg(), key=None), 401, code="invalid_api_key")
    _check_error(httpx.get(srv.base + "/v1/models"), 401, code="invalid_api_key")
    bad = openai.OpenAI(base_url=f"{srv.base}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as ei:
        bad.chat.completions.create(model=srv.name, messages=USER, max_tokens=2)
    assert ei.value.code == "invalid_api_key"
    with pytest.raises(openai.NotFoundError) as ei:
        srv.client.chat.completions.create(model="no-such-model", messages=USER, max_tokens=2)
    assert ei.value.code == "model_not_found"
    _check_error(httpx.get(srv.base + "/v1/nothing-here", headers={"Authorization": f"Bearer {KEY}"}), 404)
    _check_error(httpx.get(srv.base + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}), 405)
    assert chat_text(srv.chat(max_tokens=2))


# -- server mechanics with a scripted stand-in engine -----------------------------------------------

class ScriptedEngine:
    """The Engine interface; replies with `script` (a list of text pieces, one per token), `delay` seconds per
    token; `fail_after` raises after that many tokens."""

    def __init__(self, script=("hello", " world"), *, delay=0.0, fail_after=None, think_tags=None,
                 prompt_suffix=""):
        self.model_path, self.model_name, self.context_length = "/models/scripted", "scripted", 4096
        self.generation_defaults = {}
        self.script, self.delay, self.fail_after = list(script), delay, fail_after
        self.tokenizer = type("Tok", (), {"think_tags": think_tags, "apply_chat_template":
                                          lambda _s, m, **kw: "<|im_start|>assistant\n" + prompt_suffix})()
        self.started, self.finished, self.tokens = [], [], {}

    def generate(self, messages=None, prompt=None, max_tokens=256, sampling=None, stop=None, draft=True,
                 enable_thinking=None, cancel=None, progress=None):
        tag = (messages or [{}])[-1].get("content") if messages else prompt
        self.started.append(tag)
        if progress:
            progress(3, 3)
        n, finish = 0, "stop"
        for i, piece in enumerate(self.script[:max_tokens]):
            if cancel is not None and cancel.is_set():
                finish = "cancelled"
                break
            if self.fail_after is not None and i >= self.fail_after:
                raise RuntimeError("boom")
            time.sleep(self.delay)
            n += 1
            self.tokens[tag] = n
            yield GenerationEvent(text=piece, token_ids=[i])
        else:
            finish = "length" if len(self.script) > max_tokens else "stop"
        self.finished.append((tag, finish))
        yield GenerationEvent(finish_reason=finish, stats=GenerationStats(prompt_tokens=3, completion_tokens=n,
                                                                           finish_reason=finish))


@contextlib.contextmanager
def scripted_server(engine, **kw):
    app = create_app(engine, **kw)
    with running(app) as port:
        yield Server(port, app, app.state.worker)


def _wait(cond, timeout=10):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        time.sleep(0.01)


def test_error_inside_an_open_stream():
    eng = ScriptedEngine(["a", "b", "c"], fail_after=2)
    with scripted_server(eng, api_key=KEY) as s:
        r = s.post("/v1/chat/completions", {"messages": USER, "stream": True})
        assert r.status_code == 200
        events = [e[len("data: "):] for e in r.text.split("\n\n") if e]
        assert events[-1] == "[DONE]"
        err = json.loads(events[-2])
        assert set(err) == {"error"} and err["error"]["type"] == "server_error" and "boom" in err["error"]["message"]
        assert "Traceback" not in r.text
        # not streaming: a 500 with the error body; then the server keeps serving
        _check_error(s.post("/v1/chat/completions", {"messages": USER}), 500)
        eng.fail_after = None
        assert chat_text(s.chat(max_tokens=3)) == "abc"


def test_stream_disconnect_cancels_the_generation():
    eng = ScriptedEngine(["x"] * 400, delay=0.01)
    with scripted_server(eng, api_key=KEY) as s:
        with httpx.stream("POST", s.base + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                          json={"messages": [{"role": "user", "content": "long"}], "stream": True}) as r:
            for line in r.iter_lines():
                if '"x"' in line:
                    break       # got a token: hang up
        _wait(lambda: s.health()["cancelled"] == 1)
        assert not s.health()["busy"] and eng.tokens["long"] < 100
        eng.delay = 0
        assert chat_text(s.chat(max_tokens=2)) == "xx"


def test_non_stream_disconnect_cancels_and_queued_clients_who_left_are_skipped():
    eng = ScriptedEngine(["x"] * 600, delay=0.01)
    with scripted_server(eng, api_key=KEY) as s:
        def call(tag, timeout):
            try:
                httpx.post(s.base + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                           json={"messages": [{"role": "user", "content": tag}]}, timeout=timeout)
            except httpx.TimeoutException:
                pass
        a = threading.Thread(target=call, args=("first", 1.0))       # runs, then its client leaves
        a.start()
        _wait(lambda: eng.started == ["first"])
        b = threading.Thread(target=call, args=("second", 0.2))      # leaves while still queued
        b.start()
        a.join()
        b.join()
        _wait(lambda: s.health()["skipped"] == 1 and s.health()["cancelled"] == 1)
        assert eng.started == ["first"] and eng.tokens["first"] < 300 and not eng.finished
        eng.delay = 0
        assert chat_text(s.chat(max_tokens=3)) == "xxx"
        assert eng.started == ["first", USER[0]["content"]]


def test_reasoning_content_split():
    script = ["<think>", "Let me ", "think", ".</th", "ink>", "\n\n", "The ", "answer."]
    eng = ScriptedEngine(script, think_tags=("<think>", "</think>"))
    with scripted_server(eng, api_key=KEY) as s:
        r = s.chat(max_tokens=100)
        assert r.choices[0].message.content == "The answer."
        assert r.choices[0].message.model_extra["reasoning_content"] == "Let me think."
        chunks = list(s.chat(max_tokens=100, stream=True))
        deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
        assert "".join(d.content or "" for d in deltas) == "The answer."
        assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == "Let me think."
        # completions are raw text
        assert s.complete("p", max_tokens=100).choices[0].text == "".join(script)
    # a template that opens the think block in the prompt: the reply starts inside it
    eng = ScriptedEngine(["plan", "</think>", "\n", "done"], think_tags=("<think>", "</think>"),
                         prompt_suffix="<think>\n")
    with scripted_server(eng) as s:
        r = s.chat(max_tokens=100)
        assert r.choices[0].message.content == "done"
        assert r.choices[0].message.model_extra["reasoning_content"] == "plan"


def test_reasoning_splitter_units():
    tags = ("<think>", "</think>")
    assert ReasoningSplitter(None).feed("<think>a</think>b", final=True) == ("", "<think>a</think>b")
    assert ReasoningSplitter(tags).feed("plain text", final=True) == ("", "plain text")
    sp = ReasoningSplitter(tags)
    out = [sp.feed(c) for c in "  <think>ab</think>\ncd"] + [sp.feed("", final=True)]
    assert ("".join(r for r, _ in out), "".join(c for _, c in out)) == ("ab", "cd")
    sp = ReasoningSplitter(tags, in_think=True)
    assert sp.feed("never closed <", final=False) == ("never closed ", "")
    assert sp.feed("", final=True) == ("<", "")
    assert prompt_opens_think("<|im_start|>assistant\n<think>\n", tags)
    assert not prompt_opens_think("<|im_start|>assistant\n<think>\n\n</think>\n\n", tags)
    assert not prompt_opens_think("<|im_start|>assistant\n", tags)
    # a continued final message (continue_final_message; its text starts at final_at) still thinking
    cont = "<|im_start|>assistant\n<think>\nLet me add"
    assert prompt_opens_think(cont, tags, cont.index("<think>"))                   # the open tag in its text
    assert prompt_opens_think(cont, tags, cont.index("Let"))                       # or the template's, just before
    closed = "<|im_start|>assistant\n<think>\n\n</think>\n\nSure"
    assert not prompt_opens_think(closed, tags, closed.index("Sure"))
    earlier = "<|im_start|>user\nwhat is <think>?<|im_end|>\n<|im_start|>assistant\nSure"
    assert not prompt_opens_think(earlier, tags, earlier.index("Sure"))           # a tag in another turn


def test_server_defaults_and_name(ckpt):
    with real_server(ckpt, api_key=None, model_name="my-alias", defaults={"max_tokens": 3}) as s:
        assert [m.id for m in s.client.models.list().data] == ["my-alias"]
        r = s.client.chat.completions.create(model="my-alias", messages=USER)     # no max_tokens: the default
        assert r.model == "my-alias" and r.usage.completion_tokens <= 3
        # the directory name is accepted too; no key needed on a server without one
        assert s.post("/v1/chat/completions", _msg(), key=None).status_code == 200


def test_request_body_limit_and_small_routes():
    """A body past the limit is a 413 before it is read (by its Content-Length) or while it is read
    (sent in chunks), never tokenized on the engine's thread; HEAD /health, /v1/models/ and a
    malformed Authorization header get their own answers."""
    eng = ScriptedEngine(["ok"])
    with scripted_server(eng, api_key=KEY, max_body=4096) as s:
        big = json.dumps({"messages": [{"role": "user", "content": "x" * 5000}]})
        _check_error(s.post("/v1/chat/completions", big), 413, code="request_too_large")

        def chunks():
            for i in range(0, len(big), 1000):
                yield big[i:i + 1000].encode()
        r = httpx.post(s.base + "/v1/chat/completions", content=chunks(),
                       headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
        _check_error(r, 413, code="request_too_large")
        assert eng.started == []
        assert chat_text(s.chat(max_tokens=1)) == "ok"          # under the limit, and still serving
        assert httpx.head(s.base + "/health").status_code == 200
        r = httpx.get(s.base + "/v1/models/", headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 200 and r.json()["object"] == "list"
        e = _check_error(httpx.get(s.base + "/v1/models", headers={"Authorization": KEY}), 401,
                         code="invalid_api_key")
        assert "Bearer" in e["message"]
    from tensorfold.server.app import max_body_default
    assert max_body_default(4096) == 16 << 20 and max_body_default(1 << 20) == 256 << 20
    assert max_body_default(10 ** 7) == 1 << 30


def test_shutdown_answers_running_and_queued_requests_with_503():
    """worker.drain() (what `tensorfold serve` calls on SIGINT / SIGTERM, before uvicorn's grace
    period runs out): a running stream ends with an error event and [DONE], a queued request gets
    a JSON 503, instead of a cut connection and a text/plain 500."""
    eng = ScriptedEngine(["x"] * 2000, delay=0.01)
    with scripted_server(eng, api_key=KEY) as s:
        out = {}

        def stream():
            out["stream"] = s.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}],
                                                             "stream": True})

        def queued():
            out["queued"] = s.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "b"}]})
        threads = [threading.Thread(target=stream)]
        threads[0].start()
        _wait(lambda: eng.tokens.get("a", 0) > 5)
        threads.append(threading.Thread(target=queued))
        threads[1].start()
        _wait(lambda: s.health()["queued"] == 1)
        assert s.worker.drain() == 2
        for t in threads:
            t.join(30)
        events = [e[len("data: "):] for e in out["stream"].text.split("\n\n") if e]
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "server_shutting_down"
        e = _check_error(out["queued"], 503, code="server_shutting_down")
        assert e["type"] == "server_error"
        _wait(lambda: not s.health()["busy"])
        assert eng.tokens["a"] < 1000 and "b" not in eng.started


def test_requests_after_drain_get_503_not_a_hang():
    """A request that reaches submit() after drain() (it was being read or tokenized) gets the
    same 503; it waited for ever in the stopped worker's queue before."""
    eng = ScriptedEngine(["x"] * 3)
    with scripted_server(eng, api_key=KEY) as s:
        assert s.worker.drain() == 0
        r = s.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "late"}]})
        _check_error(r, 503, code="server_shutting_down")


def test_prompts_are_tokenized_off_the_engine_thread(ckpt):
    """The server tokenizes (and renders the template) on a thread of its own, so a large prompt
    does not stop the engine's thread, which serves every other request; the reply is the same."""
    from tensorfold.engine import Engine, SamplingParams
    threads = []

    class Spy:
        """The tokenizers object, noting the thread of each encode."""
        def __init__(self, raw):
            self.raw = raw

        def __getattr__(self, name):
            return getattr(self.raw, name)

        def encode_batch(self, *a, **k):
            threads.append(threading.current_thread().name)
            return self.raw.encode_batch(*a, **k)

        def encode(self, *a, **k):
            threads.append(threading.current_thread().name)
            return self.raw.encode(*a, **k)

    def build():
        eng = Engine(ckpt, drafts=False)
        eng.tokenizer._tok = Spy(eng.tokenizer._tok)
        return eng
    worker = EngineWorker(build, name="tensorfold-engine")
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "add two numbers"}]
    with running(create_app(worker, api_key=KEY)) as port:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0, timeout=120)
        r = client.chat.completions.create(model="tiny-qwen3", messages=msgs, max_tokens=6, temperature=0)
        c = client.completions.create(model="tiny-qwen3", prompt="def add(a, b):", max_tokens=6, temperature=0)
    assert threads and "tensorfold-engine" not in threads, threads
    ref = Engine(ckpt, drafts=False)
    greedy = SamplingParams(temperature=0.0)
    assert r.choices[0].message.content == "".join(
        ev.text for ev in ref.generate(messages=msgs, max_tokens=6, sampling=greedy))
    assert c.choices[0].text == "".join(
        ev.text for ev in ref.generate(prompt="def add(a, b):", max_tokens=6, sampling=greedy))


class PreparingEngine(ScriptedEngine):
    """ScriptedEngine with Engine.prepare: `prep_delay(tag)` seconds of "tokenizing" a request
    whose last message / prompt is `tag`; a tag starting with "toolong" is refused as the real
    prepare refuses a prompt past the context."""

    def __init__(self, *a, prep_delay=lambda tag: 0.0, **kw):
        super().__init__(*a, **kw)
        self.prep_delay, self.prepared_tags, self.entered = prep_delay, [], []

    def prepare(self, messages=None, prompt=None, enable_thinking=None, tools=None, template_kwargs=None):
        from tensorfold.engine import Prompt
        tag = messages[-1]["content"] if messages else prompt
        self.entered.append(tag[:20])
        time.sleep(self.prep_delay(tag))
        self.prepared_tags.append(tag[:20])
        if tag.startswith("toolong"):
            raise RequestError("the prompt has 9999 tokens", param="prompt", code="context_length_exceeded")
        return Prompt(ids=[1, 2, 3], chat=messages is not None, text=tag)

    def generate(self, prepared=None, **kw):
        if prepared is not None:
            kw["messages" if prepared.chat else "prompt"] = (
                [{"role": "user", "content": prepared.text}] if prepared.chat else prepared.text)
        return super().generate(**kw)


def test_shutdown_while_tokenizing_answers_503_at_once():
    """drain() (SIGINT / SIGTERM) while a prompt is being tokenized: its client gets the JSON 503
    within a poll (the handler waited for the tokenization to end, past uvicorn's grace period,
    and the client got a text/plain 500)."""
    eng = PreparingEngine(["x"], prep_delay=lambda tag: 5.0)
    with scripted_server(eng, api_key=KEY) as s:
        out = {}

        def call():
            out["r"] = s.post("/v1/completions", {"prompt": "slow"})
            out["t"] = time.monotonic()
        th = threading.Thread(target=call)
        th.start()
        _wait(lambda: eng.entered == ["slow"])
        assert s.health()["tokenizing"] == 1
        s.worker.drain()
        t0 = time.monotonic()
        th.join(30)
        _check_error(out["r"], 503, code="server_shutting_down")
        assert out["t"] - t0 < 2.0 and eng.started == []


def test_small_requests_do_not_wait_behind_large_prompts_being_tokenized():
    """Bodies past TokenizePool.SMALL are tokenized on their own threads: seven large prompts
    taking 2 s each do not hold up a small request (on asyncio's default pool, 6 threads on 2
    cores, it waited for them), nor does a prompt refused as too long wait for the request
    being generated."""
    big = "b" * (300 << 10)
    eng = PreparingEngine(["x"] * 300, delay=0.01, prep_delay=lambda tag: 2.0 if tag.startswith("b") else 0.0)
    with scripted_server(eng, api_key=KEY) as s:
        threads = [threading.Thread(target=s.post, args=("/v1/completions", {"prompt": big, "max_tokens": 1}))
                   for _ in range(7)]
        for t in threads:
            t.start()
        _wait(lambda: len(eng.entered) >= 2 and s.health()["tokenizing"] == 7)
        t0 = time.monotonic()
        r = s.post("/v1/completions", {"prompt": "small", "max_tokens": 2})
        assert r.status_code == 200 and time.monotonic() - t0 < 1.5
        # a long generation runs; a refused prompt is answered without waiting for it
        long = threading.Thread(target=s.post, args=("/v1/completions", {"prompt": "long"}))
        long.start()
        _wait(lambda: s.health()["busy"])
        t0 = time.monotonic()
        _check_error(s.post("/v1/completions", {"prompt": "toolong"}), 400, code="context_length_exceeded")
        assert time.monotonic() - t0 < 1.5 and s.health()["busy"]
        for t in threads + [long]:
            t.join(30)


def test_detokenize_runs_off_the_event_loop():
    """/detokenize decodes on a tokenizing thread: 2M ids decoded on the event loop held every other
    request and stream for 1.2 s."""
    eng = PreparingEngine(["x"])
    real = lambda ids: ",".join(map(str, ids))      # noqa: E731
    eng.tokenizer.vocab_size = 10
    eng.tokenizer.decode = lambda ids, **kw: time.sleep(2.0) or real(ids)
    with scripted_server(eng, api_key=KEY) as s:
        out = {}
        th = threading.Thread(target=lambda: out.update(r=s.post("/detokenize", {"tokens": [1, 2]})))
        th.start()
        _wait(lambda: s.health()["tokenizing"] == 1)
        t0 = time.monotonic()
        assert s.post("/v1/completions", {"prompt": "small", "max_tokens": 1}).status_code == 200
        assert time.monotonic() - t0 < 1.0
        th.join(30)
        assert out["r"].status_code == 200 and out["r"].json()["prompt"] == real([1, 2])


def test_a_client_that_leaves_while_tokenizing_is_never_queued():
    eng = PreparingEngine(["x"], prep_delay=lambda tag: 1.5 if tag == "gone" else 0.0)
    with scripted_server(eng, api_key=KEY) as s:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(s.base + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                       json={"prompt": "gone"}, timeout=0.5)
        # its tokenization cannot be stopped: /health counts it until it ends (it counted 0 while
        # two abandoned 12 MB prompts held the large lane for 23 s)
        assert s.health()["tokenizing"] == 1 and "gone" not in eng.prepared_tags
        _wait(lambda: "gone" in eng.prepared_tags)
        _wait(lambda: s.health()["tokenizing"] == 0)
        time.sleep(0.3)
        assert s.post("/v1/completions", {"prompt": "next"}).status_code == 200
        assert eng.started == ["next"]


def test_shutdown_while_a_body_arrives_answers_503():
    """SIGTERM / SIGINT (drain) while a request body is still arriving: the JSON 503 the other
    requests get, at once (uvicorn cancelled the handler when its grace period ran out, a
    text/plain 500 and a traceback in the log)."""
    import re
    import socket
    with scripted_server(ScriptedEngine(["x"]), api_key=KEY) as s:
        sock = socket.create_connection(("127.0.0.1", s.port))
        body = b'{"prompt": "slow", "max_tokens": 1}'
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: %d\r\n\r\n" % len(body)
                     + body[:10])
        time.sleep(0.5)
        t0 = time.monotonic()
        s.worker.drain()
        sock.settimeout(10)
        # the whole reply: headers and body may come in two segments (one recv got the headers
        # alone in a CI run, session 57)
        def whole(data: bytes) -> bool:
            head, sep, body = data.partition(b"\r\n\r\n")
            n = re.search(rb"(?im)^content-length: *(\d+)", head)
            return bool(sep) and len(body) >= (int(n.group(1)) if n else 0)
        data = b""
        while not whole(data):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
        reply = data.decode()
        sock.close()
        assert reply.startswith("HTTP/1.1 503") and "server_shutting_down" in reply, reply
        assert time.monotonic() - t0 < 2.0


def test_shutdown_while_tokenizing_answers_503():
    """A drain while /tokenize or /detokenize is still at work on its thread (a 12 MB prompt takes
    seconds): the JSON 503, at once (they awaited the thread without watching: uvicorn's grace
    period cancelled them, a text/plain 500 and a traceback)."""
    import threading
    eng = ScriptedEngine(["x"])
    gate = threading.Event()
    eng.tokenize = lambda **kw: (gate.wait(30), [1])[1]
    eng.tokenizer.vocab_size = 10
    eng.tokenizer.decode = lambda ids: (gate.wait(30), "x")[1]
    with scripted_server(eng, api_key=KEY) as s:
        h = {"Authorization": f"Bearer {KEY}"}
        got = {}

        def ask(path, body):
            got[path] = httpx.post(s.base + path, json=body, headers=h, timeout=30)
        threads = [threading.Thread(target=ask, args=a) for a in (("/tokenize", {"prompt": "slow"}),
                                                                   ("/detokenize", {"tokens": [1, 2]}))]
        for t in threads:
            t.start()
        time.sleep(0.5)
        t0 = time.monotonic()
        s.worker.drain()
        for t in threads:
            t.join(10)
        gate.set()
        assert time.monotonic() - t0 < 2.0
        for path in ("/tokenize", "/detokenize"):
            _check_error(got[path], 503, code="server_shutting_down")


EXIT_SCRIPT = """
import asyncio
from tensorfold.server.worker import EngineWorker
from tensorfold.cli import embedded_model_path

def build():
    from tensorfold.engine import Engine
    return Engine(embedded_model_path())

async def main():
    w = EngineWorker(build)
    w.wait_ready()
    job = w.submit(dict(messages=[{"role": "user", "content": "Show the function dumps from json."}],
                        max_tokens=8), chat=True)
    while (await job.items.get())[0] == "event":
        pass
    await asyncio.to_thread(w.stop)

asyncio.run(main())
"""


def test_process_exits_cleanly_after_the_engine_thread_served():
    """A thread that ran MLX (a prefill, then the compiled exact step) and then ended made the
    process abort at exit now and then ("terminate called without an active exception", MLX's
    per-thread state); the worker's thread is parked instead of ended."""
    import subprocess
    import sys
    for _ in range(3):
        r = subprocess.run([sys.executable, "-c", EXIT_SCRIPT], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0 and "terminate" not in r.stderr, r.stderr[-2000:]


def test_shutdown_flushes_snapshots_still_queued(tmp_path, monkeypatch):
    """The app's shutdown waits for the disk writer: a snapshot queued just before the server
    stops is on disk after it (SIGTERM skips atexit, where the only flush was)."""
    from tensorfold.cache.disk import DiskStore
    from tensorfold.engine import PrefillMode
    real = DiskStore._write

    def slow(self, *a):
        time.sleep(1.5)
        return real(self, *a)
    monkeypatch.setattr(DiskStore, "_write", slow)
    from tensorfold.cli import embedded_model_path
    snap = tmp_path / "snaps"
    with real_server(embedded_model_path(), engine_kw=dict(snapshot_dir=str(snap), drafts=False,
                                                           prefill_mode=PrefillMode(grid=16, ops="kernels"))) as s:
        s.chat(messages=[{"role": "user", "content": "Show the function dumps from json, please, now."}],
               max_tokens=2)
        assert not list(snap.glob("*.safetensors"))       # still in the writer
    assert list(snap.glob("*.safetensors"))


def test_a_stalled_body_gets_a_408():
    """A client that sends its headers and then stalls (slowloris) gets a 408 once body_timeout
    has passed, instead of holding the connection open without end."""
    eng = ScriptedEngine(["ok"])
    with scripted_server(eng, body_timeout=0.5) as s:
        with socket.create_connection(("127.0.0.1", s.port), timeout=10) as c:
            c.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 100\r\n\r\n{\"messages\"")
            reply = b""
            while b"request_timeout" not in reply:        # headers and body may come apart
                part = c.recv(4096)
                if not part:
                    break
                reply += part
            reply = reply.decode()
        assert reply.startswith("HTTP/1.1 408") and "request_timeout" in reply, reply
        assert eng.started == [] and chat_text(s.chat(max_tokens=1)) == "ok"


def test_an_engine_built_on_the_main_thread(ckpt):
    """create_app takes an Engine built by the caller (the docstring's first form): its requests run
    on the worker's thread, which failed them all with a 500 ("There is no Stream(cpu, 0) in current
    thread") while the engine's weights were graphs of the main thread's stream."""
    from tensorfold.engine import Engine
    app = create_app(Engine(str(ckpt)), api_key=KEY)
    with running(app) as port:
        s = Server(port, app, app.state.worker)
        assert s.chat(max_tokens=3).choices[0].finish_reason in ("stop", "length")
        assert s.complete(list(range(5, 60)), max_tokens=3).choices[0].text is not None


def test_penalties_through_the_client(srv):
    """presence / frequency / repetition penalties are served (they were refused): drafted == serial,
    and they change the reply."""
    kw = dict(max_tokens=16, temperature=0.0, presence_penalty=1.0, frequency_penalty=1.5,
              extra_body={"repetition_penalty": 1.5})
    a = srv.chat(**kw)
    b = srv.chat(**{**kw, "extra_body": {"repetition_penalty": 1.5, "draft": False}})
    assert chat_text(a) == chat_text(b) and a.model_extra["tensorfold"]["token_hash"] == b.model_extra["tensorfold"]["token_hash"]
    assert a.model_extra["tensorfold"]["token_hash"] != \
        srv.chat(max_tokens=16, temperature=0.0).model_extra["tensorfold"]["token_hash"]


def test_logit_bias_through_the_client(srv):
    """logit_bias (it was refused): -100 takes a token out of a greedy reply, +100 puts it in every
    position, drafted == serial with it (sampled), the stream gives the same reply, completions take
    it too, and the logprobs stay the raw model's. An id past the vocabulary is a 400 before a stream
    starts."""
    c = srv.client
    plain = srv.chat(max_tokens=8, temperature=0.0, logprobs=True)
    first = plain.choices[0].logprobs.content[0]
    def token_id(text):             # the id of a token named by its text (checked: it decodes back)
        i = srv.post("/tokenize", {"prompt": text}).json()["tokens"][-1]
        assert srv.post("/detokenize", {"tokens": [i]}).json()["prompt"] == text
        return i
    tid = token_id(first.token)
    banned = srv.chat(max_tokens=8, temperature=0.0, logit_bias={str(tid): -100}, logprobs=True)
    assert banned.choices[0].logprobs.content[0].token != first.token
    assert banned.choices[0].logprobs.content[0].logprob < first.logprob   # the raw model's, not the biased row's
    forced = srv.chat(max_tokens=4, temperature=0.0, logit_bias={"7": 100})
    assert forced.model_extra["tensorfold"]["token_hash"] == \
        srv.chat(max_tokens=4, temperature=0.0, logit_bias={"7": 100.0}).model_extra["tensorfold"]["token_hash"]
    ids = srv.post("/v1/completions", {"prompt": "def f(x):", "max_tokens": 4, "temperature": 0.0,
                                       "logit_bias": {"7": 100}, "logprobs": 0}).json()
    assert ids["usage"]["completion_tokens"] == 4
    toks = srv.post("/tokenize", {"prompt": ids["choices"][0]["text"]}).json()["tokens"]
    assert set(toks) - {1} <= {7}, toks
    sampled = srv.chat(max_tokens=24, temperature=0.9, seed=5, logprobs=True)
    s0 = sampled.choices[0].logprobs.content[0].token
    sid = token_id(s0)
    kw = dict(max_tokens=24, temperature=0.9, seed=5, logit_bias={str(sid): -100, "7": 3.5, "11": -2})
    a = srv.chat(**kw, logprobs=True)
    b = srv.chat(**kw, extra_body={"draft": False})
    assert a.model_extra["tensorfold"]["token_hash"] == b.model_extra["tensorfold"]["token_hash"]
    assert a.choices[0].logprobs.content[0].token != s0     # the sampled first token, banned
    streamed = "".join(x.choices[0].delta.content or "" for x in
                       c.chat.completions.create(model=srv.name, messages=USER, stream=True, **kw) if x.choices)
    assert streamed == chat_text(a)
    r = srv.post("/v1/chat/completions", _msg(logit_bias={"999999": 1}, stream=True))
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text


def test_stop_token_ids_and_ignore_eos(srv):
    """vLLM's stop_token_ids and ignore_eos (they were refused). A stop id ends the reply as EOS does:
    finish "stop", the id counted, its text left out, streamed the same, drafted == serial. ignore_eos:
    a reply forced to EOS (logit_bias) runs on to max_tokens; a stop id still ends it."""
    from tensorfold.testing import EOS_TOKEN_IDS
    plain = srv.chat(max_tokens=8, temperature=0.0, logprobs=True)
    toks = [t.token for t in plain.choices[0].logprobs.content]
    j = next(i for i in range(2, len(toks)) if toks[i] not in toks[:i])      # its first occurrence
    sid = srv.post("/tokenize", {"prompt": toks[j]}).json()["tokens"][-1]
    assert srv.post("/detokenize", {"tokens": [sid]}).json()["prompt"] == toks[j]
    kw = dict(max_tokens=8, temperature=0.0, extra_body={"stop_token_ids": [sid]})
    r = srv.chat(**kw)
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == j + 1
    assert chat_text(r) == "".join(toks[:j])
    assert chat_text(srv.chat(max_tokens=8, temperature=0.0, extra_body={"stop_token_ids": [sid], "draft": False})) \
        == chat_text(r)
    chunks = list(srv.client.chat.completions.create(model=srv.name, messages=USER, stream=True, **kw))
    assert "".join(x.choices[0].delta.content or "" for x in chunks if x.choices) == chat_text(r)
    assert [x.choices[0].finish_reason for x in chunks if x.choices][-1] == "stop"
    eos = {str(EOS_TOKEN_IDS[0]): 100}
    assert srv.chat(max_tokens=6, logit_bias=eos).usage.completion_tokens == 1
    on = srv.chat(max_tokens=6, logit_bias=eos, extra_body={"ignore_eos": True})
    assert on.choices[0].finish_reason == "length" and on.usage.completion_tokens == 6
    cut = srv.chat(max_tokens=6, logit_bias=eos, extra_body={"ignore_eos": True, "stop_token_ids": [EOS_TOKEN_IDS[0]]})
    assert cut.choices[0].finish_reason == "stop" and cut.usage.completion_tokens == 1
    held = srv.chat(max_tokens=6, logit_bias=eos, extra_body={"min_tokens": 3})     # vLLM's min_tokens
    assert held.choices[0].finish_reason == "stop" and held.usage.completion_tokens == 4


def test_echo_with_prompt_logprobs(srv):
    """completions' echo: the prompt leads the text, and with logprobs its tokens are scored (the
    first has none), streamed as not; max_tokens 0 scores the prompt alone (OpenAI's legacy use,
    lm-eval's loglikelihood requests)."""
    c, prompt = srv.client, "def add(a, b):\n    return a"
    kw = dict(model=srv.name, prompt=prompt, temperature=0.0)
    plain = c.completions.create(max_tokens=4, logprobs=2, **kw)
    r = c.completions.create(max_tokens=4, logprobs=2, echo=True, **kw)
    ch, lp = r.choices[0], r.choices[0].logprobs
    n = r.usage.prompt_tokens
    assert ch.text == prompt + plain.choices[0].text
    assert lp.tokens[n:] == plain.choices[0].logprobs.tokens and len(lp.tokens) == n + r.usage.completion_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:]) and lp.token_logprobs[n:] == plain.choices[0].logprobs.token_logprobs
    chunks = list(c.completions.create(max_tokens=4, logprobs=2, echo=True, stream=True, **kw))
    assert "".join(x.choices[0].text for x in chunks) == ch.text
    assert [v for x in chunks if x.choices[0].logprobs for v in x.choices[0].logprobs.token_logprobs] == lp.token_logprobs
    zero = c.completions.create(max_tokens=0, logprobs=2, echo=True, **kw)
    assert zero.choices[0].text == prompt and zero.choices[0].finish_reason == "length"
    assert zero.choices[0].logprobs.token_logprobs == lp.token_logprobs[:n] and zero.usage.completion_tokens == 0
    assert c.completions.create(max_tokens=2, echo=True, **kw).choices[0].text.startswith(prompt)
    assert srv.post("/v1/completions", {"prompt": prompt, "max_tokens": 0, "echo": True}).status_code == 400
    assert srv.post("/v1/completions", {"prompt": prompt, "max_tokens": 0}).status_code == 400
    r = srv.post("/v1/chat/completions", _msg(echo=True))
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo"


def test_n_choices(srv):
    """n > 1: choices generated one after another, each with its own seed (choice 0 is the n = 1
    reply; sampling.choice_seed), streamed as not, drafted == serial for each; usage counts the
    prompt once and every choice's tokens."""
    c = srv.client
    kw = dict(model=srv.name, max_tokens=10, temperature=0.9, seed=7)
    one = c.chat.completions.create(messages=USER, **kw)
    three = c.chat.completions.create(messages=USER, n=3, **kw)
    texts = [ch.message.content for ch in three.choices]
    assert [ch.index for ch in three.choices] == [0, 1, 2] and texts[0] == chat_text(one)
    assert len(set(texts)) > 1
    assert three.usage.prompt_tokens == one.usage.prompt_tokens
    serial = c.chat.completions.create(messages=USER, n=3, extra_body={"draft": False}, **kw)
    assert [ch.message.content for ch in serial.choices] == texts
    chunks = list(c.chat.completions.create(messages=USER, n=3, stream=True,
                                            stream_options={"include_usage": True}, **kw))
    got = {}
    for x in chunks:
        for ch in x.choices:
            got.setdefault(ch.index, []).append(ch.delta.content or "")
    assert ["".join(got[i]) for i in range(3)] == texts
    assert [ch.finish_reason for x in chunks for ch in x.choices if ch.finish_reason] == \
        [ch.finish_reason for ch in three.choices]
    assert chunks[-1].usage.completion_tokens == three.usage.completion_tokens
    comp = c.completions.create(prompt="def add(a, b):", n=2, logprobs=1, **kw)
    assert [ch.index for ch in comp.choices] == [0, 1]
    for ch in comp.choices:         # each choice's offsets start at its own text's start
        assert ch.logprobs.text_offset[0] == 0 and len(ch.logprobs.tokens) >= 1
    greedy = c.chat.completions.create(messages=USER, n=2, **{**kw, "temperature": 0.0})
    assert greedy.choices[0].message.content == greedy.choices[1].message.content


def test_tokenize_and_detokenize(srv):
    """vLLM's /tokenize and /detokenize: a chat's count is the prompt a request with those messages
    runs (its usage), a prompt past the context is still counted, bad input is a 400."""
    h = {"Authorization": f"Bearer {KEY}"}

    def post(path, body, status=200):
        r = httpx.post(srv.base + path, json=body, headers=h, timeout=60)
        assert r.status_code == status, r.text
        return r.json()
    r = post("/tokenize", {"messages": USER})
    assert r["count"] == srv.chat(max_tokens=1).usage.prompt_tokens == len(r["tokens"])
    assert r["max_model_len"] == srv.engine.context_length
    assert post("/tokenize", {"messages": USER, "add_generation_prompt": False})["count"] < r["count"]
    ids = post("/tokenize", {"prompt": "def add(a, b):"})["tokens"]
    assert post("/detokenize", {"tokens": ids})["prompt"] == "def add(a, b):"
    assert post("/tokenize", {"prompt": [5, 6, 7]})["tokens"] == [5, 6, 7]
    long = "word " * (srv.engine.context_length + 10)
    assert post("/tokenize", {"prompt": long})["count"] > srv.engine.context_length
    for path, body in (("/tokenize", {}), ("/tokenize", {"prompt": ""}), ("/tokenize", {"messages": "x"}),
                       ("/detokenize", {"tokens": [1, -2]}), ("/detokenize", {"tokens": [10**7]}),
                       ("/tokenize", {"prompt": [10**7, 5]}),      # ids past the vocabulary were counted
                       ("/tokenize", {"prompt": "x", "model": "other"}),
                       ("/tokenize", {"prompt": "x", "messages": USER}), ("/tokenize", {"prompt": "x", "model": 5}),
                       ("/v1/completions", {"prompt": "x", "model": 5})):
        assert "error" in post(path, body, 404 if body.get("model") == "other" else 400)
    assert httpx.post(srv.base + "/tokenize", json={"prompt": "x"}, timeout=60).status_code == 401
