"""Loading the GPU kernel sources shipped as files (csrc/cuda/*.cu, metal/*.metal).

Each file is cut into sections by marker lines ``// @@header`` and ``// @@body <name>``.
The header section goes to ``header=`` of ``mx.fast.cuda_kernel`` / ``metal_kernel`` and
each body section is the ``source=`` of one kernel.

Helpers shared by all files of one kind live in a section file of their own
(csrc/cuda/common.cuh, metal/common.h); its header section is prepended to the header
of every other file of that kind, so each kernel is still compiled from one text.

CUDA kernels are passed without comments, indentation or blank lines (`minified`), with
only the header items their body uses (`kernel_text`): MLX's CUDA CustomKernel hashes the
whole kernel text on every launch (custom_kernel.cpp, eval_gpu: std::hash of source_ to name
the JIT module), so the text's length is host time in every decode step. The generated code
is the same (`csrc/cuda/nvcc_check.py --ptx-hash` prints identical hashes).
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path

_PKG = Path(__file__).resolve().parent.parent  # .../tensorfold


def kernel_dir(kind: str) -> Path:
    """TENSORFOLD_<KIND>_SOURCES where set (csrc/cuda/nvcc_check.py sets it to its own folder, so an
    offline check reads the sources being edited, not a stale installed copy); else the installed
    copy (tensorfold/_kernels/<kind>); else the repository's sources."""
    override = os.environ.get(f"TENSORFOLD_{kind.upper()}_SOURCES")
    if override:
        return Path(override)
    installed = _PKG / "_kernels" / kind
    if installed.is_dir():
        return installed
    repo = _PKG.parent.parent  # python/tensorfold -> repo root
    src = repo / ("csrc/cuda" if kind == "cuda" else "metal")
    if src.is_dir():
        return src
    raise FileNotFoundError(f"tensorfold: no {kind} kernel sources found ({installed}, {src})")


COMMON = {"cuda": "common.cuh", "metal": "common.h"}


@functools.lru_cache(maxsize=None)
def sections(kind: str, filename: str) -> dict[str, str]:
    """{'header': ..., '<body name>': ...} of one kernel source file; the header starts
    with the shared helpers of COMMON[kind] (when that file exists)."""
    out = _split((kernel_dir(kind) / filename).read_text())
    common = COMMON.get(kind)
    if common is not None and filename != common and (kernel_dir(kind) / common).is_file():
        out["header"] = _split((kernel_dir(kind) / common).read_text())["header"] + \
            out.get("header", "")
    if kind == "cuda":
        out = {k: minified(v) for k, v in out.items()}
    return out


def minified(text: str) -> str:
    """C++ / CUDA text without // comments, indentation and blank lines (the sources hold no
    /* */ comments and no string literal with //; preprocessor lines stay lines of their own),
    and without the spaces between tokens that no token needs (`squeezed`)."""
    lines = []
    for line in text.splitlines():
        cut = line.find("//")
        while cut >= 0 and line.count('"', 0, cut) % 2:     # inside a string literal
            cut = line.find("//", cut + 2)
        if cut >= 0:
            line = line[:cut]
        line = line.strip()
        if line:
            lines.append(line if line.startswith("#") else squeezed(line))
    return "\n".join(lines) + "\n"


_WORD = set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.")
_OPER = set("+-*/%<>=!&|^:#~?")


def squeezed(line: str) -> str:
    """One line of C++ without the spaces that separate nothing: a space stays only between two
    word characters (names, numbers: `unsigned int`, `1 .5`) or two operator characters (`a - -b`,
    `< :`), and inside string literals. Preprocessor lines are not passed here (a macro's name
    and its `(`)."""
    out, i, n = [], 0, len(line)
    while i < n:
        c = line[i]
        if c in "\"'":                       # a literal, copied whole
            j = i + 1
            while j < n and line[j] != c:
                j += 2 if line[j] == "\\" else 1
            out.append(line[i:j + 1])
            i = j + 1
        elif c in " \t":
            j = i
            while j < n and line[j] in " \t":
                j += 1
            a, b = (out[-1][-1] if out else ""), (line[j] if j < n else "")
            if (a in _WORD and b in _WORD) or (a in _OPER and b in _OPER):
                out.append(" ")
            i = j
        else:
            out.append(c)
            i += 1
    return "".join(out)


@functools.lru_cache(maxsize=None)
def kernel_text(kind: str, filename: str, name: str) -> tuple[str, str]:
    """(header, body) of kernel `name`; for CUDA the header keeps only the items (functions,
    structs, macros) the body reaches, directly or through other kept items."""
    sec = sections(kind, filename)
    if kind != "cuda":
        return sec.get("header", ""), sec[name]
    return pruned(sec.get("header", ""), sec[name]), sec[name]


_HEAD_NAME = re.compile(r"(\w+)\s*(?:<[^()]*>)?\s*\(")


def _items(header: str) -> list[tuple[str | None, str]]:
    """Top-level items of minified C++ as (defined name or None, text)."""
    items, cur, depth = [], [], 0
    for line in header.splitlines(keepends=True):
        if depth == 0 and not cur and line.startswith("#") and not line.startswith("#pragma"):
            m = re.match(r"#define\s+(\w+)", line)
            items.append((m.group(1) if m else None, line))
            continue
        cur.append(line)
        depth += line.count("{") - line.count("}")
        if depth == 0 and line.rstrip().endswith(("}", ";")):
            text = "".join(cur)
            cur = []
            head = re.sub(r"^template\s*<[^{;]*?>\s*", "", text.split("{")[0].split(";")[0])
            m = re.match(r"\s*struct\s+(\w+)", head) or _HEAD_NAME.search(head) or \
                re.search(r"(\w+)\s*=", head)
            items.append((m.group(1) if m else None, text))
    if cur:
        items.append((None, "".join(cur)))
    return items


def pruned(header: str, body: str) -> str:
    """The header's items that `body` needs (items without a name are always kept)."""
    items = _items(header)
    keep = [name is None for name, _ in items]
    used = body + "".join(t for (n, t), k in zip(items, keep) if k)
    changed = True
    while changed:
        changed = False
        for i, (name, text) in enumerate(items):
            if not keep[i] and re.search(rf"\b{name}\b", used):
                keep[i], changed = True, True
                used += text
    return "".join(t for (_, t), k in zip(items, keep) if k)


def _split(text: str) -> dict[str, str]:
    out: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("// @@"):
            tag = stripped[5:].split()
            current = "header" if tag[0] == "header" else tag[1]
            out[current] = []
            continue
        if current is not None:
            out[current].append(line)
    return {k: "\n".join(v) + "\n" for k, v in out.items()}


# ---- CUDA kernel bodies in files (the default since session 43; TENSORFOLD_CUDA_TEXT=inline for the old way) ----
# MLX's CUDA custom kernel builds the kernel's whole source string at every call and hashes it at every
# launch (mlx/backend/cuda/custom_kernel.cpp: build_kernel, then std::hash of it in eval_gpu); the 4-bit
# GEMMs' texts are ~11 KB. In "file" mode the pruned header and the body go into a file, the body as a
# device function; the text MLX gets includes that file by its absolute path and calls the function, so it
# holds the signature MLX writes, its template constants and one call. The operations are the same:
# `csrc/cuda/nvcc_check.py --ptx-hash --text-file` prints the inline texts' hash for 534 of its 550 cases;
# the other 16 (row_mm_cp with 4 stages at K = 12288, sparse_tc) order some independent address arithmetic
# differently (diffed on one case of each). On the H200 (session 43): the same bits as inline for every
# decode kernel family (tests/test_kernels.py::test_cuda_text_file_mode_gives_the_same_bits), the same
# tokens in 8B decode, and 1.11-1.26x decode tok/s at 2k / 16k tokens in two runs (docs/benchmarks.md). Where the
# cache directory cannot be written, kernels fall back to inline texts (the same bits) with one warning.

def cuda_text_mode() -> str:
    mode = os.environ.get("TENSORFOLD_CUDA_TEXT", "file")
    if mode not in ("inline", "file"):
        raise ValueError(f"TENSORFOLD_CUDA_TEXT must be 'inline' or 'file', got {mode!r}")
    return mode


def user_cache_home() -> Path:
    """$XDG_CACHE_HOME/tensorfold, i.e. ~/.cache/tensorfold: the kernel files' and (cli.py) the
    snapshots' default parent."""
    return Path(os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")) / "tensorfold"


def cache_dir() -> Path:
    """Where generated kernel files go: $TENSORFOLD_CACHE_DIR/cuda, else user_cache_home()/cuda."""
    return Path(os.environ.get("TENSORFOLD_CACHE_DIR") or user_cache_home()) / "cuda"


def body_file_text(name: str, header: str, body: str, inputs: list[str], outputs: list[str],
                   kinds: list[tuple[str, str]]) -> tuple[str, str]:
    """(file text, call) for kernel `name` in file mode. kinds: its template arguments in order, as
    (name, "type" | "int" | "bool"). The body becomes `tf_body_<name>`, a forced-inline device function
    in MLX's kernel namespace taking the kernel's parameters by the same names (pointer types
    deduced; an input's `<n>_shape` by reference where the body reads it) and its template constants
    as template arguments."""
    tparams = [f"{'typename' if k == 'type' else k} {n}" for n, k in kinds]
    params, args = [], []
    for i, n in enumerate(inputs):
        tparams.append(f"typename TfIn{i}")
        params.append(f"const TfIn{i}* {n}")
        args.append(n)
        if f"{n}_shape" in body:
            params.append(f"const Shape& {n}_shape")
            args.append(f"{n}_shape")
    for i, n in enumerate(outputs):
        tparams.append(f"typename TfOut{i}")
        params.append(f"TfOut{i}* {n}")
        args.append(n)
    text = (header + "namespace mlx::core::cu {\n"
            f"template <{', '.join(tparams)}>\n"
            f"__device__ __forceinline__ void tf_body_{name}({', '.join(params)}) {{\n"
            + body + "}\n} // namespace mlx::core::cu\n")
    targs = ", ".join(n for n, _ in kinds)
    call = f"tf_body_{name}{f'<{targs}>' if targs else ''}({', '.join(args)});\n"
    return text, call


def atomic_write(path: Path, data: bytes) -> None:
    """`data` in `path` by a temporary file in its directory and a rename: a reader (NVRTC, MLX, another
    process) sees the old file or the whole new one."""
    import tempfile
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def written_once(text: str, stem: str) -> Path:
    """`text` in cache_dir() under a name that holds its hash (written atomically; an existing file is
    read back and written again unless it holds exactly `text`). OSError where it cannot be written."""
    import hashlib
    path = cache_dir() / f"{stem}_{hashlib.sha256(text.encode()).hexdigest()[:16]}.cuh"
    try:
        same = path.read_text() == text
    except (OSError, UnicodeDecodeError):
        same = False
    if not same:
        atomic_write(path, text.encode())
    return path.resolve()
