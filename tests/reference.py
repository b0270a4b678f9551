"""A plain NumPy model of the cache semantics, independent of jaxkv's implementation.

The model stores, per layer and per batch row, a Python list of tokens; each token is a
``(key [H, D], value [H, D])`` pair. Operations are written the obvious way (list append,
slicing, list comprehension) so that they can serve as the reference for both caches.
"""

from __future__ import annotations

import copy

import numpy as np


def crop_target(m: int, n: int) -> int:
    """The length a row of ``n`` tokens keeps after ``crop(m)``: > 0 keep at most ``m``,
    < 0 drop ``-m`` off the end, 0 drop nothing (transformers' rule)."""
    m = int(m)
    return min(n, m) if m > 0 else (max(n + m, 0) if m < 0 else n)


class ReferenceCache:
    def __init__(self, num_layers: int, batch: int):
        self.rows = [[[] for _ in range(batch)] for _ in range(num_layers)]

    @property
    def batch(self) -> int:
        return len(self.rows[0])

    def length(self, layer: int, row: int) -> int:
        return len(self.rows[layer][row])

    def update(self, layer: int, keys: np.ndarray, values: np.ndarray, num_new=None) -> None:
        """keys/values [B, H, T, D]; row b appends its first num_new[b] tokens."""
        batch, _, new_tokens, _ = keys.shape
        for b in range(batch):
            n = new_tokens if num_new is None else int(num_new[b])
            for t in range(n):
                self.rows[layer][b].append((keys[b, :, t, :].copy(), values[b, :, t, :].copy()))

    def crop(self, max_length) -> None:
        """> 0: keep at most that many; < 0: drop that many off each layer's own length; 0: nothing."""
        m = np.broadcast_to(np.asarray(max_length, dtype=object), (self.batch,))
        for b in range(self.batch):
            for layer in self.rows:
                del layer[b][crop_target(m[b], len(layer[b])):]

    def select(self, indices) -> None:
        self.rows = [[copy.deepcopy(layer[i]) for i in indices] for layer in self.rows]

    def repeat(self, r: int) -> None:
        self.rows = [[copy.deepcopy(row) for row in layer for _ in range(r)] for layer in self.rows]

    def reset(self) -> None:
        self.rows = [[[] for _ in layer] for layer in self.rows]

    def layer_arrays(self, layer: int, row: int, heads: int, head_dim: int):
        tokens = self.rows[layer][row]
        if not tokens:
            empty = np.zeros((heads, 0, head_dim), np.float32)
            return empty, empty
        keys = np.stack([k for k, _ in tokens], axis=1)
        values = np.stack([v for _, v in tokens], axis=1)
        return keys, values


# ------------------------------------------------------------ attention over a cache buffer


def numpy_attention(q, k, v, q_pos, kv_len, window=None, softcap=None):
    """Loop-per-query softmax over exactly the visible slots (float64)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    batch, hq, tokens, dim = q.shape
    groups = hq // k.shape[1]
    out = np.zeros_like(q)
    for b in range(batch):
        for h in range(hq):
            for t in range(tokens):
                p = q_pos[b, t]
                slots = [s for s in range(kv_len[b]) if s <= p and (window is None or p - s < window)]
                if not slots:
                    continue
                logits = np.array([q[b, h, t] @ k[b, h // groups, s] for s in slots]) / np.sqrt(dim)
                if softcap is not None:
                    logits = softcap * np.tanh(logits / softcap)
                w = np.exp(logits - logits.max())
                w /= w.sum()
                out[b, h, t] = sum(wi * v[b, h // groups, s] for wi, s in zip(w, slots))
    return out


def make_inputs(seed, batch, hq, h, tokens, slots, dim, kv_len, nan_fill=True):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, hq, tokens, dim)).astype(np.float32)
    k = rng.standard_normal((batch, h, slots, dim)).astype(np.float32)
    v = rng.standard_normal((batch, h, slots, dim)).astype(np.float32) + 3.0
    if nan_fill:
        for b in range(batch):
            k[b, :, kv_len[b]:] = np.nan
            v[b, :, kv_len[b]:] = np.nan
    return q, k, v
