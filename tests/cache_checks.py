"""Helpers shared by the cache tests: compare a cache with the NumPy reference."""

import numpy as np

from jaxkv import DynamicCache, StaticCache


def assert_matches_reference(cache, ref, *, heads: int, head_dim: int) -> None:
    for layer in range(len(ref.rows)):
        for row in range(ref.batch):
            ref_k, ref_v = ref.layer_arrays(layer, row, heads, head_dim)
            n = ref_k.shape[1]
            if isinstance(cache, StaticCache):
                assert int(cache.seq_lengths(layer)[row]) == n, (layer, row)
                got_k = np.asarray(cache.keys[layer, row, :, :n])
                got_v = np.asarray(cache.values[layer, row, :, :n])
            else:
                assert isinstance(cache, DynamicCache)
                assert cache.get_seq_length(layer) == n, (layer, row)
                if n == 0:
                    continue
                got_k = np.asarray(cache.layers[layer][0][row])
                got_v = np.asarray(cache.layers[layer][1][row])
            np.testing.assert_array_equal(got_k, ref_k)
            np.testing.assert_array_equal(got_v, ref_v)
