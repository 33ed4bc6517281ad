"""Where requests are tokenized: daemon threads of their own, off the event loop and off the
engine's thread (Engine.prepare; the tokenizer lets the GIL go while it works).

Two lanes, so that a small request never waits behind large ones: bodies up to SMALL bytes go to
one, larger ones to the other, each with its own threads. The threads are daemons and not
asyncio's default pool: a shutdown neither waits for a large prompt's tokenization to end nor
queues its own work (stopping the worker, flushing snapshots) behind them."""

from __future__ import annotations

import asyncio
import queue
import threading


class TokenizePool:
    SMALL = 256 << 10       # bytes of request body

    def __init__(self, small_threads: int = 2, large_threads: int = 2):
        self._lanes = {"small": (queue.Queue(), small_threads), "large": (queue.Queue(), large_threads)}
        self._started = False
        self._lock = threading.Lock()
        self.pending = 0        # requests waiting for or in tokenization (/health)

    def _start(self) -> None:
        with self._lock:
            if self._started:
                return
            self._started = True
            for name, (q, n) in self._lanes.items():
                for i in range(n):
                    threading.Thread(target=self._serve, args=(q,), name=f"tensorfold-tokenize-{name}-{i}",
                                     daemon=True).start()

    def submit(self, fn, args: tuple, size: int) -> asyncio.Future:
        """fn(*args) on a lane's thread; the returned future (of the running loop) gets its
        result or exception. Cancelling the future skips the call if it has not begun."""
        self._start()
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._lock:
            self.pending += 1
        q = self._lanes["small" if size <= self.SMALL else "large"][0]
        q.put((loop, fut, fn, args))
        return fut

    def _serve(self, q: queue.Queue) -> None:
        """A lane's thread. `pending` drops when a call is done or skipped here, not when its
        future is cancelled: a request whose client left still holds the lane until its
        tokenization ends (it cannot be stopped), and /health counted 0 while two 12 MB prompts
        held the large lane for 23 s."""
        def settle(fut, result, error):
            if not fut.done():
                if error is not None:
                    fut.set_exception(error)
                else:
                    fut.set_result(result)
        while True:
            loop, fut, fn, args = q.get()
            try:
                if fut.cancelled():
                    continue
                try:
                    result, error = fn(*args), None
                except BaseException as e:  # noqa: BLE001 - handed to the request's handler
                    result, error = None, e
                try:
                    loop.call_soon_threadsafe(settle, fut, result, error)
                except RuntimeError:        # the loop is closed: the server is gone
                    pass
            finally:
                with self._lock:
                    self.pending -= 1
