"""The per-sequence KV cache: fixed-step growth, and nothing depends on its capacity.

Keys/values for positions [0, offset) are valid. Both forward paths read only valid positions
(prefill slices to offset + L, the row-exact attention takes offset as an input), so a cache
grown in another pattern, or trimmed after rejected drafts, gives the same bits."""

from __future__ import annotations

import mlx.core as mx

STEP = 256


class KVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype, step: int = STEP,
                 value_dim: int | None = None):
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        # value_dim: a family whose per-layer second array is not head_dim wide (deepseek_v32
        # keeps the MLA latent + rotary key as "keys" and the indexer's keys as "values")
        self.value_dim = head_dim if value_dim is None else value_dim
        self.dtype, self.step = dtype, step
        self.keys: list[mx.array | None] = [None] * num_layers
        self.values: list[mx.array | None] = [None] * num_layers
        self.offset = 0
        self.capacity = 0
        self._step_off: tuple[int, mx.array] | None = None
        self.fences: list[mx.array] | None = None     # DenseModel.inplace_kv (StepCache.in_place)

    def step_offset(self) -> mx.array:
        """The offset as the first element of an int32 [4] array for the compiled exact step:
        the array the last step returned (offset + L, computed on the device) while it still
        matches, else a fresh one. On CUDA that keeps it out of MLX's managed memory (where
        arrays made from host data and all arrays of <= 8 bytes live, and every kernel's read of
        them costs microseconds: kernels._cuda.device_array)."""
        if self._step_off is None or self._step_off[0] != self.offset:
            self._step_off = (self.offset, mx.array([self.offset, 0, 0, 0], dtype=mx.int32) + 0)
        return self._step_off[1]

    def set_step_offset(self, arr: mx.array) -> None:
        self._step_off = (self.offset, arr)

    def _settle(self) -> None:
        """Rows written in place by compiled steps (DenseModel.inplace_kv) are invisible to MLX's
        CUDA graphs, so before an eager op reads or rewrites the buffers, the steps queued so
        far are evaluated (their fences are the last thing each layer's step produces)."""
        if self.fences is not None:
            mx.eval(self.fences)

    def reserve(self, n: int) -> None:
        """Make room for positions [0, n). A cache that already holds rows grows by at least an
        eighth of its capacity: each growth copies every cached row and gives the compiled
        exact step a new shape to trace (DenseModel._exact_compiled), so a long reply pays
        O(log n) growths, not one per STEP rows."""
        if n <= self.capacity:
            return
        self._settle()
        if self.offset:
            n = max(n, self.capacity + self.capacity // 8)
        cap = -(-n // self.step) * self.step
        shape = (1, self.num_kv_heads, cap, self.head_dim)
        vshape = (1, self.num_kv_heads, cap, self.value_dim)
        for i in range(self.num_layers):
            k, v = mx.zeros(shape, self.dtype), mx.zeros(vshape, self.dtype)
            copy = self.keys[i] is not None and self.offset
            if copy:
                k[..., : self.offset, :] = self.keys[i][..., : self.offset, :]
                v[..., : self.offset, :] = self.values[i][..., : self.offset, :]
            self.keys[i], self.values[i] = k, v
            if copy:
                # one layer at a time: queued lazily, every layer's old and new buffers would be
                # alive at once until the device finished the batch (on the H200, MLX's CUDA
                # graphs hold up to 1 GB of inputs each), a transient of up to the whole KV
                mx.eval(k, v)
        self.capacity = cap

    def in_place(self, layer: int):
        """None: the eager path writes rows with slice updates (StepCache.in_place)."""
        return None

    def write(self, layer: int, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        """Store rows at [offset, offset + L) for one layer; returns the full buffers."""
        if layer == 0:
            self._settle()
        L = k.shape[2]
        self.keys[layer][..., self.offset: self.offset + L, :] = k
        self.values[layer][..., self.offset: self.offset + L, :] = v
        return self.keys[layer], self.values[layer]

    def arrays(self) -> list[mx.array]:
        return [a for a in self.keys + self.values if a is not None]

    def trim(self, n: int) -> None:
        """Forget positions >= n (rejected drafts). Stale rows are never read again."""
        if n > self.offset:
            raise ValueError("cannot trim forward")
        self.offset = n

    def snapshot(self, n: int) -> list[tuple[mx.array, mx.array]]:
        """Copies of the first n positions of every layer (a prompt-cache snapshot)."""
        if n > self.offset:
            raise ValueError("snapshot beyond offset")
        self._settle()
        return [(mx.array(self.keys[i][..., :n, :]), mx.array(self.values[i][..., :n, :]))
                for i in range(self.num_layers)]

    def restore(self, snap: list[tuple[mx.array, mx.array]], n: int, capacity: int = 0) -> None:
        """The first n positions from a snapshot, in buffers with room for max(n, capacity)."""
        self.offset = 0
        self.capacity = 0
        self.keys = [None] * self.num_layers
        self.values = [None] * self.num_layers
        self.reserve(max(n, capacity))
        for i, (k, v) in enumerate(snap):
            self.keys[i][..., :n, :] = k
            self.values[i][..., :n, :] = v
        self.offset = n
