"""Serial vs drafted decode on real text: tinycode (the embedded model) on recall, echo and
rename requests. Prints tok/s, acceptance, tokens per verify round, and checks that every
drafted reply equals its serial reply token for token.

    python bench/bench_drafts.py [--model PATH] [--max-tokens 256] [--repeat 3]
"""

from __future__ import annotations

import argparse
import inspect
import json
import urllib.parse
import statistics
from pathlib import Path

import mlx.core as mx

import tensorfold
from tensorfold.engine import Engine, SamplingParams


def requests():
    src = inspect.getsource(json.dumps)
    src2 = inspect.getsource(urllib.parse.urljoin)
    return {
        "recall dumps": "Show the function dumps from json.",
        "recall urlparse": "Show the function urlparse from urllib.parse.",
        "echo json.dumps": f"Echo the following code back unchanged.\n\n```python\n{src}```",
        "echo urljoin": f"Echo the following code back unchanged.\n\n```python\n{src2}```",
        "rename dumps": f"Rename the function dumps to to_json in the following code.\n\n```python\n{src}```",
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(Path(tensorfold.__file__).parent / "data" / "tinycode-4bit"))
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--prefill", choices=["mlx", "kernels"], default="mlx")
    args = ap.parse_args(argv)
    from tensorfold.engine import PrefillMode
    eng = Engine(args.model, prefill_mode=PrefillMode(ops=args.prefill))
    print(f"# {args.model}  device={mx.default_device()}  mlx={mx.__version__}  row_exact={eng.row_exact}  prefill={args.prefill}")
    print("| request | tokens | serial tok/s | drafted tok/s | speed-up | accepted/drafted | tok/verify call | equal |")
    print("|---|---|---|---|---|---|---|---|")
    p = SamplingParams(temperature=0.0)
    eng.generate_text(prompt="def f():", max_tokens=8)   # warm-up
    for name, text in requests().items():
        msgs = [{"role": "user", "content": text}]
        ser, dr = [], []
        for _ in range(args.repeat):
            a = eng.generate_text(messages=msgs, max_tokens=args.max_tokens, sampling=p, draft=False)
            b = eng.generate_text(messages=msgs, max_tokens=args.max_tokens, sampling=p, draft=True)
            ser.append(a)
            dr.append(b)
        equal = all(x[1] == y[1] for x, y in zip(ser, dr))
        st = dr[0][2]
        s_tps = statistics.median(x[2].decode_tps for x in ser)
        d_tps = statistics.median(x[2].decode_tps for x in dr)
        # the first token is the prefill's; each decode call emits its accepted drafts plus one
        calls = st.completion_tokens - 1 - st.accepted
        print(f"| {name} | {st.completion_tokens} | {s_tps:.1f} | {d_tps:.1f} | {d_tps / s_tps:.2f} | "
              f"{st.accepted}/{st.drafted} | {(st.completion_tokens - 1) / max(1, calls):.2f} | {equal} |",
              flush=True)


if __name__ == "__main__":
    main()
