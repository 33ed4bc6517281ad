"""Split a chat reply into reasoning (inside the think block) and content, incrementally."""

from __future__ import annotations


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ReasoningSplitter:
    """Feed text deltas; get (reasoning, content) deltas back.

    `in_think` says whether the prompt already opened the think block (templates that end the generation
    prompt with the start tag). Otherwise a start tag at the very beginning of the reply (after whitespace)
    opens it. Text up to the end tag is reasoning; text after it is content (leading whitespace dropped).
    A tag split across deltas is held back until it is complete. With no tags everything is content.
    """

    def __init__(self, tags: tuple[str, str] | None, in_think: bool = False):
        self.tags = tags
        self.state = "content" if tags is None else ("think" if in_think else "start")
        self.buf = ""

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        if self.tags is None:
            return "", text
        start, end = self.tags
        self.buf += text
        reasoning, content = "", ""
        while True:
            if self.state == "start":           # before anything but whitespace
                s = self.buf.lstrip()
                if s.startswith(start):
                    self.buf, self.state = s[len(start):], "think"
                    continue
                if not final and (not s or start.startswith(s)):
                    break                       # could still become the start tag
                self.state = "content"
                continue
            if self.state == "think":
                i = self.buf.find(end)
                if i >= 0:
                    reasoning += self.buf[:i]
                    self.buf, self.state = self.buf[i + len(end):], "after"
                    continue
                keep = 0 if final else _partial_suffix(self.buf, end)
                reasoning += self.buf[:len(self.buf) - keep]
                self.buf = self.buf[len(self.buf) - keep:]
                break
            if self.state == "after":           # drop whitespace right after the end tag
                self.buf = self.buf.lstrip()
                if not self.buf:
                    break
                self.state = "content"
                continue
            content += self.buf
            self.buf = ""
            break
        return reasoning, content


def prompt_opens_think(prompt_text: str, tags: tuple[str, str] | None, final_at: int | None = None) -> bool:
    """True when the rendered prompt ends inside an unclosed think block: its last open tag with
    nothing but whitespace after it (a generation prompt's), or, for a continued final message
    (continue_final_message: its text starts at final_at), an open tag in that message's text, or
    just before it, left unclosed (a prefilled reply still thinking: "<think>\nLet me add")."""
    if tags is None or not prompt_text:
        return False
    start, end = tags
    i = prompt_text.rfind(start)
    if i < 0 or prompt_text.find(end, i) >= 0:
        return False
    if final_at is None:
        return not prompt_text[i + len(start):].strip()
    return i >= final_at or not prompt_text[i + len(start):final_at].strip()
