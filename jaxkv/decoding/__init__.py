"""Decoding algorithms built on the cache operations.

* :func:`sample_n`: ``num_return_sequences`` samples per prompt from one prefill
  (``batch_repeat_interleave``).
* :func:`beam_search`: HF-compatible beam search in one ``while_loop`` (``reorder_cache``).
* :func:`speculative_generate`: draft-and-verify decoding with per-row rollback
  (``crop(int32[B])``).
* :class:`ServingLoop`: continuous batching over fixed slots (``reset(rows=...)``,
  ``num_new`` masking).
* :func:`chunked_prefill`: long prompts in fixed-size chunks, one program per chunk size.

Shape letters: B batch, P prompt length, N new tokens, V vocabulary, K beams,
S slots, C chunk size.
"""

from jaxkv.decoding.beam import BeamSearchOutput, beam_search
from jaxkv.decoding.chunked import chunked_prefill, prefill_chunk
from jaxkv.decoding.parallel import sample_keys, sample_n
from jaxkv.decoding.serving import Completion, Request, ServingLoop
from jaxkv.decoding.speculative import SpeculativeOutput, speculative_generate

__all__ = [
    "BeamSearchOutput",
    "Completion",
    "Request",
    "ServingLoop",
    "SpeculativeOutput",
    "beam_search",
    "chunked_prefill",
    "prefill_chunk",
    "sample_keys",
    "sample_n",
    "speculative_generate",
]
