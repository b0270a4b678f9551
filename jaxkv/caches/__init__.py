"""The cache kinds: one container, one storage type per memory layout.

* :mod:`~jaxkv.caches.container`: :class:`KVCache`, the container every kind is: lengths,
  flags, overflow policy, row operations, ``check``, positions, sharding.
* storages, one per layout, each with the kind that uses it alone:
  :mod:`~jaxkv.caches.contiguous` (``StaticCache``), :mod:`~jaxkv.caches.ring`
  (``SlidingWindowCache``), :mod:`~jaxkv.caches.quantized` (``QuantizedCache``),
  :mod:`~jaxkv.caches.paged` (``PagedCache``: a page pool with block tables);
  :mod:`~jaxkv.caches.hybrid` (``HybridCache``) puts a contiguous and a ring storage in
  one container.
* :mod:`~jaxkv.caches.views`: what a storage hands to attention for one layer.
* :mod:`~jaxkv.caches.dynamic`: ``DynamicCache``, the reference semantics (growing arrays).
* :mod:`~jaxkv.caches.encdec`: ``EncoderDecoderCache``, any of the above plus encoder states.
"""

from jaxkv.caches._checks import INVALID, OUT_OF_PAGES, OVERFLOW, CacheError
from jaxkv.caches.container import KVCache, check_cache
from jaxkv.caches.contiguous import ContiguousStorage, StaticCache
from jaxkv.caches.dynamic import DynamicCache
from jaxkv.caches.encdec import CrossAttentionCache, EncoderDecoderCache
from jaxkv.caches.hybrid import FULL, SLIDING, HybridCache
from jaxkv.caches.paged import NO_PAGE, PagedCache, PagedStorage
from jaxkv.caches.quantized import QuantizedCache, QuantizedStorage, dequantize, quantize
from jaxkv.caches.ring import RingStorage, SlidingWindowCache
from jaxkv.caches.views import NO_POSITION, ContiguousView, LayerView, PagedView, QuantizedView

__all__ = [
    "FULL",
    "INVALID",
    "NO_PAGE",
    "NO_POSITION",
    "OUT_OF_PAGES",
    "OVERFLOW",
    "SLIDING",
    "CacheError",
    "ContiguousStorage",
    "ContiguousView",
    "CrossAttentionCache",
    "DynamicCache",
    "EncoderDecoderCache",
    "HybridCache",
    "KVCache",
    "LayerView",
    "PagedCache",
    "PagedStorage",
    "PagedView",
    "QuantizedCache",
    "QuantizedStorage",
    "QuantizedView",
    "RingStorage",
    "SlidingWindowCache",
    "StaticCache",
    "check_cache",
    "dequantize",
    "quantize",
]
