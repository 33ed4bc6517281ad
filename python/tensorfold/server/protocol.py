"""Parse OpenAI-style request bodies into a validated `Request`; every problem is a `RequestError` (4xx)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from ..engine.args import shown
from ..engine.logprobs import MAX_TOP
from ..engine.types import SamplingParams
from ..errors import RequestError
from ..tokenizer import TEMPLATE_OWN

ROLES = ("system", "developer", "user", "assistant", "tool")    # the chat template's (tokenizer.VALID_ROLES)


@dataclass
class Request:
    kind: str                                   # "chat" | "completion"
    model: str | None = None
    messages: list | None = None
    prompt: str | list[int] | None = None
    max_tokens: int | None = None               # None: the server default
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: list[str] | None = None
    stream: bool = False
    include_usage: bool = False
    enable_thinking: bool | None = None
    template_kwargs: dict | None = None         # chat_template_kwargs other than enable_thinking
    draft: bool = True
    logprobs: int | None = None                 # None: none; n: each token's logprob and the n most likely
    tools: list | None = None                   # chat: the tools the template renders (tool_choice "auto")
    echo: bool = False                          # completions: the prompt leads the text (and the logprobs)
    n: int = 1                                  # choices
    ignore_eos: bool = False                    # vLLM's: EOS does not end the reply
    stop_token_ids: list[int] | None = None     # vLLM's: ids that end the reply as EOS does
    min_tokens: int = 0                         # vLLM's: no EOS / stop id / stop string before this many
    add_generation_prompt: bool = True          # vLLM's (chat): the template opens the reply's turn
    continue_final_message: bool = False        # vLLM's (chat): the reply continues the last message


def content_type_error(value: str | None) -> str | None:
    """Why a request's Content-Type cannot carry its JSON body, or None where it can: none given (read
    as JSON, as FastAPI and vLLM do), application/json or a +json type, with no charset or UTF-8's.
    Anything else (curl -d's default application/x-www-form-urlencoded, text/plain, ...) is a 415."""
    if value is None or not value.strip():
        return None
    kind, *params = (part.strip() for part in value.split(";"))
    kind = kind.lower()
    if kind != "application/json" and not (kind.startswith("application/") and kind.endswith("+json")):
        return (f"Content-Type {value.strip()[:80]!r} is not JSON: send the body as application/json "
                "(curl: -H 'Content-Type: application/json').")
    for prm in params:
        key, _, val = prm.partition("=")
        if key.strip().lower() == "charset" and val.strip().strip('"').lower() not in ("utf-8", "utf8"):
            return f"Content-Type {value.strip()[:80]!r}: a JSON body is read as UTF-8 only."
    return None


def parse_json(body: bytes) -> dict:
    try:
        # UTF-8 only (RFC 8259 section 8.1; json.loads would take UTF-16 and UTF-32 bytes too), a
        # UTF-8 byte order mark ignored, as that section lets a parser do
        data = json.loads(body.decode("utf-8").removeprefix("\ufeff"))
    except UnicodeDecodeError as e:
        raise RequestError(f"Request body is not valid JSON: not UTF-8 ({e}).", code="invalid_json") from None
    except ValueError as e:
        raise RequestError(f"Request body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:
        raise RequestError("Request body is not valid JSON: nested too deeply.", code="invalid_json") from None
    if not isinstance(data, dict):
        raise RequestError("Request body must be a JSON object.", code="invalid_json")
    try:        # "\ud83d" alone is valid JSON but no text: no tokenizer takes it
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise RequestError("Request body holds a lone UTF-16 surrogate (an escape like \\ud83d without "
                           "its pair): not text.", code="invalid_json") from None
    return data


def _bad(param: str, what: str) -> RequestError:
    return RequestError(f"Invalid value for '{param}': {what}", param=param, code="invalid_value")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(d: dict, key: str, *, lo: float | None = None, hi: float | None = None,
            lo_open: bool = False) -> float | None:
    v = d.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _bad(key, f"expected a number, got {json.dumps(v)[:40]}.")
    try:
        v = float(v)                            # an integer too large for a float raises here
    except OverflowError:
        v = math.inf
    if not math.isfinite(v):
        raise _bad(key, "expected a finite number.")
    if lo is not None and (v < lo or (lo_open and v == lo)):
        raise _bad(key, f"must be {'>' if lo_open else '>='} {lo}, got {v}.")
    if hi is not None and v > hi:
        raise _bad(key, f"must be <= {hi}, got {v}.")
    return v


def _int(d: dict, key: str) -> int | None:
    v = d.get(key)
    if v is None:
        return None
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if not _is_int(v):
        raise _bad(key, f"expected an integer, got {json.dumps(v)[:40]}.")
    return v


def _bool(d: dict, key: str, default, param: str | None = None):
    """param: the name errors give (a nested field's full path)."""
    v = d.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _bad(param or key, f"expected a boolean, got {json.dumps(v)[:40]}.")
    return v


def _messages(v) -> list:
    if v is None:
        raise RequestError("Missing required parameter: 'messages'.", param="messages",
                           code="missing_required_parameter")
    if not isinstance(v, list):
        raise _bad("messages", "expected an array of message objects.")
    if not v:
        raise _bad("messages", "must contain at least one message.")
    out = []
    for i, m in enumerate(v):
        p = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _bad(p, "expected a message object.")
        role = m.get("role")
        if not isinstance(role, str):
            raise _bad(f"{p}.role", "missing or not a string.")
        if role not in ROLES:
            raise _bad(f"{p}.role", f"unknown role {role!r} (expected one of {', '.join(ROLES)}).")
        c = m.get("content")
        if c is None:
            if role != "assistant" or not m.get("tool_calls"):  # an assistant turn may carry only tool_calls
                raise _bad(f"{p}.content", "missing.")
        elif isinstance(c, list):
            for j, part in enumerate(c):
                if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                    raise _bad(f"{p}.content[{j}]", "expected a content part object with a 'type'.")
                if part["type"] == "text" and not isinstance(part.get("text"), str):
                    raise _bad(f"{p}.content[{j}].text", "expected a string.")
                if part["type"] != "text":
                    raise _bad(f"{p}.content[{j}].type", f"unsupported content part {part['type']!r}.")
        elif not isinstance(c, str):
            raise _bad(f"{p}.content", "expected a string or an array of content parts.")
        if m.get("tool_calls") is not None:
            _tool_calls(m["tool_calls"], role, f"{p}.tool_calls")
        if m.get("name") is not None and not isinstance(m["name"], str):
            raise _bad(f"{p}.name", "expected a string.")
        out.append(m)
    return out


def _tool_calls(v, role: str, p: str) -> None:
    """An assistant turn's tool_calls, OpenAI's shape: [{"id"?, "type"?: "function", "function":
    {"name": str, "arguments": str (JSON) or object}}]. A template that renders them reads these
    keys; one that does not would have taken a malformed list silently (a 200 for a request
    OpenAI refuses), and one that does raised mid-render."""
    if role != "assistant":
        raise _bad(p, f"only assistant messages carry tool_calls, not {role!r}.")
    if not isinstance(v, list):
        raise _bad(p, "expected an array of tool call objects.")
    for j, call in enumerate(v):
        q = f"{p}[{j}]"
        if not isinstance(call, dict):
            raise _bad(q, "expected a tool call object.")
        if call.get("type") not in (None, "function"):
            raise _bad(f"{q}.type", f"unsupported tool call type {json.dumps(call['type'])[:40]} (expected 'function').")
        if call.get("id") is not None and not isinstance(call["id"], str):
            raise _bad(f"{q}.id", "expected a string.")
        fn = call.get("function")
        if not isinstance(fn, dict):
            raise _bad(f"{q}.function", "missing or not an object.")
        if not isinstance(fn.get("name"), str):
            raise _bad(f"{q}.function.name", "missing or not a string.")
        if not isinstance(fn.get("arguments"), (str, dict)):
            raise _bad(f"{q}.function.arguments", "missing, or not a string (JSON) or an object.")


def _prompt(v):
    if v is None:
        raise RequestError("Missing required parameter: 'prompt'.", param="prompt",
                           code="missing_required_parameter")
    batch = isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list))
    if batch:
        v = v[0]                                # a batch of one
    if isinstance(v, str):
        return v
    if isinstance(v, list):
        if not v:
            raise _bad("prompt", "must not be empty.")
        if all(_is_int(t) for t in v):
            if any(t < 0 for t in v):
                raise _bad("prompt", "token ids must be non-negative.")
            return list(v)
        if all(isinstance(t, (str, list)) for t in v) and not batch:
            raise RequestError("Unsupported parameter: 'prompt' holds several prompts; this server takes one "
                               "prompt a request (send them as separate requests).", param="prompt",
                               code="unsupported_parameter")
    raise _bad("prompt", "expected a string or an array of token ids.")


def _logit_bias(v) -> dict[int, float] | None:
    """OpenAI's logit_bias: an object of token ids (as JSON keys, strings of decimal digits) to
    biases from -100 to 100, added to the logits before sampling (engine/penalties.py). Ids past the
    vocabulary are refused by the engine, which knows it."""
    if v is None:
        return None
    if not isinstance(v, dict):
        raise _bad("logit_bias", "expected an object of token ids (strings) to numbers.")
    out = {}
    for k, b in v.items():
        if not (k.isascii() and k.isdigit()) or len(k) > 12:
            raise _bad("logit_bias", f"a key must be a token id, got {json.dumps(k)[:40]}.")
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not -100 <= b <= 100:
            raise _bad("logit_bias", f"the bias of token {k} must be a number from -100 to 100, "
                                     f"got {json.dumps(b)[:40]}.")
        out[int(k)] = float(b)
    return out or None


def _stop(v) -> list[str] | None:
    if v is None:
        return None
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise _bad("stop", "expected a string or an array of strings.")
    # every stop string is looked for after every token, on the engine's one thread: 100,000 of
    # them made each token 110 ms, for every request queued behind (OpenAI takes up to 4)
    if len(v) > MAX_STOPS:
        raise _bad("stop", f"at most {MAX_STOPS} stop strings, got {len(v)}.")
    if any(len(s) > MAX_STOP_CHARS for s in v):
        raise _bad("stop", f"a stop string has at most {MAX_STOP_CHARS} characters.")
    v = [s for s in v if s]
    return v or None


MAX_STOPS, MAX_STOP_CHARS = 16, 1024
MAX_CHOICES = 128                               # n, as OpenAI caps it


# OpenAI fields this server does not implement, each with a test of "asks for nothing": a request
# that asks for one gets a 400 naming it instead of a reply that silently lacks it (no tool
# calls, other sampling than asked). Their neutral values (false, 0, 1, {}, [], "none",
# "text") are accepted, since many clients send them by default.
def _is(v, n) -> bool:
    """v is the number n (a JSON boolean is not a number here)."""
    return not isinstance(v, bool) and isinstance(v, (int, float)) and v == n


_UNSUPPORTED = {
    "response_format": lambda v: v is None or (isinstance(v, dict) and v.get("type") == "text"),
    "tools": lambda v: v is None or v == [],
    "functions": lambda v: v is None or v == [],
    "function_call": lambda v: v is None or v in ("none", "auto"),     # functions' legacy tool_choice
    "modalities": lambda v: v is None or v == [] or v == ["text"],      # audio out
    "audio": lambda v: v is None,
    "tool_choice": lambda v: v is None or v in ("none", "auto"),
    "echo": lambda v: v is None or v is False or _is(v, 0),
    "best_of": lambda v: v is None or _is(v, 1),
    "suffix": lambda v: v is None or v == "",
    # vLLM's extensions that clients send to OpenAI-compatible servers (top_k and min_p are served)
    "typical_p": lambda v: v is None or _is(v, 1),
}


_CHAT_SERVED = frozenset({"tools", "tool_choice"})     # chat serves them (_tools); completions do not
_COMPLETION_SERVED = frozenset({"echo"})                 # and completions this one


def _refuse_unsupported(data: dict, kind: str) -> None:
    for key, neutral in _UNSUPPORTED.items():
        v = data.get(key)
        if neutral(v) or key in (_CHAT_SERVED if kind == "chat" else _COMPLETION_SERVED):
            continue
        raise RequestError(f"Unsupported parameter: '{key}' is not supported by this server "
                           f"(got {json.dumps(v)[:60]}).", param=key, code="unsupported_parameter")


def parse_request(data: dict, kind: str, *, context_length: int) -> Request:
    """Validate an OpenAI body for `kind` ("chat" or "completion"). Unknown fields are ignored;
    known fields this server does not implement are refused unless neutral (_UNSUPPORTED)."""
    r = Request(kind=kind)
    rf = data.get("response_format")
    if rf is not None and not (isinstance(rf, dict) and isinstance(rf.get("type"), str)):
        raise _bad("response_format.type" if isinstance(rf, dict) else "response_format",
                   "expected an object with a 'type' string.")
    _refuse_unsupported(data, kind)
    # fields served as OpenAI's but not read: their types checked all the same, as OpenAI does
    for key, typ, what in (("user", str, "a string"), ("metadata", dict, "an object"),
                           ("reasoning_effort", str, "a string")):
        if data.get(key) is not None and not isinstance(data[key], typ):
            raise _bad(key, f"expected {what}, got {json.dumps(data[key])[:40]}.")
    model = data.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("model", "expected a string.")
    r.model = model or None
    if kind == "chat":
        r.messages = _messages(data.get("messages"))
    else:
        r.prompt = _prompt(data.get("prompt"))

    echo = kind == "completion" and data.get("echo") not in (None, False, 0) and _bool(data, "echo", False)
    # both are checked whenever given (max_tokens: -5 beside max_completion_tokens was accepted);
    # max_completion_tokens, the newer name, wins where both are
    mt = None
    for key in ("max_tokens", "max_completion_tokens"):
        v = _int(data, key)
        if v is None:
            continue
        if v < 1 and not (v == 0 and echo and _logprobs(data, kind) is not None):
            # 0 with echo and logprobs: the prompt scored, nothing generated (OpenAI's legacy use)
            raise _bad(key, f"must be at least 1, got {shown(v)}.")
        if v > context_length:
            raise RequestError(f"Invalid value for '{key}': {shown(v)} is more than the model's context "
                               f"length ({context_length} tokens).", param=key, code="invalid_value")
        mt = v
    r.max_tokens = mt

    n = _int(data, "n")
    if n is not None:
        if not 1 <= n <= MAX_CHOICES:
            raise _bad("n", f"must be from 1 to {MAX_CHOICES}, got {shown(n)}.")
        r.n = n

    s = r.sampling
    t = _number(data, "temperature", lo=0.0)
    if t is not None:
        s.temperature = t
    p = _number(data, "top_p", lo=0.0, hi=1.0, lo_open=True)
    if p is not None:
        s.top_p = p
    k = _int(data, "top_k")
    if k is not None:
        if k < -1:
            raise _bad("top_k", f"must be >= 0 (or -1 for off), got {shown(k)}.")
        s.top_k = max(k, 0)
    mp = _number(data, "min_p", lo=0.0, hi=1.0)
    if mp is not None:
        s.min_p = mp
    for key in ("presence_penalty", "frequency_penalty"):        # OpenAI's range
        v = _number(data, key, lo=-2.0, hi=2.0)
        if v is not None:
            setattr(s, key, v)
    rp = _number(data, "repetition_penalty", lo=0.0, lo_open=True)
    if rp is not None:
        s.repetition_penalty = rp
    s.logit_bias = _logit_bias(data.get("logit_bias"))
    seed = _int(data, "seed")
    if seed is not None:
        if not -2**63 <= seed < 2**63:      # sampling keys a seed by its low 64 bits: 2**64 was 0
            raise _bad("seed", f"must be a 64-bit signed integer, got {shown(seed)}.")
        s.seed = seed

    r.stop = _stop(data.get("stop"))
    r.ignore_eos = _bool(data, "ignore_eos", False)
    mt = _int(data, "min_tokens")
    if mt is not None:
        if mt < 0:
            raise _bad("min_tokens", f"must be at least 0, got {shown(mt)}.")
        r.min_tokens = mt
    sti = data.get("stop_token_ids")
    if sti is not None:
        if not isinstance(sti, list) or not all(_is_int(i) and i >= 0 for i in sti):
            raise _bad("stop_token_ids", "expected an array of token ids (integers >= 0).")
        r.stop_token_ids = sti or None
    r.stream = _bool(data, "stream", False)
    so = data.get("stream_options")
    if so is not None:
        if not isinstance(so, dict):
            raise _bad("stream_options", "expected an object.")
        r.include_usage = _bool(so, "include_usage", False, "stream_options.include_usage")
        if not r.stream:     # as OpenAI (and vLLM) answer: it was ignored silently
            raise _bad("stream_options", "is only allowed when 'stream' is true.")
    ctk = data.get("chat_template_kwargs")
    if ctk is not None:
        if not isinstance(ctk, dict):
            raise _bad("chat_template_kwargs", "expected an object.")
        r.enable_thinking = _bool(ctk, "enable_thinking", None, "chat_template_kwargs.enable_thinking")
        # the others reach the template as they are (DeepSeek-V3.1's `thinking`, ...), as mlx-lm's
        # server passes them; they were dropped, and the request served without them
        other = {k: v for k, v in ctk.items() if k != "enable_thinking"}
        for k in other:
            if not k.isidentifier() or k in TEMPLATE_OWN:
                raise _bad(f"chat_template_kwargs.{k}", "is not a template variable a request may set.")
        r.template_kwargs = other or None
    r.draft = _bool(data, "draft", True)
    r.logprobs = _logprobs(data, kind)
    r.echo = echo
    if kind == "chat":
        r.tools = _tools(data)
        r.add_generation_prompt, r.continue_final_message = _turn(data)
    return r


def _turn(data: dict) -> tuple[bool, bool]:
    """vLLM's add_generation_prompt (default true) and continue_final_message (default false): with
    the second, the last message is left open and the reply continues it (a prefilled start)."""
    gen = _bool(data, "add_generation_prompt", True)
    cont = _bool(data, "continue_final_message", False)
    if gen and cont:
        raise _bad("continue_final_message", "needs 'add_generation_prompt': false (the final message is "
                                             "continued, no new turn opened).")
    return gen, cont


def _tools(data: dict) -> list | None:
    """The request's tools in OpenAI's form ([{"type": "function", "function": {"name", ...}}]), or
    None where none are given or tool_choice is "none". A choice the server cannot enforce
    ("required", a named function: it would need constrained decoding) is refused."""
    tools, choice = data.get("tools"), data.get("tool_choice")
    parallel = data.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise _bad("parallel_tool_calls", "expected a boolean.")
    if choice is not None and choice not in ("none", "auto"):
        raise RequestError(f"Unsupported parameter: 'tool_choice' {json.dumps(choice)[:60]} is not supported by "
                           "this server (it takes \"auto\" and \"none\").", param="tool_choice",
                           code="unsupported_parameter")
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise _bad("tools", "expected an array.")
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise _bad(f"tools[{i}]", 'expected {"type": "function", "function": {...}}.')
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise _bad(f"tools[{i}].function.name", "expected a non-empty string.")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise _bad(f"tools[{i}].function.parameters", "expected an object (a JSON Schema).")
        # `strict` is accepted and not enforced (README): the openai client's pydantic_function_tool and
        # the Agents SDK send strict true by default, so refusing it refused those clients' tools
    if parallel is False and choice != "none":      # at most one call: the model may write several
        raise RequestError("Unsupported parameter: 'parallel_tool_calls' false is not supported by this server "
                           "(a reply holds the calls the model writes).", param="parallel_tool_calls",
                           code="unsupported_parameter")
    return None if choice == "none" else tools     # checked all the same: a malformed list is a 400 either way


def _logprobs(data: dict, kind: str) -> int | None:
    """How many alternatives a token's logprobs come with, or None (none asked). Chat: `logprobs`
    true, with `top_logprobs` 0..20; completions: `logprobs` 0..20 (OpenAI's legacy field; false
    or null is none)."""
    def count(key: str) -> int:
        n = _int(data, key)
        if not 0 <= n <= MAX_TOP:
            raise _bad(key, f"must be from 0 to {MAX_TOP}, got {shown(n)}.")
        return n

    if kind == "chat":
        on = _bool(data, "logprobs", False)
        top = count("top_logprobs") if data.get("top_logprobs") is not None else None
        if top and not on:
            raise _bad("top_logprobs", "needs 'logprobs': true.")
        return (top or 0) if on else None
    if data.get("top_logprobs") not in (None, 0):
        raise _bad("top_logprobs", "is a chat field; completions take 'logprobs': n.")
    v = data.get("logprobs")
    if v is None or v is False:
        return None
    return count("logprobs")


def parse_tokenize(data: dict) -> dict:
    """/tokenize's body (vLLM's): {"prompt": text or ids} or {"messages": [...], "add_generation_prompt",
    "continue_final_message", "chat_template_kwargs", "tools"} -> Engine.tokenize's keyword arguments."""
    if data.get("messages") is not None:
        if data.get("prompt") is not None:
            raise _bad("prompt", "give either 'prompt' or 'messages', not both.")
        r = parse_request({k: data.get(k) for k in ("messages", "chat_template_kwargs", "tools",
                                                    "add_generation_prompt", "continue_final_message")},
                          "chat", context_length=1)
        return dict(messages=r.messages, enable_thinking=r.enable_thinking, tools=r.tools,
                    template_kwargs=r.template_kwargs, add_generation_prompt=r.add_generation_prompt,
                    continue_final_message=r.continue_final_message)
    return dict(prompt=_prompt(data.get("prompt")))


def parse_detokenize(data: dict) -> list[int]:
    """/detokenize's body: {"tokens": [ids]}."""
    ids = data.get("tokens")
    if not isinstance(ids, list) or not all(_is_int(t) and t >= 0 for t in ids):
        raise _bad("tokens", "expected an array of non-negative token ids.")
    return ids


def sampling_with_defaults(req: Request, data: dict, defaults: dict) -> SamplingParams:
    """Fill the fields the request did not set from the server defaults."""
    s = req.sampling
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
        if data.get(name) is None and defaults.get(name) is not None:
            setattr(s, name, type(getattr(SamplingParams(), name))(defaults[name]))
    return s
