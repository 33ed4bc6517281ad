"""What goes into and comes out of Engine.generate."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    temperature: float = 0.0      # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0                # 0 = off
    min_p: float = 0.0
    seed: int | None = None       # None: hash of the prompt's token ids
    presence_penalty: float = 0.0     # engine/penalties.py (vLLM's definitions)
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0   # 1 = off
    logit_bias: dict | None = None    # {token id: -100..100} added to the raw logits (engine/penalties.py)
    choice: int = 0               # a request's n > 1: the choice's index, mixed into the seed (sampling.choice_seed)


@dataclass(frozen=True)
class Prompt:
    """A request's prompt, tokenized (Engine.prepare): what generate(prepared=...) runs. Made on
    any thread, so a server tokenizes off the engine's thread (the tokenizer lets the GIL go)."""
    ids: list[int]
    chat: bool                    # from messages (else a completions prompt)
    pin_at: int = 0               # grid point ending the system block (its snapshot is pinned)
    text: str | None = None       # the rendered chat template (chat only)
    final_at: int | None = None   # continue_final_message: where the continued message's text starts in text


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0        # prompt tokens restored from a prompt-cache snapshot
    completion_tokens: int = 0
    prefill_s: float = 0.0
    ttft_s: float = 0.0           # request start -> first token
    decode_s: float = 0.0
    decode_tps: float = 0.0
    drafted: int = 0              # drafted tokens sent to verification
    accepted: int = 0             # drafted tokens accepted
    verify_rounds: int = 0
    token_hash: str = ""          # sha256 of the reply's token ids (hex, first 16)
    finish_reason: str | None = None

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class GenerationEvent:
    """One step of a generation. `text` is the new text since the last event (may be "")."""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None   # None while running; "stop" | "length" at the end
    stats: GenerationStats | None = None  # set on the final event
    logprobs: list | None = None       # generate(logprobs=n): a logprobs.TokenLogprob per token id
    prompt_logprobs: list | None = None  # generate(prompt_logprobs=n): one per prompt token, first event
