"""The CUDA kernel texts handed to mx.fast.cuda_kernel: minified, header pruned to what the body
uses. MLX hashes the whole text on every launch, so the text is kept short; the generated code
is checked to be unchanged by `python csrc/cuda/nvcc_check.py --ptx-hash` (nvcc, no GPU)."""
import os
import re

import pytest

from tensorfold.kernels import _cuda
from tensorfold.kernels._sources import kernel_text, minified, pruned


def test_minified_drops_comments_and_layout_only():
    src = 'int a = 1;  // one\n\n    #pragma unroll\n  asm("x // y"); // z\n'
    assert minified(src) == 'int a=1;\n#pragma unroll\nasm("x // y");\n'


def test_squeezed_keeps_every_token_apart():
    """A space stays where dropping it would join two tokens into another (names and numbers,
    operators), and inside literals; preprocessor lines keep theirs (a macro's name and its `(`).
    nvcc_check.py --ptx-hash showed the real kernels' PTX unchanged by it."""
    src = ('unsigned int q = a - -b + c & &d < :e ? 1 .5 : x < y > z;\n'
           'asm volatile("bar.sync %0, 64;" : : "r"(w + 1) : "memory");\n'
           '#define TF_F (x + 1)\n')
    assert minified(src) == ('unsigned int q=a- -b+c& &d< :e?1 .5:x<y>z;\n'
                             'asm volatile("bar.sync %0, 64;": :"r"(w+1):"memory");\n'
                             '#define TF_F (x + 1)\n')


def test_pruned_keeps_what_the_body_reaches():
    header = minified("""
#define TF_A 1
#define TF_UNUSED 2
struct TfS { int v; };
template <typename T> __device__ T tf_f(T x) { return x + TF_A; }
__device__ int tf_g(int x) {
  return tf_f(x);
}
__device__ int tf_h(int x) { return x; }
""")
    out = pruned(header, "int y = tf_g(3); TfS s;")
    assert "tf_g" in out and "tf_f" in out and "TF_A" in out and "TfS" in out
    assert "tf_h" not in out and "TF_UNUSED" not in out


def test_every_cuda_kernel_finds_its_helpers():
    for name, (_, _, filename) in _cuda._KERNELS.items():
        header, body = kernel_text("cuda", filename, name)
        assert "//" not in re.sub(r'"[^"]*"', "", header + body), name
        text = header + body
        for ident in set(re.findall(r"\b(?:tf_\w+|TF_\w+|Tf\w+)\b", body)):
            assert re.search(rf"(?:\b{ident}\s*(?:<[^()]*>)?\s*\(|#define {ident}\b|struct {ident}\b)",
                             header), (name, ident)
        assert len(text) < 13500, (name, len(text))    # the longest: row_attn_wg, 13.2 KB (MLX hashes it every launch)


@pytest.fixture
def fake_kernels(monkeypatch):
    """mx.fast.cuda_kernel replaced by a recorder: the list of each kernel's creation arguments (a
    launch returns its own arguments), so the texts can be read on any machine."""
    import mlx.core as mx
    made = []

    def fake_kernel(**kw):
        made.append(kw)
        return lambda **call: call
    monkeypatch.setattr(mx.fast, "cuda_kernel", fake_kernel)
    return made


def test_file_mode_text_is_short_and_includes_the_body(tmp_path, monkeypatch, fake_kernels):
    """TENSORFOLD_CUDA_TEXT=file: the text MLX gets (and hashes at every launch) is the include of a
    file holding the pruned header and the body as tf_body_<name>, plus one call passing the
    kernel's parameters and template constants; the file is written once, under
    TENSORFOLD_CACHE_DIR. (Its machine code: test_cuda_compiles.py.)"""
    import mlx.core as mx
    from tensorfold.kernels import _cuda
    from tensorfold.kernels._sources import kernel_text
    made = fake_kernels
    monkeypatch.setenv("TENSORFOLD_CUDA_TEXT", "file")
    monkeypatch.setenv("TENSORFOLD_CACHE_DIR", str(tmp_path))
    _cuda.clear_kernel_caches()
    try:
        tmpl = [("T", mx.bfloat16), ("D", 128), ("SPAN", 64), ("DC", 32), ("MW", 1), ("E", 1)]
        for _ in range(2):
            _cuda._kernel("row_attn_merge", 0)(template=tmpl, grid=(1, 1, 1))
        tmpl2 = [("T", mx.bfloat16), ("H", 32), ("HK", 8), ("HD", 128), ("NORM", True)]
        _cuda._kernel("qk_norm_rope_kv", 0)(template=tmpl2, grid=(1, 1, 1))
    finally:
        _cuda.clear_kernel_caches()
    assert len(made) == 2                       # one kernel a template signature, made once
    header, body = kernel_text("cuda", "row_attention.cu", "row_attn_merge")
    k = made[0]
    path = k["header"].split('"')[1]
    assert k["header"] == f'#include "{path}"\n' and path.startswith(str(tmp_path.resolve()))
    text = open(path).read()
    assert text.startswith(header) and body in text
    assert "template <typename T, int D, int SPAN, int DC, int MW, int E," in text
    assert "__device__ __forceinline__ void tf_body_row_attn_merge(" in text
    assert k["source"].startswith("tf_body_row_attn_merge<T, D, SPAN, DC, MW, E>(part, part_shape, offset,")
    assert len(k["header"]) + len(k["source"]) < (len(header) + len(body)) // 4
    q = made[1]["source"]                       # inputs whose shapes the body reads pass them on
    assert "qkv, qkv_shape" in q and "kc, kc_shape" in q and "<T, H, HK, HD, NORM>" in q
    assert len(list(tmp_path.rglob("*.cuh"))) == 2


def test_clearing_the_caches_switches_the_launch_plans_to_file_mode(tmp_path, monkeypatch, fake_kernels):
    """The launch plans (_qmm_cp_call and the other *_call caches) hold the kernel they were made
    with, so switching TENSORFOLD_CUDA_TEXT must clear them too (bench_engine --text-file-too had
    cleared only the kernel caches: its GEMMs stayed inline). clear_kernel_caches does."""
    import mlx.core as mx
    from tensorfold.kernels import _cuda
    made = fake_kernels
    monkeypatch.setenv("TENSORFOLD_CACHE_DIR", str(tmp_path))

    def launch():
        kern, template, grid, tg, shapes, dtypes = _cuda._qmm_cp_call(mx.bfloat16, mx.bfloat16, 4096, 4096, 64, 1)
        kern(template=template, grid=grid)
        return made[-1]["header"]
    try:
        for mode, inline in (("inline", True), ("file", False), ("inline", True)):
            monkeypatch.setenv("TENSORFOLD_CUDA_TEXT", mode)
            _cuda.clear_kernel_caches()
            assert launch().startswith("#include") is not inline, mode
    finally:
        _cuda.clear_kernel_caches()


def test_file_mode_is_the_default_and_falls_back_to_inline(tmp_path, monkeypatch, fake_kernels):
    """Kernel texts in files are the default (session 43). Where the cache directory can't be
    written, a kernel gets its inline text (the same operations) and the user one warning; a file
    that does not hold exactly the text its name promises is written again."""
    import mlx.core as mx
    from tensorfold.kernels import _cuda
    from tensorfold.kernels._sources import cuda_text_mode, written_once
    monkeypatch.delenv("TENSORFOLD_CUDA_TEXT", raising=False)
    assert cuda_text_mode() == "file"
    made = fake_kernels
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("TENSORFOLD_CACHE_DIR", str(blocker / "cache"))
    monkeypatch.setattr(_cuda._texts, "warned", False)
    tmpl = [("T", mx.bfloat16), ("D", 128), ("SPAN", 64), ("DC", 32), ("MW", 1), ("E", 1)]
    _cuda.clear_kernel_caches()
    try:
        with pytest.warns(RuntimeWarning, match="CUDA kernel texts inline"):
            _cuda._kernel("row_attn_merge", 0)(template=tmpl, grid=(1, 1, 1))
        _cuda._kernel("qk_norm_rope", 0)(template=[("T", mx.bfloat16), ("H", 32), ("HK", 8), ("HD", 128),
                                                   ("NORM", True)], grid=(1, 1, 1))   # no second warning
    finally:
        _cuda.clear_kernel_caches()
    header, body = kernel_text("cuda", "row_attention.cu", "row_attn_merge")
    assert (made[0]["header"], made[0]["source"]) == (header, body)
    monkeypatch.setenv("TENSORFOLD_CACHE_DIR", str(tmp_path / "ok"))
    path = written_once("int a;\n", "tf_x")
    path.write_text("int b;\n")                 # damaged
    assert written_once("int a;\n", "tf_x") == path and path.read_text() == "int a;\n"

    def no_room(*a):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "replace", no_room)
    with pytest.raises(OSError):
        written_once("int c;\n", "tf_x")
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]     # no partial file left


def test_a_new_template_instance_finds_its_file_again(tmp_path, monkeypatch, fake_kernels):
    """MLX compiles a file-mode kernel's template instance at its first launch, so a new instance
    must find the included file even after the cache directory was cleaned under a running server:
    the first call of each instance writes it again."""
    import mlx.core as mx
    from tensorfold.kernels import _cuda
    monkeypatch.setenv("TENSORFOLD_CUDA_TEXT", "file")
    monkeypatch.setenv("TENSORFOLD_CACHE_DIR", str(tmp_path))
    tmpl = [("T", mx.bfloat16), ("D", 128), ("SPAN", 64), ("DC", 32), ("MW", 1), ("E", 1)]
    _cuda.clear_kernel_caches()
    try:
        _cuda._kernel("row_attn_merge", 0)(template=tmpl, grid=(1, 1, 1))
        (f,) = tmp_path.rglob("*.cuh")
        text = f.read_text()
        f.unlink()                                   # cleaned
        _cuda._kernel("row_attn_merge", 0)(template=tmpl, grid=(1, 1, 1))
        assert not f.exists()                        # a known instance: MLX compiled it already
        _cuda._kernel("row_attn_merge", 0)(template=tmpl[:4] + [("MW", 2), ("E", 1)], grid=(1, 1, 1))
        assert f.read_text() == text                 # a new one: the same file, written again
    finally:
        _cuda.clear_kernel_caches()


def test_kernel_cache_directory(monkeypatch, tmp_path):
    from tensorfold.kernels._sources import cache_dir
    monkeypatch.delenv("TENSORFOLD_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "tensorfold" / "cuda"
    monkeypatch.setenv("TENSORFOLD_CACHE_DIR", str(tmp_path / "tf"))
    assert cache_dir() == tmp_path / "tf" / "cuda"
