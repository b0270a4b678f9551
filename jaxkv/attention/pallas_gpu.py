"""Decode attention on GPU: Pallas (Triton) split-K kernels over the cache protocol's views.

The blockwise XLA loop (:mod:`jaxkv.attention.blockwise`) is a ``while`` loop whose body is a
few XLA kernels per block of slots: on a GPU that is kernel launches per block, and it read
the cache at 2-8% of HBM bandwidth on an H200 (issue 14). The kernels here read the same
slots in one launch, as flash decoding does:

* **Grid** ``(B, H, NS)``: one program per batch row, kv head and split. Row ``b`` visits
  only its range ``[lo_b, hi_b)``: ``hi_b = min(lengths[b], last query position + 1)`` and,
  with a window ``W``, ``lo_b`` = the first position its earliest query still sees, rounded
  down to a block. That range (not the capacity) is cut into ``NS`` equal, block-aligned
  chunks, so the work and the parallelism follow the tokens stored: a row at fill 1K in a
  64K buffer reads 1K slots, spread over all ``NS`` programs.
* **GQA**: the ``G`` query heads of a kv head and the ``T <= 16`` queries of the row are the
  ``G * T`` rows of one ``[M, D]`` query tile (padded to a power of two, at least 16, for
  Triton's dot); each key/value block ``[BK, D]`` is loaded once for all of them and enters
  two matrix products (``q k^T`` and ``p v``) with float32 accumulation.
* **In place**: the kernels take the whole stacked ``[L, B, H, S, D]`` buffers (as stored:
  16-bit floats as uint16 bits, bitcast in the kernel) and the layer index as an operand
  (a traced int is fine): no layer is sliced or copied out first.
* **Whole blocks**: the blocks every query of the row sees whole (at decode all but the
  last; with a window, not the first) run in a loop of their own, without the visibility
  mask and the non-finite bookkeeping (``full_blocks``); the blocks at the edges are masked.
* **Split merge**: each program writes its partial ``(acc [M, D], m [M], l [M])`` (unnormalised
  weighted values, running max, running sum of ``exp(logit - m)``); a small XLA step merges
  the splits by log-sum-exp: ``out = sum_j e^(m_j - m) acc_j / sum_j e^(m_j - m) l_j``.
* **Quantized** (:class:`~jaxkv.caches.QuantizedView`): the kernel reads int8 codes (or
  uint8 bytes holding two int4) and the per-token scales, and dequantizes in registers: the
  scale of a key is applied to its logit (``(q . codes) * s_k``) and the scale of a value to
  its weight (``(p * s_v) . codes``), so codes enter the products as exact small integers.
  int4 keeps its packing: the even and odd head-dim elements are two half-width products
  (queries are split the same way outside the kernel), so nothing is interleaved in the
  kernel. Slots whose position a used residual slot holds are skipped in the kernel; the
  residual's exact tokens (``R`` slots) are attended densely in XLA and merged as one more
  split, so every position is counted exactly once, residual copy first.
* **Paged** (:class:`~jaxkv.caches.PagedView`): a block is one page (the page size is the
  block size); the program looks the page of each block up in the row's block table and
  reads it from the pool where it lies, float or int8/int4 as above.
* **LayerView** (rings, DynamicCache, encoder states) keeps the dense :func:`attend` path:
  a ring holds at most its window (O(window) whatever the context), a DynamicCache's
  arrays hold exactly its tokens, so no capacity is wasted there and a dense masked
  attention is a few fused XLA ops; a kernel over slots with explicit positions would
  read the same bytes. :func:`unsupported_reason` says so for such a view.

Visibility is :mod:`jaxkv.attention`'s rule: slot ``s`` of row ``b`` is seen by the query at
``p`` iff ``s < lengths[b]``, ``s <= p`` and, with a window, ``p - s < W``; an optional soft
cap turns logits into ``c * tanh(logits / c)``. Window and soft cap are runtime operands
(one compiled kernel serves every value).

Non-finite contract (the one of :mod:`jaxkv.attention.blockwise`, the XLA loop and the CPU
kernel): a slot a query cannot see never affects it, whatever it holds (its logit is
replaced by -inf with a select, never added to, so its weight is exactly 0, and non-finite
value elements are zeroed before the product, so 0 * NaN never occurs); if a slot the query sees
has a non-finite raw logit (``q . k * scale`` before the soft cap; for a quantized slot a
non-finite key scale gives one) or a non-finite value element (a non-finite value scale),
the query's whole output row is NaN (the split marks its ``l`` NaN and the merge spreads
it); otherwise the usual softmax; a query that sees nothing gets zeros.

What applies (:func:`unsupported_reason`): :class:`~jaxkv.caches.ContiguousView`,
:class:`~jaxkv.caches.QuantizedView` and :class:`~jaxkv.caches.PagedView` (pages of a power
of two >= 16 tokens), at most 16 queries per row, float32/bfloat16/float16 queries and
cache, head dim a power of two >= 16 (>= 32 for int4), capacity at least 16 (any size:
a last block that would run past it is read from its last BK slots, the overlap not counted),
``G * T <= 128``, and no 1-byte buffer (int8/int4 codes) of 2-4 GiB (Pallas' Triton lowering
would index it with 32-bit offsets that wrap; see :func:`_offsets_wrap`). :func:`attend_view` picks these kernels by itself only when the
default device is a GPU (``JAXKV_PALLAS_GPU=1`` forces them wherever they apply, in
interpret mode off a GPU; ``=0`` turns them off; the variable is read when a function is
traced, so a function already jitted keeps the path it was traced with). On CPU they run in
Pallas interpret mode (``tests/test_pallas_gpu.py``: the float64 reference and the
contract; the Triton lowering is exported for CUDA there too). Their GPU speed is measured
by part 0 of ``benchmarks/bench_device.py``; it has not run on a GPU yet.

Sharded caches: the kernels carry a partitioning rule (``custom_partitioning``, the CPU
kernel's rule): over a cache sharded by rows and kv heads, each device runs them on its own
rows and kv heads and the output comes back sharded that way; nothing gathers the cache
(``tests/test_sharding.py`` checks the compiled program on 8 virtual devices, interpret
mode). Under ``jax.vmap`` the Pallas call batches itself. Derivatives come from the same
attention over the layer read whole (``custom_jvp``; reverse mode cannot go through the XLA
loop's traced trip counts).

Shapes: B rows, Hq query heads, H kv heads, G = Hq // H, T queries, S slots, D head dim,
M = G * T padded, BK slots per block, NS splits, R residual slots.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.custom_partitioning import custom_partitioning
from jax.experimental.pallas import triton as pltriton
from jax.sharding import NamedSharding, PartitionSpec

from jaxkv import _env
from jaxkv.attention.blockwise import check_int_inputs, check_softcap, check_view_lengths, dense_equivalent
from jaxkv.attention.blockwise import (
    blockwise_attend,
    paged_blockwise_attend,
    quantized_blockwise_attend,
    _checked_layer,
    _nan_unless,
    _default_platform,
    _local_axes,
)
from jaxkv.caches.views import ContiguousView, PagedView, QuantizedView

__all__ = ["ENV_VAR", "interpret_default", "pallas_attend_view", "unsupported_reason", "use_pallas"]

#: ``"auto"`` (default): the kernels when the default device is a GPU; ``"1"``: wherever
#: they apply (interpret mode off a GPU, for tests); ``"0"``: never.
ENV_VAR = "JAXKV_PALLAS_GPU"

MAX_QUERIES = 16
_MAX_ROWS = 128  # G * T: one query tile of at most 128 x D float32 stays in registers
_FLOATS = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_NEG_INF = float("-inf")


def switch_mode() -> str:
    """``JAXKV_PALLAS_GPU`` read: ``"auto"``, ``"1"`` or ``"0"`` (ValueError for another value)."""
    return _env.switch(ENV_VAR, "auto", ("auto",))


def use_pallas(queries: jax.Array, view: Any) -> bool:
    """Whether :func:`jaxkv.attention.attend_view` takes the Pallas kernels for this call.

    ``JAXKV_PALLAS_GPU`` decides (``auto``, ``1``, ``0``; see :data:`ENV_VAR`); in every
    mode the inputs must be ones the kernels take (:func:`unsupported_reason`).
    """
    mode = switch_mode()
    if mode == "0" or (mode == "auto" and _default_platform() != "gpu"):
        return False
    return unsupported_reason(queries, view) is None


def interpret_default() -> bool:
    """True off a GPU: there the kernels can only run in Pallas interpret mode."""
    return _default_platform() != "gpu"


def unsupported_reason(queries: jax.Array, view: Any) -> str | None:
    """Why the kernels cannot take these inputs, or None when they can."""
    if not isinstance(view, (ContiguousView, QuantizedView, PagedView)):
        return (f"{type(view).__name__} is attended densely (a ring holds O(window) slots, a "
                "dynamic cache exactly its tokens); the kernels take contiguous, quantized and paged views")
    if queries.ndim != 4:
        return f"queries must be [B, Hq, T, D], got shape {queries.shape}"
    batch, num_q_heads, num_tokens, head_dim = queries.shape
    num_kv_heads, stored = view.keys.shape[2], view.keys.shape[4]
    if isinstance(view, PagedView):
        kv_batch, num_slots, page_size = view.block_table.shape[0], view.num_slots, view.keys.shape[3]
        if page_size < 16 or page_size & (page_size - 1):
            return f"page size {page_size}; the kernels read one page per block: a power of two >= 16"
    else:
        kv_batch, num_slots = view.keys.shape[1], view.keys.shape[3]
    if kv_batch != batch or num_q_heads % num_kv_heads:
        return f"queries {queries.shape} do not fit the cache {view.keys.shape} (same B; Hq a multiple of H)"
    if batch == 0 or num_tokens == 0:
        return f"queries {queries.shape}: no rows or no queries (nothing for a kernel to do; the XLA path returns the empty result)"
    if num_tokens > MAX_QUERIES:
        return f"{num_tokens} queries per row; the kernels take at most {MAX_QUERIES} (prefill uses the XLA loop)"
    if (num_q_heads // num_kv_heads) * num_tokens > _MAX_ROWS:
        return f"G * T = {(num_q_heads // num_kv_heads) * num_tokens} query rows per kv head; at most {_MAX_ROWS}"
    kv_dtype = jnp.dtype(view.dtype)
    if jnp.dtype(queries.dtype) not in _FLOATS or kv_dtype not in _FLOATS:
        return f"dtypes {queries.dtype} (queries) and {kv_dtype} (cache); the kernels take float32, bfloat16, float16"
    if head_dim < 16 or head_dim & (head_dim - 1):
        return f"head_dim {head_dim}; the kernels take powers of two >= 16 (Triton tiles)"
    if num_slots < 16:
        return f"capacity {num_slots}; the kernels take at least 16 slots (one block)"
    quantized = isinstance(view, QuantizedView) or (isinstance(view, PagedView) and view.bits is not None)
    if quantized:
        if view.bits not in (4, 8):
            return f"{view.bits}-bit codes; the kernels take 8 and 4"
        residual_dim = view.residual_keys.shape[-1] if isinstance(view, QuantizedView) else head_dim
        if stored != (head_dim if view.bits == 8 else head_dim // 2) or residual_dim != head_dim:
            return f"codes {view.keys.shape} do not fit head_dim {head_dim} at {view.bits} bits"
        if view.bits == 4 and head_dim < 32:
            return "int4 with head_dim < 32 (each half-width product needs 16)"
        if jnp.dtype(view.scale_dtype) not in _FLOATS:
            return f"scale dtype {view.scale_dtype}"
    elif stored != head_dim:
        return f"keys {view.keys.shape} do not fit head_dim {head_dim}"
    for name in view._fields:
        if (wraps := _offsets_wrap(getattr(view, name))) is not None:
            return f"{name} {wraps}"
    return None


def _offsets_wrap(array: Any) -> str | None:
    """Why Triton would read ``array`` at wrong addresses, or None.

    Pallas' Triton lowering indexes an operand of at most 2**32 bytes with 32-bit element
    offsets (``jax._src.pallas.triton.lowering._compute_offsets_from_indices``; larger ones
    get 64-bit offsets), and Triton's pointer arithmetic takes them as signed: an element
    past 2**31 - 1 would be read from before the buffer's start. Only 1-byte elements (int8
    codes, int4 pairs) can be that many in 4 GiB: a quantized cache whose stacked codes hold
    2-4 GiB. ``tests/test_pallas_gpu.py`` checks the lowering's rule.
    """
    shape, dtype = getattr(array, "shape", None), getattr(array, "dtype", None)
    if not isinstance(shape, tuple) or dtype is None:  # a view's static fields (a dtype, even np.float32)
        return None
    elements = 1
    for size in shape:
        elements *= int(size)
    nbytes = elements * jnp.dtype(dtype).itemsize
    if elements > 2**31 and nbytes <= 2**32:
        return (f"{jnp.dtype(dtype).name}{list(shape)} holds {elements} elements in {nbytes / 2**30:.2f} GiB: "
                "Pallas' Triton lowering indexes an operand of at most 4 GiB with 32-bit offsets, which "
                "would wrap past 2**31 elements (read from the wrong place), so the XLA loop takes this layer")
    return None


def pallas_attend_view(
    queries: jax.Array,  # [B, Hq, T, D]
    view: Any,  # ContiguousView, QuantizedView or PagedView
    *,
    q_positions: jax.Array,  # [B, T] int
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    scale: float | None = None,
    interpret: bool = False,
    num_splits: int | None = None,
    block_k: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    f32_precision: str = "highest",
    full_blocks: bool = True,
) -> jax.Array:  # [B, Hq, T, D]
    """Attention of new queries over one layer's view with the Pallas split-K kernels.

    Computes what :func:`jaxkv.attention.attend_view` computes for the view (the visibility
    rule and non-finite contract of the module docstring), reading only the slots each row
    has filled (and, with a window, still sees).

    Args:
        queries: [B, Hq, T, D] position-encoded queries.
        view: a :class:`~jaxkv.caches.ContiguousView`, :class:`~jaxkv.caches.QuantizedView` or
            :class:`~jaxkv.caches.PagedView`.
        q_positions: [B, T] absolute query positions.
        sliding_window: optional window W (a query at p sees positions > p - W).
        logit_softcap: optional soft cap c > 0.
        scale: logit scale, ``1 / sqrt(D)`` if None.
        interpret: run the kernels in Pallas interpret mode (any backend; how they are
            tested on CPU). False lowers them with Triton, which needs a GPU.
        num_splits: NS, splits of each row's range (default: enough programs to fill a GPU,
            at most one per block of the capacity).
        block_k: BK, slots per block (default 64, halved until it is at most the capacity;
            at least 16). A capacity that is not a multiple of BK reads its last block from
            slot S - BK, the slots shared with the block before not counted again. A paged
            view's block is its page.
        num_warps, num_stages: Triton's launch options for the kernel (warps per program,
            software-pipelining depth of the block loop); ignored in interpret mode.
        f32_precision: how float32 operands are multiplied: ``"highest"`` (IEEE float32
            products, which Triton runs on the FMA units: ~1100 of the ~2500 PTX
            instructions of a float32 block, ``scripts/kernel_ptx.py``) or ``"tf32x3"``
            (three TF32 tensor-core products per pair, ~float32 accuracy: 2^-21 relative
            per product rather than 2^-24; not measured on a GPU yet, hence not the
            default). Interpret mode multiplies in float32 for both (XLA:CPU has no TF32).
        full_blocks: run the blocks that every query of the row sees whole without the
            visibility mask and the non-finite bookkeeping (the contract still holds: a
            non-finite logit or value there makes the row's output non-finite, hence NaN);
            False: every block masked (the kernel before 2026-12-05). Not with a quantized
            view's residual (its slots are skipped block by block).

    Returns:
        [B, Hq, T, D] in the dtype of ``queries``. Derivatives (``jax.jvp``/``grad``) come
        from dense attention over the layer read whole, which computes the same function.

    Raises:
        ValueError: inputs the kernels do not take (the reason of :func:`unsupported_reason`),
            a bad window, soft cap, split count or block size, or q_positions of the wrong shape.

    Example:
        >>> cache, view = cache.write(k, v, layer)                          # doctest: +SKIP
        >>> out = pallas_attend_view(q, view, q_positions=positions)         # doctest: +SKIP
    """
    why = unsupported_reason(queries, view)
    if why is not None:
        raise ValueError(f"pallas_attend_view: {why}; use jaxkv.attention.attend_view, which falls back.")
    check_view_lengths("pallas_attend_view", view.lengths, queries.shape[0])
    layer, layer_ok = _checked_layer(view.layer, view.keys.shape[0], "pallas_attend_view")
    if layer_ok is not None:  # a traced layer outside [0, L): layer 0 is read, the output is NaN
        layer = jnp.where(layer_ok, layer, 0)
    batch, num_q_heads, num_tokens, head_dim = queries.shape
    paged = isinstance(view, PagedView)
    num_slots = view.num_slots if paged else view.keys.shape[3]
    if q_positions.shape != (batch, num_tokens):
        raise ValueError(f"pallas_attend_view: q_positions must be [{batch}, {num_tokens}], got {q_positions.shape}.")
    ints = dict(q_positions=q_positions, lengths=view.lengths)
    if paged:
        ints["block_table"] = view.block_table
    if isinstance(view, QuantizedView):
        ints["residual_positions"] = view.residual_positions
    check_int_inputs("pallas_attend_view", **ints)
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
        raise ValueError(f"pallas_attend_view: sliding_window must be a positive int or None, got {sliding_window!r}.")
    check_softcap("pallas_attend_view", logit_softcap)
    if paged and block_k not in (None, view.page_size):
        raise ValueError(f"pallas_attend_view: a paged view is read one page per block: block_k must be None or the "
                         f"page size {view.page_size}, got {block_k!r}.")
    if block_k is None:
        block_k = view.page_size if paged else 64
        while block_k > num_slots:
            block_k //= 2
    if not isinstance(block_k, int) or block_k < 16 or block_k & (block_k - 1) or block_k > num_slots:
        raise ValueError(
            f"pallas_attend_view: block_k must be a power of two >= 16 and at most the capacity {num_slots}, "
            f"got {block_k!r}."
        )
    num_kv_heads = view.keys.shape[2]
    max_splits = -(-num_slots // block_k)
    if num_splits is None:
        # Enough programs for ~4 per streaming multiprocessor of a large GPU (132 on an H200).
        num_splits = max(1, min(max_splits, 64, -(-512 // (batch * num_kv_heads))))
    if not isinstance(num_splits, int) or not 1 <= num_splits <= max_splits:
        raise ValueError(f"pallas_attend_view: num_splits must be an int in [1, {max_splits}], got {num_splits!r}.")
    # positions are int32, so a window wider than 2**31 - 1 hides nothing: none (a clamp to
    # 2**31 - 1 hid slot 0 from a query at 2**31 - 1)
    wide = sliding_window is None or sliding_window > 2**31 - 1
    options = jnp.array([0 if wide else sliding_window], jnp.int32)
    floats = jnp.array([head_dim**-0.5 if scale is None else scale, logit_softcap or 0.0], jnp.float32)
    for name, value in (("num_warps", num_warps), ("num_stages", num_stages)):
        if not isinstance(value, int) or not 1 <= value <= 16 or (name == "num_warps" and value & (value - 1)):
            raise ValueError(f"pallas_attend_view: {name} must be an int in [1, 16] (warps: a power of two), "
                             f"got {value!r}.")
    if f32_precision not in ("highest", "tf32x3"):
        raise ValueError(f"pallas_attend_view: f32_precision must be 'highest' or 'tf32x3', got {f32_precision!r}.")
    static = dict(num_splits=num_splits, block_k=block_k, interpret=bool(interpret), num_warps=num_warps,
                  num_stages=num_stages, capped=logit_softcap is not None,
                  tf32x3=f32_precision == "tf32x3" and not interpret, full_blocks=bool(full_blocks))
    view = view._replace(layer=layer, lengths=view.lengths.astype(jnp.int32))
    view_static = tuple((name, getattr(view, name)) for name in _STATIC_FIELDS if name in view._fields)
    names = [name for name in view._fields if name not in _STATIC_FIELDS]
    kernel = _sharded_kernel(type(view), view_static, tuple(static.items()), (sliding_window, logit_softcap, scale))

    def rebuild(arrays):
        return view._replace(**dict(zip(names, arrays)))

    @jax.custom_jvp
    def attend(queries, q_positions, *arrays):
        return _run_sharded(kernel, interpret)(queries, q_positions, options, floats, *arrays)

    # derivatives (rarely wanted in decode) from the same attention over the layer read whole,
    # which reverse mode differentiates at any length (the XLA loop's traced trip counts it cannot)
    dense = dense_equivalent(lambda q_pos, *arrays: (rebuild(arrays), q_pos), sliding_window=sliding_window,
                             logit_softcap=logit_softcap, scale=scale)
    attend.defjvp(lambda primals, tangents: jax.jvp(dense, primals, tangents))

    return _nan_unless(layer_ok, attend(queries, q_positions.astype(jnp.int32), *[getattr(view, name) for name in names]))


def _kernel_path(queries, view, q_positions, options, floats, **static):
    if isinstance(view, PagedView):
        return _run(_paged, static["interpret"])(
            queries, view.keys, view.values, view.key_scales, view.value_scales, view.block_table, view.layer,
            view.lengths, q_positions, options, floats, bits=view.bits, kv_dtype=jnp.dtype(view.dtype),
            scale_dtype=None if view.bits is None else jnp.dtype(view.scale_dtype), **static)
    if isinstance(view, ContiguousView):
        return _run(_contiguous, static["interpret"])(
            queries, view.keys, view.values, view.layer, view.lengths, q_positions, options, floats,
            kv_dtype=jnp.dtype(view.dtype), **static)
    return _run(_quantized, static["interpret"])(
        queries, view.keys, view.values, view.key_scales, view.value_scales, view.residual_keys,
        view.residual_values, view.residual_positions.astype(jnp.int32), view.layer, view.lengths, q_positions,
        options, floats, bits=view.bits, kv_dtype=jnp.dtype(view.dtype), scale_dtype=jnp.dtype(view.scale_dtype),
        **static,
    )


_STATIC_FIELDS = ("bits", "dtype", "scale_dtype")  # a view's fields that are not arrays


@functools.lru_cache(maxsize=None)
def _sharded_kernel(view_type, view_static, static, xla_options):
    """The kernels as one call ``(queries, q_positions, options, floats, *view arrays)``,
    split by rows and kv heads over a sharded cache.

    Without this, XLA's partitioner knows nothing of the Pallas call and gathers the whole
    cache (every layer) onto every device before it. With it, each device runs the kernels
    on its own rows and kv heads (``custom_partitioning``, the rule of the CPU kernel in
    :mod:`jaxkv.attention.blockwise`: rows split freely, kv heads where the query heads
    split the same way; a paged pool splits by kv heads only, its block table by rows) and
    the output comes back sharded like that. On one device it is the plain call. Each
    program's work is one row and kv head, so a shard's result is exactly its part of the
    whole. Under ``jax.vmap`` the Pallas call's own batching takes over (not partitioned).
    """
    view_static, static = dict(view_static), dict(static)
    names = [name for name in view_type._fields if name not in view_static]
    paged = view_type is PagedView

    def xla_local(queries, q_positions, options, floats, *arrays):
        view = view_type(**dict(zip(names, arrays)), **view_static)
        return _xla_path(queries, view, q_positions, *xla_options)

    def local(queries, q_positions, options, floats, *arrays):
        if any(_offsets_wrap(x) is not None for x in arrays):
            # a device's shard of a larger cache holds 2-4 GiB of one-byte codes: the Triton
            # lowering would index it with 32-bit offsets (see _offsets_wrap); the XLA loop
            return xla_local(queries, q_positions, options, floats, *arrays)
        view = view_type(**dict(zip(names, arrays)), **view_static)
        return _kernel_path(queries, view, q_positions, options, floats, **static)

    @custom_partitioning
    def call(*operands):
        return local(*operands)

    def shardings(mesh, arg_shapes):
        shapes = dict(zip(names, arg_shapes[4:]))
        rows, heads = _local_axes(mesh, arg_shapes[0], shapes["keys"], shapes["block_table"] if paged else None)
        named = lambda *spec: NamedSharding(mesh, PartitionSpec(*spec))  # noqa: E731
        per_name = {
            "keys": named(None, None if paged else rows, heads, None, None),
            "key_scales": named(None, None if paged else rows, heads, None),
            "residual_keys": named(rows, heads, None, None),
            "residual_positions": named(rows, None),
            "block_table": named(rows, None),
            "layer": named(),
            "lengths": named(rows),
        }
        per_name.update(values=per_name["keys"], value_scales=per_name["key_scales"],
                        residual_values=per_name["residual_keys"])
        args = (named(rows, heads, None, None), named(rows, None), named(None), named(None),
                *[per_name[name] for name in names])
        return args, named(rows, heads, None, None)

    def partition(mesh, arg_shapes, result_shape):
        args, out = shardings(mesh, arg_shapes)
        return mesh, local, out, args

    # queries [B, Hq, T, D], q_positions [B, T], options [1], floats [2], then the view's arrays
    # (keys/values [L, B, H, S, D'] or pools [L, P, H, ps, D']; scales [L, B|P, H, S|ps|0];
    # residual keys/values [B, H, R, D], positions [B, R]; block table [B, M]; layer []; lengths [B])
    factors = {
        ContiguousView: "l b k s e, l b k s e, , b",
        QuantizedView: "l b k s e, l b k s e, l b k s, l b k s, b k r d, b k r d, b r, , b",
        PagedView: "l p k s e, l p k s e, l p k z, l p k z, b m, , b",
    }
    call.def_partition(
        partition=partition,
        infer_sharding_from_operands=lambda mesh, arg_shapes, result_shape: shardings(mesh, arg_shapes)[1],
        sharding_rule=f"b h t d, b t, o, f, {factors[view_type]} -> b h t d",
    )

    @jax.custom_batching.custom_vmap
    def batchable(*operands):
        return call(*operands)

    @batchable.def_vmap
    def _rule(axis_size, in_batched, *operands):
        # the Pallas call's batching lowers the batched operands: 2-4 GiB of one-byte codes
        # across the batch would get 32-bit offsets (see _offsets_wrap): the XLA loop then
        wraps = any(_offsets_wrap(x) is not None for x in operands)
        return jax.vmap(xla_local if wraps else local, in_axes=tuple(0 if b else None for b in in_batched))(
            *operands), True

    return batchable


def _run_sharded(kernel, interpret: bool):
    """``kernel`` (:func:`_sharded_kernel`) as called now: traced in place inside a caller's
    trace, else jitted once (with interpret mode's compiler options off a GPU)."""
    if isinstance(jnp.zeros(()), jax.core.Tracer):
        return kernel
    return _jitted_call(kernel, interpret)


@functools.lru_cache(maxsize=None)
def _jitted_call(kernel, interpret: bool):
    return jax.jit(kernel, compiler_options=_INTERPRET_COMPILER_OPTIONS if interpret else None)


def _xla_path(queries, view, q_positions, sliding_window, logit_softcap, scale):
    """The same attention by the blockwise XLA loop (:mod:`jaxkv.attention.blockwise`)."""
    options = dict(q_positions=q_positions, sliding_window=sliding_window, logit_softcap=logit_softcap, scale=scale)
    if isinstance(view, ContiguousView):
        return blockwise_attend(queries, view.keys, view.values, layer_idx=view.layer, kv_lengths=view.lengths,
                                implementation="xla", kv_dtype=view.dtype, **options)
    if isinstance(view, PagedView):
        return paged_blockwise_attend(queries, view, implementation="xla", **options)
    return quantized_blockwise_attend(queries, view, **options)


# ---------------------------------------------------------------------------- the kernel


def _split_kernel(
    ints_ref,  # int32[2]: layer, window (0: none)
    floats_ref,  # f32[2]: logit scale, soft cap (0: none)
    bounds_ref,  # int32[B, 8]: length, lo, hi, residual lo, residual hi (per row)
    qpos_ref,  # int32[B, M]: position of each query row (-1: padding, sees nothing)
    rpos_ref,  # int32[B, R']: positions the residual holds (-1: none); read only with a residual
    table_ref,  # int32[B, S / BK]: paged: the page of each block of the row (-1: none); else unread
    q_ref,  # [M, D] this (b, h)'s query tile (int4: [even half | odd half])
    k_ref,  # [L, B, H, S, D'] stacked keys as stored (paged: the pool [L, P, H, BK, D'])
    v_ref,  # [L, B, H, S, D'] (paged: [L, P, H, BK, D'])
    ks_ref,  # [L, B, H, S] key scales as stored (paged: [L, P, H, BK]); read only when quantized
    vs_ref,  # [L, B, H, S] (paged: [L, P, H, BK])
    acc_ref,  # out [M, D] float32
    m_ref,  # out [M] float32
    l_ref,  # out [M] float32 (NaN: a visible slot was non-finite)
    *,
    num_splits: int,
    block_k: int,
    compute_dtype: Any,
    value_dtype: Any,
    stored_dtype: Any,
    bits: int | None,
    scale_dtype: Any,
    residual: bool,
    paged: bool,
    capped: bool,
    tf32x3: bool,
    used: int,
    full_blocks: bool,
):
    b, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    layer, window = ints_ref[0], ints_ref[1]
    logit_scale, softcap = floats_ref[0], floats_ref[1]
    length, lo, hi = bounds_ref[b, 0], bounds_ref[b, 1], bounds_ref[b, 2]
    # This split's share of the row's range [lo, hi): block-aligned chunks of equal size.
    span = jnp.maximum(hi - lo, 0)
    # int32 constants throughout: under jax_enable_x64 a Python int is int64 (lax.div refuses the mix)
    chunk = pl.cdiv(pl.cdiv(span, jnp.int32(num_splits)), jnp.int32(block_k)) * jnp.int32(block_k)
    start = lo + j * chunk
    num_blocks = pl.cdiv(jnp.maximum(jnp.minimum(start + chunk, hi) - start, jnp.int32(0)), jnp.int32(block_k))

    num_slots = k_ref.shape[3]  # S (paged: the page size, unused)
    qpos = qpos_ref[b, :]  # [M]
    rows, width = q_ref.shape
    parts = 2 if bits == 4 else 1  # int4: even and odd head-dim elements are separate products
    part = width // parts
    q_parts = [q_ref[:, pl.ds(i * part, part)].astype(compute_dtype) for i in range(parts)]
    # Triton runs a float32 dot at TF32 by default (10-bit mantissas: errors near 1e-3);
    # float32 operands are multiplied in full precision, as the float64 reference expects.
    # (``tf32x3``: three TF32 tensor-core products per pair instead, see ``f32_precision``.)
    f32 = jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3 if tf32x3 else jax.lax.Precision.HIGHEST
    qk_precision = f32 if jnp.dtype(compute_dtype) == jnp.float32 else None
    pv_precision = f32 if jnp.dtype(value_dtype) == jnp.float32 else None
    if residual:
        rpos = rpos_ref[b, :]  # [R']
        res_lo, res_hi = bounds_ref[b, 3], bounds_ref[b, 4]

    def load_block(off, checked=True):
        """Keys and values of slots [off, off + BK) as products' operands, their scales, and
        which value elements (float) or slots (quantized: the value scale) are non-finite;
        ``checked=False`` (a block every query sees): values as stored, nothing marked."""
        if paged:  # a block is one page, found through the row's block table
            # clamped into the pool as the XLA loop's gather and the CPU kernel clamp (a GPU
            # kernel would read outside it); jaxkv's own tables hold -1 or a pool page
            page = jnp.minimum(jnp.maximum(table_ref[b, off // block_k], 0), k_ref.shape[1] - 1)
            at = (layer, page, h, pl.ds(0, block_k))
        else:  # a last block past the capacity is read from S - BK (see ``body``)
            at = (layer, b, h, pl.ds(jnp.minimum(off, num_slots - block_k), block_k))
        keys, values = k_ref[(*at, slice(None))], v_ref[(*at, slice(None))]
        if bits is None:
            keys, values = (x if x.dtype == stored_dtype else jax.lax.bitcast_convert_type(x, stored_dtype)
                            for x in (keys, values))
            if not checked:
                return [keys.astype(compute_dtype)], [values.astype(value_dtype)], None, None, None
            # Non-finite value elements are zeroed (0 * NaN never enters the product) and
            # marked [BK, D]; a visible slot's marks reach its queries through a product
            # (``body``), not a per-block reduction over D (the broadcast of a [BK] flag
            # against the [M, BK] logits cost a layout conversion through shared memory).
            finite = jnp.isfinite(values.astype(jnp.float32))
            values = jnp.where(finite, values, jnp.zeros((), values.dtype))
            return [keys.astype(compute_dtype)], [values.astype(value_dtype)], None, None, ~finite
        k_scale, v_scale = (s if s.dtype == scale_dtype else jax.lax.bitcast_convert_type(s, scale_dtype)
                            for s in (ks_ref[at], vs_ref[at]))
        k_scale, v_scale = k_scale.astype(jnp.float32), v_scale.astype(jnp.float32)
        bad_value = None
        if checked:
            bad_value = ~jnp.isfinite(v_scale)
            v_scale = jnp.where(bad_value, 0.0, v_scale)
        if bits == 8:
            key_parts, value_parts = [keys], [values]
        else:  # two's complement nibbles: low = element 2i, high = element 2i + 1
            key_parts, value_parts = ([((x & 15) ^ 8) - 8, (((x >> 4) & 15) ^ 8) - 8]
                                      for x in (keys.astype(jnp.int32), values.astype(jnp.int32)))
        return ([x.astype(compute_dtype) for x in key_parts], [x.astype(value_dtype) for x in value_parts],
                k_scale, v_scale, bad_value)

    def raw_logits(keys, k_scale):
        """``q . k * scale`` [M, BK] in float32 (quantized: times each key's scale)."""
        raw = sum(jax.lax.dot_general(qp, kp, (((1,), (1,)), ((), ())), precision=qk_precision,
                                      preferred_element_type=jnp.float32)
                  for qp, kp in zip(q_parts, keys))
        return (raw if k_scale is None else raw * k_scale[None, :]) * logit_scale

    def weigh_values(acc, correction, weights, v_scale, values, visible=None):
        """``acc * correction + (weights * v_scale) @ values``, the product's operands in the
        value dtype. Quantized float16: the value scales are divided by the block's largest
        first (and the product multiplied by it): weights times a small scale fell below
        float16's normal range (6e-5) and lost their digits (error 5e-3 of the values at
        magnitude 1e-4, review 55). The largest over the slots some query sees (``visible``
        [M, BK]; None: all): an unseen slot's scale must not shift the others' rounding."""
        block_scale = None
        if v_scale is not None:
            if jnp.dtype(value_dtype) == jnp.float16:
                seen = v_scale if visible is None else jnp.where(jnp.max(visible.astype(jnp.float32), axis=0) > 0,
                                                                 v_scale, 0.0)
                block_scale = jnp.max(seen)
                block_scale = jnp.where(block_scale > 0, block_scale, jnp.float32(1))
                v_scale = v_scale / block_scale
            weights = weights * v_scale[None, :]
        weights = weights.astype(value_dtype)
        out = []
        for a, vp in zip(acc, values):
            product = jax.lax.dot_general(weights, vp, (((1,), (0,)), ((), ())), precision=pv_precision,
                                          preferred_element_type=jnp.float32)
            out.append(a * correction[:, None] + (product if block_scale is None else product * block_scale))
        return out

    def body(i, carry):
        running_max, running_sum, marks, *acc = carry
        off = start + i * block_k
        # A capacity that is not a multiple of BK: the last block is the buffer's last BK
        # slots, and the slots below ``off`` in it (the previous block's) are not counted.
        slots = (off if paged else jnp.minimum(off, num_slots - block_k)) + jax.lax.broadcasted_iota(
            jnp.int32, (block_k,), 0)
        keys, values, k_scale, v_scale, bad_value = load_block(off)
        raw = raw_logits(keys, k_scale)
        visible = (slots[None, :] >= off) & (slots[None, :] < length) & (slots[None, :] <= qpos[:, None])
        visible = visible & ((window <= 0) | (qpos[:, None] - slots[None, :] < window))
        if residual:  # positions a used residual slot holds are counted there, exactly
            def covered():
                hit = jnp.where(slots[:, None] == rpos[None, :], jnp.int32(1), jnp.int32(0))
                return jnp.max(hit, axis=1)

            near = (off < res_hi) & (off + block_k > res_lo)
            skip = jax.lax.cond(near, covered, lambda: jnp.zeros((block_k,), jnp.int32))
            visible = visible & (skip[None, :] == 0)
        # A visible slot with a non-finite raw logit (or, quantized, value scale): its
        # weight is NaN, so the running sum (the split's ``l``) is NaN from then on.
        bad = ~jnp.isfinite(raw) if bits is None else ~jnp.isfinite(raw) | bad_value[None, :]
        if bits is None:  # float values: marks [M, D] += visible [M, BK] @ non-finite elements [BK, D]
            marks = marks + jax.lax.dot_general(
                visible.astype(jnp.bfloat16), bad_value.astype(jnp.bfloat16), (((1,), (0,)), ((), ())),
                preferred_element_type=jnp.float32)
        if capped:  # a static switch: without a soft cap no tanh is computed
            raw = softcap * jnp.tanh(raw / softcap)
        logits = jnp.where(visible & ~bad, raw, _NEG_INF)
        new_max = jnp.maximum(running_max, jnp.max(logits, axis=1))
        safe_max = jnp.where(new_max > _NEG_INF, new_max, 0.0)
        weights = jnp.exp(logits - safe_max[:, None])  # exactly 0 where not seen
        weights = jnp.where(visible & bad, jnp.nan, weights)
        correction = jnp.exp(running_max - safe_max)  # 0 while nothing was seen
        running_sum = running_sum * correction + jnp.sum(weights, axis=1)
        acc = weigh_values(acc, correction, weights, v_scale, values, visible)
        return (new_max, running_sum, marks, *acc)

    def full_body(i, carry):
        """A block every real query row sees: no visibility mask, nothing zeroed or marked.
        A non-finite raw logit becomes NaN (before the soft cap, which would bound an
        infinity) and its weight NaN; a non-finite value element meets a positive weight,
        so the row's output is non-finite and the merge makes it NaN: the contract holds."""
        running_max, running_sum, marks, *acc = carry
        off = start + i * block_k
        keys, values, k_scale, v_scale, _ = load_block(off, checked=False)
        raw = raw_logits(keys, k_scale)
        raw = jnp.where(jnp.isfinite(raw), raw, jnp.nan)
        if capped:
            raw = softcap * jnp.tanh(raw / softcap)
        new_max = jnp.maximum(running_max, jnp.max(raw, axis=1))
        safe_max = jnp.where(new_max > _NEG_INF, new_max, 0.0)
        weights = jnp.exp(raw - safe_max[:, None])
        correction = jnp.exp(running_max - safe_max)
        running_sum = running_sum * correction + jnp.sum(weights, axis=1)
        acc = weigh_values(acc, correction, weights, v_scale, values)
        return (new_max, running_sum, marks, *acc)

    marks = jnp.zeros((rows, width) if bits is None else (rows,), jnp.float32)
    carry = (jnp.full((rows,), _NEG_INF, jnp.float32), jnp.zeros((rows,), jnp.float32), marks,
             *[jnp.zeros((rows, part), jnp.float32) for _ in range(parts)])
    num_blocks = num_blocks.astype(jnp.int32)
    if full_blocks and not residual:
        # The blocks every real query row (the first ``used``) sees whole: slots
        # [lo_full, hi_full) are below the row's length and every query's position and
        # inside every query's window. They run in ``full_body``; the blocks before and
        # after (a window's edge, the causal or length tail) in ``body``.
        real = jax.lax.broadcasted_iota(jnp.int32, (rows,), 0) < used
        q_min = jnp.min(jnp.where(real, qpos, jnp.int32(2**31 - 1)))
        q_max = jnp.max(jnp.where(real, qpos, jnp.int32(-(2**31))))
        hi_full = jnp.where(q_min < hi, q_min + 1, hi)  # hi <= length and the capacity already
        lo_full = jnp.where((window > 0) & (q_max >= window - 1), q_max - (window - 1), jnp.int32(0))
        first = jnp.minimum(pl.cdiv(jnp.maximum(lo_full - start, 0), jnp.int32(block_k)), num_blocks)
        # compared before subtracting: hi_full may be near -2**31 (a query at a very negative position)
        past = jnp.where(hi_full > start, hi_full - start, jnp.int32(0))
        last = jnp.maximum(jnp.minimum(past // block_k, num_blocks), first)
        carry = jax.lax.fori_loop(jnp.int32(0), first, body, carry)
        carry = jax.lax.fori_loop(first, last, full_body, carry)
        carry = jax.lax.fori_loop(last, num_blocks, body, carry)
    else:
        carry = jax.lax.fori_loop(jnp.int32(0), num_blocks, body, carry)
    running_max, running_sum, marks, *acc = carry
    for i, a in enumerate(acc):
        acc_ref[:, pl.ds(i * part, part)] = a
    m_ref[...] = running_max
    if bits is None:  # once per program: did a visible slot hold a non-finite value element?
        running_sum = jnp.where(jnp.max(marks, axis=1) > 0, jnp.nan, running_sum)
    l_ref[...] = running_sum


# Interpret mode is how the kernels are tested off a GPU: the emulated grid is a small while
# loop that XLA's optimisation passes barely speed up, and compiling it without them takes
# about half the time (measured on the 2-core CI machine: 1.3 s against 2.3-2.7 s).
_INTERPRET_COMPILER_OPTIONS = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


@functools.lru_cache(maxsize=None)
def _jitted(fn, interpret: bool):
    """``fn`` jitted; its keyword-only parameters are the static ones."""
    static = [p.name for p in inspect.signature(fn).parameters.values() if p.kind is p.KEYWORD_ONLY]
    return jax.jit(fn, static_argnames=static, compiler_options=_INTERPRET_COMPILER_OPTIONS if interpret else None)


def _run(fn, interpret: bool):
    """``fn`` as called now: inside a caller's trace (a jitted model step) it is traced in
    place (the caller's jit compiles it, and XLA allows compiler options only there);
    called eagerly, it is jitted once per static configuration."""
    if isinstance(jnp.zeros(()), jax.core.Tracer):
        return fn
    return _jitted(fn, interpret)


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _query_rows(queries, q_positions, num_kv_heads):
    """[B, Hq, T, D] -> [B, H, M, D] (row g * T + t), positions [B, M] (-1: padding)."""
    batch, num_q_heads, num_tokens, head_dim = queries.shape
    used = num_q_heads // num_kv_heads * num_tokens
    rows = max(16, _next_pow2(used))
    q = queries.reshape(batch, num_kv_heads, used, head_dim)
    q = jnp.pad(q, ((0, 0), (0, 0), (0, rows - used), (0, 0)))
    qpos = jnp.tile(q_positions, (1, used // num_tokens))
    qpos = jnp.pad(qpos, ((0, 0), (0, rows - used)), constant_values=-1)
    return q, qpos, used


def _row_bounds(q_positions, lengths, window, num_slots, block_k, extra=()):
    """int32[B, 8]: length, first slot any query of the row sees (block-aligned), one past
    the last; then ``extra`` columns."""
    # Capped below S before the + 1: a position of 2**31 - 1 would wrap to negative.
    hi = jnp.clip(jnp.minimum(lengths, jnp.minimum(jnp.max(q_positions, axis=1), num_slots - 1) + 1), 0, num_slots)
    # Compared before subtracting: a padding query at a very negative position with a large
    # window would wrap ``first - window + 1`` past -2**31 to a large positive start.
    first = jnp.min(q_positions, axis=1)
    lo = jnp.where((window > 0) & (first >= window - 1), first - (window - 1), 0)
    lo = jnp.minimum(lo // block_k * block_k, hi)
    columns = [lengths, lo, hi, *extra]
    zeros = jnp.zeros_like(lengths)
    return jnp.stack(columns + [zeros] * (8 - len(columns)), axis=1).astype(jnp.int32)


def _call_kernel(q, qpos, bounds, rpos, table, ints, floats, keys, values, key_scales, value_scales, *, num_splits,
                 block_k, interpret, num_warps, num_stages, **kernel_static):
    batch, num_kv_heads, rows, width = q.shape
    kernel = functools.partial(_split_kernel, num_splits=num_splits, block_k=block_k, **kernel_static)
    whole = pl.no_block_spec  # the whole array: the kernel indexes the stacked buffers itself
    one = pl.squeezed  # a size-1 block dimension, dropped from the kernel's view
    tile = pl.BlockSpec((one, one, rows, width), lambda b, h, j: (b, h, 0, 0))
    out_tile = pl.BlockSpec((one, one, one, rows, width), lambda b, h, j: (b, h, j, 0, 0))
    out_row = pl.BlockSpec((one, one, one, rows), lambda b, h, j: (b, h, j, 0))
    stats = jax.ShapeDtypeStruct((batch, num_kv_heads, num_splits, rows), jnp.float32)
    return pl.pallas_call(
        kernel,
        grid=(batch, num_kv_heads, num_splits),
        in_specs=[whole] * 6 + [tile] + [whole] * 4,
        out_specs=[out_tile, out_row, out_row],
        out_shape=[jax.ShapeDtypeStruct((batch, num_kv_heads, num_splits, rows, width), jnp.float32), stats, stats],
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="jaxkv_split_decode",
    )(ints, floats, bounds, qpos, rpos, table, q, keys, values, key_scales, value_scales)


def _merge(acc, running_max, running_sum):
    """Log-sum-exp merge over axis 2 (splits): acc [B, H, NS, M, D], stats [B, H, NS, M]."""
    marked = jnp.any(jnp.isnan(running_sum), axis=2)
    top = jnp.max(running_max, axis=2, keepdims=True)
    weight = jnp.where(running_max > _NEG_INF, jnp.exp(running_max - jnp.where(top > _NEG_INF, top, 0.0)), 0.0)
    total = jnp.sum(jnp.where(jnp.isnan(running_sum), 0.0, running_sum) * weight, axis=2)
    out = jnp.sum(acc * weight[..., None], axis=2) / jnp.where(total > 0, total, 1.0)[..., None]
    bad = marked[..., None] | ~jnp.all(jnp.isfinite(out), axis=-1, keepdims=True)
    return jnp.where(bad, jnp.nan, out)


def _finish(out, queries, used):
    batch, num_q_heads, num_tokens, head_dim = queries.shape
    return out[:, :, :used].reshape(batch, num_q_heads, num_tokens, head_dim).astype(queries.dtype)


def _compute_dtype(queries, kv_dtype):
    return jnp.promote_types(queries.dtype, kv_dtype)


def _contiguous(queries, keys, values, layer, lengths, q_positions, options, floats, *, kv_dtype, num_splits, block_k,
                interpret, num_warps, num_stages, capped, tf32x3, full_blocks):
    num_kv_heads, num_slots = keys.shape[2], keys.shape[3]
    compute = _compute_dtype(queries, kv_dtype)
    q, qpos, used = _query_rows(queries.astype(compute), q_positions, num_kv_heads)
    bounds = _row_bounds(q_positions, lengths, options[0], num_slots, block_k)
    none = jnp.zeros((1,), jnp.int32)
    acc, running_max, running_sum = _call_kernel(
        q, qpos, bounds, none, none, jnp.concatenate([layer[None], options]), floats, keys, values, none, none,
        num_splits=num_splits, block_k=block_k, interpret=interpret, num_warps=num_warps,
        num_stages=num_stages, compute_dtype=compute, value_dtype=kv_dtype,
        stored_dtype=kv_dtype, bits=None, scale_dtype=None, residual=False, paged=False, capped=capped, tf32x3=tf32x3,
        used=used, full_blocks=full_blocks,
    )
    return _finish(_merge(acc, running_max, running_sum), queries, used)


def _dense_partial(q, keys, values, positions, used, qpos, window, floats):
    """The residual's ``(acc, m, l)`` [B, H, 1, M(, D)], under the kernel's contract, in XLA:
    q [B, H, M, D], keys/values [B, H, R, D], positions/used [B, R], qpos [B, M]."""
    logit_scale, softcap = floats[0], floats[1]
    raw = jnp.einsum("bhmd,bhrd->bhmr", q, keys, preferred_element_type=jnp.float32) * logit_scale
    pos = positions[:, None, None, :]
    visible = used[:, None, None, :] & (pos <= qpos[:, None, :, None])
    visible = visible & ((window <= 0) | (qpos[:, None, :, None] - pos < window))
    finite = jnp.isfinite(values)
    bad = ~jnp.isfinite(raw) | ~jnp.all(finite, axis=-1)[:, :, None, :]
    marked = jnp.any(visible & bad, axis=-1)
    capped = jnp.where(softcap > 0, softcap * jnp.tanh(raw / softcap), raw)
    logits = jnp.where(visible & ~bad, capped, _NEG_INF)
    top = jnp.max(logits, axis=-1)
    weights = jnp.exp(logits - jnp.where(top > _NEG_INF, top, 0.0)[..., None])
    acc = jnp.einsum("bhmr,bhrd->bhmd", weights.astype(values.dtype), jnp.where(finite, values, 0),
                     preferred_element_type=jnp.float32)
    total = jnp.where(marked, jnp.nan, jnp.sum(weights, axis=-1))
    return acc[:, :, None], top[:, :, None], total[:, :, None]


def _quantized(queries, keys, values, key_scales, value_scales, residual_keys, residual_values, residual_positions,
               layer, lengths, q_positions, options, floats, *, bits, kv_dtype, scale_dtype, num_splits, block_k,
               interpret, num_warps, num_stages, capped, tf32x3, full_blocks):
    num_kv_heads, num_slots = keys.shape[2], keys.shape[3]
    compute = _compute_dtype(queries, kv_dtype)
    q, qpos, used = _query_rows(queries.astype(compute), q_positions, num_kv_heads)
    num_residual = residual_keys.shape[2]
    residual_used = (residual_positions >= 0) & (residual_positions < lengths[:, None])  # [B, R]
    if num_residual:
        held = jnp.where(residual_used, residual_positions, -1)
        extra = (jnp.min(jnp.where(residual_used, residual_positions, num_slots), axis=1), jnp.max(held, axis=1) + 1)
        rpos = jnp.pad(held, ((0, 0), (0, _next_pow2(num_residual) - num_residual)), constant_values=-1)
    else:
        extra, rpos = (), jnp.zeros((1,), jnp.int32)
    bounds = _row_bounds(q_positions, lengths, options[0], num_slots, block_k, extra)
    order = _int4_order(q.shape[-1]) if bits == 4 else None
    acc, running_max, running_sum = _call_kernel(
        q if order is None else q[..., order], qpos, bounds, rpos, jnp.zeros((1,), jnp.int32),
        jnp.concatenate([layer[None], options]), floats, keys, values, key_scales, value_scales,
        num_splits=num_splits, block_k=block_k, interpret=interpret, num_warps=num_warps,
        num_stages=num_stages, compute_dtype=compute, value_dtype=kv_dtype,
        stored_dtype=None, bits=bits, scale_dtype=scale_dtype, residual=bool(num_residual), paged=False,
        capped=capped, tf32x3=tf32x3, used=used, full_blocks=full_blocks,
    )
    if order is not None:
        acc = acc[..., jnp.argsort(order)]
    if num_residual:
        parts = _dense_partial(q, residual_keys.astype(compute), residual_values.astype(kv_dtype),
                               residual_positions, residual_used, qpos, options[0], floats)
        acc, running_max, running_sum = (jnp.concatenate([x, y], axis=2)
                                         for x, y in zip((acc, running_max, running_sum), parts))
    return _finish(_merge(acc, running_max, running_sum), queries, used)


def _paged(queries, keys, values, key_scales, value_scales, block_table, layer, lengths, q_positions, options, floats,
           *, bits, kv_dtype, scale_dtype, num_splits, block_k, interpret, num_warps, num_stages, capped, tf32x3,
           full_blocks):
    num_kv_heads, num_slots = keys.shape[2], block_table.shape[1] * block_k
    compute = _compute_dtype(queries, kv_dtype)
    q, qpos, used = _query_rows(queries.astype(compute), q_positions, num_kv_heads)
    bounds = _row_bounds(q_positions, lengths, options[0], num_slots, block_k)
    order = _int4_order(q.shape[-1]) if bits == 4 else None
    if bits is None:  # float pages have no scales ([L, P, H, 0]); the kernel reads none
        key_scales = value_scales = jnp.zeros((1,), jnp.float32)
    acc, running_max, running_sum = _call_kernel(
        q if order is None else q[..., order], qpos, bounds, jnp.zeros((1,), jnp.int32), block_table.astype(jnp.int32),
        jnp.concatenate([layer[None], options]), floats, keys, values, key_scales, value_scales,
        num_splits=num_splits, block_k=block_k, interpret=interpret, num_warps=num_warps,
        num_stages=num_stages, compute_dtype=compute, value_dtype=kv_dtype,
        stored_dtype=kv_dtype, bits=bits, scale_dtype=scale_dtype, residual=False, paged=True, capped=capped,
        tf32x3=tf32x3, used=used, full_blocks=full_blocks,
    )
    if order is not None:
        acc = acc[..., jnp.argsort(order)]
    return _finish(_merge(acc, running_max, running_sum), queries, used)


def _int4_order(head_dim):
    """int4 keeps its packing: the kernel's products run over even, then odd elements."""
    return jnp.concatenate([jnp.arange(0, head_dim, 2), jnp.arange(1, head_dim, 2)])
