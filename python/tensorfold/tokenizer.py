"""Tokenizer, chat templates and streaming detokenization.

`Tokenizer.from_dir(path)` reads a Hugging Face style model directory:

- ``tokenizer.json`` (loaded with the `tokenizers` library),
- the chat template from ``chat_template.jinja`` or ``tokenizer_config.json["chat_template"]``
  (or ``chat_template.json``), and a template named ``tool_use`` (in the named list, or
  ``additional_chat_templates/tool_use.jinja``) that transformers renders instead when tools are passed,
- EOS ids from ``generation_config.json`` (else ``config.json``) and ``tokenizer_config.json``'s
  ``eos_token``; BOS ids from all three.

`IncrementalDetokenizer` turns a stream of token ids into text pieces whose concatenation equals
``tokenizer.decode(all_ids)``, decoding only a bounded window of recent tokens per step.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import pathlib
import re
import time
from datetime import datetime
from typing import Any, Iterable, Sequence

from tokenizers import Tokenizer as _HFTokenizer

log = logging.getLogger("tensorfold")

__all__ = [
    "Tokenizer",
    "IncrementalDetokenizer",
    "TemplateError",
    "VALID_ROLES",
    "validate_messages",
]

VALID_ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})
_REPLACEMENT = "\ufffd"


RENDER_LIMIT_S = 10.0      # a chat template's rendering past this is a TemplateError (a 400)
# Tokenizer.far_past: a prompt's text longer than 8 characters a token of the context (and a slice) is
# counted slice by slice before it is tokenized whole: a 15 MB prompt to a 4k-context server took
# 2.3 GB and 11-17 s to refuse (the tokenizers library keeps ~600 bytes a token), and kept 1.5 GB
SLICE_CHARS = 1 << 16
_SPACE = re.compile(r"\s")


class TemplateError(ValueError):
    """A chat template could not be rendered (raise_exception() in the template, or a template bug)."""


# --------------------------------------------------------------------------------------------------
# helpers


def read_json_object(path: pathlib.Path) -> dict:
    """A side file's JSON object ({} where the file is absent). A file that is there but cannot be
    read is an error at load, as transformers / mlx-lm make it: read as empty, a trailing comma in
    tokenizer_config.json dropped the chat template and the eos token without a word."""
    if not path.is_file():
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read ({type(e).__name__}: {str(e)[:200]})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _token_content(tok: Any) -> str | None:
    """tokenizer_config's bos_token/eos_token: a string, or {"content": ...}, or None."""
    if isinstance(tok, str):
        return tok
    if isinstance(tok, dict):
        content = tok.get("content")
        return content if isinstance(content, str) else None
    return None


def _int_ids(value: Any) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _named_templates(value: Any) -> dict[str, str]:
    """tokenizer_config's chat_template as {name: template}: a string is the default; a list of
    {"name", "template"} (Hermes-2-Pro, Command-R: "default" and "tool_use") keeps its names."""
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list):
        named: dict[str, str] = {}
        for t in value:     # an entry without a name is the default (a one-entry list had been read so)
            if isinstance(t, dict) and isinstance(t.get("template"), str):
                named.setdefault(t["name"] if isinstance(t.get("name"), str) else "default", t["template"])
        return named
    return {}


def _pick_template(named: dict[str, str]) -> str | None:
    """The template rendered without tools: "default", or the only one there is."""
    if "default" in named:
        return named["default"]
    if len(named) == 1:
        return next(iter(named.values()))
    return None


def _templates_in(path: pathlib.Path, tcfg: dict) -> tuple[dict[str, str], pathlib.Path]:
    """The named chat templates of a model directory and the file they came from, as transformers
    reads them: chat_template.jinja (the default) with additional_chat_templates/<name>.jinja beside
    it, else tokenizer_config.json's chat_template, else chat_template.json's."""
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        named = {"default": jinja_file.read_text(encoding="utf-8")}
        extra = path / "additional_chat_templates"
        if extra.is_dir():
            for f in sorted(extra.glob("*.jinja")):
                named.setdefault(f.stem, f.read_text(encoding="utf-8"))
        return named, jinja_file
    named = _named_templates(tcfg.get("chat_template"))
    if named:
        return named, path / "tokenizer_config.json"
    source = path / "chat_template.json"       # some repos ship {"chat_template": ...} there
    return _named_templates(read_json_object(source).get("chat_template")), source


def validate_messages(messages: Any) -> list[dict]:
    """Check chat messages; return shallow copies. Raises ValueError with a one-line message."""
    if not isinstance(messages, (list, tuple)):
        raise ValueError(f"messages must be a list of objects, got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages must not be empty")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] must be an object, got {type(m).__name__}")
        role = m.get("role")
        if role not in VALID_ROLES:
            raise ValueError(
                f"messages[{i}].role must be one of {', '.join(sorted(VALID_ROLES))}, got {role!r}"
            )
        content = m.get("content")
        if content is None:
            if not (role == "assistant" and m.get("tool_calls")):
                raise ValueError(f"messages[{i}].content is required")
        elif isinstance(content, list):
            for j, part in enumerate(content):
                if not isinstance(part, dict):
                    raise ValueError(f"messages[{i}].content[{j}] must be an object")
                if part.get("type") != "text":
                    raise ValueError(
                        f"messages[{i}].content[{j}].type must be 'text', got {part.get('type')!r}"
                    )
                if not isinstance(part.get("text"), str):
                    raise ValueError(f"messages[{i}].content[{j}].text must be a string")
        elif not isinstance(content, str):
            raise ValueError(
                f"messages[{i}].content must be a string or a list of text parts, "
                f"got {type(content).__name__}"
            )
        out.append(_normalized(m))
    return out


def _normalized(m: dict) -> dict:
    """A message as mlx-lm's server hands it to the template (process_message_content): text
    parts joined into one string (real templates such as Qwen3's render list content as ''),
    a missing content as '', and tool-call arguments sent as a JSON string (OpenAI's wire
    format) parsed, so that a template's `tojson` does not encode them twice."""
    # keys set to null dropped, as transformers does (OpenAI clients send "tool_calls": null;
    # Llama 3's template tests `'tool_calls' in message` and then iterates it)
    m = {k: v for k, v in m.items() if v is not None}
    c = m.get("content")
    if isinstance(c, list):
        m["content"] = "".join(part["text"] for part in c)
    elif c is None:
        m["content"] = ""
    calls = m.get("tool_calls")
    if isinstance(calls, list):
        fixed = []
        for call in calls:
            fn = call.get("function") if isinstance(call, dict) else None
            args = fn.get("arguments") if isinstance(fn, dict) else None
            if isinstance(args, str):
                try:
                    call = dict(call, function=dict(fn, arguments=json.loads(args)))
                except (ValueError, RecursionError):     # not JSON, or nested past Python's stack
                    pass
            fixed.append(call)
        m["tool_calls"] = fixed
    return m


# marks where a continued final message's content ends in a rendering (private-use characters)
_CONTINUE_MARK = "\ue000tensorfold-continue\ue001"

# the chat template's variables this tokenizer sets itself (apply_chat_template's context and the
# environment's functions): a request's chat_template_kwargs may not set them (server/protocol.py)
TEMPLATE_OWN = frozenset({"messages", "tools", "documents", "add_generation_prompt", "bos_token", "eos_token",
                          "pad_token", "unk_token", "raise_exception", "strftime_now"})


def _generation_tag():
    """`{% generation %}...{% endgeneration %}` (transformers' AssistantTracker, used by templates
    written for training masks): renders its body."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    return Generation


@functools.lru_cache(maxsize=1)
def _template_env():
    """The one Jinja environment chat templates are compiled and read in (sandboxed, as transformers')."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(str(message))

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _generation_tag()]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


@functools.lru_cache(maxsize=32)
def _compile_template(source: str):
    """A chat template compiled once per text (each Tokenizer's default and tool_use templates, and a
    template a test swaps in, share this cache: no per-instance slot to go stale)."""
    import jinja2
    try:
        return _template_env().from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise TemplateError(f"chat template syntax error (line {e.lineno}): {e.message}") from None


def _template_reads(source: str, name: str) -> bool:
    """The chat template `source` (already compiled once: it parses) reads the variable `name`."""
    from jinja2 import meta
    return name in meta.find_undeclared_variables(_template_env().parse(source))


@contextlib.contextmanager
def _template_errors():
    """Any error a chat template raises as a TemplateError (the request's 400, never a 500:
    ZeroDivisionError and OverflowError were); RecursionError is left to the caller's message."""
    import jinja2
    try:
        yield
    except (TemplateError, RecursionError):
        raise
    except Exception as e:
        what = str(e) if isinstance(e, jinja2.TemplateError) else f"{type(e).__name__}: {e}"
        raise TemplateError(f"chat template error: {what}"[:500]) from None


# --------------------------------------------------------------------------------------------------


def _gpt2_byte_table() -> dict[str, int]:
    """GPT-2's byte -> printable character table (byte-level BPE vocabularies), inverted."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) \
        + list(range(ord("\xae"), ord("\xff") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


_BYTE_OF = _gpt2_byte_table()


def _decoder_kind(tok: _HFTokenizer) -> str:
    """"bytelevel" (GPT-2 style), "metaspace" (SentencePiece style: '\u2581' decoded as a space) or
    "other", from tokenizer.json's decoder."""
    d = tok.decoder
    if d is None:
        return "other"
    try:
        spec = json.loads(d.__getstate__())
    except Exception:  # noqa: BLE001 - an unknown decoder: tokens are decoded alone
        return "other"
    parts = (spec.get("decoders") or []) if spec.get("type") == "Sequence" else [spec]
    types = {p.get("type") for p in parts if isinstance(p, dict)}
    if "ByteLevel" in types:
        return "bytelevel"
    if "Metaspace" in types or any(p.get("type") == "Replace" and p.get("content") == " "
                                   and (p.get("pattern") or {}).get("String") == "\u2581"
                                   for p in parts if isinstance(p, dict)):
        return "metaspace"
    return "other"


class Tokenizer:
    """A `tokenizers` tokenizer plus the model directory's chat template and special ids."""

    def __init__(
        self,
        tokenizer: _HFTokenizer,
        *,
        chat_template: str | None = None,
        tool_template: str | None = None,
        template_fn=None,
        eos_ids: Iterable[int] = (),
        bos_ids: Iterable[int] = (),
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        unk_token: str | None = None,
    ):
        self._tok = tokenizer
        self.chat_template = chat_template
        # the template named "tool_use", rendered instead of chat_template where a request has tools
        # (transformers' get_chat_template, so mlx-lm's prompts); None where there is none
        self.tool_template = tool_template
        self.template_fn = template_fn      # chat_templates.TEMPLATES[chat_template_type], over the Jinja one
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.pad_token = pad_token
        self.unk_token = unk_token
        self.eos_ids: frozenset[int] = frozenset(eos_ids)
        self.bos_ids: frozenset[int] = frozenset(bos_ids)
        added = tokenizer.get_added_tokens_decoder()
        self.special_ids: frozenset[int] = frozenset(i for i, t in added.items() if t.special)
        self.added_ids: frozenset[int] = frozenset(added)

    # -- loading ---------------------------------------------------------------------------------

    @classmethod
    def from_dir(cls, path: str | pathlib.Path) -> "Tokenizer":
        path = pathlib.Path(path)
        tj = path / "tokenizer.json"
        if not tj.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {path}")
        try:
            tok = _HFTokenizer.from_file(str(tj))
        except Exception as e:  # noqa: BLE001 - the tokenizers library raises a bare Exception
            raise ValueError(f"{tj}: cannot read the tokenizer ({str(e).splitlines()[0][:200] if str(e) else type(e).__name__})") from None
        # a tokenizer.json saved with truncation or padding (a fine-tune script's last setting) would
        # cut or pad every prompt: transformers turns both off unless asked, and so does this
        tok.no_truncation()
        tok.no_padding()
        tcfg = read_json_object(path / "tokenizer_config.json")
        gcfg = read_json_object(path / "generation_config.json")
        mcfg = read_json_object(path / "config.json")

        named, source = _templates_in(path, tcfg)
        template = _pick_template(named)
        tool_template = named.get("tool_use") if named.get("tool_use") != template else None
        if named and template is None and tool_template is None:
            log.warning("%s: chat templates named %s, none of them \"default\": chat requests are refused",
                        source, ", ".join(map(repr, named)))

        # mlx-lm's chat_template_type: a template written in Python, used before a Jinja one
        template_fn = None
        ttype = tcfg.get("chat_template_type")
        if ttype is not None:
            from .chat_templates import TEMPLATES
            template_fn = TEMPLATES.get(ttype) if isinstance(ttype, str) else None
            if template_fn is None:
                log.warning("tokenizer_config.json: chat_template_type %r is not one this server has (%s); "
                            "ignored", ttype, ", ".join(TEMPLATES))

        if template_fn is None:
            # compiled at load: a template that does not parse made every chat request a 400 that
            # blamed the request's messages, on a server that had started without a word
            try:
                if template:
                    _compile_template(template)
            except TemplateError as e:
                raise ValueError(f"{source}: {e}") from None
            try:
                if tool_template:
                    _compile_template(tool_template)
            except TemplateError as e:
                # as transformers, which fails only when it renders it: the model serves, and a
                # request with tools takes the default template (or its 400 where that reads none)
                tool_src = (path / "additional_chat_templates" / "tool_use.jinja"
                            if source.name == "chat_template.jinja" else source)
                log.warning("%s: the tool_use chat template does not parse (%s); requests with tools "
                            "render the default template", tool_src, e)
                tool_template = None

        eos_token = _token_content(tcfg.get("eos_token"))
        bos_token = _token_content(tcfg.get("bos_token"))
        pad_token = _token_content(tcfg.get("pad_token"))
        unk_token = _token_content(tcfg.get("unk_token"))

        # generation_config.json's eos ids replace config.json's, as in transformers' generate and
        # mlx-lm's load_config (a union stopped replies on an id both of them generate past)
        eos: set[int] = set(_int_ids(gcfg.get("eos_token_id")) or _int_ids(mcfg.get("eos_token_id")))
        bos: set[int] = set(_int_ids(gcfg.get("bos_token_id"))) | set(_int_ids(mcfg.get("bos_token_id")))
        if eos_token is not None and (i := tok.token_to_id(eos_token)) is not None:
            eos.add(i)
        if bos_token is not None and (i := tok.token_to_id(bos_token)) is not None:
            bos.add(i)
        return cls(
            tok,
            chat_template=template,
            tool_template=tool_template,
            template_fn=template_fn,
            eos_ids=eos,
            bos_ids=bos,
            bos_token=bos_token,
            eos_token=eos_token,
            pad_token=pad_token,
            unk_token=unk_token,
        )

    # -- basic ops ---------------------------------------------------------------------------------

    @property
    def backend(self) -> _HFTokenizer:
        return self._tok

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; no BOS/EOS added, but special token strings map to their ids."""
        return self._encode(text, False)

    def _encode(self, text: str, special: bool) -> list[int]:
        # encode_batch, not encode: the same ids, but tokenizers lets the GIL go while it works
        # (encode holds it: a 6 MB prompt stopped every other Python thread for 4.5 s)
        return self._tok.encode_batch([text], add_special_tokens=special)[0].ids

    def far_past(self, text: str, limit: int) -> int | None:
        """A count of `text`'s tokens over `limit`, made slice by slice (SLICE_CHARS, each cut before a
        whitespace character where one is near, where pre-tokenizers start a piece anyway), where it
        passes 2 limit + 64 (a slice's edge can split a token or two, never double a count), so that
        a prompt far past the context is refused at the cost of its first slices; None otherwise (the
        text is then tokenized whole, as it is, and checked exactly). Texts of at most 8 characters
        a token of `limit` are not looked at: whole, they cost little."""
        if len(text) <= 8 * limit + SLICE_CHARS:
            return None
        bound, n, i = 2 * limit + 64, 0, 0
        while i < len(text):
            j = i + SLICE_CHARS
            if j < len(text):
                m = _SPACE.search(text, j, j + 1024)
                j = m.start() if m else j
            n += len(self._encode(text[i:j], False))
            if n > bound:
                return n
            i = j
        return None

    def encode_prompt(self, text: str) -> list[int]:
        """A completions prompt with what tokenizer.json's post-processor adds (a BOS for Llama /
        Mistral style tokenizers; nothing for Qwen's), unless the text already starts with the BOS
        token: mlx-lm's generate's rule. (transformers' tokenizer(text) and mlx-lm's server add a
        second BOS there, which no model was trained on.)"""
        if self._typed_bos(text):
            return self.encode(text)
        return self._encode(text, True)

    def _typed_bos(self, text: str) -> bool:
        return bool(self.bos_token) and text.startswith(self.bos_token)

    @functools.cached_property
    def _post_adds_bos(self) -> bool:
        """tokenizer.json's post-processor puts a BOS before the text (Llama, Mistral; not Qwen)."""
        with_post = self._encode("a", True)
        return bool(with_post) and with_post[0] in self.bos_ids and with_post[1:] == self._encode("a", False)

    def added_bos(self, text, ids) -> bool:
        """encode_prompt(text) gave `ids` a BOS the text does not hold: the post-processor's, as
        encode_prompt adds it. (A BOS id the text itself starts with, as "<|endoftext|>" typed into a
        Qwen prompt where config.json names that id the BOS, is the text's: echo keeps it.)"""
        return (isinstance(text, str) and bool(ids) and ids[0] in self.bos_ids and self._post_adds_bos
                and not self._typed_bos(text))

    def is_byte_token(self, token_id: int) -> bool:
        """A byte-fallback token (<0xNN>, SentencePiece style)."""
        cache = self.__dict__.setdefault("_byte_ids", {})
        b = cache.get(token_id)
        if b is None:
            t = self._tok.id_to_token(int(token_id)) or ""
            b = cache[token_id] = len(t) == 6 and t.startswith("<0x") and t.endswith(">")
        return b

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for in decoded text (a reply's logprobs name tokens by them):
        a byte-level BPE token's characters mapped back to bytes (GPT-2's table), a byte-fallback
        token's byte (<0xE2>), a SentencePiece piece with its '▁' as spaces, an added token's
        text. A token that is part of a UTF-8 character has that part only. Other decoders: the
        token decoded alone."""
        cache = self.__dict__.setdefault("_bytes_of_id", {})
        b = cache.get(token_id)
        if b is None:
            b = cache[token_id] = self._token_bytes(int(token_id))
        return b

    def _token_bytes(self, token_id: int) -> bytes:
        t = self._tok.id_to_token(token_id)
        if t is None:
            return b""
        if token_id in self.added_ids:
            return t.encode()
        kind = self.__dict__.get("_decoder_kind")
        if kind is None:
            kind = self._decoder_kind = _decoder_kind(self._tok)
        if kind == "bytelevel" and all(c in _BYTE_OF for c in t):
            return bytes(_BYTE_OF[c] for c in t)
        if self.is_byte_token(token_id):
            return bytes([int(t[3:5], 16)])
        if kind == "metaspace":
            return t.replace("\u2581", " ").encode()
        return self._tok.decode([token_id], skip_special_tokens=False).encode()

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(int(token_id))

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    @property
    def bos_id(self) -> int | None:
        if self.bos_token is not None and (i := self.token_to_id(self.bos_token)) is not None:
            return i
        return min(self.bos_ids) if self.bos_ids else None

    # -- chat template -------------------------------------------------------------------------------

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template) or self.template_fn is not None

    @functools.cached_property
    def takes_tools(self) -> bool:
        """The chat template renders a request's `tools` (a Python template_fn is given them)."""
        if self.template_fn is not None:
            return True
        return bool(self.tools_template) and _template_reads(self.tools_template, "tools")

    @property
    def tools_template(self) -> str | None:
        """The Jinja template a request with tools renders: the tool_use one where there is one."""
        return self.tool_template or self.chat_template

    @property
    def has_thinking_toggle(self) -> bool:
        if self.template_fn is not None:
            return True
        return bool(self.chat_template) and "enable_thinking" in self.chat_template

    @property
    def think_tags(self) -> tuple[str, str] | None:
        t = "<think></think>" if self.template_fn is not None else (self.chat_template or "")
        if (
            self.token_to_id("<think>") is not None
            and self.token_to_id("</think>") is not None
            and "<think>" in t
            and "</think>" in t
        ):
            return ("<think>", "</think>")
        return None

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        enable_thinking: bool | None = None,
        tools: list[dict] | None = None,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> str:
        """The chat template's text. continue_final_message (transformers' and vLLM's): the last
        message is left open, the text cut right after its content, so that a reply continues it
        (a prefilled start of the assistant's turn); it needs add_generation_prompt false."""
        if not continue_final_message:
            return self._render(messages, add_generation_prompt, enable_thinking, tools, **kwargs)
        if add_generation_prompt:
            raise ValueError("continue_final_message needs add_generation_prompt false (the final message "
                             "is continued, no new turn opened)")
        msgs = validate_messages(messages)
        raw = self.final_text(msgs)
        final = raw.strip()
        if not final:
            raise ValueError("continue_final_message: the final message has no text to continue")
        # where the content ends, marked: the template's text after it (a closing "<|im_end|>") may hold
        # the content's last characters again ("end", "im"), where a search for the content cut inside it
        marked = self._render(msgs[:-1] + [dict(msgs[-1], content=raw + _CONTINUE_MARK)], False,
                              enable_thinking, tools, **kwargs)
        at = marked.find(_CONTINUE_MARK)
        if at >= 0 and marked.count(_CONTINUE_MARK) == 1 and marked[:at].rstrip().endswith(final):
            return marked[:at]
        # a template that changes the content as it writes it: transformers' rule, the last place the
        # content stands in the text, its trailing whitespace kept where the template wrote it
        text = self._render(msgs, False, enable_thinking, tools, **kwargs)
        at = text.rfind(final)
        if at < 0:
            raise ValueError("continue_final_message: the chat template does not write the final message's "
                             "text as given, so it cannot be continued")
        raw = raw.lstrip()
        return text[:at + (len(raw) if text.startswith(raw, at) else len(final))]

    @staticmethod
    def final_text(messages: list[dict]) -> str:
        """The last message's text (its text parts joined), as the template gets it; the messages
        already validated (apply_chat_template did)."""
        c = _normalized(messages[-1]).get("content")
        return c if isinstance(c, str) else ""

    def _render(self, messages: list[dict], add_generation_prompt: bool, enable_thinking: bool | None,
                tools: list[dict] | None, **kwargs: Any) -> str:
        if self.template_fn is not None:
            if tools is not None and not isinstance(tools, list):
                raise ValueError("tools must be a list")
            msgs = validate_messages(messages)
            with _template_errors():
                return self.template_fn(msgs, add_generation_prompt=add_generation_prompt,
                                        enable_thinking=enable_thinking, tools=tools, **kwargs)
        use_tool = tools is not None and self.tool_template is not None
        if not (self.chat_template or use_tool):
            raise ValueError("this model has no chat template (no chat_template.jinja or "
                             "tokenizer_config.json chat_template); use a completions request instead")
        source = self.tool_template if use_tool else self.chat_template
        msgs = validate_messages(messages)
        if "developer" not in source:     # OpenAI's newer name for the system role
            msgs = [dict(m, role="system") if m.get("role") == "developer" else m for m in msgs]
        if tools is not None and not isinstance(tools, list):
            raise ValueError("tools must be a list")
        compiled = _compile_template(source)
        ctx: dict[str, Any] = {
            "messages": msgs,
            "tools": tools,
            "documents": None,          # transformers passes it (None without documents)
            "add_generation_prompt": bool(add_generation_prompt),
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
            "pad_token": self.pad_token or "",
            "unk_token": self.unk_token or "",
        }
        if enable_thinking is not None:
            ctx["enable_thinking"] = bool(enable_thinking)
        ctx.update(kwargs)
        with _template_errors():
            # render() as generate()'s pieces, joined: the same text, with a deadline between pieces
            # (a template looping without end held a tokenizing thread, and its request, forever)
            deadline, parts = time.monotonic() + RENDER_LIMIT_S, []
            for part in compiled.generate(**ctx):
                parts.append(part)
                if time.monotonic() > deadline:
                    raise TemplateError(f"chat template error: rendering took more than {RENDER_LIMIT_S:g} s "
                                        "(a template that loops without end?)")
            return "".join(parts)

    def encode_chat(self, messages: list[dict], **kwargs: Any) -> list[int]:
        return self.encode(self.apply_chat_template(messages, **kwargs))


# --------------------------------------------------------------------------------------------------


class IncrementalDetokenizer:
    """Streaming detokenizer: `add(id)` returns the newly final text.

    Works like Hugging Face's / vLLM's prefix-offset detokenizer: only `ids[prefix:]` is decoded
    (prefix = start of the previously emitted chunk, kept as context for decoders whose output
    depends on the preceding token), and text whose tail is an incomplete UTF-8 sequence (decoded
    as U+FFFD) is held back until it completes. If garbage bytes keep the tail incomplete for many
    tokens, the window is cut at a token boundary that splits the decoded text exactly, so the
    window stays bounded. The concatenation of everything returned equals
    ``tokenizer.decode(token_ids)``.
    """

    # Grow the window beyond this many unread tokens only if no exact cut point exists.
    MAX_PENDING = 16

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False,
                 context: Sequence[int] = ()):
        """context: token ids before the first one added (a completions prompt's tail), decoded
        only as the window's start, so that decoders that drop a leading space (SentencePiece's
        metaspace) keep the first generated token's; `text` and the returned pieces hold only
        what follows it. A trailing run of byte-fallback tokens is left out of it (the
        tokenizers library decodes such a run as a whole, so its text depends on what follows),
        and of the tokens before that run the last 4 are kept; used where they decode to complete
        characters."""
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self.token_ids: list[int] = []      # the ids the window decodes (those decode keeps)
        self._all: list[int] = []           # every id added
        self._pieces: list[str] = []
        self._prefix = 0  # window start (context)
        self._read = 0  # ids[:read] are fully emitted
        self._emitted = 0  # chars of decode(ids[prefix:]) already emitted
        self._text_cache: str | None = None
        ctx = [t for t in context if not self._dropped(t)]
        while ctx and tokenizer.is_byte_token(ctx[-1]):
            ctx.pop()       # "café" ends [f, <0xC3>, <0xA9>]: [..., f] keeps the reply's first space
        ctx = ctx[-4:]
        if ctx and not self._decode(ctx).endswith(_REPLACEMENT):
            self._ctx = len(ctx)
            self.token_ids = ctx
            self._read = len(ctx)
            self._emitted = len(self._decode(ctx))
        else:
            self._ctx = 0

    def _byte_run(self) -> int:
        """Index where the trailing run of byte-fallback tokens starts (len(ids) if none): the
        tokenizers library decodes an invalid run as one U+FFFD a byte, so text from that run may
        still change until a token that is not a byte ends it."""
        ids, i = self.token_ids, len(self.token_ids)
        while i > self._read and self._tok.is_byte_token(ids[i - 1]):
            i -= 1
        return i

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    @property
    def text(self) -> str:
        if self._text_cache is None:
            self._text_cache = "".join(self._pieces)
        return self._text_cache

    def _out(self, s: str) -> str:
        if s:
            self._pieces.append(s)
            self._text_cache = None
        return s

    @property
    def generated_ids(self) -> list[int]:
        return list(self._all)

    def _dropped(self, token_id: int) -> bool:
        """An id decode leaves out wherever it stands: one the tokenizer does not have (a model's
        embedding padded past its vocabulary), or a special token when they are skipped. It never
        enters the window: as the window's first id it made the next one first, and a decoder that
        strips the first space (SentencePiece's) took that token's space."""
        return self._tok.id_to_token(token_id) is None or (self._skip and token_id in self._tok.special_ids)

    def add(self, token_id: int) -> str:
        token_id = int(token_id)
        self._all.append(token_id)
        if self._dropped(token_id):
            return ""
        ids = self.token_ids
        ids.append(token_id)
        if len(ids) - 1 > self._read and self._tok.is_byte_token(token_id) and self._tok.is_byte_token(ids[-2]):
            # inside a run of byte tokens, past its first: decode takes the run as a whole (one U+FFFD
            # a byte where any of it is not UTF-8), so nothing of it is final before it ends, and
            # what precedes it went out with its first token. Not decoding here keeps a long run
            # linear (it was decoded whole at every token).
            return ""
        new = self._decode(ids[self._prefix:])
        if self._tok.is_byte_token(ids[-1]):    # hold a byte run's text until the run ends
            run = self._byte_run()
            if run < len(ids):
                safe = len(self._decode(ids[self._prefix:run]))
                out = new[self._emitted:safe] if safe > self._emitted and new.startswith(
                    self._decode(ids[self._prefix:run])) else ""
                self._emitted += len(out)
                return self._out(out)
        if not new.endswith(_REPLACEMENT):
            out = new[self._emitted:]
            self._prefix, self._read = self._read, len(ids)
            self._emitted = len(self._decode(ids[self._prefix:self._read]))
            return self._out(out)
        # Tail is (maybe) an incomplete multi-byte char: emit only what precedes it.
        out = ""
        safe = len(new.rstrip(_REPLACEMENT))
        if safe > self._emitted:
            out = new[self._emitted:safe]
            self._emitted = safe
        if len(ids) - self._read > self.MAX_PENDING:
            out += self._cut(new)
        return self._out(out)

    def _cut(self, new: str) -> str:
        """Move the window start to a token boundary >= 4 tokens back where the text splits exactly."""
        ids = self.token_ids
        p = self._prefix
        for q in range(len(ids) - 4, self._read, -1):
            head = self._decode(ids[p:q])
            if new.startswith(head) and new == head + self._decode(ids[q:]):
                out = ""
                if self._emitted < len(head):  # head is final: bytes >= 4 tokens back can't change
                    out = new[self._emitted:len(head)]
                    self._emitted = len(head)
                self._prefix = self._read = q
                self._emitted -= len(head)
                return out
        return ""

    def flush(self) -> str:
        ids = self.token_ids
        new = self._decode(ids[self._prefix:])
        out = new[self._emitted:]
        self._prefix = self._read = len(ids)
        self._emitted = 0
        return self._out(out)

    def reset(self) -> None:
        self.__init__(self._tok, self._skip)
