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
