"""The `tensorfold` command: help, one-line errors with exit code 2, and serving the embedded model."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

CMD = [sys.executable, "-m", "tensorfold"]


def run(*args, env=None, timeout=60):
    e = dict(os.environ, **(env or {}))
    return subprocess.run(CMD + list(args), capture_output=True, text=True, timeout=timeout, env=e)


def test_help():
    r = run("--help")
    assert r.returncode == 0 and "serve" in r.stdout and "info" in r.stdout
    r = run("serve", "--help")
    assert r.returncode == 0
    for opt in ("--host", "--port", "--name", "--alias", "--context", "--max-tokens", "--temperature", "--top-p",
                "--top-k", "--min-p", "--thinking", "--no-thinking", "--no-drafts", "--drafter",
                "--prompt-cache-gib", "--snapshot-dir", "--api-key", "MODEL"):
        assert opt in r.stdout, opt
    r = run("info", "--help")
    assert r.returncode == 0 and "PATH" in r.stdout
    assert run().returncode == 2        # no command: usage on stderr


def _one_line_error(r):
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in r.stderr, r.stderr
    return lines[0]


def test_serve_unknown_path_is_one_line_exit_2(tmp_path):
    assert "/nonexistent" in _one_line_error(run("serve", "/nonexistent"))
    _one_line_error(run("serve", str(tmp_path)))                          # a directory but not a model
    _one_line_error(run("serve", "./relative/missing"))
    # a Hugging Face id that cannot be fetched (offline)
    line = _one_line_error(run("serve", "no-such-org/no-such-model-xyz", env={"HF_HUB_OFFLINE": "1"}))
    assert "no-such-org/no-such-model-xyz" in line
    _one_line_error(run("serve", "--port", "99999"))


def test_unsupported_checkpoint_is_one_error_line_exit_2(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "mamba9", "architectures": ["Mamba9ForCausalLM"]}')
    r = run("serve", str(tmp_path), "--port", "0")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and "mamba9" in errors[0], r.stderr
    assert "mamba9" in _one_line_error(run("info", str(tmp_path)))


def test_serve_refuses_bad_flags_before_loading(tmp_path):
    """Each a one-line error, exit 2, before the model loads: non-finite numbers (--temperature nan
    made every request a 500), sizes past an integer of bytes, an empty --api-key (it turned a
    $TENSORFOLD_API_KEY off) or one no client can send, an empty
    --host (it listened on every interface), a --snapshot-dir that is a file, a port in use."""
    f = tmp_path / "a-file"
    f.write_text("x")
    for args, env, want in [
            (["--temperature", "nan"], None, "--temperature must be a finite number"),
            (["--top-p", "nan"], None, "--top-p must be a finite number"),
            (["--prompt-cache-gib", "inf"], None, "--prompt-cache-gib must be a finite number"),
            (["--max-request-mib", "0"], None, "--max-request-mib must be positive"),
            (["--api-key", ""], {"TENSORFOLD_API_KEY": "secret"}, "--api-key must not be blank"),
            # a blank or unsendable key: every request was a 401
            ([], {"TENSORFOLD_API_KEY": "   "}, "TENSORFOLD_API_KEY must not be blank"),
            (["--api-key", "clé"], None, "--api-key must be printable ASCII"),
            (["--api-key", "two words"], None, "--api-key must be printable ASCII"),
            # bytes past any integer: OverflowError (a traceback) after the model loaded
            (["--max-request-mib", "1e308"], None, "--max-request-mib is too large"),
            (["--snapshot-gib", "1e308"], None, "--snapshot-gib is too large"),
            (["--prompt-cache-gib", "1e300"], None, "--prompt-cache-gib is too large"),
            (["--host", ""], None, "--host must not be empty"),
            (["--snapshot-dir", str(f)], None, "is not a directory"),
            (["--host", "999.1.1.1"], None, "cannot listen on 999.1.1.1")]:
        assert want in _one_line_error(run("serve", *args, env=env)), args
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        t0 = time.monotonic()
        line = _one_line_error(run("serve", "--port", str(port)))
        assert f"cannot listen on 127.0.0.1:{port}" in line and time.monotonic() - t0 < 30


def test_argument_errors_are_one_line_naming_the_subcommand():
    """argparse's errors in the project's form: one line, exit 2. A bad value printed serve's whole
    twelve-line usage first, and an unknown flag after a subcommand was named by the top level
    (`tensorfold: error: unrecognized arguments`, with the top level's usage)."""
    for args, want in [(["serve", "--port", "abc"], "argument --port: invalid int value: 'abc' (see tensorfold serve --help)"),
                       (["serve", "--prefill", "foo"], "see tensorfold serve --help"),
                       (["serve", "--bogus"], "unrecognized arguments: --bogus (see tensorfold serve --help)"),
                       (["info", "a", "b"], "unrecognized arguments: b (see tensorfold info --help)"),
                       (["info", "--bogus"], "(see tensorfold info --help)"),
                       (["bogus"], "invalid choice: 'bogus'"),
                       (["--bogus"], "unrecognized arguments: --bogus (see tensorfold --help)")]:
        assert want in _one_line_error(run(*args)), args


def _serve_on_port_0(tmp_path, *extra):
    """A `serve` process on a port the system picks (read from its ready line), healthy."""
    import re
    log_path = tmp_path / "serve.log"
    log = open(log_path, "w+")
    p = subprocess.Popen(CMD + ["serve", "--port", "0", "--snapshot-dir", "none", *extra],
                         stdout=log, stderr=subprocess.STDOUT, text=True)
    p.log = log
    try:
        deadline, port = time.monotonic() + 120, None
        while port is None:
            assert p.poll() is None and time.monotonic() < deadline, log_path.read_text()
            m = re.search(r"OpenAI API at http://127\.0\.0\.1:(\d+)/v1", log_path.read_text())
            port = int(m.group(1)) if m else None
            time.sleep(0.1)
        assert port != 0
        _wait_healthy(p, port, log_path)
    except BaseException:
        _stop(p)
        log.close()
        raise
    return p, port


def test_port_0_names_the_port_it_listens_on(tmp_path):
    """--port 0 (the system picks one): the ready line said http://127.0.0.1:0/v1; it now names the
    port the server listens on (_serve_on_port_0 reads it and waits for /health there)."""
    p, _ = _serve_on_port_0(tmp_path)
    _stop(p)
    p.log.close()


def test_a_second_ctrl_c_exits_at_once(tmp_path):
    """Ctrl-C in a long prefill: the first answers the request with a 503 and waits up to 10 s for
    the engine's current MLX evaluation (one prefill chunk: minutes on a CPU); a second went
    unheard through that wait (10.3 s to exit, session 56's CLI audit). It now exits at once, 130."""
    import signal
    import threading
    p, port = _serve_on_port_0(tmp_path)
    status = []
    prompt = "def f(x):\n    return x + 1\n" * 150      # ~1,800 tokens: one chunk, > 10 s on 2 cores
    t = threading.Thread(target=lambda: status.append(httpx.post(
        f"http://127.0.0.1:{port}/v1/completions", json={"prompt": prompt, "max_tokens": 4}, timeout=120).status_code),
        daemon=True)
    try:
        t.start()
        time.sleep(2.0)                         # inside the prefill
        t0 = time.monotonic()
        p.send_signal(signal.SIGINT)
        time.sleep(0.5)
        p.send_signal(signal.SIGINT)
        rc = p.wait(30)
        took = time.monotonic() - t0
    finally:
        _stop(p)
        p.log.close()
    t.join(10)
    out = (tmp_path / "serve.log").read_text()
    assert rc == 130 and took < 5.0, (rc, took, out)
    assert status == [503] and "a second signal: exiting now" in out and "Traceback" not in out, out


def _serve_error(r):
    """serve's one error line (after its INFO lines), exit 2, no traceback."""
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1, r.stderr
    return errors[0]


def test_malformed_checkpoint_files_are_one_line_errors(tmp_path):
    """config.json values of the wrong type, a corrupt tokenizer.json: one line from `info` and
    `serve`, never a traceback."""
    from tensorfold.cli import embedded_model_path
    import json
    import shutil
    src = embedded_model_path()
    cases = {"rope": lambda c: c.update(rope_scaling="linear"),
             "heads": lambda c: c.update(num_key_value_heads="2"),
             "maxpos": lambda c: c.update(max_position_embeddings=None, rope_theta="x")}
    for name, edit in cases.items():
        d = tmp_path / name
        shutil.copytree(src, d)
        cfg = json.loads((d / "config.json").read_text())
        edit(cfg)
        (d / "config.json").write_text(json.dumps(cfg))
        _one_line_error(run("info", str(d)))
        _serve_error(run("serve", str(d), "--port", "0"))
    d = tmp_path / "tok"
    shutil.copytree(src, d)
    (d / "tokenizer.json").write_text('{"model": 1}')
    assert "tokenizer" in _serve_error(run("serve", str(d), "--port", "0"))
    d = tmp_path / "template"       # a chat template that does not parse: refused at load
    shutil.copytree(src, d)
    (d / "chat_template.jinja").write_text("{% for %}")
    assert "chat_template.jinja: chat template syntax error" in _serve_error(run("serve", str(d), "--port", "0"))


def test_info():
    r = run("info")
    assert r.returncode == 0 and "qwen3" in r.stdout and "4-bit" in r.stdout, r.stderr
    _one_line_error(run("info", "/nonexistent"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(p, port, log_path):
    deadline = time.monotonic() + 120
    while True:
        assert p.poll() is None, log_path.read_text()
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.1)


def _stop(p):
    p.terminate()
    try:
        p.wait(20)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


def test_serve_a_hugging_face_id_by_its_name(tmp_path):
    """`tensorfold serve org/name` (here from a Hugging Face cache, offline) serves the model as
    org/name: its snapshot directory is a commit hash, which /v1/models and every reply's `model`
    showed, and a request naming org/name got 404."""
    import shutil

    from tensorfold.cli import embedded_model_path
    sha = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--acme--tinycode-4bit"
    shutil.copytree(embedded_model_path(), repo / "snapshots" / sha)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(sha)
    port = _free_port()
    log = open(tmp_path / "serve.log", "w+")
    env = dict(os.environ, HF_HUB_CACHE=str(tmp_path / "hub"), HF_HUB_OFFLINE="1")
    p = subprocess.Popen(CMD + ["serve", "acme/tinycode-4bit", "--port", str(port), "--snapshot-dir", "none"],
                         stdout=log, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        _wait_healthy(p, port, tmp_path / "serve.log")
        base = f"http://127.0.0.1:{port}/v1"
        assert [m["id"] for m in httpx.get(f"{base}/models").json()["data"]] == ["acme/tinycode-4bit"]
        r = httpx.post(f"{base}/completions", json={"model": "acme/tinycode-4bit", "prompt": "def ",
                                                     "max_tokens": 2}, timeout=60)
        assert r.status_code == 200 and r.json()["model"] == "acme/tinycode-4bit", r.text
    finally:
        _stop(p)
        log.close()


def test_serve_embedded_model_answers_with_code(tmp_path):
    import openai   # a test dependency: missing it must fail, not skip
    port = _free_port()
    log = open(tmp_path / "serve.log", "w+")
    # the key as a secrets file gives it, with its newline: every request was a 401
    env = dict(os.environ, TENSORFOLD_API_KEY="s3cret-key\n")
    p = subprocess.Popen(CMD + ["serve", "--port", str(port), "--snapshot-dir", str(tmp_path / "snaps")],
                         stdout=log, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        _wait_healthy(p, port, tmp_path / "serve.log")
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).status_code == 401
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="s3cret-key", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["tinycode-4bit"]
        r = client.chat.completions.create(
            model="tinycode-4bit", temperature=0, max_tokens=80,
            messages=[{"role": "user", "content": "Show the function dumps from json."}])
        assert "def dumps" in r.choices[0].message.content, r.choices[0].message.content
    finally:
        _stop(p)
        log.close()
    out = (tmp_path / "serve.log").read_text()
    first = out.strip().splitlines()[0]
    assert "embedded" in first and "tinycode-4bit" in first, out
    assert "Traceback" not in out, out


def test_a_signal_inside_submit_does_not_deadlock():
    """SIGTERM / SIGINT run their handler on the event loop's thread wherever the signal found it:
    inside EngineWorker.submit's queue put, which holds the queue's lock that drain() takes, the
    server hung for good. The drain is now scheduled on the loop."""
    import asyncio
    import threading
    from tensorfold.cli import schedule_drain

    lock, called = threading.Lock(), []

    class Worker:
        def drain(self):
            with lock:
                called.append(1)
            return 0

    async def signal_inside_put():
        with lock:                  # what submit holds while the signal lands
            schedule_drain(Worker())
        await asyncio.sleep(0.05)

    t = threading.Thread(target=lambda: asyncio.run(signal_inside_put()), daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive() and called == [1]
