"""MLX's own quantized_matmul on this device vs the CPU, by K and M (finds broken shapes)."""
import mlx.core as mx
for K in (64, 128, 256, 384, 512, 1024, 4096):
    N = 256
    w = mx.random.normal((N, K)).astype(mx.bfloat16)
    q, s, b = mx.quantize(w, group_size=64, bits=4)
    bad = []
    for M in (1, 2, 4, 8, 16, 33):
        x = mx.random.normal((M, K)).astype(mx.bfloat16)
        y = mx.quantized_matmul(x, q, s, b, transpose=True, group_size=64, bits=4)
        with mx.stream(mx.cpu):
            yc = mx.quantized_matmul(x, q, s, b, transpose=True, group_size=64, bits=4)
        err = (mx.abs(y.astype(mx.float32) - yc.astype(mx.float32)).max() / mx.abs(yc.astype(mx.float32)).max()).item()
        if err > 0.05:
            bad.append((M, round(err, 3)))
    print(f"K={K}: bad (M, rel err) = {bad}", flush=True)
