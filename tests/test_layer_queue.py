"""LayerQueue bounds in-flight layers and changes nothing about the results."""

import mlx.core as mx

from tensorfold._ext import LayerQueue


def _layers(x, ws):
    outs = []
    for w in ws:
        x = mx.tanh(x @ w)
        outs.append(x)
    return outs


def test_bounds_in_flight_and_equals_plain_eval():
    mx.random.seed(0)
    ws = [mx.random.normal((128, 128)) * 0.1 for _ in range(12)]
    x = mx.random.normal((64, 128))
    plain = _layers(x, ws)
    mx.eval(plain)
    for depth in (1, 2, 3):
        q = LayerQueue(depth)
        queued = []
        h = x
        for w in ws:
            h = mx.tanh(h @ w)
            q.push([h])
            queued.append(h)
            assert q.in_flight <= depth
        assert q.max_in_flight == depth
        q.drain()
        assert q.in_flight == 0 and q.pushed == len(ws)
        for a, b in zip(plain, queued):
            assert mx.array_equal(a, b).item()


def test_depth_must_be_positive():
    import pytest
    with pytest.raises(ValueError):
        LayerQueue(0)
