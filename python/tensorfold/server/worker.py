"""The one thread that owns the Engine (and MLX): a FIFO of jobs, events handed back to asyncio handlers."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from ..errors import RequestError
from .progress import ProgressLine
from .reasoning import prompt_opens_think

log = logging.getLogger("tensorfold.server")

_STOP = object()


@dataclass
class Job:
    """One request. The worker calls `engine.generate(**kwargs)` and posts ("event", ev) items, then
    ("error", RequestError) or ("end", None) through `loop.call_soon_threadsafe`."""
    kwargs: dict
    loop: asyncio.AbstractEventLoop
    chat: bool = False
    cancel: threading.Event = field(default_factory=threading.Event)
    items: asyncio.Queue = field(default_factory=asyncio.Queue)
    id: int = 0
    in_think: bool = False      # set by the worker before the first event (chat: prompt opened a think block)
    n: int = 1                  # choices: generated one after another, ("choice", i) posted before choice i > 0

    def post(self, kind: str, value=None) -> None:
        try:
            self.loop.call_soon_threadsafe(self.items.put_nowait, (kind, value))
        except RuntimeError:    # the event loop is gone (server shutting down)
            self.cancel.set()


class EngineWorker:
    """Builds the engine on its own thread (MLX streams are per thread) and serves jobs in order."""

    def __init__(self, engine_or_factory, *, name: str = "tensorfold-engine"):
        if callable(engine_or_factory) and not hasattr(engine_or_factory, "generate"):
            self._factory = engine_or_factory
        else:
            self._factory = lambda: engine_or_factory
        self.engine = None
        self._q: queue.Queue = queue.Queue()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self.current: Job | None = None
        self.stats = {"served": 0, "cancelled": 0, "skipped": 0, "errors": 0, "queued": 0}
        self._stopped = threading.Event()
        self._closing = False       # drain() or stop() ran: submit() refuses
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.progress = ProgressLine()

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> "EngineWorker":
        if not self._thread.is_alive() and not self._ready.is_set():
            self._thread.start()
        return self

    def wait_ready(self, timeout: float | None = None):
        """Block until the engine is built; re-raise the error if building it failed."""
        self.start()
        if not self._ready.wait(timeout):
            raise TimeoutError("engine did not start in time")
        if self._error is not None:
            raise self._error
        return self.engine

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel the current job and wait (up to `timeout`) until the thread has stopped serving.
        The thread is then parked, not ended: a thread that used MLX and ends before the process
        does made the exit abort now and then ("terminate called without an active exception",
        MLX's per-thread state torn down after its thread) even when joined."""
        self._closing = True
        cur = self.current
        if cur is not None:
            cur.cancel.set()
        self._q.put(_STOP)
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            if not self._stopped.wait(timeout):
                log.warning("the engine did not stop within %.0f s (a prefill chunk is one MLX "
                            "evaluation); exiting under it", timeout)

    def drain(self, message: str = "The server is shutting down.") -> int:
        """Answer every queued job and the current one with a 503 and cancel them (the server is
        shutting down: handlers end cleanly, streams with an error event and [DONE], before the
        server's grace period runs out). Returns the number of jobs answered. Thread-safe."""
        self._closing = True
        with self._q.mutex:
            jobs = [j for j in self._q.queue if isinstance(j, Job)]
        cur = self.current
        if cur is not None:
            jobs.append(cur)
        for job in jobs:
            if not job.cancel.is_set():
                # the error first: set first, the cancel let the engine's thread post its final
                # "cancelled" event ahead of it (a 200 with a finish reason OpenAI has not)
                job.post("error", RequestError(message, type="server_error", code="server_shutting_down",
                                               status=503))
                job.cancel.set()
        return len(jobs)

    @property
    def closing(self) -> bool:
        """drain() or stop() ran: requests still being read or tokenized get a 503."""
        return self._closing

    # -- requests ----------------------------------------------------------------------------------
    def submit(self, kwargs: dict, *, chat: bool = False, n: int = 1) -> Job:
        if self._closing:       # drained or stopped: nothing would serve it
            raise RequestError("The server is shutting down.", type="server_error",
                               code="server_shutting_down", status=503)
        job = Job(kwargs=kwargs, loop=asyncio.get_running_loop(), chat=chat, id=next(self._ids), n=n)
        with self._lock:
            self.stats["queued"] += 1
        self._q.put(job)
        return job

    def _run(self) -> None:
        try:
            self.engine = self._factory()
        except BaseException as e:  # noqa: BLE001 - handed to wait_ready()
            self._error = e
            self._ready.set()
            self._park()
        self._ready.set()
        while True:
            job = self._q.get()
            if job is _STOP:
                self._park()
            with self._lock:
                self.stats["queued"] -= 1
            if job.cancel.is_set():     # the client left while queued: skip it
                with self._lock:
                    self.stats["skipped"] += 1
                job.post("end")
                continue
            self.current = job
            try:
                self._serve(job)
            finally:
                self.current = None

    def _park(self) -> None:
        """Stop serving for good, without ending the thread (see stop())."""
        self._stopped.set()
        while True:
            threading.Event().wait()

    def _serve(self, job: Job) -> None:
        eng = self.engine
        t0 = time.perf_counter()
        try:
            if job.chat:
                job.in_think = self._opens_think(job.kwargs)
            total = 0
            kwargs = dict(job.kwargs, cancel=job.cancel, progress=self.progress.prefill)
            self.progress.begin()
            keeps = job.n > 1 and hasattr(eng, "forget_prompt")
            for i in range(job.n):
                if i:                   # choice i: its own seed (sampling.choice_seed), the same prompt
                    job.post("choice", i)
                    kwargs["sampling"] = dataclasses.replace(job.kwargs["sampling"], choice=i)
                if keeps:               # the prompt prefilled (and scored) once for all the choices
                    kwargs["keep_prompt"] = i < job.n - 1
                for ev in eng.generate(**kwargs):
                    total += len(ev.token_ids)
                    self.progress.decode(total, time.perf_counter() - t0)
                    job.post("event", ev)
                    if job.cancel.is_set():
                        break
                if job.cancel.is_set():
                    break
        except RequestError as e:
            with self._lock:
                self.stats["errors"] += 1
            job.post("error", e)
            return
        except Exception as e:  # noqa: BLE001 - never kill the worker
            log.exception("generation failed")
            with self._lock:
                self.stats["errors"] += 1
            job.post("error", RequestError(f"Internal error during generation: {type(e).__name__}: {e}",
                                           type="server_error", code="internal_error", status=500))
            return
        finally:
            self.progress.end()
            if hasattr(eng, "forget_prompt"):
                eng.forget_prompt()
        with self._lock:
            self.stats["cancelled" if job.cancel.is_set() else "served"] += 1
        job.post("end")

    def _opens_think(self, kwargs: dict) -> bool:
        tok = getattr(self.engine, "tokenizer", None)
        tags = getattr(tok, "think_tags", None)
        prepared = kwargs.get("prepared")
        if tags and prepared is not None:       # rendered by Engine.prepare
            return bool(prepared.chat and prepared.text) and prompt_opens_think(prepared.text, tags,
                                                                                prepared.final_at)
        if not tags or not kwargs.get("messages"):
            return False
        think = kwargs.get("enable_thinking")
        if think is None:
            think = getattr(self.engine, "thinking", None)     # the engine's default, as it will render
        try:
            text = tok.apply_chat_template(kwargs["messages"], add_generation_prompt=True,
                                           enable_thinking=think)
            if not isinstance(text, str):
                text = tok.decode(list(text)[-64:])
        except Exception:  # noqa: BLE001 - the engine reports bad messages itself
            return False
        return prompt_opens_think(text, tags)
