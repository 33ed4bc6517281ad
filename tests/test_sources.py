"""The CUDA kernel texts handed to mx.fast.cuda_kernel: minified, header pruned to what the body
uses. MLX hashes the whole text on every launch, so the text is kept short; the generated code
is checked to be unchanged by `python csrc/cuda/nvcc_check.py --ptx-hash` (nvcc, no GPU)."""
import re

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
