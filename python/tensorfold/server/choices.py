"""One choice of a reply (a request's n): its text split into reasoning, content and tool calls, its
logprobs, finish reason and stats, built from the engine's events for it."""

from __future__ import annotations

from .reasoning import ReasoningSplitter
from .tools import ToolCallSplitter


class Choice:
    def __init__(self, index: int, tags, in_think: bool, tools: bool, echo: str | None, stream: bool):
        """tags / in_think: the think block's (chat); tools: the request has tools; echo: the prompt's
        text, which leads a completion's (`echo`); stream: content deltas follow
        ToolCallSplitter.stream_feed's rule (their join is the content not streamed)."""
        self.index = index
        self.splitter = ReasoningSplitter(tags, in_think)
        self.tools = ToolCallSplitter(tools)
        self.stream = stream
        self.echo = echo
        self.reasoning: list[str] = []
        self.content: list[str] = [echo or ""]
        self.calls: list[dict] = []
        self.lps: list | None = None
        self.finish: str | None = None
        self.stats = None
        self.started = False            # an event of it was seen

    def add(self, ev) -> tuple[str, str, list[dict], int]:
        """Take one event: (reasoning delta, content delta, tool calls completed, index of the first
        of them)."""
        self.started = True
        final = ev.finish_reason is not None
        r, c = self.splitter.feed(ev.text, final=final)
        first = self.tools.calls
        c, calls = (self.tools.stream_feed if self.stream else self.tools.feed)(c, final=final)
        self.reasoning.append(r)
        self.content.append(c)
        self.calls += calls
        for more in (ev.prompt_logprobs, ev.logprobs):
            if more is not None:    # into a list of the choice's own (the engine keeps a prompt's scores
                if self.lps is None:    # for the next choice), extended: one event's worth a token
                    self.lps = []
                self.lps.extend(more)
        self.finish = ev.finish_reason or self.finish
        self.stats = ev.stats or self.stats
        if final and self.calls and self.finish == "stop":
            self.finish = "tool_calls"
        return r, c, calls, first

    def close(self) -> None:
        """What the splitters still hold (a reply that ended without a final event)."""
        r, c = self.splitter.feed("", final=True)
        c, calls = self.tools.feed(c, final=True)
        self.reasoning.append(r)
        self.content.append(c)
        self.calls += calls

    @property
    def text(self) -> str:
        return "".join(self.content)

    @property
    def reasoning_text(self) -> str | None:
        return "".join(self.reasoning) or None

    @property
    def tool_calls(self) -> list | None:
        return self.calls if self.tools.enabled else None
