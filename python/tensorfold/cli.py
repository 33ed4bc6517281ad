"""The `tensorfold` command: `serve` an OpenAI-compatible server, `info` about a checkpoint."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import sys
from pathlib import Path

from . import __version__

EMBEDDED_NAME = "tinycode-4bit"
EMBEDDED_ABOUT = ("15.7M-parameter Qwen3-architecture model trained on the Python 3.12 standard library; "
                  "try \"Show the function dumps from json.\"")
_HF_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")

log = logging.getLogger("tensorfold")


class _Help(argparse.HelpFormatter):
    """Show "(default: X)" for options whose default means something."""

    def _get_help_string(self, action):
        h = action.help or ""
        if (action.default not in (None, False, argparse.SUPPRESS) and "default" not in h
                and action.option_strings):
            h += " (default: %(default)s)"
        return h


class CliError(Exception):
    """A one-line error for the user; exit code 2."""


class _Parser(argparse.ArgumentParser):
    """argparse with the project's one-line errors: `error: MESSAGE (see PROG --help)`, exit 2,
    where argparse printed the whole usage (twelve lines for serve) before its message."""

    def error(self, message):
        self.exit(2, f"error: {' '.join(message.split())} (see {self.prog} --help)\n")


def embedded_model_path() -> Path:
    return Path(__file__).resolve().parent / "data" / EMBEDDED_NAME


def resolve_model(model: str | None) -> tuple[Path, bool]:
    """A local directory for MODEL (None: the embedded model), downloading a Hugging Face id if needed.
    Returns (path, embedded)."""
    if model is None:
        p = embedded_model_path()
        if not (p / "config.json").is_file():
            raise CliError(f"the embedded model is missing from this installation ({p})")
        return p, True
    p = Path(model).expanduser()
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise CliError(f"{model} is not a model directory (no config.json)")
        return p.resolve(), False
    if p.exists():
        raise CliError(f"{model} is not a directory (expected a model directory with config.json)")
    if not _HF_ID.match(model) or model.startswith((".", "~")):
        raise CliError(f"no such model directory: {model}")
    return _download(model), False


def _download(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise CliError(f"no such model directory: {repo_id} (and huggingface_hub is not installed to "
                       f"download it)") from None
    patterns = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken", "*.md"]
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns, local_files_only=True))
    except Exception:  # noqa: BLE001 - not cached: try the network below
        pass
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except Exception as e:  # noqa: BLE001 - offline, unknown repo, gated, ...
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CliError(f"{repo_id} is not a local directory and could not be downloaded from Hugging Face "
                       f"({type(e).__name__}: {msg[:200]})") from None


def default_snapshot_dir() -> str:
    env = os.environ.get("TENSORFOLD_SNAPSHOT_DIR")
    if env:
        return env
    from .kernels._sources import user_cache_home
    return str(user_cache_home() / "snapshots")


# -- parser ----------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="tensorfold",
        description="TensorFold: an exact, fast LLM server on MLX (OpenAI-compatible HTTP API).")
    p.add_argument("--version", action="version", version=f"tensorfold {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    s = sub.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve MODEL at http://HOST:PORT/v1 (chat/completions, completions, models), /tokenize, /detokenize and /health.",
        formatter_class=_Help)
    s.add_argument("model", nargs="?", metavar="MODEL",
                   help="a local model directory or a Hugging Face id (downloaded when online); "
                        f"default: the embedded {EMBEDDED_NAME} model")
    g = s.add_argument_group("network")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on")
    g.add_argument("--port", type=int, default=8080, help="port to listen on")
    g.add_argument("--api-key", default=None,
                   help="require this key (Authorization: Bearer KEY); default: $TENSORFOLD_API_KEY, "
                        "or no key")
    g.add_argument("--name", "--alias", dest="name", default=None,
                   help="model name reported by /v1/models and accepted in requests (default: the "
                        "model directory's name)")
    g.add_argument("--max-request-mib", type=float, default=None, metavar="MIB",
                   help="largest request body accepted, in MiB; larger ones get a 413 before they are "
                        "read (default: 16, or 256 bytes a context token where that is more, up to 1024)")
    g.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="log level")
    g = s.add_argument_group("model")
    g.add_argument("--context", type=int, default=None,
                   help="context length in tokens (default: the model's max_position_embeddings, or "
                        "yarn's factor x its original positions; more is taken, with a warning)")
    g.add_argument("--thinking", action=argparse.BooleanOptionalAction, default=None,
                   help="enable the model's thinking mode by default (requests may override with "
                        "chat_template_kwargs.enable_thinking; default: the chat template's)")
    g.add_argument("--no-drafts", action="store_true", help="turn speculative drafting off")
    g.add_argument("--drafter", default=None, metavar="PATH", help="a draft model directory")
    g.add_argument("--prompt-cache-gib", type=float, default=2.0, help="prompt cache size in GiB")
    g.add_argument("--snapshot-gib", type=float, default=8.0,
                   help="disk budget for prompt-cache snapshots in GiB (oldest unpinned dropped first)")
    g.add_argument("--prefill", choices=["mlx", "kernels"], default="mlx",
                   help="prompt ops on the 2,048 grid: 'mlx' = MLX's own forward (equals mlx-lm's "
                        "logits); 'kernels' = the row-exact kernels (much faster on MLX's CPU backend, "
                        "other bits; part of the prompt-cache key)")
    g.add_argument("--snapshot-dir", default=None, metavar="DIR",
                   help="directory for prompt-cache snapshots on disk, kept across restarts; 'none' "
                        "disables (default: $TENSORFOLD_SNAPSHOT_DIR, else "
                        "$XDG_CACHE_HOME/tensorfold/snapshots, i.e. ~/.cache/tensorfold/snapshots)")
    g = s.add_argument_group("request defaults")
    g.add_argument("--max-tokens", type=int, default=None,
                   help="max_tokens for requests that give none (default: up to the context length)")
    g.add_argument("--temperature", type=float, default=None,
                   help="default temperature (default: generation_config.json's, else 0 = greedy)")
    g.add_argument("--top-p", type=float, default=None, help="default top_p (default: generation_config.json's)")
    g.add_argument("--top-k", type=int, default=None, help="default top_k (default: generation_config.json's)")
    g.add_argument("--min-p", type=float, default=None, help="default min_p (default: generation_config.json's)")
    s.set_defaults(func=cmd_serve)

    i = sub.add_parser("info", help="describe a checkpoint (architecture, quantization, memory)",
                       description="Describe the checkpoint at PATH without loading its weights.")
    i.add_argument("path", nargs="?", metavar="PATH",
                   help=f"a model directory or Hugging Face id (default: the embedded {EMBEDDED_NAME} model)")
    i.set_defaults(func=cmd_info)
    p.set_defaults(subparsers={"serve": s, "info": i})
    return p


# -- commands --------------------------------------------------------------------------------------

def _check_serve_args(a) -> None:
    import math
    for flag in ("temperature", "top_p", "min_p", "prompt_cache_gib", "snapshot_gib", "max_request_mib"):
        v = getattr(a, flag)
        if v is not None and not math.isfinite(v):
            raise CliError(f"--{flag.replace('_', '-')} must be a finite number, got {v}")
    if not 0 <= a.port <= 65535:
        raise CliError(f"--port must be between 0 and 65535, got {a.port}")
    if not a.host.strip():
        raise CliError("--host must not be empty (use 0.0.0.0 to listen on every interface)")
    a.api_key = _api_key(a.api_key)
    if a.context is not None and a.context < 1:
        raise CliError(f"--context must be positive, got {a.context}")
    if a.max_tokens is not None and a.max_tokens < 1:
        raise CliError(f"--max-tokens must be positive, got {a.max_tokens}")
    if a.temperature is not None and a.temperature < 0:
        raise CliError(f"--temperature must be >= 0, got {a.temperature}")
    if a.top_p is not None and not 0 < a.top_p <= 1:
        raise CliError(f"--top-p must be in (0, 1], got {a.top_p}")
    if a.top_k is not None and a.top_k < 0:
        raise CliError(f"--top-k must be >= 0, got {a.top_k}")
    if a.min_p is not None and not 0 <= a.min_p <= 1:
        raise CliError(f"--min-p must be in [0, 1], got {a.min_p}")
    if a.max_request_mib is not None and not a.max_request_mib > 0:
        raise CliError(f"--max-request-mib must be positive, got {a.max_request_mib}")
    if a.prompt_cache_gib < 0:
        raise CliError(f"--prompt-cache-gib must be >= 0, got {a.prompt_cache_gib}")
    if a.snapshot_gib < 0:
        raise CliError(f"--snapshot-gib must be >= 0, got {a.snapshot_gib}")
    # sizes in bytes must be integers: 1e308 GiB overflowed to infinity after the model loaded
    for flag, unit in (("prompt_cache_gib", 2**30), ("snapshot_gib", 2**30), ("max_request_mib", 2**20)):
        v = getattr(a, flag)
        if v is not None and v * unit > 2**62:
            raise CliError(f"--{flag.replace('_', '-')} is too large: at most {2**62 // unit} ({v:g} given)")
    if a.drafter is not None and not Path(a.drafter).expanduser().is_dir():
        raise CliError(f"no such drafter directory: {a.drafter}")
    snap = a.snapshot_dir
    if snap is not None and snap.lower() != "none" and Path(snap).expanduser().exists() \
            and not Path(snap).expanduser().is_dir():
        raise CliError(f"--snapshot-dir {snap} exists and is not a directory")


def _api_key(flag: str | None) -> str | None:
    """The key clients must send: --api-key, else $TENSORFOLD_API_KEY (unset or empty: no key).
    Whitespace around it is dropped (HTTP drops it from a header, so a key read from a file with
    its newline could never match: every request was a 401); a key left empty, or holding a space
    or a character outside printable ASCII (no client sends those bytes as they were typed), is a
    one-line error at start."""
    src, key = ("--api-key", flag) if flag is not None else \
        ("TENSORFOLD_API_KEY", os.environ.get("TENSORFOLD_API_KEY") or None)
    if key is None:
        return None
    key = key.strip()
    if not key:
        raise CliError(f"{src} must not be blank (leave it out to serve without a key)")
    if any(not 0x21 <= ord(c) <= 0x7E for c in key):
        raise CliError(f"{src} must be printable ASCII without spaces (as an 'Authorization: Bearer' "
                       f"token is)")
    return key


def _check_listen(host: str, port: int) -> None:
    """Bind the address once before the model loads (minutes for a large one), so that a port in
    use or an address this host does not have is a one-line error at once."""
    import socket
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError) as e:
        raise CliError(f"cannot listen on {host}:{port}: {e}") from None
    fam, typ, proto, _, addr = infos[0]
    with socket.socket(fam, typ, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)     # as uvicorn binds
        try:
            s.bind(addr)
        except OSError as e:
            raise CliError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def _setup_logging(level: str) -> None:
    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
    log.addHandler(h)
    log.setLevel(level.upper())
    log.propagate = False


def schedule_drain(worker) -> None:
    """What SIGINT / SIGTERM do first: the queued and running requests get a 503 (a stream an error
    event and [DONE]) inside uvicorn's grace period, instead of being cut off when it runs out.
    Scheduled on the event loop, not run in the signal handler: the handler runs on the loop's
    thread wherever the signal found it, and EngineWorker.drain takes the job queue's lock, which
    that thread may hold (inside submit's put: the server hung for good)."""
    def drain():
        n = worker.drain()
        if n:
            log.info("shutting down: %d request(s) answered with 503", n)
    try:
        asyncio.get_running_loop().call_soon_threadsafe(drain)
    except RuntimeError:        # no loop running: nothing on this thread holds the lock
        drain()


def cmd_serve(a) -> int:
    _check_serve_args(a)
    _check_listen(a.host, a.port)
    _setup_logging(a.log_level)
    from .kernels import _kcache
    ptx = _kcache.lasting_mlx_dir()          # before anything runs on the GPU (MLX reads it once)
    if ptx is not None:
        log.info("compiled CUDA kernels kept in %s (MLX_PTX_CACHE_DIR)", ptx)
    path, embedded = resolve_model(a.model)
    # a Hugging Face id is the model's name (its snapshot directory is named by a commit hash,
    # which clients never send: they got 404 model_not_found for the id they asked to serve)
    hf_id = a.model if not embedded and not Path(a.model).expanduser().exists() else None
    if embedded:
        log.info("no MODEL given: serving the embedded default model %s (%s) from %s",
                 EMBEDDED_NAME, EMBEDDED_ABOUT, path)
    else:
        log.info("serving %s", path)

    import uvicorn

    from .server import EngineWorker, create_app

    from .engine.prefill import PrefillMode
    kwargs = dict(drafter=a.drafter, drafts=not a.no_drafts, context=a.context,
                  prompt_cache_gib=a.prompt_cache_gib, snapshot_gib=a.snapshot_gib, thinking=a.thinking,
                  prefill_mode=PrefillMode(ops=a.prefill))
    snap = a.snapshot_dir or default_snapshot_dir()
    kwargs["snapshot_dir"] = None if snap.lower() == "none" else str(Path(snap).expanduser())

    def build():
        from .engine import Engine
        eng = Engine(str(path), **kwargs)
        if eng.warm_up_async() is not None:   # saved system blocks: read in the background
            log.info("warming saved system-prompt snapshots from %s in the background", kwargs["snapshot_dir"])
        return eng

    worker = EngineWorker(build)
    try:
        eng = worker.wait_ready()
    except Exception as e:  # noqa: BLE001 - one line, whatever the checkpoint did
        worker.stop()       # join the thread first: exiting under it can abort inside MLX
        from .errors import TensorFoldError
        if isinstance(e, TensorFoldError):
            raise
        what = str(e) if isinstance(e, (OSError, ValueError)) else f"{type(e).__name__}: {e}"
        raise CliError(f"cannot load {path}: {what}") from None
    api_key = a.api_key         # resolved and checked by _check_serve_args
    defaults = dict(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, min_p=a.min_p,
                    max_tokens=a.max_tokens, thinking=a.thinking)
    app = create_app(worker, model_name=a.name or hf_id, aliases=(hf_id,) if hf_id else (),
                     api_key=api_key, defaults=defaults,
                     max_body=None if a.max_request_mib is None else max(1, int(a.max_request_mib * 2**20)))
    config = uvicorn.Config(app, host=a.host, port=a.port, log_level=a.log_level, timeout_graceful_shutdown=2)
    sockets, port = None, a.port
    if a.port == 0:     # the port the system picks, bound here so that the line below can name it
        sockets = [config.bind_socket()]
        port = sockets[0].getsockname()[1]
    log.info("model %s: context %d tokens, drafting %s, prompt snapshots on disk: %s; OpenAI API at "
             "http://%s:%d/v1%s", app.state.model_name, eng.context_length,
             "on" if getattr(eng, "drafts_enabled", not a.no_drafts) else "off",
             # the engine's store: a directory it found unusable is "off" (it had been named here)
             getattr(getattr(eng, "disk", None), "dir", None) or "off",
             f"[{a.host}]" if ":" in a.host else a.host, port, " (API key required)" if api_key else "")

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            if not self.should_exit:
                schedule_drain(worker)
            else:
                force_exit(sig)
            super().handle_exit(sig, frame)

    server = Server(config)
    server.run(sockets=sockets)
    worker.stop()
    return 0 if getattr(server, "started", True) else 1


def force_exit(sig: int) -> None:
    """A second SIGINT / SIGTERM while the server shuts down: exit now, 128 + the signal. The first
    one waits up to 10 s for the engine's current MLX evaluation (a prefill chunk can take longer
    on a CPU) and for queued prompt snapshots to reach the disk; a second Ctrl-C went unheard
    through that wait. os._exit: no destructor runs under the engine's thread (MLX may be
    mid-evaluation), and nothing saved is lost -- snapshots are written under a temporary name
    and renamed when whole, and a temporary file is removed at the next start (cache/disk.py)."""
    log.warning("a second signal: exiting now, without waiting for the engine")
    logging.shutdown()
    os._exit(128 + int(sig))


def cmd_info(a) -> int:
    path, _ = resolve_model(a.path)
    from .errors import TensorFoldError
    from .models.info import describe
    try:
        text = describe(path)
    except TensorFoldError:
        raise
    except Exception as e:  # noqa: BLE001 - one line, whatever config.json holds
        raise CliError(f"cannot describe {path}: {type(e).__name__}: {e}") from None
    print(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:       # named by the subcommand that was given them (argparse named the top level)
        parser = args.subparsers.get(getattr(args, "command", None) or "", parser)
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return 2
    from .errors import TensorFoldError
    try:
        return args.func(args)
    except (CliError, TensorFoldError) as e:
        print("error: " + " ".join(str(e).split()), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
