"""Benchmark: how long a running stream stalls while another client's large prompt is tokenized.

One in-process server on the embedded tinycode model streams a completion; 0.3 s in, another
client posts a prompt of --mb megabytes (refused afterwards as longer than the context, so only
its tokenization costs). Reported: the stream's largest gap between events, and its median.

Two modes in one run, side by side:
- "engine thread": the request is tokenized by Engine.generate on the engine's thread with
  tokenizers' `encode`, which holds the GIL (TensorFold before session 51);
- "tokenize pool": the server's path now (Engine.prepare on server/tokenizing.py's threads,
  `encode_batch`, which lets the GIL go).

    python bench/bench_tokenize_stall.py [--mb 4.4] [--repeat 3]
"""

from __future__ import annotations

import argparse
import socket
import statistics
import threading
import time

import httpx
import uvicorn

from tensorfold.cli import embedded_model_path
from tensorfold.engine import Engine
from tensorfold.server import EngineWorker, create_app
from tensorfold.tokenizer import Tokenizer


class _WithoutPrepare:
    """The engine as the server sees it, less `prepare`: the handler then hands the raw prompt to
    generate, which tokenizes it on the engine's thread (the path before session 51)."""

    def __init__(self, eng):
        self._eng = eng

    def __getattr__(self, name):
        if name == "prepare":
            raise AttributeError(name)
        return getattr(self._eng, name)


def _serve(app):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    th = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    base = f"http://127.0.0.1:{sock.getsockname()[1]}"
    while True:
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return base, server, th
        except httpx.HTTPError:
            time.sleep(0.05)


def run(mode: str, mb: float) -> tuple[float, float, int]:
    def build():                                # on the worker's thread (MLX's streams are per thread)
        eng = Engine(embedded_model_path(), drafts=False, snapshot_dir=None)
        return _WithoutPrepare(eng) if mode == "engine thread" else eng
    base, server, th = _serve(create_app(EngineWorker(build)))
    prompt = "def foo(x):\n    return x + 1\n" * int(mb * 1e6 / 30)
    status = {}

    def big():
        time.sleep(0.3)
        status["big"] = httpx.post(base + "/v1/completions", json={"prompt": prompt, "max_tokens": 1},
                                   timeout=600).status_code
    t = threading.Thread(target=big)
    t.start()
    times = []
    with httpx.stream("POST", base + "/v1/completions", timeout=600,
                      json={"prompt": "import os\n", "max_tokens": 1500, "temperature": 0,
                            "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                times.append(time.perf_counter())
    t.join()
    server.should_exit = True
    th.join(10)
    gaps = sorted(b - a for a, b in zip(times, times[1:]))
    return gaps[-1], statistics.median(gaps), status["big"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, default=4.4)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    rows = {}
    encode_batch = Tokenizer._encode
    for mode in ("engine thread", "tokenize pool"):
        if mode == "engine thread":             # tokenizers' encode, which holds the GIL
            Tokenizer._encode = lambda self, text, special: self._tok.encode(
                text, add_special_tokens=special).ids
        else:
            Tokenizer._encode = encode_batch
        rows[mode] = [run(mode, a.mb) for _ in range(a.repeat)]
    Tokenizer._encode = encode_batch
    print(f"a stream's gaps while a {a.mb} MB prompt is tokenized (tinycode-4bit, medians of {a.repeat})\n")
    print("| tokenized on | largest gap ms | median gap ms | large prompt's status |")
    print("|---|---:|---:|---:|")
    for mode, rs in rows.items():
        print(f"| {mode} | {statistics.median(r[0] for r in rs) * 1e3:.0f} | "
              f"{statistics.median(r[1] for r in rs) * 1e3:.1f} | {rs[0][2]} |")
    old, new = (statistics.median(r[0] for r in rows[m]) for m in rows)
    print(f"\nlargest gap: {old / new:.0f}x shorter on the tokenize pool")


if __name__ == "__main__":
    main()
