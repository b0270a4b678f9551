"""jaxkv: immutable key/value caches for autoregressive decoding in JAX.

Shape alphabet used throughout: L layers, B batch rows, H kv heads, T new tokens,
S cached tokens or capacity, D head dim.
"""

from jaxkv.cache import INVALID, OVERFLOW, CacheError, DynamicCache, StaticCache

__all__ = [
    "CacheError",
    "DynamicCache",
    "INVALID",
    "OVERFLOW",
    "StaticCache",
]

__version__ = "0.1.0"
