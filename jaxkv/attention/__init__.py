"""Attention over jaxkv caches.

* :mod:`~jaxkv.attention.dense`: :func:`attend` / :func:`attention_mask`, the math on
  plain arrays, every slot read (the reference, and the path for small dense views).
* :mod:`~jaxkv.attention.blockwise`: :func:`blockwise_attend`, the same function reading
  only the filled blocks of a stacked buffer (XLA loop, or the native CPU kernel), and
  :func:`quantized_blockwise_attend`, dequantizing block by block.
* :mod:`~jaxkv.attention.dispatch`: :func:`cache_attention` (write one layer of any cache,
  then attend) and :func:`attend_view`, which picks the path from the layer's view.
* :mod:`~jaxkv.attention.pallas_gpu`: :func:`pallas_attend_view`, Pallas (Triton) split-K
  decode kernels over contiguous and quantized views, which :func:`attend_view` takes on a GPU.
"""

from jaxkv.attention.blockwise import blockwise_attend, paged_blockwise_attend, quantized_blockwise_attend
from jaxkv.attention.dense import attend, attention_mask
from jaxkv.attention.dispatch import attend_view, cache_attention, token_positions, update_and_attend
from jaxkv.attention.pallas_gpu import pallas_attend_view

__all__ = [
    "attend",
    "attend_view",
    "attention_mask",
    "blockwise_attend",
    "cache_attention",
    "paged_blockwise_attend",
    "pallas_attend_view",
    "quantized_blockwise_attend",
    "token_positions",
    "update_and_attend",
]
