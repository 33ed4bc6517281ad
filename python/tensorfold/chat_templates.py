"""Chat templates written in Python rather than Jinja: tokenizer_config.json's "chat_template_type"
names one (mlx-lm's convention, mlx_lm/chat_templates/). Each renders the same text as mlx-lm's
(tests/test_tokenizer.py compares them on many conversations).

deepseek_v32: DeepSeek-V3.2's encoding. A prompt is BOS, then each message in turn: a system
message's text; a user message as <｜User｜>text<｜Assistant｜> followed by <think> (thinking
mode, the last user message) or </think>; an assistant message as [reasoning</think>] text
[tool calls] EOS, its reasoning kept only past the last user message in thinking mode; tool
results folded into <function_results>. Thinking mode unless enable_thinking is false."""

from __future__ import annotations

import json
from typing import Any

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
THINK, END_THINK = "<think>", "</think>"
DSML = "｜DSML｜"


def _json(value: Any) -> str:
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return json.dumps(value, ensure_ascii=True)


def _user_turn(text: str) -> str:
    return f"<｜User｜>{text}<｜Assistant｜>"


def _response_format(m: dict) -> str:
    rf = m.get("response_format")
    return ("\n\n## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"
            + _json(rf)) if rf else ""


def _dsml_call(call: dict) -> str:
    fn = call.get("function") or {}
    args = fn.get("arguments")
    args = json.loads(args) if isinstance(args, str) else (args or {})
    params = "\n".join(
        f'<{DSML}parameter name="{k}" string="{"true" if isinstance(v, str) else "false"}">'
        f'{v if isinstance(v, str) else _json(v)}</{DSML}parameter>' for k, v in args.items())
    return f'<{DSML}invoke name="{fn.get("name")}">\n{params}\n</{DSML}invoke>'


def deepseek_v32(messages: list[dict], add_generation_prompt: bool = True,
                 enable_thinking: bool | None = None, tools=None, **_: Any) -> str:
    if tools:
        raise ValueError("tools are not supported with the deepseek_v32 chat template")
    thinking = enable_thinking is not False
    last_user = max((i for i, m in enumerate(messages) if m.get("role") in ("user", "developer")),
                    default=-1)
    if thinking and any(m.get("role") == "developer" for m in messages[:max(last_user, 0)]):
        # mlx-lm's encoding drops such a message and then fails on the shorter list
        raise ValueError("a developer message before the last user message is not supported by the "
                         "deepseek_v32 template in thinking mode")
    if thinking:    # earlier turns' reasoning is dropped
        messages = [dict((k, v) for k, v in m.items() if k != "reasoning_content")
                    if m.get("role") == "assistant" and i < last_user else m
                    for i, m in enumerate(messages)]
    out = [BOS]
    for i, m in enumerate(messages):
        role, content = m.get("role"), m.get("content")
        opens = THINK if thinking and i == last_user else END_THINK
        if role == "system":
            out.append((content or "") + _response_format(m))
        elif role == "developer":
            if not content:
                raise ValueError(f"messages[{i}]: a developer message needs content")
            out.append(_user_turn(_response_format(m) + f"\n\n# The user's message is: {content}") + opens)
        elif role == "user":
            out.append(_user_turn(content) + opens)
        elif role == "tool":
            j = i - 1
            while j >= 0 and messages[j].get("role") == "tool":
                j -= 1
            calls = messages[j].get("tool_calls") if j >= 0 and messages[j].get("role") == "assistant" else None
            order = i - j
            if not calls or len(calls) < order:
                raise ValueError(f"messages[{i}]: a tool result without its assistant tool call")
            if order == 1:
                out.append("\n\n<function_results>")
            out.append(f"\n<result>{content}</result>")
            if order == len(calls):
                out.append("\n</function_results>\n\n" + (THINK if thinking and i >= last_user else END_THINK))
        elif role == "assistant":
            calls = m.get("tool_calls")
            reasoning = ""
            if thinking and i > last_user:
                if not (m.get("reasoning_content") or calls):
                    raise ValueError(f"messages[{i}]: in thinking mode an assistant message after the "
                                     "last user message needs reasoning_content or tool_calls")
                reasoning = (m.get("reasoning_content") or "") + END_THINK
            tail = ""
            if calls:
                body = "\n".join(_dsml_call(c) for c in calls)
                tail = f"\n\n<{DSML}function_calls>\n{body}\n</{DSML}function_calls>"
            out.append(reasoning + (content or "") + tail + EOS)
        else:
            raise ValueError(f"messages[{i}]: role {role!r} is not one the deepseek_v32 template takes")
    text = "".join(out)
    if not add_generation_prompt and messages and messages[-1].get("role") == "user":
        text = text.removesuffix("<｜Assistant｜>" + THINK)
    return text


TEMPLATES = {"deepseek_v32": deepseek_v32}
