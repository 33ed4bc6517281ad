"""Stop strings found on the detokenized text, across token boundaries.

Text that could still be the start of a stop string is held back, so nothing past a stop
string is ever emitted. The reply ends at the stop string that is completed first in the text (the
earliest end; of two ending together, the longer), wherever the tokens' boundaries fall.
Text pushed with look=False (vLLM's min_tokens: the reply's first tokens) is passed on unsearched;
stop strings are then found in the text pushed after it only."""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: list[str] | None):
        self.stops = [s for s in (stops or []) if s]
        self.held = ""

    def push(self, text: str, look: bool = True) -> tuple[str, bool]:
        """Feed new text; returns (text safe to emit, stopped). look=False: not searched (nothing is
        held then, as no text was searched before it)."""
        if not self.stops or not look:
            return text, False
        self.held += text
        # a stop's first occurrence is also its earliest end; across stops the earliest end wins
        # (the earliest start would depend on how much text one push brought: "ret" + "urn" and
        # "return" ended at "u" and at "return" with the stops "return" and "u")
        hits = [(i + len(s), i) for s in self.stops if (i := self.held.find(s)) >= 0]
        if hits:
            i = min(hits)[1]
            out, self.held = self.held[:i], ""
            return out, True
        # hold back the longest tail of the text that starts some stop string (shorter than it):
        # only positions holding that string's first character are tried
        keep, held = 0, self.held
        for s in self.stops:
            i = held.find(s[0], max(0, len(held) - len(s) + 1))
            while i >= 0 and len(held) - i > keep:
                if s.startswith(held[i:]):
                    keep = len(held) - i
                    break
                i = held.find(s[0], i + 1)
        cut = len(held) - keep
        out, self.held = self.held[:cut], self.held[cut:]
        return out, False

    def flush(self) -> str:
        out, self.held = self.held, ""
        return out
