"""Tool calls: tools reach the chat template; Hermes / Qwen `<tool_call>` blocks in the reply become
OpenAI tool_calls, streamed and not; nothing the model wrote is lost (server/tools.py)."""

from __future__ import annotations

import json
import random

import httpx
import pytest

from tensorfold.server.tools import ToolCallSplitter, parse_call, tool_format
from tensorfold.testing import CHAT_TEMPLATE
from test_server import KEY, PreparingEngine, real_server, scripted_server

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}
TWO_CALLS = ('I will look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>')


def test_parse_call():
    c = parse_call('\n{"name": "f", "arguments": {"a": [1, "é"]}}\n')
    assert c["type"] == "function" and c["id"].startswith("call_")
    assert c["function"] == {"name": "f", "arguments": '{"a": [1, "é"]}'}
    assert parse_call('{"name": "f", "arguments": "{\\"a\\": 1}"}')["function"]["arguments"] == '{"a": 1}'
    assert parse_call('{"name": "f", "parameters": {"a": 1}}')["function"]["arguments"] == '{"a": 1}'
    assert parse_call('{"name": "f"}')["function"]["arguments"] == "{}"
    for bad in ('{"name": "f", "arguments": {', '["f"]', '{"arguments": {}}', '{"name": ""}',
                '{"name": "f", "arguments": "not json"}', "[" * 100000):
        assert parse_call(bad) is None, bad


def _split(text: str, cuts: list[int], enabled=True):
    sp = ToolCallSplitter(enabled)
    pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    out = [sp.feed(p) for p in pieces] + [sp.feed("", final=True)]
    return "".join(c for c, _ in out), [call["function"] for _, calls in out for call in calls]


def test_splitter_any_cut_same_result():
    rng = random.Random(0)
    want = ("I will look.\n\n", [{"name": "get_weather", "arguments": '{"city": "Paris"}'},
                                 {"name": "get_weather", "arguments": '{"city": "Zürich"}'}])
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(TWO_CALLS)), rng.randint(0, 30)))
        assert _split(TWO_CALLS, cuts) == want
    assert _split(TWO_CALLS, [], enabled=False) == (TWO_CALLS, [])
    # what is not a call stays text, as the model wrote it: a block the reply ends inside, a block
    # that is not a call, a start tag's prefix at the end, a lone end tag
    for text in ('x <tool_call>\n{"name": "f", "argu', "x <tool_call>oops</tool_call> y", "x <tool_",
                 "a </tool_call> b", "<tool_call>"):
        for cuts in ([], list(range(1, len(text)))):
            assert _split(text, cuts) == (text, []), (text, cuts)


def test_tool_format():
    assert tool_format(type("T", (), {"chat_template": CHAT_TEMPLATE})()) == "json"
    coder = CHAT_TEMPLATE.replace("<tool_call>\\n{", "<tool_call>\\n<function=")
    assert "<function=" in coder and tool_format(type("T", (), {"chat_template": coder})()) is None
    assert tool_format(type("T", (), {"chat_template": "{{ messages }}"})()) is None
    assert tool_format(None) is None


class ToolEngine(PreparingEngine):
    """A scripted engine whose template writes Hermes tool calls; records the tools prepare got."""

    def __init__(self, script, template=CHAT_TEMPLATE):
        super().__init__(script)
        self.tokenizer.chat_template = template
        self.tools_seen = []

    def prepare(self, messages=None, prompt=None, enable_thinking=None, tools=None, template_kwargs=None):
        self.tools_seen.append(tools)
        return super().prepare(messages, prompt, enable_thinking, tools, template_kwargs)


def _pieces(text: str, n: int = 3) -> list[str]:
    return [text[i:i + n] for i in range(0, len(text), n)]


def test_tool_calls_through_the_openai_client():
    eng = ToolEngine(_pieces(TWO_CALLS))
    with scripted_server(eng, api_key=KEY) as s:
        r = s.chat(tools=[WEATHER], max_tokens=1000)
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls" and ch.message.content == "I will look.\n\n"
        assert [(c.function.name, json.loads(c.function.arguments)) for c in ch.message.tool_calls] == \
            [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Zürich"})]
        assert len({c.id for c in ch.message.tool_calls}) == 2 and eng.tools_seen[-1] == [WEATHER]
        chunks = list(s.chat(tools=[WEATHER], max_tokens=1000, stream=True))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        calls = [tc for d in deltas for tc in (d.tool_calls or [])]
        assert [(tc.index, tc.function.name, tc.function.arguments) for tc in calls] == \
            [(k, c.function.name, c.function.arguments) for k, c in enumerate(ch.message.tool_calls)]
        assert "".join(d.content or "" for d in deltas) == ch.message.content
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
        # n = 2: each choice its calls, numbered from 0 within it
        two = s.chat(tools=[WEATHER], max_tokens=1000, n=2).choices
        assert [len(c.message.tool_calls) for c in two] == [2, 2] and all(c.finish_reason == "tool_calls" for c in two)
        chunks = list(s.chat(tools=[WEATHER], max_tokens=1000, stream=True, n=2))
        assert sorted((c.choices[0].index, tc.index) for c in chunks if c.choices
                      for tc in (c.choices[0].delta.tool_calls or [])) == [(0, 0), (0, 1), (1, 0), (1, 1)]
        # cut inside the second block by max_tokens: the first call, the rest as text, "length"
        n = len(_pieces(TWO_CALLS)) - 3
        r = s.chat(tools=[WEATHER], max_tokens=n)
        assert r.choices[0].finish_reason == "length" and len(r.choices[0].message.tool_calls) == 1
        first = TWO_CALLS[TWO_CALLS.index("<tool_call>"):TWO_CALLS.index("</tool_call>") + len("</tool_call>")]
        assert r.choices[0].message.content == "".join(_pieces(TWO_CALLS)[:n]).replace(first, "")
        # without tools (or with tool_choice "none") the blocks are text, and no tools reach the template
        for kw in ({}, {"tools": [WEATHER], "tool_choice": "none"}):
            r = s.chat(max_tokens=1000, **kw)
            assert r.choices[0].message.content == TWO_CALLS and not r.choices[0].message.tool_calls
            assert r.choices[0].finish_reason == "stop" and eng.tools_seen[-1] is None


def test_strict_tools_are_served_as_written():
    """`strict` is accepted and not enforced: the openai client's pydantic_function_tool (and the Agents
    SDK) send strict true by default, and a 400 for it refused their tools."""
    import openai
    import pydantic

    class GetWeather(pydantic.BaseModel):
        city: str

    tool = openai.pydantic_function_tool(GetWeather, name="get_weather")
    assert tool["function"].get("strict") is True
    with scripted_server(ToolEngine(_pieces(TWO_CALLS)), api_key=KEY) as s:
        r = s.chat(tools=[tool], max_tokens=1000)
        assert r.choices[0].finish_reason == "tool_calls" and len(r.choices[0].message.tool_calls) == 2


@pytest.mark.parametrize("body, param", [
    ({"tools": [WEATHER], "tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice"),
    ({"tools": {"a": 1}}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools[0].function.parameters"),
])
def test_bad_tools_are_400(body, param):
    with scripted_server(ToolEngine(["x"])) as s:
        r = s.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_a_template_without_a_parsed_format_refuses_tools():
    with scripted_server(ToolEngine(["x"], template="{{ messages }}")) as s:
        r = s.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER]})
        assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_parameter"
        r = s.post("/v1/completions", {"prompt": "hi", "tools": [WEATHER]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
        assert s.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [],
                                               "max_tokens": 1}).status_code == 200


def test_tools_reach_a_real_models_template(checkpoints):
    """On a real engine the tools are rendered into the prompt (the test checkpoints' Qwen3-style
    template) and a reply is served; a tool turn and a tool result in the history render too."""
    with real_server(checkpoints["qwen3_mlx_4bit"]) as s:
        plain = s.chat(max_tokens=2)
        r = s.chat(tools=[WEATHER], max_tokens=2)
        assert r.usage.prompt_tokens > plain.usage.prompt_tokens + 20
        prompt = s.worker.engine.prepare([{"role": "user", "content": "hi"}], tools=[WEATHER]).text
        assert '"name": "get_weather"' in prompt and "<tools>" in prompt
        history = [{"role": "user", "content": "Weather in Paris?"},
                   {"role": "assistant", "content": None, "tool_calls": [
                       {"id": "call_1", "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                   {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
        r = s.chat(messages=history, tools=[WEATHER], max_tokens=2)
        assert r.choices[0].finish_reason in ("stop", "length")
        text = s.worker.engine.prepare(history, tools=[WEATHER]).text
        assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
        assert "<tool_response>\nsunny\n</tool_response>" in text


@pytest.mark.parametrize("script", [
    '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>',
    '\n\n<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>',
    '\n Look: <tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n',
    "\n  \n",
    "plain text",
    "",
])
def test_streamed_content_is_the_content(script):
    """Content that is all whitespace beside tool calls is null, streamed or not (two calls written
    a newline apart streamed the newline); other content streams as it is. The deltas assemble as the
    openai client assembles them (null until a delta has content) to the unstreamed message's content,
    null included: the first delta's content "" made a reply of calls alone assemble to ""."""
    with scripted_server(ToolEngine(_pieces(script, 2) or [""])) as s:
        full = s.chat(tools=[WEATHER], max_tokens=1000).choices[0]
        chunks = list(s.chat(tools=[WEATHER], max_tokens=1000, stream=True))
        parts = [c.choices[0].delta.content for c in chunks if c.choices]
        streamed = None if all(p is None for p in parts) else "".join(p or "" for p in parts)
        assert streamed == full.message.content, parts
        if full.message.tool_calls:
            assert full.message.content is None or full.message.content.strip()
        else:
            assert full.message.content == script


def test_tokenize_takes_tools_as_a_request_does():
    msgs = [{"role": "user", "content": "hi"}]
    with scripted_server(ToolEngine(["x"], template="{{ messages }}")) as s:
        r = s.post("/tokenize", {"messages": msgs, "tools": [WEATHER]})
        assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_parameter"
