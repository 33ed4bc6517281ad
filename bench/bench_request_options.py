"""What a request's options cost decode speed, side by side in one run (Engine API, no server).

    python bench/bench_request_options.py [--model DIR] [--prompt-tokens 64] [--decode 128] [--repeat 5]

Each row is one configuration of the same greedy request (same prompt, same reply length unless an
option changes the reply): plain, logprobs 0 / 5 / 20, the penalties, echo's prompt scoring. Decode
tok/s is the engine's own (GenerationStats.decode_tps: first token to last, every token's text
produced); medians over --repeat runs, the configurations interleaved so that a load change on the
host hits them all. Ratios are against "plain" in the same run."""

from __future__ import annotations

import argparse
import statistics
import time

from tensorfold.engine import Engine, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the packaged tinycode-4bit)")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    if a.model is None:
        import pathlib
        import tensorfold
        a.model = str(pathlib.Path(tensorfold.__file__).parent / "data" / "tinycode-4bit")
    eng = Engine(a.model, snapshot_dir=None)
    text = "import os\nimport sys\n\n\ndef main(argv):\n    parser = argparse.ArgumentParser()\n" * 40
    prompt = eng.tokenizer.encode(text)[: a.prompt_tokens]
    greedy = SamplingParams(temperature=0.0)
    configs = {
        "plain": {},
        "logprobs 0": {"logprobs": 0},
        "logprobs 5": {"logprobs": 5},
        "logprobs 20": {"logprobs": 20},
        "penalties (frequency 0.2, repetition 1.05)": {
            "sampling": SamplingParams(temperature=0.0, frequency_penalty=0.2, repetition_penalty=1.05)},
        "echo: prompt scored + logprobs 1": {"logprobs": 1, "prompt_logprobs": 1},
    }
    rates: dict[str, list[float]] = {k: [] for k in configs}
    walls: dict[str, list[float]] = {k: [] for k in configs}
    tokens: dict[str, int] = {}
    for name, kw in configs.items():            # warm-up: traces, kernels, the prompt's snapshot
        list(eng.generate(prompt=prompt, max_tokens=8, draft=False, **{"sampling": greedy, **kw}))
    for _ in range(a.repeat):
        for name, kw in configs.items():
            t0 = time.perf_counter()
            evs = list(eng.generate(prompt=prompt, max_tokens=a.decode, draft=False, **{"sampling": greedy, **kw}))
            walls[name].append(time.perf_counter() - t0)
            rates[name].append(evs[-1].stats.decode_tps)
            tokens[name] = evs[-1].stats.completion_tokens
    base = statistics.median(rates["plain"])
    print(f"model {a.model}, prompt {len(prompt)} tokens, {a.decode} decoded, greedy, drafts off, "
          f"medians of {a.repeat}\n")
    print("| request | tokens | decode tok/s | vs plain | wall s (prefill included) |")
    print("|---|---:|---:|---:|---:|")
    for name in configs:
        r = statistics.median(rates[name])
        print(f"| {name} | {tokens[name]} | {r:.1f} | {r / base:.2f}x | {statistics.median(walls[name]):.3f} |")


if __name__ == "__main__":
    main()
