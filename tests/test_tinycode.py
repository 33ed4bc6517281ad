"""The embedded model on real text, through HTTP: drafting accepts on copy/rename requests and
the drafted reply equals the `"draft": false` reply byte for byte."""

from __future__ import annotations

import inspect
import json
import textwrap

import pytest

from tensorfold.engine import PrefillMode
from test_server import real_server

SRC = inspect.getsource(json.dumps)


@pytest.fixture(scope="module")
def server(tinycode_path):
    # the "kernels" prefill keeps these ~300-token prompts fast on the CPU; drafting is what is tested
    with real_server(tinycode_path, engine_kw={"prefill_mode": PrefillMode(ops="kernels")}) as s:
        yield s


@pytest.mark.parametrize("request_text", [
    f"Echo the following code back unchanged.\n\n```python\n{SRC}```",
    f"Rename the function dumps to to_json in the following code.\n\n```python\n{SRC}```",
    "Echo the following code back unchanged.\n\n```python\n" + textwrap.dedent('''\
        def add(a, b):
            """Return the sum of a and b."""
            return a + b


        def mul(a, b):
            """Return the product of a and b."""
            return a * b
        ''') + "```",
])
def test_drafts_accept_and_equal_serial(server, request_text):
    msgs = [{"role": "user", "content": request_text}]
    drafted = server.chat(msgs, max_tokens=160, temperature=0)
    serial = server.chat(msgs, max_tokens=160, temperature=0, extra_body={"draft": False})
    tf_d, tf_s = drafted.model_extra["tensorfold"], serial.model_extra["tensorfold"]
    assert drafted.choices[0].message.content == serial.choices[0].message.content
    assert tf_d["token_hash"] == tf_s["token_hash"]
    assert tf_s["drafted"] == 0
    assert tf_d["accepted"] > 0, tf_d
    assert "def " in drafted.choices[0].message.content


def test_sampled_drafts_equal_serial(server):
    msgs = [{"role": "user", "content": f"Echo the following code back unchanged.\n\n```python\n{SRC}```"}]
    a = server.chat(msgs, max_tokens=120, temperature=0.7, seed=7)
    b = server.chat(msgs, max_tokens=120, temperature=0.7, seed=7, extra_body={"draft": False})
    assert a.choices[0].message.content == b.choices[0].message.content


def test_tools_its_template_does_not_read_are_refused(server):
    """tinycode's chat template never reads `tools`: the server refused them (no tool-call format),
    but Engine.generate rendered the chat without them and answered (they were dropped without a
    word). Now a RequestError naming tools, as the server's 400 does."""
    from tensorfold.errors import RequestError
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    msgs = [{"role": "user", "content": "weather?"}]
    assert not server.engine.tokenizer.takes_tools
    with pytest.raises(RequestError) as e:
        server.engine.generate_text(messages=msgs, tools=tools, max_tokens=2)
    assert e.value.param == "tools" and e.value.code == "unsupported_parameter"
    r = server.post("/v1/chat/completions", {"messages": msgs, "tools": tools, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"


def test_echo_keeps_a_bos_id_the_prompt_types(server):
    """tinycode's config.json names id 0 (<|endoftext|>) the BOS, which its tokenizer never adds: a
    prompt typed with it lost it from echo's text while the logprobs listed it (offsets 0, 0, ...)."""
    prompt = "<|endoftext|>def f("
    r = server.post("/v1/completions", {"prompt": prompt, "max_tokens": 3, "echo": True, "logprobs": 0,
                                        "temperature": 0})
    ch = r.json()["choices"][0]
    assert ch["text"].startswith(prompt), ch["text"]
    lp = ch["logprobs"]
    assert lp["tokens"][0] == "<|endoftext|>" and lp["text_offset"][:2] == [0, len("<|endoftext|>")]
    assert "".join(lp["tokens"]) == ch["text"]
