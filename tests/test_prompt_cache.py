"""Prompt cache: resumed == fresh (memory, disk, restart), keys, corruption, pinning, warm-up."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import time

import mlx.core as mx
import numpy as np
import pytest

from tensorfold.cache.disk import DiskStore
from tensorfold.cache.memory import SnapshotStore, common_prefix
from tensorfold.engine import Engine, PrefillMode, SamplingParams
from tensorfold.engine.prefill import prefill

GRID = 16
P = SamplingParams(temperature=0.8, seed=11)


def _words(n, seed):
    rng = np.random.default_rng(seed)
    vocab = ["def", "class", "return", "value", "self", "list", "the", "data", "x", "if", "for", "in"]
    return " ".join(rng.choice(vocab, size=n))


def _conversation(first_len, seed):
    return [
        [{"role": "system", "content": _words(30, seed + 1)},
         {"role": "user", "content": _words(first_len, seed)}],
        [{"role": "user", "content": _words(7, seed + 2)}],
        [{"role": "user", "content": _words(5, seed + 3)}],
    ]


def _chat(eng_factory, turns, thinking, max_tokens=12):
    """Run a three-turn chat; eng_factory() gives the engine for each turn."""
    msgs, replies, cached = [], [], []
    for t in turns:
        msgs = msgs + t
        eng = eng_factory()
        text, ids, st = eng.generate_text(messages=msgs, max_tokens=max_tokens, sampling=P,
                                          enable_thinking=thinking)
        replies.append((text, ids))
        cached.append(st.cached_tokens)
        msgs = msgs + [{"role": "assistant", "content": text}]
    return replies, cached


@pytest.fixture(scope="module")
def model_path(checkpoints):
    return checkpoints["qwen3_mlx_4bit"]


@pytest.mark.parametrize("first_len", [1, 9, 23, 40, 75])
@pytest.mark.parametrize("thinking", [True, False])
@pytest.mark.parametrize("name", ["qwen3_mlx_4bit", "qwen3_moe_mlx_4bit", "deepseek_v32_mlx_4bit"])
def test_three_turns_resumed_equals_fresh(checkpoints, name, first_len, thinking):
    model_path = checkpoints[name]
    mode = PrefillMode(grid=GRID)
    turns = _conversation(first_len, seed=first_len)
    one = Engine(model_path, prefill_mode=mode, drafts=False)
    resumed, cached = _chat(lambda: one, turns, thinking)
    fresh, fcached = _chat(lambda: Engine(model_path, prefill_mode=mode, drafts=False), turns, thinking)
    assert resumed == fresh
    assert fcached == [0, 0, 0]
    assert cached[1] > 0 and cached[2] >= cached[1]


def test_moe_dequantized_prefill_resumed_equals_fresh(checkpoints, monkeypatch):
    """The MoE family with its prefill experts through dequantize + gather_mm (the CUDA face's
    path for long chunks, forced here): resumed == fresh as with mlx-lm's gather_qmm."""
    monkeypatch.setenv("TENSORFOLD_MOE_PREFILL", "dequant")
    model_path = checkpoints["qwen3_moe_mlx_4bit"]
    mode = PrefillMode(grid=GRID)
    turns = _conversation(40, seed=40)
    one = Engine(model_path, prefill_mode=mode, drafts=False)
    resumed, cached = _chat(lambda: one, turns, False)
    fresh, _ = _chat(lambda: Engine(model_path, prefill_mode=mode, drafts=False), turns, False)
    assert resumed == fresh
    assert cached[1] > 0 and cached[2] >= cached[1]


@pytest.mark.parametrize("thinking", [True, False])
def test_resume_at_every_grid_point_of_the_first_message(model_path, thinking):
    mode = PrefillMode(grid=GRID)
    turns = _conversation(60, seed=3)
    fresh, _ = _chat(lambda: Engine(model_path, prefill_mode=mode, drafts=False), turns, thinking)
    eng = Engine(model_path, prefill_mode=mode, drafts=False)
    first_ids = eng.prompt_ids(messages=turns[0], enable_thinking=thinking)
    c = eng.model.new_cache()
    prefill(eng.model, c, first_ids, mode)
    msgs = turns[0] + [{"role": "assistant", "content": fresh[0][0]}] + turns[1]
    second_ids = eng.prompt_ids(messages=msgs, enable_thinking=thinking)
    shared = common_prefix(np.array(first_ids), np.array(second_ids))   # templates may re-render
    points = list(range(GRID, min(len(first_ids), shared) + 1, GRID))
    assert len(points) >= 4
    for g in points:
        eng.snapshots = SnapshotStore(1 << 30)
        eng.snapshots.add(eng.cache_key, first_ids[:g], c.snapshot(g))
        text, ids, st = eng.generate_text(messages=msgs, max_tokens=12, sampling=P, enable_thinking=thinking)
        assert st.cached_tokens == g
        assert (text, ids) == fresh[1]


def test_2048_grid_three_turns(model_path):
    """The real grid across several cells (first message ~5,000 tokens)."""
    turns = _conversation(3500, seed=5)
    one = Engine(model_path, drafts=False)
    resumed, cached = _chat(lambda: one, turns, False, max_tokens=6)
    fresh, _ = _chat(lambda: Engine(model_path, drafts=False), turns, False, max_tokens=6)
    assert resumed == fresh
    assert cached[1] >= 4096 and cached[1] % 2048 == 0


RESTART = textwrap.dedent("""
    import json, sys
    from tensorfold.engine import Engine, PrefillMode, SamplingParams
    path, snap, msgs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    eng = Engine(path, prefill_mode=PrefillMode(grid=16), snapshot_dir=snap, drafts=False)
    text, ids, st = eng.generate_text(messages=msgs, max_tokens=12,
                                      sampling=SamplingParams(temperature=0.8, seed=11))
    print(json.dumps({"text": text, "ids": ids, "cached": st.cached_tokens}))
""")


def _in_new_process(model_path, snap, msgs):
    out = subprocess.run([sys.executable, "-c", RESTART, str(model_path), str(snap), json.dumps(msgs)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_restart_from_disk_equals_fresh(model_path, tmp_path):
    snap = tmp_path / "snaps"
    turns = _conversation(50, seed=8)
    first = _in_new_process(model_path, snap, turns[0])
    assert first["cached"] == 0
    assert list(snap.glob("*.safetensors"))
    msgs = turns[0] + [{"role": "assistant", "content": first["text"]}] + turns[1]
    second = _in_new_process(model_path, snap, msgs)          # a new process, snapshots from disk
    fresh = Engine(model_path, prefill_mode=PrefillMode(grid=GRID), drafts=False).generate_text(
        messages=msgs, max_tokens=12, sampling=P)
    assert second["cached"] > 0
    assert (second["text"], second["ids"]) == (fresh[0], fresh[1])


def _prime(model_path, snap, mode=PrefillMode(grid=GRID), msgs=None):
    eng = Engine(model_path, prefill_mode=mode, snapshot_dir=snap, drafts=False)
    msgs = msgs or _conversation(50, seed=9)[0]
    eng.generate_text(messages=msgs, max_tokens=4, sampling=P)
    eng.disk.flush()          # snapshots are written by a background writer
    return msgs


def test_other_prefill_mode_or_kernels_miss(model_path, tmp_path, monkeypatch):
    snap = tmp_path / "snaps"
    msgs = _prime(model_path, snap)
    again = Engine(model_path, prefill_mode=PrefillMode(grid=GRID), snapshot_dir=snap, drafts=False)
    assert again.generate_text(messages=msgs, max_tokens=4, sampling=P)[2].cached_tokens > 0
    other = Engine(model_path, prefill_mode=PrefillMode(name="grid", grid=GRID * 2), snapshot_dir=snap,
                   drafts=False)
    assert other.generate_text(messages=msgs, max_tokens=4, sampling=P)[2].cached_tokens == 0
    import tensorfold.cache.key as key
    monkeypatch.setattr(key, "kernel_hash", lambda: "another-build")
    rebuilt = Engine(model_path, prefill_mode=PrefillMode(grid=GRID), snapshot_dir=snap, drafts=False)
    assert rebuilt.cache_key != again.cache_key
    assert rebuilt.generate_text(messages=msgs, max_tokens=4, sampling=P)[2].cached_tokens == 0


def test_key_covers_the_python_code_not_the_build_id(tmp_path, monkeypatch):
    """kernel_hash covers TensorFold's Python sources (a model's RoPE fix changed KV bits under the
    same key: a new version resumed an old version's snapshots, and replied other bytes than
    fresh), leaves out the extension's build id (each rebuild of the same sources differs only in
    those 20 bytes, and orphaned every snapshot), and the key names the backend."""
    import tensorfold.cache.key as key
    root = tmp_path / "site" / "tensorfold"
    (root / "models").mkdir(parents=True)
    (root / "data").mkdir()
    (root / "cache").mkdir()
    (root / "models" / "dense.py").write_text("theta = 1e6\n")
    (root / "data" / "big.txt").write_text("the embedded model")
    so = bytearray(b"\x7fELF" + bytes(60)) + key._BUILD_ID + bytes(range(20)) + b"code"
    (root / "_ext.so").write_bytes(bytes(so))
    monkeypatch.setattr(key, "__file__", str(root / "cache" / "key.py"))

    def h():
        key.kernel_hash.cache_clear()
        return key.kernel_hash()
    base = h()
    so[len(so) - 24:len(so) - 4] = bytes(range(100, 120))        # another build id: same key
    (root / "_ext.so").write_bytes(bytes(so))
    assert h() == base
    (root / "_ext.so").write_bytes(bytes(so[:-4]) + b"CODE")      # other machine code: another key
    assert h() != base
    (root / "_ext.so").write_bytes(bytes(so))
    (root / "data" / "big.txt").write_text("not read")             # the embedded model is not code
    assert h() == base
    (root / "models" / "dense.py").write_text("theta = 1e4\n")     # a model's code: another key
    assert h() != base
    key.kernel_hash.cache_clear()
    (tmp_path / "config.json").write_text("{}")
    a = key.cache_key(tmp_path, "bfloat16", "grid-16-mlx", kernels="k", whole=False)
    # another make of device (a GPU of another architecture sharing a home over NFS): another key
    info = dict(key.mx.device_info())
    monkeypatch.setattr(key.mx, "device_info", lambda: dict(info, device_name="another"))
    assert key.cache_key(tmp_path, "bfloat16", "grid-16-mlx", kernels="k", whole=False) != a
    monkeypatch.setattr(key.mx, "device_info", lambda: info)
    assert key.cache_key(tmp_path, "bfloat16", "grid-16-mlx", kernels="k", whole=False) == a
    monkeypatch.setattr(key.mx, "default_device", lambda: key.mx.Device(key.mx.gpu, 0))
    assert key.cache_key(tmp_path, "bfloat16", "grid-16-mlx", kernels="k", whole=False) != a


def test_key_covers_the_environment_that_chooses_arithmetic(checkpoints, tmp_path, monkeypatch):
    """A MoE server restarted with another TENSORFOLD_MOE_PREFILL (the README's switch between the
    dequantized and mlx-lm's gather_qmm prefill) resumed the other path's snapshots from disk: a
    resumed reply unlike the fresh one. Each variable of BITS_ENV changes the key; every
    TENSORFOLD_ variable the package reads is in BITS_ENV or, with its reason, NOT_BITS_ENV."""
    import re
    from pathlib import Path

    import tensorfold
    import tensorfold.cache.key as key
    model_path = checkpoints["qwen3_moe_mlx_4bit"]
    snap = tmp_path / "snaps"
    mode = PrefillMode(grid=GRID)
    msgs = [{"role": "user", "content": "x " * 40}]
    monkeypatch.setenv("TENSORFOLD_MOE_PREFILL", "dequant")
    first = Engine(model_path, prefill_mode=mode, snapshot_dir=snap, drafts=False)
    first.generate_text(messages=msgs, max_tokens=2, sampling=P)
    first.disk.flush()
    again = Engine(model_path, prefill_mode=mode, snapshot_dir=snap, drafts=False)
    assert again.generate_text(messages=msgs, max_tokens=2, sampling=P)[2].cached_tokens > 0
    monkeypatch.delenv("TENSORFOLD_MOE_PREFILL")
    other = Engine(model_path, prefill_mode=mode, snapshot_dir=snap, drafts=False)
    assert other.generate_text(messages=msgs, max_tokens=2, sampling=P)[2].cached_tokens == 0

    (tmp_path / "config.json").write_text("{}")
    base = key.cache_key(tmp_path, "bfloat16", "grid-16-mlx", kernels="k", whole=False)
    for var, value in [(v, "dequant" if v.endswith("PREFILL") else "cpu" if v.endswith("KERNELS")
                        else "0") for v in key.BITS_ENV]:
        monkeypatch.setenv(var, value)
        assert key.cache_key(tmp_path, "bfloat16", "grid-16-mlx", kernels="k", whole=False) != base, var
        monkeypatch.delenv(var)
    for var in ("TENSORFOLD_QUEUE_DEPTH", "TENSORFOLD_API_KEY", "TENSORFOLD_COMPILE_DECODE"):
        monkeypatch.setenv(var, "3")
        assert key.cache_key(tmp_path, "bfloat16", "grid-16-mlx", kernels="k", whole=False) == base, var
        monkeypatch.delenv(var)
    root = Path(tensorfold.__file__).parent
    read = {m for f in root.rglob("*.py") for m in re.findall(r"TENSORFOLD_[A-Z0-9_]*[A-Z0-9]", f.read_text())}
    assert read and read <= set(key.BITS_ENV) | set(key.NOT_BITS_ENV), read - set(key.BITS_ENV) - set(key.NOT_BITS_ENV)


def test_damaged_weights_memo_is_ignored(model_path, tmp_path, monkeypatch):
    """A memo nested past Python's stack ('[' x 100,000) made the server refuse to start, the
    error naming the model; it is ignored and the weights hashed again."""
    monkeypatch.setenv("TENSORFOLD_CACHE_DIR", str(tmp_path / "memo"))
    (tmp_path / "memo").mkdir()
    (tmp_path / "memo" / "weights-sha256.json").write_text("[" * 100000)
    eng = Engine(model_path, prefill_mode=PrefillMode(grid=GRID), snapshot_dir=tmp_path / "snaps", drafts=False)
    assert eng.wait_disk_key()
    assert list((tmp_path / "memo").iterdir()) == [tmp_path / "memo" / "weights-sha256.json"]


def test_slow_chunks_save_their_grid_point_before_the_next_chunk(model_path, tmp_path, monkeypatch):
    """Where a chunk takes SAVE_SLOW_CHUNKS_S or more (a quantized model's MLX prefill on a CPU:
    ~100 s), a grid point's snapshot is queued when it is reached: a shutdown during the next
    chunk (one MLX evaluation, which the server cannot wait out) kept nothing of a 2,963-token
    prompt. Here the next chunk fails; the grid point is on disk, and resuming from it == fresh."""
    monkeypatch.setattr(Engine, "SAVE_SLOW_CHUNKS_S", 0.0, raising=False)
    snap = tmp_path / "snaps"
    eng = Engine(model_path, prefill_mode=PrefillMode(grid=GRID), snapshot_dir=snap, drafts=False)
    ids = [10 + (i * 7) % 300 for i in range(3 * GRID + 5)]
    fwd, calls = eng.model.forward, []

    def dies_on_the_second_chunk(x, cache, **kw):
        calls.append(x.shape[1])
        if len(calls) == 2:
            raise RuntimeError("killed")
        return fwd(x, cache, **kw)
    monkeypatch.setattr(eng.model, "forward", dies_on_the_second_chunk)
    with pytest.raises(RuntimeError):
        eng.generate_text(prompt=ids, max_tokens=3, sampling=P)
    eng.disk.flush()
    assert [len(e.tokens) for e in DiskStore(snap).entries] == [GRID]
    again = Engine(model_path, prefill_mode=PrefillMode(grid=GRID), snapshot_dir=snap, drafts=False)
    got = again.generate_text(prompt=ids, max_tokens=6, sampling=P)
    assert got[2].cached_tokens == GRID
    fresh = Engine(model_path, prefill_mode=PrefillMode(grid=GRID), drafts=False).generate_text(
        prompt=ids, max_tokens=6, sampling=P)
    assert got[:2] == fresh[:2]


def _corrupt(f, how):
    data = bytearray(f.read_bytes())
    if how == "truncate":
        f.write_bytes(bytes(data[: len(data) - 100]))
    elif how == "flip":
        data[-50] ^= 0xFF
        f.write_bytes(bytes(data))
    elif how in ("format", "key"):
        n = int.from_bytes(data[:8], "little")
        head = json.loads(data[8: 8 + n])
        if how == "format":
            head["__metadata__"]["format"] = "tensorfold-snapshot-0"
        else:
            head["__metadata__"]["key"] = "0" * 32
        new = json.dumps(head, separators=(",", ":")).encode()
        new += b" " * (n - len(new)) if len(new) <= n else b""
        assert len(new) == n
        f.write_bytes(bytes(data[:8]) + new + bytes(data[8 + n:]))
    elif how == "garbage":
        f.write_bytes(b"not a safetensors file")
    elif how in ("shape", "offsets"):   # one bit: ',' (0x2C) -> '.' (0x2E) in a list of the header
        n = int.from_bytes(data[:8], "little")
        head = bytes(data[8: 8 + n])
        at = head.index(b'"shape":[1,' if how == "shape" else b'"data_offsets":[0,') + len(
            b'"shape":[1' if how == "shape" else b'"data_offsets":[0')
        data[8 + at] ^= 0x02
        f.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["truncate", "flip", "format", "key", "garbage", "shape", "offsets"])
def test_corrupted_snapshot_is_ignored_and_answer_unchanged(model_path, tmp_path, how, caplog):
    snap = tmp_path / "snaps"
    msgs = _prime(model_path, snap)
    files = list(snap.glob("*.safetensors"))
    assert files
    for f in files:
        _corrupt(f, how)
    eng = Engine(model_path, prefill_mode=PrefillMode(grid=GRID), snapshot_dir=snap, drafts=False)
    text, ids, st = eng.generate_text(messages=msgs, max_tokens=8, sampling=P)
    fresh = Engine(model_path, prefill_mode=PrefillMode(grid=GRID), drafts=False).generate_text(
        messages=msgs, max_tokens=8, sampling=P)
    assert st.cached_tokens == 0
    assert (text, ids) == fresh[:2]
    if how != "key":   # a foreign key is simply not ours: not an error
        assert "ignoring snapshot" in caplog.text


KILL = textwrap.dedent("""
    import os, sys
    import mlx.core as mx
    from tensorfold.cache.disk import DiskStore
    store = DiskStore(sys.argv[1])
    real = os.fsync
    def die(fd):
        os._exit(137)          # killed after the data was written, before the rename
    os.fsync = die
    kv = [(mx.ones((1, 2, 32, 16)), mx.ones((1, 2, 32, 16)))]
    store.save("k" * 32, list(range(32)), kv)
""")


def test_kill_during_write_leaves_nothing_reused(tmp_path):
    snap = tmp_path / "snaps"
    r = subprocess.run([sys.executable, "-c", KILL, str(snap)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 137, r.stderr
    tmps = [f for f in snap.iterdir() if f.name.startswith(".tmp-")]
    assert tmps
    assert DiskStore(snap).entries == [] and all(f.exists() for f in tmps)   # as fresh as a live write
    for f in tmps:
        os.utime(f, (time.time() - 120, time.time() - 120))
    store = DiskStore(snap)
    assert store.entries == []
    assert list(snap.iterdir()) == []


# Qwen3's template raises "No user query found in messages" for system messages alone: the system
# block's length came out 0 and it was never pinned; it is measured with an empty user turn after it
REFUSES_SYSTEM_ALONE = (
    "{%- set ns = namespace(user=false) %}{%- for m in messages %}{%- if m.role == 'user' %}"
    "{%- set ns.user = true %}{%- endif %}{%- endfor %}"
    "{%- if not ns.user %}{{ raise_exception('No user query found in messages.') }}{%- endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")


def _pinned_system_block(model_path, snap):
    """A chat whose system block holds a grid point: (its system message, the disk's one pinned entry)."""
    system = {"role": "system", "content": _words(60, 1)}
    eng = Engine(model_path, prefill_mode=PrefillMode(grid=GRID), snapshot_dir=snap, drafts=False)
    eng.generate_text(messages=[system, {"role": "user", "content": "hello"}], max_tokens=4, sampling=P)
    eng.disk.flush()
    pinned = [e for e in eng.disk.entries if e.pinned]
    assert len(pinned) == 1 and len(pinned[0].tokens) % GRID == 0
    return system, pinned


@pytest.mark.parametrize("template", ["own", "refuses system alone"])
def test_system_block_pinned_and_warmed_at_start(model_path, tmp_path, template):
    if template != "own":
        import shutil
        shutil.copytree(model_path, tmp_path / "m")
        model_path = tmp_path / "m"
        (model_path / "chat_template.jinja").write_text(REFUSES_SYSTEM_ALONE)
    snap = tmp_path / "snaps"
    system, pinned = _pinned_system_block(model_path, snap)
    # a new engine warms the pinned block in the background; another user's chat reuses it
    eng2 = Engine(model_path, prefill_mode=PrefillMode(grid=GRID), snapshot_dir=snap, drafts=False)
    eng2.warm_up_async().join(timeout=60)
    assert eng2.snapshots.holds(eng2.cache_key, pinned[0].tokens)
    msgs = [system, {"role": "user", "content": "something else entirely"}]
    text, ids, st = eng2.generate_text(messages=msgs, max_tokens=6, sampling=P)
    assert st.cached_tokens == len(pinned[0].tokens)
    fresh = Engine(model_path, prefill_mode=PrefillMode(grid=GRID), drafts=False).generate_text(
        messages=msgs, max_tokens=6, sampling=P)
    assert (text, ids) == fresh[:2]


def test_warm_up_is_held_inside_the_memory_budget(model_path, tmp_path):
    """The pinned blocks read at start go into the memory store, under --prompt-cache-gib: they
    were held in a table of their own beside a full store (up to twice the budget), and a full
    store of unpinned entries gives way to them."""
    snap = tmp_path / "snaps"
    _, pinned = _pinned_system_block(model_path, snap)
    size = pinned[0].nbytes
    eng2 = Engine(model_path, prefill_mode=PrefillMode(grid=GRID), snapshot_dir=snap, drafts=False,
                  prompt_cache_gib=1.5 * size / 2**30)
    filler = [(mx.zeros((1, 1, 8, size // 64)), mx.zeros((1, 1, 8, size // 64)))]   # size bytes
    assert eng2.snapshots.add("other", np.arange(8), filler) is not None
    eng2.warm_up_async().join(timeout=60)
    assert eng2.snapshots.holds(eng2.cache_key, pinned[0].tokens)
    assert not eng2.snapshots.holds("other", np.arange(8))
    assert eng2.snapshots.nbytes <= eng2.snapshots.max_bytes


def test_memory_snapshots_hold_what_they_count(model_path):
    """A memory-only snapshot (no snapshot directory) was a lazy slice of its request's KV buffer,
    which it kept alive: the store counted 0.16 MB and held 13 MB (50x a 256 KiB budget). Now it
    is evaluated into its own arrays when saved."""
    import gc
    budget = 256 << 10
    eng = Engine(model_path, prefill_mode=PrefillMode(grid=GRID), drafts=False, prompt_cache_gib=budget / 2**30)

    def active():
        gc.collect()
        mx.synchronize()
        return mx.get_active_memory()
    base = active()
    for i in range(12):
        eng.generate_text(prompt=[3 + i, 7 + i] + list(range(10, 10 + GRID + 4)), max_tokens=200)
    assert 0 < eng.snapshots.nbytes <= budget
    assert active() - base <= eng.snapshots.nbytes + (64 << 10)


def test_memory_store_lru_pinned_last():
    kv = lambda n: [(mx.zeros((1, 1, n, 8)), mx.zeros((1, 1, n, 8)))]
    one = 2 * 16 * 8 * 4
    store = SnapshotStore(max_bytes=3 * one)
    store.add("k", [1] * 16, kv(16), pinned=True)
    store.add("k", [2] * 16, kv(16))
    store.add("k", [3] * 16, kv(16))
    store.add("k", [4] * 16, kv(16))       # over budget: the oldest unpinned goes, not the pinned one
    firsts = sorted(int(e.tokens[0]) for e in store._entries.values())
    assert firsts == [1, 3, 4]
    assert store.lookup("k", np.array([2] * 20), 16, 19)[1] == 0
    assert store.lookup("k", np.array([1] * 20), 16, 19)[1] == 16
    assert store.lookup("other", np.array([1] * 20), 16, 19)[1] == 0


def test_disk_store_bounded_newest_kept(tmp_path, caplog):
    """The budget holds one of these snapshots: the newest is kept. A snapshot larger than the
    whole budget is not written at all (`--snapshot-gib 0` had written every one: the newest was
    always kept, whatever its size)."""
    kv = [(mx.ones((1, 2, 16, 8)), mx.ones((1, 2, 16, 8)))]
    one = DiskStore(tmp_path / "one").save("k" * 32, [1] * 16, kv).stat().st_size
    store = DiskStore(tmp_path / "a", max_bytes=one + 100)
    store.save("k" * 32, [1] * 16, kv)
    store.save("k" * 32, [2] * 16, kv)
    assert len(store.entries) == 1 and int(store.entries[0].tokens[0]) == 2
    assert len(list((tmp_path / "a").glob("*.safetensors"))) == 1
    for budget in (0, 1, one - 1):
        small = DiskStore(tmp_path / f"b{budget}", max_bytes=budget)
        with caplog.at_level(logging.INFO, logger="tensorfold"):
            assert small.save("k" * 32, [1] * 16, kv) is None
            small.save_async("k" * 32, [2] * 16, kv)
            small.flush(timeout=30)
        assert small.entries == [] and list((tmp_path / f"b{budget}").iterdir()) == []
    assert "larger than the disk budget" in caplog.text


def test_disk_writer_queue_is_bounded(tmp_path, caplog):
    """Snapshots waiting for a slow disk are at most MAX_QUEUED (each a whole KV cache in host memory,
    under neither budget: 30 had piled up, 200 MB): the oldest unpinned waiting one is dropped, a
    pinned one (a system block) only where all waiting ones are pinned."""
    import threading
    store = DiskStore(tmp_path)
    kv = [(mx.ones((1, 1, 16, 8)), mx.ones((1, 1, 16, 8)))]
    gate, real = threading.Event(), store._write
    store._write = lambda *a: (gate.wait(30), real(*a))[1]
    store.save_async("k" * 32, [0] * 16, kv)                # taken by the writer, held at the gate
    import time
    t0 = time.monotonic()
    while store._jobs and time.monotonic() - t0 < 10:
        time.sleep(0.01)
    store.save_async("k" * 32, [1] * 16, kv, pinned=True)
    for i in range(2, 12):
        store.save_async("k" * 32, [i] * 16, kv)
        assert len(store._jobs) <= DiskStore.MAX_QUEUED
    gate.set()
    store.flush(timeout=30)
    assert sorted(int(e.tokens[0]) for e in store.entries) == [0, 1, 11]
    assert "snapshot writer is behind" in caplog.text


def test_a_store_keeps_the_file_another_store_pinned(tmp_path):
    """Two servers on one directory: B pins tokens A had saved unpinned (the same file), then A saves
    a longer snapshot of them: A's index still said unpinned and deleted B's system block. A's
    unpinned save of tokens B pinned keeps the pin too."""
    a, b = DiskStore(tmp_path), DiskStore(tmp_path)
    kv16 = [(mx.ones((1, 1, 16, 8)), mx.ones((1, 1, 16, 8)))]
    kv32 = [(mx.ones((1, 1, 32, 8)), mx.ones((1, 1, 32, 8)))]
    toks = list(range(32))
    short = a.save("k" * 32, toks[:16], kv16)
    assert b.save("k" * 32, toks[:16], kv16, pinned=True) == short
    a.candidates("k" * 32)
    a.save("k" * 32, toks, kv32)
    assert short.exists() and [e.pinned for e in DiskStore(tmp_path).entries if len(e.tokens) == 16] == [True]
    a.save("k" * 32, toks[:16], kv16)                      # unpinned, over B's pinned file
    assert [e.pinned for e in DiskStore(tmp_path).entries if len(e.tokens) == 16] == [True]
    # nor evicted first as unpinned, by a store whose index still says unpinned
    d = tmp_path / "evict"
    one = DiskStore(tmp_path / "probe").save("k" * 32, [9] * 16, kv16).stat().st_size
    a, b = DiskStore(d, max_bytes=int(one * 2.5)), DiskStore(d, max_bytes=int(one * 2.5))
    pa = a.save("k" * 32, [1] * 16, kv16)
    b.save("k" * 32, [1] * 16, kv16, pinned=True)
    a.save("k" * 32, [2] * 16, kv16)
    a.save("k" * 32, [3] * 16, kv16)                      # over the budget: [2] goes, not B's pinned [1]
    assert pa.exists() and sorted(int(e.tokens[0]) for e in DiskStore(d, max_bytes=10**9).entries) == [1, 3]


def test_disk_store_remakes_a_removed_directory_and_skips_bad_times(tmp_path, caplog):
    """A snapshot directory removed while the server runs is made again by the next save (every
    save after had failed until a restart); a file whose `created` is not a finite number (nan,
    1e400: an undefined eviction order, or an entry never evicted) is skipped as damaged."""
    import shutil
    d = tmp_path / "snap"
    store = DiskStore(d)
    kv = [(mx.ones((1, 2, 16, 8)), mx.ones((1, 2, 16, 8)))]
    store.save("k" * 32, [1] * 16, kv)
    shutil.rmtree(d)
    f = store.save("k" * 32, [2] * 16, kv)
    assert f.is_file() and [int(e.tokens[0]) for e in DiskStore(d).entries] == [2]
    data = f.read_bytes()
    for bad in ("nan", "1e400", "inf"):
        created = json.loads(data[8:8 + int.from_bytes(data[:8], "little")])["__metadata__"]["created"]
        g = tmp_path / bad / f.name
        g.parent.mkdir()
        g.write_bytes(data.replace(f'"created":"{created}"'.encode(), f'"created":"{bad}"'.ljust(len(created) + 12).encode(), 1))
        assert g.read_bytes() != data and DiskStore(g.parent).entries == []


def test_snapshots_are_written_in_the_background(tmp_path):
    """save_async returns before the file exists; flush waits; the file equals a synchronous save."""
    import threading
    store = DiskStore(tmp_path / "a")
    kv = [(mx.random.normal((1, 2, 32, 16)).astype(mx.bfloat16), mx.random.normal((1, 2, 32, 16)).astype(mx.bfloat16))]
    gate = threading.Event()
    real = store._write
    store._write = lambda *a: (gate.wait(30), real(*a))[1]
    store.save_async("k" * 32, list(range(32)), kv)
    assert store.entries == []                       # not on disk yet: the caller did not wait
    gate.set()
    store.flush()
    assert len(store.entries) == 1
    sync = DiskStore(tmp_path / "b")
    sync.save("k" * 32, list(range(32)), kv)
    from tensorfold.cache.disk import read_tensors
    a, b = read_tensors(store.entries[0]), read_tensors(sync.entries[0])
    assert all(np.array_equal(x[0], y[0]) and np.array_equal(x[1], y[1]) for x, y in zip(a, b))
    # MLX itself reads our files
    loaded = mx.load(str(store.entries[0].path))
    assert mx.array_equal(loaded["k.0"], kv[0][0]).item()


def test_cancel_during_prefill_stops_at_the_next_chunk_and_keeps_its_grid_point(model_path):
    """A client that leaves during a long prompt's prefill: the engine stops before the next grid
    chunk (finish_reason "cancelled", no token), keeps the snapshot of the last grid point it
    reached, and the same request sent again resumes there and gives a fresh engine's reply."""
    import threading
    mode = PrefillMode(grid=GRID)
    msgs = [{"role": "user", "content": _words(120, 5)}]
    eng = Engine(model_path, prefill_mode=mode, drafts=False)
    n = len(eng.prompt_ids(msgs))
    assert n > 4 * GRID
    cancel, seen = threading.Event(), []

    def progress(done, total):
        seen.append(done)
        if done >= 2 * GRID:
            cancel.set()

    events = list(eng.generate(messages=msgs, max_tokens=8, sampling=P, cancel=cancel, progress=progress))
    assert seen == [GRID, 2 * GRID]
    assert [(e.token_ids, e.finish_reason) for e in events] == [([], "cancelled")]
    assert events[0].stats.finish_reason == "cancelled" and events[0].stats.completion_tokens == 0
    text, ids, st = eng.generate_text(messages=msgs, max_tokens=8, sampling=P)
    assert st.cached_tokens == 2 * GRID
    assert (text, ids) == Engine(model_path, prefill_mode=mode, drafts=False).generate_text(
        messages=msgs, max_tokens=8, sampling=P)[:2]



def test_snapshot_header_bit_flips_are_ignored(tmp_path):
    """Every 5th bit of a snapshot's header flipped, one at a time: the store either ignores the
    file or reads back exactly the tensors written (a flip in a field nothing reads). Before, some
    flips raised TypeError / IndexError out of the scan or the read (a server that would not start,
    or a 500 on every request sharing the prefix)."""
    from tensorfold.cache.disk import read_tensors
    good = tmp_path / "good"
    kv = [(mx.array(np.random.default_rng(i).normal(size=(1, 2, 32, 8)).astype(np.float32)),
           mx.array(np.random.default_rng(i + 9).normal(size=(1, 2, 32, 8)).astype(np.float32)))
          for i in range(2)]
    f = DiskStore(good).save("k" * 32, list(range(32)), kv)
    data = f.read_bytes()
    n = int.from_bytes(data[:8], "little")
    want = [np.array(a) for pair in kv for a in pair]
    bad = tmp_path / "bad"
    bad.mkdir()
    g = bad / f.name
    kept = 0
    for bit in range(0, 8 * n, 5):
        flipped = bytearray(data)
        flipped[8 + bit // 8] ^= 1 << (bit % 8)
        g.write_bytes(bytes(flipped))
        store = DiskStore(bad)
        for e in store.entries:
            try:
                got = read_tensors(e)
            except ValueError:
                continue
            assert [a for pair in got for a in pair[:2]] and all(
                np.array_equal(a, b) for a, b in zip([a for pair in got for a in pair[:2]], want))
            kept += 1
    assert 0 < kept < 8 * n // 5


def test_same_shapes_other_weights_do_not_share_snapshots(tmp_path):
    """Two checkpoints of one config whose weights differ only in the middle of a file (a
    fine-tune of one layer): the keys differ, so the second never resumes from the first's
    snapshots. The key used to hash each file's header and first and last 64 KiB only."""
    import shutil
    from tensorfold.cli import embedded_model_path
    a = tmp_path / "a"
    shutil.copytree(embedded_model_path(), a)
    b = tmp_path / "b"
    shutil.copytree(a, b)
    w = b / "model.safetensors"
    data = bytearray(w.read_bytes())
    mid = len(data) // 2
    data[mid: mid + 64] = bytes(x ^ 0x01 for x in data[mid: mid + 64])
    w.write_bytes(bytes(data))
    snap = tmp_path / "snaps"
    mode = PrefillMode(grid=GRID, ops="kernels")
    msgs = [{"role": "user", "content": _words(40, 2)}]
    ea = Engine(a, prefill_mode=mode, snapshot_dir=snap, drafts=False)
    ea.generate_text(messages=msgs, max_tokens=2, sampling=P)
    ea.disk.flush()
    eb = Engine(b, prefill_mode=mode, snapshot_dir=snap, drafts=False)
    assert eb.disk_key != ea.disk_key and None not in (ea.disk_key, eb.disk_key)
    assert eb.generate_text(messages=msgs, max_tokens=2, sampling=P)[2].cached_tokens == 0
    # the same weights again: the hash comes from the memo, and the snapshot is found
    again = Engine(a, prefill_mode=mode, snapshot_dir=snap, drafts=False)
    assert again.disk_key == ea.disk_key
    assert again.generate_text(messages=msgs, max_tokens=2, sampling=P)[2].cached_tokens > 0


def _hash_in_background_held(tmp_path, monkeypatch):
    """Engines made now hash their weights on a thread (no memo, no size threshold) that waits for
    the returned event before it hashes."""
    import threading

    import tensorfold.cache.key as key
    monkeypatch.setenv("TENSORFOLD_CACHE_DIR", str(tmp_path / "fresh-memo"))     # nothing known
    monkeypatch.setattr(Engine, "DISK_KEY_SYNC_BYTES", 0)
    gate, real = threading.Event(), key.file_hashes

    def held(files):
        gate.wait(30)
        return real(files)
    monkeypatch.setattr(key, "file_hashes", held)
    return gate


def test_large_weights_are_hashed_in_the_background(model_path, tmp_path, monkeypatch):
    """Weights the memo does not know past DISK_KEY_SYNC_BYTES are hashed on a thread: the engine
    serves at once (memory snapshots only), and uses the disk from when the key is known."""
    snap = tmp_path / "snaps"
    msgs = _prime(model_path, snap)
    gate = _hash_in_background_held(tmp_path, monkeypatch)
    eng = Engine(model_path, prefill_mode=PrefillMode(grid=GRID), snapshot_dir=snap, drafts=False)
    assert eng.disk_key is None
    first = eng.generate_text(messages=msgs, max_tokens=4, sampling=P)
    assert first[2].cached_tokens == 0                   # the disk is not used before the key
    gate.set()
    assert eng.wait_disk_key(30)
    eng.snapshots = type(eng.snapshots)(eng.snapshots.max_bytes)       # forget memory snapshots
    again = eng.generate_text(messages=msgs, max_tokens=4, sampling=P)
    assert again[2].cached_tokens > 0 and again[:2] == first[:2]


def test_weights_replaced_while_hashed_keep_the_disk_off(model_path, tmp_path, monkeypatch, caplog):
    """Weights replaced in place (same shapes, other bytes) after they were loaded, while the
    background hash runs: the key came out as the new file's, and the old weights' KV was saved
    under it, for an engine on the new weights to resume (logits up to 12.5 off fresh). Now the
    stamps at hashing are checked against those at load: the disk stays off, with a warning."""
    import logging
    import shutil
    d = tmp_path / "m"
    shutil.copytree(model_path, d)
    gate = _hash_in_background_held(tmp_path, monkeypatch)
    with caplog.at_level(logging.WARNING, logger="tensorfold"):
        eng = Engine(d, prefill_mode=PrefillMode(grid=GRID), snapshot_dir=tmp_path / "snaps", drafts=False)
        w = dict(mx.load(str(d / "model.safetensors")))
        name = next(k for k in w if k.endswith("norm.weight"))
        w[name] = w[name] * 2
        mx.save_safetensors(str(d / "new.safetensors"), w, metadata={"format": "mlx"})
        os.replace(d / "new.safetensors", d / "model.safetensors")
        gate.set()
        assert not eng.wait_disk_key(30)
    assert "changed since they were loaded" in caplog.text


def test_disk_store_failures_lose_nothing_saved(tmp_path, monkeypatch, caplog):
    """A store opened on the same directory leaves a temporary file that a live writer holds alone
    (it used to delete the first server's write under way), and removes one nobody holds, whatever
    pid its name carries (a restarted container's server has its predecessor's pid); a failed write
    leaves no partial file; the background writer survives any error and writes the next one."""
    import fcntl
    import os
    from tensorfold.cache import disk as disk_mod
    d = tmp_path / "snaps"
    d.mkdir()
    live = d / f".tmp-{os.getpid()}-1-x.safetensors"
    orphan = d / f".tmp-{os.getpid()}-2-y.safetensors"
    live.write_bytes(b"in progress")
    orphan.write_bytes(b"left by a killed writer with this pid")
    old = time.time() - 2 * disk_mod.ABANDONED_AFTER
    for f in (live, orphan):
        os.utime(f, (old, old))
    with open(live, "rb") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)       # as the writer holds it
        store = DiskStore(d)
        assert live.exists() and not orphan.exists()
    assert DiskStore(d).entries == [] and not live.exists()      # released: abandoned
    # a file just made, its writer's lock not yet taken (the window between open and flock): kept
    young = d / ".tmp-1-1-z.safetensors"
    young.write_bytes(b"just opened")
    assert DiskStore(d).entries == [] and young.exists()
    young.unlink()
    # a FIFO named as a snapshot: never opened (the open blocked the engine for ever)
    os.mkfifo(d / "x.safetensors")
    os.mkfifo(d / ".tmp-9-9-x.safetensors")
    assert DiskStore(d).entries == []
    (d / "x.safetensors").unlink()
    (d / ".tmp-9-9-x.safetensors").unlink()
    kv = [(mx.ones((1, 1, 16, 8)), mx.ones((1, 1, 16, 8)))]

    def full(_fd):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(disk_mod.os, "fsync", full)
    with pytest.raises(OSError):
        store.save("k" * 32, list(range(16)), kv)
    assert list(d.iterdir()) == []
    monkeypatch.undo()
    real, calls = DiskStore._write, []

    def once(self, *a):
        calls.append(1)
        if len(calls) == 1:
            raise ValueError("a file changed under the writer")
        return real(self, *a)
    monkeypatch.setattr(DiskStore, "_write", once)
    store.save_async("k" * 32, list(range(16)), kv)
    store.save_async("k" * 32, list(range(32)), [(mx.ones((1, 1, 32, 8)), mx.ones((1, 1, 32, 8)))])
    store.flush(timeout=30)
    assert len(calls) == 2 and [len(e.tokens) for e in store.entries] == [32]
    assert "could not write a snapshot" in caplog.text


def test_unusable_snapshot_dir_and_tiny_memory_budget(model_path, tmp_path, caplog):
    """A snapshot directory that cannot be made: the engine serves with memory snapshots and one
    warning (it refused to start). A memory budget smaller than one snapshot: a request still
    resumes from the disk snapshot (it used to read and drop it, and lose the memory hit too), and
    the warm-up keeps nothing past the budget."""
    f = tmp_path / "a-file"
    f.write_text("x")
    eng = Engine(model_path, prefill_mode=PrefillMode(grid=GRID), snapshot_dir=f / "snaps", drafts=False)
    assert eng.disk is None and "unusable" in caplog.text
    assert eng.generate_text(messages=[{"role": "user", "content": "hi"}], max_tokens=2, sampling=P)[1]
    snap = tmp_path / "snaps"
    system = {"role": "system", "content": _words(60, 1)}
    msgs = [system, {"role": "user", "content": _words(40, 3)}]
    _prime(model_path, snap, msgs=msgs)
    tiny = Engine(model_path, prefill_mode=PrefillMode(grid=GRID), snapshot_dir=snap, drafts=False,
                  prompt_cache_gib=1e-9)
    tiny.warm_up_async().join(timeout=60)
    assert len(tiny.snapshots) == 0
    text, ids, st = tiny.generate_text(messages=msgs, max_tokens=6, sampling=P)
    assert st.cached_tokens > 0 and len(tiny.snapshots) == 0
    fresh = Engine(model_path, prefill_mode=PrefillMode(grid=GRID), drafts=False).generate_text(
        messages=msgs, max_tokens=6, sampling=P)
    assert (text, ids) == fresh[:2]


@pytest.mark.parametrize("cut", ["grid-prefix", "mid-entry"])
def test_prompts_that_end_on_or_split_a_stored_entry(model_path, cut):
    """A prompt that is exactly a stored grid-length prefix (it must resume one grid point lower:
    its last token runs as the row-exact step), and one that leaves a stored entry partway through
    a grid cell (it resumes at the last whole grid point inside the shared part): both equal a
    fresh engine, and what they resume from is a grid point."""
    mode = PrefillMode(grid=GRID)
    rng = np.random.default_rng(23)
    eng = Engine(model_path, prefill_mode=mode, drafts=False)
    vocab = eng.model.cfg.vocab_size
    first = rng.integers(3, vocab, size=5 * GRID + 3).tolist()
    eng.generate_text(prompt=first, max_tokens=2, sampling=P)          # stores 5 grid cells
    if cut == "grid-prefix":
        prompt, want_cached = first[:3 * GRID], 2 * GRID
    else:
        prompt = first[:3 * GRID + 5] + rng.integers(3, vocab, size=GRID).tolist()
        want_cached = 3 * GRID
    text, ids, st = eng.generate_text(prompt=prompt, max_tokens=8, sampling=P)
    assert st.cached_tokens == want_cached and st.cached_tokens % GRID == 0
    fresh = Engine(model_path, prefill_mode=mode, drafts=False).generate_text(prompt=prompt, max_tokens=8,
                                                                               sampling=P)
    assert (text, ids) == fresh[:2]


def test_resumed_prompts_are_chunked_on_the_fresh_grid(model_path):
    """On the CPU a prompt's prefill bits do not depend on its chunking, so resumed == fresh
    cannot see a broken grid there. This records the chunks the model is given: a resumed turn's
    chunks must be exactly the fresh run's chunks past its restored grid point, and each chunk
    must start on the grid (so on a backend whose bits depend on the call shape, the two runs
    compute the same KV)."""
    mode = PrefillMode(grid=GRID)
    turns = _conversation(75, seed=75)

    def chunks_of(eng):
        seen = []
        forward = eng.model.forward

        def spy(x, cache, *a, logits=True, **kw):
            if logits is False:
                seen.append((cache.offset, cache.offset + x.shape[1]))
            return forward(x, cache, *a, logits=logits, **kw)
        eng.model.forward = spy
        return seen
    one = Engine(model_path, prefill_mode=mode, drafts=False)
    resumed_chunks = chunks_of(one)
    msgs = []
    for i, t in enumerate(turns):
        msgs = msgs + t
        del resumed_chunks[:]
        text, _, st = one.generate_text(messages=msgs, max_tokens=12, sampling=P)
        fresh = Engine(model_path, prefill_mode=mode, drafts=False)
        fresh_chunks = chunks_of(fresh)
        assert fresh.generate_text(messages=msgs, max_tokens=12, sampling=P)[0] == text
        n = len(one.prompt_ids(msgs))
        assert fresh_chunks == [(s, min(s + GRID, n - 1)) for s in range(0, n - 1, GRID)]
        assert resumed_chunks == [c for c in fresh_chunks if c[0] >= st.cached_tokens], i
        assert st.cached_tokens % GRID == 0 and (i == 0) == (st.cached_tokens == 0)
        msgs = msgs + [{"role": "assistant", "content": text}]


def test_disk_stores_sharing_a_directory_see_each_others_snapshots(model_path, tmp_path):
    """A server sharing its snapshot directory read it once, at start: a snapshot another server
    wrote afterwards was never resumed from (and was written again). The store now takes in
    what changed in the directory when it is asked (one stat when nothing did), and forgets
    files another store removed."""
    a, b = DiskStore(tmp_path / "shared"), DiskStore(tmp_path / "shared")
    kv = [(mx.ones((1, 1, 16, 8)), mx.ones((1, 1, 16, 8)))]
    pa = a.save("k", list(range(16)), kv)
    assert [e.path for e in b.candidates("k")] == [pa]
    pb = b.save("k", list(range(32, 48)), kv)
    assert sorted(e.path for e in a.candidates("k")) == sorted([pa, pb])
    pa.unlink()
    assert [e.path for e in b.candidates("k")] == [pb]
    # two engines on one directory: the second resumes from the first's turn
    mode = PrefillMode(grid=GRID)
    e1 = Engine(model_path, prefill_mode=mode, snapshot_dir=tmp_path / "snaps", drafts=False)
    e2 = Engine(model_path, prefill_mode=mode, snapshot_dir=tmp_path / "snaps", drafts=False)
    msgs = _conversation(40, seed=4)[0]
    text, _, _ = e1.generate_text(messages=msgs, max_tokens=8, sampling=P)
    e1.disk.flush()
    text2, _, st = e2.generate_text(messages=msgs, max_tokens=8, sampling=P)
    assert text2 == text and st.cached_tokens > 0
