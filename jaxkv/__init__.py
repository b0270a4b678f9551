"""jaxkv: immutable key/value caches for autoregressive decoding in JAX.

Shape alphabet used throughout: L layers, B batch rows, H kv heads, T new tokens,
S cached tokens or capacity, D head dim.

The core (``jaxkv.caches``, ``jaxkv.attention``, ``jaxkv.attention.blockwise``, ``jaxkv.sampling``) depends on
jax only.
Generation and models need flax (``pip install jaxkv[models]``); they are imported lazily
so that ``import jaxkv`` works with jax alone.
"""

from jaxkv.attention import update_and_attend
from jaxkv.caches import (
    INVALID,
    NO_POSITION,
    OUT_OF_PAGES,
    OVERFLOW,
    CacheError,
    CrossAttentionCache,
    DynamicCache,
    EncoderDecoderCache,
    HybridCache,
    KVCache,
    PagedCache,
    LayerView,
    QuantizedCache,
    SlidingWindowCache,
    StaticCache,
    dequantize,
    quantize,
)
from jaxkv.models.layer_types import layer_types_from_config
from jaxkv.offload import OffloadedCache
from jaxkv.persist import CacheFileError, load_cache, load_sequence, model_fingerprint, save_cache, save_sequence
from jaxkv.sampling import SamplingConfig

__all__ = [
    "INVALID",
    "NO_POSITION",
    "OUT_OF_PAGES",
    "OVERFLOW",
    "CacheError",
    "CacheFileError",
    "CrossAttentionCache",
    "DynamicCache",
    "EncoderDecoderCache",
    "GenerateOutput",
    "HybridCache",
    "KVCache",
    "PagedCache",
    "LayerView",
    "OffloadedCache",
    "QuantizedCache",
    "SamplingConfig",
    "SlidingWindowCache",
    "StaticCache",
    "dequantize",
    "generate",
    "layer_types_from_config",
    "load_cache",
    "load_sequence",
    "model_fingerprint",
    "quantize",
    "save_cache",
    "save_sequence",
    "stream",
    "update_and_attend",
]

__version__ = "0.1.0"

if __import__("sys").modules.get("flax") is not None:  # flax already loaded: let flax.serialization save caches
    from jaxkv.serialization import register_flax_serialization

    register_flax_serialization()

_LAZY = {"generate": "generate", "stream": "stream", "GenerateOutput": "GenerateOutput"}


def __getattr__(name):
    # flax is imported only when generation is first used: the core stays jax-only.
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module("jaxkv.generation"), _LAZY[name])
        globals()[name] = value
        return value
    raise AttributeError(f"module 'jaxkv' has no attribute {name!r}")
