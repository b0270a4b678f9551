"""Attention over jaxkv caches.

* :mod:`~jaxkv.attention.dense`: :func:`attend` / :func:`attention_mask`, the math on
  plain arrays, every slot read (the reference, and the path for small dense views).
* :mod:`~jaxkv.attention.blockwise`: :func:`blockwise_attend`, the same function reading
  only the filled blocks of a stacked buffer (XLA loop, or the native CPU kernel), and
  :func:`quantized_blockwise_attend`, dequantizing block by block.
* :mod:`~jaxkv.attention.dispatch`: :func:`cache_attention` (write one layer of any cache,
  then attend) and :func:`attend_view`, which picks the path from the layer's view.
"""

from jaxkv.attention.blockwise import blockwise_attend, quantized_blockwise_attend
from jaxkv.attention.dense import attend, attention_mask
from jaxkv.attention.dispatch import attend_view, cache_attention, token_positions, update_and_attend

__all__ = [
    "attend",
    "attend_view",
    "attention_mask",
    "blockwise_attend",
    "cache_attention",
    "quantized_blockwise_attend",
    "token_positions",
    "update_and_attend",
]
