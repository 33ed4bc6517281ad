"""The exact generation engine: grid prefill, row-exact decode, keyed sampling, drafts.

    eng = Engine("path/to/model")
    for ev in eng.generate(messages=[{"role": "user", "content": "hi"}], max_tokens=64):
        print(ev.text, end="")

Not thread-safe: one thread owns an Engine (and MLX)."""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..cache.disk import DiskStore, read_tensors, to_mlx
from ..cache.key import cache_key, unhashed_bytes, weight_stamps
from ..cache.memory import SnapshotStore
from ..errors import RequestError
from ..models import load_model
from .. import kernels
from ..models.loader import mlx_cuda_qmm_overreads
from ..tokenizer import IncrementalDetokenizer, Tokenizer, read_json_object
from . import args
from .prefill import PrefillCancelled, PrefillMode, prefill, reserve_rows
from .proposers import ContextCopy, DraftModel, Proposer
from .rowcheck import MAX_K as ROW_CHECK_MAX_K, row_check
from .sampling import choice_seed, greedy_device, prompt_seed, sample
from .logprobs import MAX_TOP, token_logprob
from .penalties import Penalties
from .stops import StopMatcher
from .types import GenerationEvent, GenerationStats, Prompt, SamplingParams

log = logging.getLogger("tensorfold")


def _sampling_error(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, presence_penalty=0.0,
                    frequency_penalty=0.0, repetition_penalty=1.0) -> str | None:
    """The name of the first sampling parameter out of range (NaN included), or None."""
    if not temperature >= 0:
        return "temperature"
    if not 0 < top_p <= 1:
        return "top_p"
    if not top_k >= 0:
        return "top_k"
    if not 0 <= min_p <= 1:
        return "min_p"
    if not -2 <= presence_penalty <= 2:
        return "presence_penalty"
    if not -2 <= frequency_penalty <= 2:
        return "frequency_penalty"
    if not 0 < repetition_penalty < float("inf"):
        return "repetition_penalty"
    return None


class Engine:
    # a grid point reached after a chunk at least this long is saved at once (_prefill); the
    # server waits this long for the engine at shutdown (server/worker.py)
    SAVE_SLOW_CHUNKS_S = 10.0

    def __init__(self, model_path, *, drafter=None, drafts: bool = True, context: int | None = None,
                 prompt_cache_gib: float = 2.0, snapshot_dir=None, snapshot_gib: float = 8.0,
                 thinking: bool | None = None, prefill_mode: PrefillMode = PrefillMode(),
                 draft_width: int = 8):
        context, draft_width, prefill_mode = args.constructor(context, draft_width, prefill_mode, prompt_cache_gib,
                                                              snapshot_gib, drafts, thinking)
        self.model_path = Path(model_path)
        self.model_name = self.model_path.resolve().name
        self._loaded_stamps = weight_stamps(self.model_path)    # the disk key must be of these bytes
        self.model = load_model(self.model_path)
        self._nan_warned = False        # _check_finite: a NaN logits row is logged once
        if kernels.mlx_runs_on_cuda():
            short = mlx_cuda_qmm_overreads(self.model.cfg)
            if short:
                log.warning("MLX's CUDA quantized matmul reads past its operands for K <= 2 x its K "
                            "tile, which %d modules of this checkpoint have (%s): a prefill may "
                            "fail with CUDA error 700 (docs/benchmarks.md, Session 45)",
                            len(short), ", ".join(short[:4]) + (", ..." if len(short) > 4 else ""))
        self.tokenizer = Tokenizer.from_dir(self.model_path)
        cfg = self.model.cfg
        # an explicit context past the model's positions is the user's to ask for (mlx-lm sets no
        # limit): taken, with a warning; it was cut to max_position_embeddings without a word
        self.context_length = context or cfg.trained_positions
        if self.context_length > cfg.trained_positions:
            log.warning("context %d tokens is past the %d positions this model is made for "
                        "(max_position_embeddings%s): replies past them may degrade",
                        self.context_length, cfg.trained_positions,
                        ", yarn" if cfg.trained_positions > cfg.max_position else "")
        self.thinking = thinking
        self.mode = prefill_mode
        self.draft_width = draft_width
        self.snapshots = SnapshotStore(int(prompt_cache_gib * 2**30))
        self.disk = None
        if snapshot_dir:
            try:
                self.disk = DiskStore(snapshot_dir, int(snapshot_gib * 2**30))
            except OSError as e:    # a directory that cannot be made or listed: serve without it
                log.warning("snapshot directory %s is unusable (%s): prompt-cache snapshots stay in "
                            "memory only", snapshot_dir, e)
        # memory snapshots never leave this engine: a sample of the weights identifies them. Disk
        # snapshots are keyed by the weights' whole bytes (another checkpoint of the same shapes
        # must not resume from them): hashed here where little is new to the memo, else in the
        # background (disk snapshots are used from when it is done; ~0.5-2 GB/s)
        self.cache_key = cache_key(self.model_path, str(self.model.dtype), self.mode.key, whole=False)
        self.disk_key = None
        self._disk_key_ready = threading.Event()
        if self.disk is not None:
            self._start_disk_key()
        self._warm_thread = None
        self._kept = None               # generate(keep_prompt=True): a prompt's prefilled state
        self.generation_defaults = self._read_generation_defaults()
        self.drafter = None
        if drafter is not None:
            dm = load_model(drafter)
            if dm.cfg.vocab_size != cfg.vocab_size and Tokenizer.from_dir(drafter).vocab_size != self.tokenizer.vocab_size:
                raise RequestError(f"drafter {drafter} has another tokenizer than the model", param="drafter")
            self.drafter = DraftModel(dm, self.mode)
        self.drafts_enabled = drafts
        # greedy rounds without drafts: build step t+1 while step t runs (_decode_pipelined).
        # False forces the host path (tests compare the two, token for token).
        self._pipeline = True
        self.row_exact = None
        if drafts:
            self.row_exact = row_check(self.model, k=min(draft_width + 1, ROW_CHECK_MAX_K))
            if not self.row_exact:
                log.warning("row_check failed on this backend: the decode kernels are not row-exact "
                            "here, so drafting is DISABLED (replies stay exact, only slower)")
                self.drafts_enabled = False

    DISK_KEY_SYNC_BYTES = 512 << 20

    def _start_disk_key(self) -> None:
        def work():
            try:
                key = cache_key(self.model_path, str(self.model.dtype), self.mode.key)
                if weight_stamps(self.model_path) != self._loaded_stamps:
                    # replaced since they were loaded (the hash of a large checkpoint takes minutes):
                    # the key would be the new bytes', the KV the old ones'
                    log.warning("the weight files changed since they were loaded: prompt-cache "
                                "snapshots stay in memory only (restart to use the disk again)")
                else:
                    self.disk_key = key
            except OSError as e:
                log.warning("cannot hash the weights (%s): prompt-cache snapshots stay in memory only", e)
            self._disk_key_ready.set()
        pending = unhashed_bytes(self.model_path)
        if pending <= self.DISK_KEY_SYNC_BYTES:
            work()
            return
        log.info("hashing %.1f GB of weights in the background (once; remembered by path and stamp): "
                 "disk snapshots are read and written once it is done", pending / 1e9)
        threading.Thread(target=work, name="tensorfold-weights-hash", daemon=True).start()

    def wait_disk_key(self, timeout: float | None = None) -> bool:
        """Wait until disk snapshots can be used (their key is known); True when they can."""
        self._disk_key_ready.wait(timeout)
        return self.disk_key is not None

    @property
    def _disk_on(self) -> bool:
        return self.disk is not None and self.disk_key is not None

    # ---- settings ---------------------------------------------------------------------------
    def _read_generation_defaults(self) -> dict:
        out = {}
        g = read_json_object(self.model_path / "generation_config.json")   # {} where absent
        for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
            v = g.get(k)
            if v is None:
                continue
            if not isinstance(v, (int, float)) or isinstance(v, bool):     # "hot" was dropped without a word
                log.warning("generation_config.json: ignoring %s = %r (not a number)", k, v)
                continue
            if k == "top_k" and isinstance(v, int) and v < 0:
                v = 0               # -1: off (vLLM's spelling), as a request's top_k -1 is
            if _sampling_error(**{k: v}) is None:
                out[k] = v
            else:                   # every request leaving it unset would have got a 400
                log.warning("generation_config.json: ignoring %s = %r (out of range)", k, v)
        if g.get("do_sample") is False:
            out["temperature"] = 0.0
        return out

    # ---- prompt -----------------------------------------------------------------------------
    def prompt_ids(self, messages=None, prompt=None, enable_thinking=None, tools=None,
                   template_kwargs=None) -> list[int]:
        return self.prepare(messages, prompt, enable_thinking, tools, template_kwargs).ids

    def prepare(self, messages=None, prompt=None, enable_thinking=None, tools=None,
                template_kwargs=None, room: int = 1, *, add_generation_prompt: bool = True,
                continue_final_message: bool = False) -> Prompt:
        """The request's prompt, tokenized and checked (RequestError on bad input). Thread-safe:
        it reads only the tokenizer and the config, so a server calls it on a thread of its own
        and the engine's thread never tokenizes a large prompt. template_kwargs: more variables
        for the chat template (a request's chat_template_kwargs); add_generation_prompt and
        continue_final_message: vLLM's (Tokenizer.apply_chat_template), a reply that continues the
        last message."""
        tkw = dict(template_kwargs or {})
        if messages is not None:
            ids, text, think = self._chat_ids(messages, prompt, enable_thinking, tools, tkw, add_generation_prompt,
                                              limit=True, continue_final_message=continue_final_message)
            self._check_prompt(ids, True, room)
            pin_at = self.system_prefix_len(messages, ids, think, tools, tkw) // self.mode.grid * self.mode.grid
            final_at = text.rfind(self.tokenizer.final_text(messages).strip()) if continue_final_message else None
            return Prompt(ids=ids, chat=True, pin_at=pin_at, text=text, final_at=final_at)
        if isinstance(prompt, str):
            self._far_past(prompt, False)
        ids = self.tokenize(prompt=prompt, tools=tools)     # its ids checked against the vocabulary there
        self._check_prompt(ids, False, room, vocab=False)
        return Prompt(ids=ids, chat=False)

    def tokenize(self, messages=None, prompt=None, enable_thinking=None, tools=None, template_kwargs=None,
                 add_generation_prompt: bool = True, continue_final_message: bool = False) -> list[int]:
        """The token ids prepare() would run (the chat template rendered, or a completions prompt
        encoded), without the context check: a server's /tokenize counts a prompt past the context (ids
        past the model's vocabulary are refused)."""
        if messages is not None:
            return self._chat_ids(messages, prompt, enable_thinking, tools, dict(template_kwargs or {}),
                                  add_generation_prompt, continue_final_message=continue_final_message)[0]
        if prompt is None:
            raise RequestError("give exactly one of messages or prompt", param="messages")
        if tools:       # nothing renders them with a prompt (they were dropped without a word)
            raise RequestError("tools apply to chat messages, not to a prompt", param="tools",
                               code="unsupported_parameter")
        if isinstance(prompt, str):
            ids = self.tokenizer.encode_prompt(prompt)
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
        else:
            raise RequestError("prompt must be a string or a list of token ids", param="prompt")
        if not ids:
            raise RequestError("the prompt is empty", param="prompt")
        self._check_vocab(ids, False)       # /tokenize counted ids past it (a 200)
        return ids

    def _far_past(self, text: str, chat: bool) -> None:
        """A prompt's text far past the context is refused before it is tokenized whole
        (Tokenizer.far_past; /tokenize, which counts, does not ask)."""
        n = self.tokenizer.far_past(text, self.context_length)
        if n is not None:
            raise RequestError(f"the prompt has over {2 * self.context_length:,} tokens (its first pieces alone "
                               f"{n:,}); this model's context is {self.context_length}",
                               param="messages" if chat else "prompt", code="context_length_exceeded")

    def _chat_ids(self, messages, prompt, enable_thinking, tools, tkw: dict, add_generation_prompt: bool = True,
                  limit: bool = False, continue_final_message: bool = False):
        """(ids, rendered text, enable_thinking used) of a chat request; limit: refuse a text far
        past the context before tokenizing it whole (_far_past)."""
        if prompt is not None:
            raise RequestError("give exactly one of messages or prompt", param="messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError("messages must be a non-empty list", param="messages")
        think = self.thinking if enable_thinking is None else enable_thinking
        if tools and not self.tokenizer.takes_tools:
            raise RequestError("tools: this model's chat template does not read them (they would be "
                               "dropped)", param="tools", code="unsupported_parameter")
        try:
            if continue_final_message:      # only then: a tokenizer of another make need not take it
                tkw = dict(tkw, continue_final_message=True)
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                      enable_thinking=think, tools=tools, **tkw)
        except ValueError as e:
            raise RequestError(str(e), param="messages") from None
        except RecursionError:      # a template walking a value nested past Python's stack
            raise RequestError("messages are nested too deeply for the chat template (or the template "
                               "recurses without end)", param="messages") from None
        if limit:
            self._far_past(text, True)
        return self.tokenizer.encode(text), text, think

    def _check_vocab(self, ids, chat: bool) -> None:
        vocab = self.model.cfg.vocab_size
        if len(ids) and not 0 <= min(ids) <= max(ids) < vocab:
            raise RequestError(f"token ids must be in [0, {vocab})" + (
                " (the chat template's text tokenized to ids past the model's embedding)" if chat else ""),
                param="messages" if chat else "prompt")

    def _check_prompt(self, ids, chat: bool, room: int = 1, vocab: bool = True) -> None:
        """Every id is a row of the embedding (MLX's gather does not check: an id past it read other
        memory, a reply that changed from run to run) and the prompt and `room` generated tokens
        (1; 0 for a prompt only scored) fit the context. Checked by prepare, so that a server answers at once, and again by
        generate for a Prompt made elsewhere (another engine's, with a larger vocabulary)."""
        if vocab:
            self._check_vocab(ids, chat)
        n_prompt = len(ids)
        if n_prompt + room > self.context_length:
            raise RequestError(
                f"the prompt has {n_prompt} tokens; this model's context is {self.context_length}",
                param="messages" if chat else "prompt", code="context_length_exceeded")

    # ---- prefill with the prompt cache --------------------------------------------------------
    def _lookup(self, arr: np.ndarray, limit: int):
        """Longest usable grid-point snapshot: (kv of length g, g). Memory first, then disk."""
        grid = self.mode.grid
        entry, g = self.snapshots.lookup(self.cache_key, arr, grid, limit)
        if self._disk_on:
            from ..cache.memory import common_prefix
            best = sorted(((min(common_prefix(d.tokens, arr), limit) // grid * grid, d)
                           for d in self.disk.candidates(self.disk_key)), key=lambda t: -t[0])
            for gd, d in best:
                if gd <= g:
                    break
                kv = self._read_snapshot(d)
                if kv is None:
                    continue
                added = self.snapshots.add(self.cache_key, d.tokens, kv, pinned=d.pinned, source="disk")
                # too large for the memory budget: this request still resumes from it
                return [(k[..., :gd, :], v[..., :gd, :]) for k, v in (added.kv if added else kv)], gd
        if entry is None or g == 0:
            return None, 0
        return [(k[..., :g, :], v[..., :g, :]) for k, v in entry.kv], g

    def _read_snapshot(self, d):
        """A disk snapshot's KV as MLX arrays, or None (a damaged file: ignored and dropped)."""
        try:
            kv = to_mlx(read_tensors(d))
            if len(kv) != self.model.cfg.num_layers:
                raise ValueError(f"{len(kv)} layers, the model has {self.model.cfg.num_layers}")
            return kv
        except Exception as e:  # noqa: BLE001 - a damaged file is ignored, whatever it holds
            log.warning("ignoring snapshot %s: %s: %s", d.path.name, type(e).__name__, e)
            self.disk.drop(d)
            return None

    def _save(self, ids, cache, p: int, pinned: bool) -> None:
        snap = cache.snapshot(p)
        # evaluated now, memory-only snapshots too: left as slices of the request's KV buffers they
        # held every buffer alive (the store counted 0.16 MB and held 13 MB) and could not be
        # evaluated by a request on another thread (MLX's streams are per thread)
        mx.eval(snap)
        self.snapshots.add(self.cache_key, ids[:p], snap, pinned=pinned)
        if self._disk_on:
            try:
                self.disk.save_async(self.disk_key, ids[:p], snap, pinned=pinned)
            except OSError as e:
                log.warning("could not write a snapshot to %s: %s", self.disk.dir, e)

    def _prefill(self, ids: list[int], progress=None, pin_at: int = 0, room: int = 0, cancel=None):
        """room: the tokens the reply may add (its rows are reserved with the prompt's, up to
        prefill.REPLY_ROWS). A prefill cancelled between chunks still keeps its last grid point's
        snapshot (the same KV a whole run would have saved there), then raises PrefillCancelled."""
        cache = self.model.new_cache()
        rows = reserve_rows(len(ids), room)
        kv, g = self._lookup(np.asarray(ids, dtype=np.int64), len(ids) - 1)
        if g:
            try:
                cache.restore(kv, g, rows)
            except (ValueError, RuntimeError) as e:    # a snapshot of other shapes: start fresh
                log.warning("could not restore a prompt-cache snapshot (%s); prefilling from the start", e)
                cache = self.model.new_cache()
        cached = cache.offset
        points, saved = [], {pin_at}
        last = [time.perf_counter()]

        def on_grid_point(p):
            points.append(p)
            now = time.perf_counter()
            slow, last[0] = now - last[0] >= self.SAVE_SLOW_CHUNKS_S, now
            if p == pin_at and p > cached:
                self._save(ids, cache, p, pinned=True)   # the conversation's system block
            elif slow and p > cached:
                # chunks this slow (a quantized model's MLX prefill on a CPU: ~100 s): the grid point
                # is saved now, not when the prompt is done, so a shutdown that cannot wait for the
                # next chunk (a chunk is one MLX evaluation) keeps it
                self._save(ids, cache, p, pinned=False)
                saved.add(p)

        try:
            logits = prefill(self.model, cache, ids, self.mode, on_grid_point, progress, reserve=rows,
                             cancel=cancel)
        except PrefillCancelled:
            logits = None
        if points and points[-1] > cached and points[-1] not in saved:
            self._save(ids, cache, points[-1], pinned=False)   # the prompt's last grid point
        if logits is None:
            raise PrefillCancelled
        return cache, logits, cached

    def system_prefix_len(self, messages, ids, enable_thinking=None, tools=None, template_kwargs=None) -> int:
        """Tokens of the prompt before the first non-system message (0 if none)."""
        n = 0
        while n < len(messages) and isinstance(messages[n], dict) and messages[n].get("role") in ("system", "developer"):
            n += 1
        if n == 0:
            return 0
        text = None
        # the system messages alone; a template that refuses them (Qwen3's raises "No user query
        # found in messages": its system block was never pinned) with an empty user turn after them
        # (the common prefix below stops inside that turn)
        for tail in ([], [{"role": "user", "content": ""}]):
            try:
                text = self.tokenizer.apply_chat_template(messages[:n] + tail, add_generation_prompt=False,
                                                          enable_thinking=enable_thinking, tools=tools,
                                                          **(template_kwargs or {}))
                break
            except (ValueError, RecursionError):
                continue
        if text is None:
            return 0
        from ..cache.memory import common_prefix
        return common_prefix(np.asarray(self.tokenizer.encode(text)), np.asarray(ids))

    def warm_up_async(self):
        """Read this key's saved system blocks from disk into the memory store in a background
        thread: requests never wait for it; a prompt that needs a block before it is read reads it.
        They go into the store itself, under --prompt-cache-gib (read into a side table until
        session 53, they were held beside a full store: up to twice the budget). The arrays are
        evaluated here, so that no graph made on this thread reaches the engine's (MLX's streams
        are per thread), and the thread drops its streams before it ends."""
        if self.disk is None:
            return None

        def work():
            try:
                if not self.wait_disk_key():
                    return
                # the newest first, as many as memory keeps beside the pinned entries it has (a
                # pinned entry is evicted after every unpinned one)
                budget = self.snapshots.max_bytes - self.snapshots.pinned_nbytes()
                for d in sorted(self.disk.candidates(self.disk_key), key=lambda d: -d.created):
                    if not d.pinned or d.nbytes > budget or self.snapshots.holds(self.cache_key, d.tokens):
                        continue
                    kv = self._read_snapshot(d)
                    if kv is None:
                        continue
                    mx.eval(kv)
                    if self.snapshots.add(self.cache_key, d.tokens, kv, pinned=True, source="disk"):
                        budget -= d.nbytes
            finally:
                mx.clear_streams()

        self._warm_thread = threading.Thread(target=work, name="tensorfold-warmup", daemon=True)
        self._warm_thread.start()
        return self._warm_thread

    # ---- generation ---------------------------------------------------------------------------
    def generate(self, messages=None, prompt=None, *, max_tokens: int = 256,
                 sampling: SamplingParams | None = None, stop=None, draft: bool = True,
                 enable_thinking=None, tools=None, cancel=None, progress=None,
                 ignore_eos: bool = False, proposers: list[Proposer] | None = None,
                 prepared: Prompt | None = None, logprobs: int | None = None,
                 prompt_logprobs: int | None = None, keep_prompt: bool = False, stop_token_ids=None,
                 min_tokens: int = 0):
        """Yield GenerationEvents; the last one has finish_reason and stats. prepared: the prompt
        as prepare() made it (then messages, prompt, enable_thinking and tools are not read).
        logprobs: None, or n in 0..20: each event carries its tokens' logprobs with the n most
        likely alternatives (engine/logprobs.py). prompt_logprobs: the same for the prompt's tokens,
        on a first event of its own (`prompt_logprobs_of`); then max_tokens may be 0 (nothing is
        generated: a prompt scored). stop_token_ids: ids that end the reply as EOS does (finish "stop",
        the id counted and its text left out), also under ignore_eos (vLLM's). min_tokens (vLLM's): EOS
        and stop_token_ids are out of the first min_tokens positions' rows, and stop strings are
        looked for only in the text that comes after the min_tokens-th token. keep_prompt: keep this
        prompt's prefilled state (and its scores) for the next call with the same ids, which then
        skips that work (a request's n choices; `forget_prompt` drops it)."""
        t0 = time.perf_counter()
        p = args.sampling(sampling)
        max_tokens = args.integer(max_tokens, "max_tokens")
        stop = args.stops(stop)
        stop_ids = args.token_ids(stop_token_ids, "stop_token_ids")
        min_tokens = args.integer(min_tokens, "min_tokens", 0)
        args.other(draft=draft, ignore_eos=ignore_eos, keep_prompt=keep_prompt,
                   enable_thinking=enable_thinking, tools=tools, cancel=cancel, prepared=prepared)
        bad = _sampling_error(p.temperature, p.top_p, p.top_k, p.min_p, p.presence_penalty,
                              p.frequency_penalty, p.repetition_penalty)
        if bad is not None:
            raise RequestError(f"{bad} is out of range", param=bad)
        for name, used in (("logit_bias", p.logit_bias or ()), ("stop_token_ids", stop_ids)):
            if used and max(used) >= self.model.cfg.vocab_size:
                raise RequestError(f"{name}: token id {max(used)} is past the vocabulary "
                                   f"({self.model.cfg.vocab_size} ids)", param=name)
        logprobs, prompt_logprobs = (None if n is None else args.integer(n, name, 0, MAX_TOP)
                                     for name, n in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)))
        scoring_only = prompt_logprobs is not None and max_tokens == 0     # nothing generated: no room needed
        if prepared is None:        # prepare checks the prompt; one made elsewhere is checked here
            prepared = self.prepare(messages, prompt, enable_thinking, tools, room=0 if scoring_only else 1)
        else:
            self._check_prompt(prepared.ids, prepared.chat, 0 if scoring_only else 1)
        ids, chat = prepared.ids, prepared.chat
        n_prompt = len(ids)
        if max_tokens < (0 if prompt_logprobs is not None else 1):
            raise RequestError("max_tokens must be at least 1", param="max_tokens")
        if min_tokens > max_tokens:
            raise RequestError(f"min_tokens ({args.shown(min_tokens)}) is more than max_tokens "
                               f"({args.shown(max_tokens)})", param="min_tokens")
        max_tokens = min(max_tokens, self.context_length - n_prompt)
        if min_tokens > max_tokens:     # the reply could not reach min_tokens: a 400, not a short reply
            raise RequestError(f"min_tokens ({min_tokens}) is more than the {max_tokens} tokens the context "
                               f"({self.context_length}) leaves after the prompt's {n_prompt}",
                               param="min_tokens", code="context_length_exceeded")
        seed = choice_seed(p.seed if p.seed is not None else prompt_seed(ids), p.choice)

        stats = GenerationStats(prompt_tokens=n_prompt)
        kept = self._kept if self._kept is not None and self._kept["ids"] == tuple(ids) else None
        if keep_prompt and kept is None:
            kept = self._kept = {"ids": tuple(ids), "scored": {}}
        if prompt_logprobs is not None:
            scored = kept["scored"].get(prompt_logprobs) if kept is not None else None
            if scored is None:
                scored = self.prompt_logprobs_of(ids, prompt_logprobs, cancel)
                if kept is not None and scored is not None:
                    kept["scored"][prompt_logprobs] = scored
            if scored is None or max_tokens == 0:
                stats.prefill_s = time.perf_counter() - t0
                stats.finish_reason = "cancelled" if scored is None else "length"
                yield GenerationEvent(finish_reason=stats.finish_reason, stats=stats, prompt_logprobs=scored)
                return
            yield GenerationEvent(prompt_logprobs=scored)
        try:
            if kept is not None and "kv" in kept:
                # the prompt's state as the previous call's prefill left it (the same bits a prefill
                # gives: it is that prefill's), in buffers of this call's size
                cache = self.model.new_cache()
                cache.restore(kept["kv"], n_prompt, reserve_rows(n_prompt, max_tokens + self.draft_width))
                logits, stats.cached_tokens = kept["logits"], kept["cached"]
            else:
                cache, logits, stats.cached_tokens = self._prefill(ids, progress, prepared.pin_at,
                                                                   room=max_tokens + self.draft_width,
                                                                   cancel=cancel)
                if kept is not None:
                    kept.update(kv=cache.snapshot(n_prompt), logits=logits, cached=stats.cached_tokens)
                    mx.eval(kept["kv"], logits)
        except PrefillCancelled:
            stats.prefill_s = time.perf_counter() - t0
            stats.finish_reason = "cancelled"
            yield GenerationEvent(text="", token_ids=[], finish_reason="cancelled", stats=stats)
            return
        stats.prefill_s = time.perf_counter() - t0

        if proposers is None:
            proposers = []
            if draft and self.drafts_enabled:
                proposers.append(ContextCopy())
                if self.drafter is not None:
                    self.drafter.reset()        # shared across requests: its cache and state
                    self.drafter.cancel = cancel
                    proposers.append(self.drafter)
        elif not (draft and (self.drafts_enabled or self.row_exact is None)):
            proposers = []

        # a completion continues its prompt's text: the prompt's tail is the detokenizer's context
        # (a SentencePiece tokenizer's first generated '▁fox' then gives ' fox', not 'fox')
        detok = IncrementalDetokenizer(self.tokenizer, context=() if chat else ids[-64:])
        stopper = StopMatcher(stop)
        eos = (frozenset() if ignore_eos else self.tokenizer.eos_ids) | frozenset(stop_ids)
        tokens = list(ids)
        reply: list[int] = []
        finish = None
        t_first = None

        pen = Penalties.of(p, ids)
        pen.hold(min_tokens, eos)

        def accept(tok: int):
            """Append one generated token; returns (event text, finish reason or None)."""
            nonlocal t_first
            reply.append(tok)
            pen.push(tok)
            if t_first is None:
                t_first = time.perf_counter()
            if tok in eos:
                return stopper.push(detok.flush())[0] + stopper.flush(), "stop"
            look = len(reply) > min_tokens      # min_tokens: stop strings only in the text after these
            text, stopped = stopper.push(detok.add(tok), look)
            if stopped:
                return text, "stop"
            if len(reply) >= max_tokens:
                # the detokenizer's held text (a byte-fallback run) may complete a stop string
                tail, stopped = stopper.push(detok.flush(), look)
                return text + tail + stopper.flush(), "stop" if stopped else "length"
            return text, None

        def lps(rows, toks):
            """The tokens' logprobs (each from its own row), when the request asks for them."""
            if logprobs is None:
                return None
            return [token_logprob(rows[j].reshape(-1), t, logprobs) for j, t in enumerate(toks)]

        row0 = np.asarray(logits.astype(mx.float32))
        self._check_finite(row0, n_prompt)
        first = sample(pen.apply(row0), seed, n_prompt, p)
        tokens.append(first)
        text, finish = accept(first)
        stats.ttft_s = time.perf_counter() - t0
        yield GenerationEvent(text=text, token_ids=[first], logprobs=lps([row0], [first]))

        # the pipelined greedy steps never read the logits back: a request for logprobs or with
        # penalties takes the host loop below (the same tokens)
        greedy_pipeline = p.temperature <= 0.0 and self._pipeline and logprobs is None and not pen.active
        if finish is None and not proposers and greedy_pipeline:
            finish = yield from self._decode_pipelined(cache, tokens, reply, max_tokens, accept, cancel)

        while finish is None:
            if cancel is not None and cancel.is_set():
                finish = "cancelled"
                break
            if greedy_pipeline and proposers and not any(q.active(len(tokens)) for q in proposers):
                # every proposer is silenced (it kept missing) until some later position: run
                # the pipelined serial steps up to there (same tokens, no host wait per step)
                until = min(q.silent_until for q in proposers)
                finish = yield from self._decode_pipelined(cache, tokens, reply, max_tokens, accept,
                                                           cancel, until=until)
                continue
            room = min(max_tokens - len(reply), self.context_length - len(tokens)) - 1
            drafts, who = [], None
            for prop in proposers:
                if room <= 0 or not prop.active(len(tokens)):
                    continue
                drafts = prop.propose(tokens, min(prop.width, self.draft_width, room))[:room]
                V = self.model.cfg.vocab_size
                bad = next((j for j, d in enumerate(drafts) if not 0 <= d < V), None)
                if bad is not None:     # a drafter's padding id: never embedded (MLX's gather
                    drafts = drafts[:bad]   # does not check), and never a sample of ours anyway
                if drafts:
                    who = prop
                    break
            feed = [tokens[-1]] + drafts
            rows = self.model.forward(mx.array([feed]), cache, exact=True, all_logits=True)
            rows = np.asarray(rows.astype(mx.float32))
            base = len(tokens)
            out, n_acc = [], 0
            for j in range(len(feed)):
                s = sample(pen.apply(rows[j], out), seed, base + j, p)   # out == drafts[:j] here
                out.append(s)
                if j < len(drafts) and drafts[j] == s:
                    n_acc += 1
                    continue
                break
            cache.trim(base + n_acc)
            if who is not None:
                stats.drafted += len(drafts)
                stats.verify_rounds += 1
                who.feedback(len(tokens), len(drafts), n_acc)
            pieces, new = [], []
            for tok in out:
                tokens.append(tok)
                new.append(tok)
                text, finish = accept(tok)
                pieces.append(text)
                if finish is not None:
                    break
            if who is not None:     # accepted drafts that are in the reply (a stop may end it sooner)
                stats.accepted += min(n_acc, len(new))
            yield GenerationEvent(text="".join(pieces), token_ids=new, logprobs=lps(rows, new))

        now = time.perf_counter()
        stats.completion_tokens = len(reply)
        stats.decode_s = now - (t_first or now)
        stats.decode_tps = (len(reply) - 1) / stats.decode_s if stats.decode_s > 0 and len(reply) > 1 else 0.0
        stats.token_hash = hashlib.sha256(np.asarray(reply, dtype=np.int64).tobytes()).hexdigest()[:16]
        stats.finish_reason = finish
        yield GenerationEvent(text="", token_ids=[], finish_reason=finish, stats=stats)

    def forget_prompt(self) -> None:
        """Drop the state generate(keep_prompt=True) kept."""
        self._kept = None

    PROMPT_LOGPROB_ROWS = 256

    def prompt_logprobs_of(self, ids: list[int], n: int, cancel=None) -> list | None:
        """Each prompt token's logprob given the tokens before it, with the n most likely ids
        (engine/logprobs.py); the first token has none (logprob None). Computed through the
        row-exact decode kernels on a cache of its own from position 0, in calls of
        PROMPT_LOGPROB_ROWS rows: a row's logits depend only on its own position's tokens, whatever
        call holds it, so a prompt scores the same alone, resumed or beside a reply. None when
        `cancel` was set between two calls."""
        from .logprobs import TokenLogprob
        out = [TokenLogprob(int(ids[0]), None, None)]
        cache = self.model.new_cache()
        feed = ids[:-1]                     # row i predicts ids[i + 1]
        for s in range(0, len(feed), self.PROMPT_LOGPROB_ROWS):
            if cancel is not None and cancel.is_set():
                return None
            chunk = feed[s: s + self.PROMPT_LOGPROB_ROWS]
            rows = np.asarray(self.model.forward(mx.array([chunk]), cache, exact=True,
                                                 all_logits=True).astype(mx.float32))
            out += [token_logprob(rows[j], ids[s + j + 1], n) for j in range(len(chunk))]
        return out

    def _decode_pipelined(self, cache, tokens: list[int], reply: list[int], max_tokens: int, accept,
                          cancel, until: int | None = None):
        """Greedy decode without drafts, one step ahead of the host: while step t runs on the
        device, step t+1's graph is built on its (unread) token and launched with async_eval; only
        then is step t's token read and passed to `accept`. Yields the same events as the host
        loop in `generate` (one per token) and returns the finish reason -- or None once `tokens`
        has reached `until` (the host loop goes on from there: silenced proposers wake up).

        Same tokens as the host loop: the step is the same forward call and greedy_device is
        `sample`'s greedy branch on the device. Same cache state at the end: a step launched for a
        token that turns out to be the last (EOS, stop string, cancel) is trimmed off; a step past
        max_tokens (so past the context, which bounds max_tokens) is never launched."""

        def step(tok):
            """Feed `tok` (an int, or an unread [1] device token) at cache.offset; returns the
            greedy next token, launched on the device, unread."""
            ids = tok.reshape(1, 1) if isinstance(tok, mx.array) else mx.array([[tok]])
            rows = self.model.forward(ids, cache, exact=True, all_logits=True)
            nxt = greedy_device(rows)                # [1]
            mx.async_eval(nxt)
            return nxt

        if cancel is not None and cancel.is_set():
            return "cancelled"
        # invariant at the loop head: cur is the token at position len(tokens), its step launched,
        # and cache.offset == len(tokens)
        end = len(tokens) + max_tokens - len(reply)           # len(tokens) to stop at
        if until is not None:
            end = min(end, until)
        if len(tokens) >= end:
            return None
        cur = step(tokens[-1])
        finish = None
        while finish is None and len(tokens) < end:
            nxt = step(cur) if len(tokens) + 1 < end else None
            tok = cur.item()
            tokens.append(tok)
            text, finish = accept(tok)
            yield GenerationEvent(text=text, token_ids=[tok])
            if finish is None and cancel is not None and cancel.is_set():
                finish = "cancelled"
            cur = nxt
        cache.trim(len(tokens) - 1)                  # what the host loop leaves: the last token unfed
        return finish

    def _check_finite(self, row: np.ndarray, position: int) -> None:
        """Warn, once per engine, where a request's first logits row holds NaN: the model's forward
        is broken there (a checkpoint's NaN weights, an fp16 overflow, a backend fault such as MLX
        0.32.4's CUDA quantized matmul at K = 64), and its replies mean nothing. Sampling still
        follows its rules, so a reply is still a pure function of the row (NaN ids are never
        sampled; greedy, and a row of nothing finite, take the first NaN id, as numpy's argmax
        does); the operator hears of it. Checked once a request, on the row read back anyway."""
        if self._nan_warned or not np.isnan(row).any():
            return
        self._nan_warned = True
        log.warning("the model's logits hold NaN (%d of %d at position %d of a request): its replies "
                    "are not meaningful. The forward is broken on this checkpoint or backend (NaN "
                    "weights, an fp16 overflow, a kernel fault); said once per engine.",
                    int(np.isnan(row).sum()), row.size, position)

    def generate_text(self, *args, **kwargs) -> tuple[str, list[int], GenerationStats]:
        """Run generate to the end: (text, reply token ids, stats)."""
        text, ids, stats = [], [], None
        for ev in self.generate(*args, **kwargs):
            text.append(ev.text)
            ids += ev.token_ids
            stats = ev.stats or stats
        return "".join(text), ids, stats
