"""Reference models over jaxkv caches, and loading of HF-format checkpoints.

Example:
    >>> from jaxkv.models import from_pretrained              # doctest: +SKIP
    >>> loaded = from_pretrained("/path/to/checkpoint")       # doctest: +SKIP
    >>> cache = loaded.model.init_cache(batch_size=1, max_length=128)  # doctest: +SKIP
    >>> logits, cache = loaded.model(tokens, cache)           # doctest: +SKIP
"""

from jaxkv.models.layer_types import FULL, SLIDING, layer_types_from_config

_LAZY = {
    "ARCHITECTURES": "jaxkv.models.llama",
    "Llama": "jaxkv.models.llama",
    "LlamaConfig": "jaxkv.models.llama",
    "CheckpointError": "jaxkv.models.loading",
    "Pretrained": "jaxkv.models.loading",
    "from_pretrained": "jaxkv.models.loading",
}


def __getattr__(name):
    # The models need flax; the layer-type rule does not (the core's HybridCache uses it),
    # so flax is imported only when a model name is first used.
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'jaxkv.models' has no attribute {name!r}")


__all__ = [
    "ARCHITECTURES", "CheckpointError", "FULL", "Llama", "LlamaConfig", "Pretrained", "SLIDING", "from_pretrained",
    "layer_types_from_config",
]
