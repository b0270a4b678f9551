"""Reference models over jaxkv caches, and loading of HF-format checkpoints.

Example:
    >>> from jaxkv.models import from_pretrained              # doctest: +SKIP
    >>> loaded = from_pretrained("/path/to/checkpoint")       # doctest: +SKIP
    >>> cache = loaded.model.init_cache(batch_size=1, max_length=128)  # doctest: +SKIP
    >>> logits, cache = loaded.model(tokens, cache)           # doctest: +SKIP
"""

from jaxkv.models.llama import ARCHITECTURES, Llama, LlamaConfig
from jaxkv.models.loading import CheckpointError, Pretrained, from_pretrained

__all__ = ["ARCHITECTURES", "CheckpointError", "Llama", "LlamaConfig", "Pretrained", "from_pretrained"]
