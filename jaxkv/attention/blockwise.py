"""Blockwise attention over a cache buffer: cost scales with tokens stored, not capacity.

Plain masked attention over a ``StaticCache`` layer reads all ``S`` slots every step, so a
decode step at 1K tokens in a 64K cache costs as much as one at 64K. Here the slots are
visited in blocks of ``block_size`` inside a ``lax.fori_loop`` whose trip count comes from
the data: it stops after the last block that any row has filled (and, with a sliding
window, starts at the first block any query can still see). Softmax is accumulated online
(running max, running sum, running weighted values), so the result equals one softmax
over all visible slots.

Two implementations compute this same function:

* The XLA loop (any platform, any dtype). Blocks that every query of every row sees in
  full run an unmasked loop body; only the edge blocks (a partly filled last block, ragged
  rows, a window's start) pay for masks, and a last block holding few tokens is read at
  1/2, 1/4 or 1/8 of its size. On XLA:CPU each block is copied out of the buffer before its
  products (a dot cannot read a slice of a larger buffer in place), one thread at a time:
  15-20% of the machine's read bandwidth.
* On CPU, for decode-sized calls (up to 16 queries per row, f32/bf16), a native kernel
  (:mod:`jaxkv._kernels`, an XLA FFI custom call built on first use) that reads the visible
  slots where they lie in the stacked buffer, once, on all cores: 76-92% of the read
  bandwidth. ``implementation="auto"`` (the default) picks it when it applies. It is built
  (with the machine's C++ compiler) and registered only when JAX's default device is a
  CPU: tracing for a GPU or TPU never runs the compiler. The same kernel reads a paged
  pool through the block table (:func:`paged_blockwise_attend`), and int8/int4 codes with
  their per-token scales (:func:`quantized_blockwise_attend`, int8/int4 pages), each row
  dequantized as it is read; anything off CPU takes the XLA loop.

``benchmarks/bench_attention.py`` measures both side by side; ``benchmarks/bench_paged.py``
(section "attention") a paged decode step against a contiguous one.

Shapes: B batch, Hq query heads, H kv heads, G = Hq // H, T queries, S slots, D head dim.
Slot ``s`` holds absolute position ``s`` (the ``StaticCache`` layout). Visibility is the
rule of :func:`jaxkv.attention.attend`: filled (``s < kv_lengths[b]``), not in the future
(``s <= p``), and inside the window (``p - s < W``).

Non-finite keys and values follow the contract of :mod:`jaxkv.attention`, on both
implementations alike:

* a slot a query cannot see (unfilled, in its future, outside its window) never affects
  that query, whatever it holds (NaN, inf);
* if a slot the query sees has a non-finite raw logit (``q . k * scale``, before the soft
  cap: a NaN or infinite key gives one) or a non-finite value element, the query's whole
  output row is NaN;
* otherwise the usual softmax; a query that sees nothing gets zeros.
"""

from __future__ import annotations

from functools import lru_cache, partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from jaxkv import _kernels
from jaxkv.caches._bits import from_bits, stored_dtype
from jaxkv.caches._checks import _widen
from jaxkv.caches.views import ContiguousView

__all__ = ["blockwise_attend", "paged_blockwise_attend", "quantized_blockwise_attend"]


def blockwise_attend(
    queries: jax.Array,  # [B, Hq, T, D]
    keys: jax.Array,  # [B, H, S, D] or stacked [L, B, H, S, D] with layer_idx
    values: jax.Array,  # same shape as keys
    *,
    q_positions: jax.Array,  # [B, T] int
    kv_lengths: jax.Array,  # [B] int
    layer_idx: int | jax.Array | None = None,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    scale: float | None = None,
    block_size: int | None = None,
    implementation: str = "auto",
    kv_dtype: Any = None,
) -> jax.Array:  # [B, Hq, T, D]
    """Grouped-query attention that reads only the blocks holding visible tokens.

    Args:
      queries: [B, Hq, T, D] position-encoded queries.
      keys: [B, H, S, D] a layer's key buffer (slot s = position s), or the whole stacked
        buffer [L, B, H, S, D] (``StaticCache.keys``) together with ``layer_idx``. Prefer the
        stacked form inside a jitted step: blocks are then read straight from the cache,
        whereas slicing one layer out first may materialise a capacity-sized copy.
      values: the value buffer, same shape as ``keys``.
      q_positions: [B, T] absolute query positions.
      kv_lengths: [B] filled slots per row.
      layer_idx: the layer to read when ``keys`` is stacked (an int or traced int32).
      sliding_window: optional window W: a query at p sees positions > p - W.
      logit_softcap: optional c: logits become ``c * tanh(logits / c)``.
      scale: logit scale, ``1 / sqrt(D)`` if None.
      block_size: slots per loop iteration (clipped to S). Default: 512 for up to 16
        queries (decode), 128 for more (prefill chunks): a block's scores are
        ``[B, Hq, block, T]``, and for a 512-token chunk, blocks of 128 hold a quarter of
        the temporaries of blocks of 512 at no cost in speed (measured in
        ``benchmarks/bench_generate.py --memory-only``).
      implementation: ``"auto"`` (default): on CPU, up to 16 queries, f32/bf16, the native
        kernel of :mod:`jaxkv._kernels` (reads blocks in place, on all cores) when it could
        be built, else the XLA loop; on other platforms the XLA loop (the kernel is built
        and registered only when the default device is a CPU). ``"xla"``: always the
        XLA loop. ``"kernel"``: the native kernel on CPU, an error if it is unavailable or
        the inputs are outside what it takes. Both compute the same function; derivatives
        always come from the XLA loop. Under ``jax.vmap`` the kernel runs once per mapped
        element, in sequence; over a cache sharded by rows and/or kv heads each device runs
        it on its own shard (no gather; query heads must split like the kv heads). A program
        serialised with ``jax.export`` names the kernel's custom call, which only a process
        that has built it can run: export with ``JAXKV_CPU_KERNEL=0`` (or ``"xla"``).
      kv_dtype: the float dtype ``keys``/``values`` hold when they are given as their uint16
        bits (how jaxkv's contiguous storage keeps 16-bit floats: XLA:CPU cannot update a
        bf16 array in place); None: the buffers' own dtype.

    Returns:
      [B, Hq, T, D] in the dtype of ``queries``; a query that sees nothing gets zeros.

    Raises:
      ValueError: mismatched shapes, Hq not a multiple of H, bad window, block size or
        implementation; ``implementation="kernel"`` that cannot be honoured.
    """
    q_positions, kv_lengths = as_index_arrays(q_positions, kv_lengths)
    kv_rank = 4 if layer_idx is None else 5
    if queries.ndim != 4 or keys.ndim != kv_rank or keys.shape != values.shape:
        raise ValueError(
            "blockwise_attend: expected queries [B, Hq, T, D] and keys == values "
            f"{'[B, H, S, D]' if layer_idx is None else '[L, B, H, S, D] (stacked, with layer_idx)'}, got "
            f"{queries.shape}, {keys.shape}, {values.shape}."
        )
    if layer_idx is None:
        keys, values, layer_idx = keys[None], values[None], 0
    batch, num_q_heads, num_tokens, head_dim = queries.shape
    _, _, num_kv_heads, num_slots, _ = keys.shape
    if keys.shape[1] != batch or keys.shape[4] != head_dim or num_q_heads % num_kv_heads:
        raise ValueError(
            f"blockwise_attend: queries {queries.shape} do not fit keys {keys.shape} (same batch and "
            "head_dim; query heads a multiple of kv heads)."
        )
    if q_positions.shape != (batch, num_tokens) or kv_lengths.shape != (batch,):
        raise ValueError(
            f"blockwise_attend: q_positions must be [{batch}, {num_tokens}] and kv_lengths [{batch}], "
            f"got {q_positions.shape} and {kv_lengths.shape}."
        )
    check_int_inputs("blockwise_attend", q_positions=q_positions, kv_lengths=kv_lengths)
    block_size = _loop_options("blockwise_attend", num_tokens, sliding_window, logit_softcap, block_size)
    _check_implementation("blockwise_attend", implementation)
    if kv_dtype is None and not (jnp.issubdtype(keys.dtype, jnp.floating) and values.dtype == keys.dtype):
        raise TypeError(
            f"blockwise_attend: keys/values of dtype {keys.dtype}/{values.dtype} are not a float cache; a uint16 "
            "buffer of 16-bit floats stored as bits needs kv_dtype (jnp.bfloat16 or jnp.float16)."
        )
    kv_dtype = keys.dtype if kv_dtype is None else jnp.dtype(kv_dtype)
    if keys.dtype != kv_dtype and (keys.dtype != jnp.uint16 or stored_dtype(kv_dtype) != keys.dtype):
        raise ValueError(
            f"blockwise_attend: keys of dtype {keys.dtype} cannot hold kv_dtype={kv_dtype}; kv_dtype names the "
            "16-bit float a uint16 buffer holds as bits (jaxkv's contiguous storage), else leave it None."
        )
    if scale is None:
        scale = head_dim**-0.5
    layer_idx, layer_ok = _checked_layer(layer_idx, keys.shape[0], "blockwise_attend")
    args = (queries, keys, values, layer_idx, q_positions.astype(jnp.int32), kv_lengths.astype(jnp.int32))
    xla = partial(
        _xla_loop, sliding_window=sliding_window, logit_softcap=logit_softcap, scale=scale, block_size=block_size,
        kv_dtype=kv_dtype,
    )
    kernel = partial(_kernel_call, sliding_window=sliding_window, logit_softcap=logit_softcap, scale=scale)
    why_not = None if implementation == "xla" else _kernel_unsuitable(queries, kv_dtype)
    dense = dense_equivalent(
        lambda k, v, layer, q_pos, kv_len: (ContiguousView(k, v, layer, kv_len, kv_dtype or k.dtype), q_pos),
        sliding_window=sliding_window, logit_softcap=logit_softcap, scale=scale)
    return _nan_unless(layer_ok, _select("blockwise_attend", implementation, why_not, xla, kernel, args, scale=scale,
                                         dense=dense))


def check_view_lengths(who: str, lengths: Any, batch: int) -> None:
    """A view's ``lengths`` must be [B]: a [1] one was broadcast to every row by the XLA
    loop (rows read slots they never filled) and failed elsewhere with messages naming none
    of this. (Views a cache builds always have it.)"""
    if tuple(lengths.shape) != (batch,):
        raise ValueError(f"{who}: the view's lengths must have shape [{batch}] (one per row of the queries), got "
                         f"{list(lengths.shape)}; a hand-built view needs the tokens each row holds.")


def _check_layer(layer: Any, num_layers: int, who: str) -> None:
    """A concrete layer index outside ``[0, L)`` is a ValueError: the XLA loop's slice would
    clamp it onto a real layer (silently another layer's attention) where the kernel refuses
    it at run time. A traced one cannot be checked here (a cache's view of a traced bad
    layer is flagged ``INVALID`` and reads as empty)."""
    if isinstance(layer, jax.core.Tracer):
        return
    value = np.asarray(layer)
    if value.ndim or not np.issubdtype(value.dtype, np.integer) or not 0 <= int(value) < num_layers:
        raise ValueError(f"{who}: layer index {layer!r} is outside [0, {num_layers}) (the stacked buffers hold "
                         f"{num_layers} layers).")


def _checked_layer(layer: Any, num_layers: int, who: str) -> tuple[jax.Array, jax.Array | None]:
    """``(layer as int32, ok)``. A concrete bad layer is :func:`_check_layer`'s ValueError
    (``ok`` None). For a traced one ``ok`` says whether it is inside ``[0, L)``; the caller's
    output is NaN where it is not (:func:`_nan_unless`): the XLA loop's slice clamps it onto
    a real layer (that layer's attention came out, silently), the CPU kernel raises at run
    time, and the Pallas kernels read layer 0 instead (a GPU kernel would read outside the
    buffers). A cache's view never holds one: a bad traced layer there is layer 0 with no
    tokens."""
    _check_layer(layer, num_layers, who)
    if not isinstance(layer, jax.core.Tracer):
        return jnp.asarray(layer, jnp.int32), None
    layer = _widen(layer)
    ok = (layer >= 0) & (layer < num_layers)  # before the cast: an int64 2**32 + 1 would wrap to 1
    # out of range it is L, whatever it was: the CPU kernel's run-time check still refuses it
    return jnp.where(ok, layer, num_layers).astype(jnp.int32), ok


def pv_operands(probs: jax.Array, values: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The probabilities and values as the probability-value product takes them: in the
    values' dtype (a 16-bit cache multiplies in 16 bits, accumulating in float32), but never
    narrower than 16 bits: in a float8 cache's dtype the probabilities kept 2-3 mantissa bits,
    0.03-0.18 off the same attention over the stored values in float32 (review 77)."""
    dtype = values.dtype if jnp.dtype(values.dtype).itemsize >= 2 else jnp.float32
    return probs.astype(dtype), values.astype(dtype)


def _nan_unless(ok: jax.Array | None, out: jax.Array) -> jax.Array:
    return out if ok is None else jnp.where(ok, out, jnp.asarray(jnp.nan, out.dtype))


def _check_implementation(who: str, implementation: str) -> None:
    if implementation not in ("auto", "xla", "kernel"):
        raise ValueError(f"{who}: implementation must be 'auto', 'xla' or 'kernel', got {implementation!r}.")


_QUANTIZED_ARGS = ("keys", "values", "key_scales", "value_scales", "residual_keys", "residual_values",
                   "residual_positions", "layer", "lengths")


def dense_equivalent(view_of, *, sliding_window, logit_softcap, scale):
    """``f(queries, *args)``: the same attention as the blockwise paths, by
    :func:`jaxkv.attention.attend` over ``view.dense()`` (the layer read whole, unfilled
    slots zeroed), where ``view, q_positions = view_of(*args)``. Derivatives come from it: the XLA loop's ``while`` loops have
    traced trip counts, which reverse mode cannot transpose (``jax.grad`` under ``jit``
    failed as soon as a cache held more than one loop block, review 57)."""
    from jaxkv.attention.dense import attend  # dense imports this module

    def f(queries, *args):
        view, q_positions = view_of(*args)
        layer = view.dense()
        return attend(queries, layer.keys, layer.values, q_positions=q_positions, kv_lengths=layer.kv_lengths,
                      kv_positions=layer.kv_positions, sliding_window=sliding_window, logit_softcap=logit_softcap,
                      scale=scale)

    return f


def _select(who, implementation, why_not, xla, kernel, args, *, scale, dense):
    """Runs ``kernel(*args)`` or ``xla(*args)`` (same function) as ``implementation`` and
    ``why_not`` (the inputs' reason the kernel cannot take them, or None) decide; both take
    their derivatives from ``dense(*args)`` (:func:`dense_equivalent`), which reverse mode
    can differentiate at any length. (A traced scale: the XLA loop's own derivatives, as a
    custom derivative cannot close over it.)"""
    traced_scale = isinstance(scale, jax.core.Tracer)

    def run(fn):
        return fn(*args) if traced_scale else _with_dense_derivative(fn, dense)(*args)

    if implementation == "xla":
        return run(xla)
    if why_not is None and traced_scale:  # the XLA loop takes it as an operand
        why_not = "the scale is traced, and the kernel takes it as a compile-time constant (pass a Python float)"
    platform = _default_platform()
    if why_not is None and platform != "cpu":  # checked first: available() runs the compiler
        why_not = f"the default device is a {platform} device and the native kernel runs on CPU only"
    if why_not is None and not _kernels.available():
        why_not = "the native kernel could not be built or loaded (see the warning above, or JAXKV_CPU_KERNEL=0 is set)"
    if why_not:
        if implementation == "kernel":
            raise ValueError(f"{who}: implementation='kernel' cannot run here: {why_not}; use 'auto'.")
        return run(xla)

    def attend_(*args):
        if implementation == "kernel":  # lowering for another platform fails: no target there
            return kernel(*args)
        # Lowered for one platform, this picks one branch: no conditional in the program.
        return jax.lax.platform_dependent(*args, cpu=kernel, default=xla)

    return run(attend_)


def _with_dense_derivative(fn, dense):
    wrapped = jax.custom_jvp(fn)
    wrapped.defjvp(lambda primals, tangents: jax.jvp(dense, primals, tangents))
    return wrapped


MAX_SOFTCAP = 1e30
#: The smallest soft cap: one below float32's normal range rounds to 0 (or a denormal) in
#: the kernels' float32 attribute, where 0 means "no cap".
MIN_SOFTCAP = 1e-30
_INT32_MAX = 2**31 - 1


def window_reach(sliding_window: int) -> int:
    """``W - 1``, the farthest a query sees back through a window of ``W`` positions (it sees
    ``p - slot <= W - 1``), capped at int32's max: positions are int32, so a wider window sees
    every slot, and the Python int itself would not convert."""
    return min(sliding_window - 1, _INT32_MAX)


def _window_start(q, sliding_window: int):
    """The first slot a query at position ``q`` (int32) sees through a window of
    ``sliding_window`` positions, at least 0. ``q - W + 1`` would wrap for a very negative
    ``q``: compared before it is subtracted."""
    reach = window_reach(sliding_window)
    return jnp.where(q > reach, q - reach, 0).astype(jnp.int32)


def as_index_arrays(*xs: Any) -> tuple:
    """Positions and lengths given as Python ints or lists, as arrays (``.shape`` was an
    AttributeError; review 84); arrays, tracers and None as they are."""
    return tuple(x if x is None or hasattr(x, "shape") else jnp.asarray(x) for x in xs)


def check_int_inputs(who: str, **arrays) -> None:
    """Positions, lengths and block tables are integers on every attention path: a float
    one would be truncated by the int32 cast (position 4.9 read as 4). ``who`` ("" for none)
    starts the message."""
    for name, x in arrays.items():
        if not jnp.issubdtype(jnp.result_type(x), jnp.integer):
            raise TypeError(f"{who + ': ' if who else ''}{name} must be an integer array, got dtype "
                            f"{jnp.result_type(x)}; cast it with .astype(jnp.int32)")


def check_softcap(who: str, logit_softcap) -> None:
    """A soft cap is in ``[MIN_SOFTCAP, MAX_SOFTCAP]``: an infinite one makes every logit
    ``inf * tanh(x / inf) = inf * 0 = NaN``, and past about 1e30 ``x / cap`` leaves float32's
    normal range (a cap of 3e38 made the softmax uniform, one past float32's max NaN)."""
    if logit_softcap is not None and not MIN_SOFTCAP <= logit_softcap <= MAX_SOFTCAP:
        raise ValueError(f"{who}: logit_softcap must be in [{MIN_SOFTCAP:g}, {MAX_SOFTCAP:g}], or None (an infinite "
                         f"cap makes every logit inf * 0 = NaN, and a cap that rounds to float32 0 would read as "
                         f"no cap in the kernels; Gemma-2 uses 30 and 50), got {logit_softcap!r}.")


def _loop_options(who: str, num_tokens: int, sliding_window, logit_softcap, block_size) -> int:
    """Checks the options both blockwise entries share; returns the block size (default:
    512 slots for up to 16 queries, 128 for prefill chunks; see ``blockwise_attend``)."""
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
        raise ValueError(f"{who}: sliding_window must be a positive int, got {sliding_window!r}.")
    check_softcap(who, logit_softcap)
    if block_size is None:
        block_size = 512 if num_tokens <= 16 else 128
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"{who}: block_size must be a positive int, got {block_size!r}.")
    return block_size


def _default_platform() -> str:
    """The platform a computation traced now runs on: the default device's, if one is set
    (``jax.default_device``), else the default backend's."""
    device = jax.config.jax_default_device
    if device is None:
        return jax.default_backend()
    return getattr(device, "platform", device)


# The kernel's limits: a decode step or a short verify chunk; longer chunks (prefill) are
# matrix products, which XLA's dot does better than the kernel's per-query loops.
KERNEL_MAX_QUERIES = 16


def _kernel_unsuitable(queries: jax.Array, kv_dtype: Any) -> str | None:
    if queries.shape[2] > KERNEL_MAX_QUERIES:
        return f"{queries.shape[2]} queries, the kernel takes at most {KERNEL_MAX_QUERIES}"
    supported = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
    if queries.dtype not in supported or kv_dtype not in supported:
        return f"dtypes {queries.dtype} (queries) and {kv_dtype} (cache); the kernel takes float32 and bfloat16"
    return None  # bf16 may come as its uint16 bits: the kernel reads 16-bit rows as bf16 either way


def _ffi_call(queries, *operands, sliding_window, logit_softcap, scale, paged, bits=0):
    """The kernel's custom call; ``operands``: keys, values, layer, q_pos, kv_len and, when
    ``paged``, the block table (keys/values are then the page pool); with ``bits`` (8 or 4),
    key and value scales follow the keys and values (int8 codes, or uint8 bytes of two int4
    codes), and, not paged, the residual's keys, values and positions."""
    # vmap never reaches this call: _batchable_kernel maps it first.
    targets = {(False, False): _kernels.TARGET, (True, False): _kernels.PAGED_TARGET,
               (False, True): _kernels.QUANTIZED_TARGET, (True, True): _kernels.PAGED_QUANTIZED_TARGET}
    target = targets[bool(paged), bool(bits)]
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(queries.shape, queries.dtype))
    # a window past int64 sees what one of 2**62 does (positions are int32)
    attributes = dict(window=np.int64(min(sliding_window or 0, 2**62)), softcap=np.float32(logit_softcap or 0.0),
                      scale=np.float32(scale))
    if bits:
        attributes["bits"] = np.int64(bits)
    return call(queries, *operands, **attributes)


def _local_axes(mesh, queries, keys, block_table=None):
    """The mesh axes of the cache's rows and kv heads that each device can keep local.

    ``queries``, ``keys`` and ``block_table`` are the operands' shapes with shardings, as
    ``custom_partitioning`` hands them over. Rows split freely; kv heads split only where the
    query heads split the same way (so each device holds whole groups: query head i reads kv
    head i // G). A paged pool (``block_table`` given) is shared by all rows: its rows are
    the block table's, and every device keeps every page (of its kv heads).
    """
    spec = tuple(getattr(keys.sharding, "spec", ())) + (None,) * 5
    rows, heads = spec[1], spec[2]
    if block_table is not None:
        rows = (tuple(getattr(block_table.sharding, "spec", ())) + (None,))[0]

    def size(axes):
        names = axes if isinstance(axes, tuple) else (axes,)
        return int(np.prod([mesh.shape[name] for name in names if name is not None]))

    q_heads, kv_heads = queries.shape[1], keys.shape[2]
    if heads is not None and (q_heads % size(heads) or kv_heads % size(heads)):
        heads = None
    return rows, heads


@lru_cache(maxsize=None)
def _partitioned_kernel(sliding_window, logit_softcap, scale, paged=False, bits=0):
    """The kernel call, split by rows and kv heads over a sharded cache.

    Without this, XLA's partitioner knows nothing of the custom call and gathers the whole
    cache onto every device before it. Each device now runs the kernel on its own rows and
    heads; the output comes back sharded the same way. On one device it is the plain call.
    A paged pool splits by kv heads only (any row may read any page); its block table
    splits by rows.
    """
    static = dict(sliding_window=sliding_window, logit_softcap=logit_softcap, scale=scale, paged=paged, bits=bits)

    @custom_partitioning
    def call(*operands):
        return _ffi_call(*operands, **static)

    def shardings(mesh, arg_shapes):
        rows, heads = _local_axes(mesh, arg_shapes[0], arg_shapes[1], arg_shapes[-1] if paged else None)
        named = lambda *spec: NamedSharding(mesh, PartitionSpec(*spec))  # noqa: E731
        cache = named(None, None, heads, None, None) if paged else named(None, rows, heads, None, None)
        quantized = (named(None, None if paged else rows, heads, None),) * 2 if bits else ()  # the scales
        if bits and not paged:  # the residual ring: keys, values [B, H, R, D], positions [B, R]
            quantized += (named(rows, heads, None, None),) * 2 + (named(rows, None),)
        args = (named(rows, heads, None, None), cache, cache, *quantized, named(), named(rows, None), named(rows))
        if paged:
            args += (named(rows, None),)
        return args, named(rows, heads, None, None)

    def infer(mesh, arg_shapes, result_shape):
        return shardings(mesh, arg_shapes)[1]

    def partition(mesh, arg_shapes, result_shape):
        args, out = shardings(mesh, arg_shapes)
        return mesh, partial(_ffi_call, **static), out, args

    call.def_partition(
        partition=partition,
        infer_sharding_from_operands=infer,
        # queries [B, Hq, T, D], keys and values [L, B, H, S, D] (paged: pools [L, P, H, ps, D];
        # quantized: codes [L, B, H, S, D'] and scales [L, B, H, S], then, not paged, the
        # residual's keys and values [B, H, R, D] and positions [B, R]), layer [], q_pos [B, T],
        # kv_len [B] (paged: block_table [B, M])
        sharding_rule=(
            "b h t d, l p k s e, l p k s e, l p k s, l p k s, , b t, b, b m -> b h t d" if paged and bits
            else "b h t d, l p k s d, l p k s d, , b t, b, b m -> b h t d" if paged
            else "b h t d, l b k s e, l b k s e, l b k s, l b k s, b k r d, b k r d, b r, , b t, b -> b h t d" if bits
            else "b h t d, l b k s d, l b k s d, , b t, b -> b h t d"
        ),
    )
    return call


@lru_cache(maxsize=None)
def _batchable_kernel(sliding_window, logit_softcap, scale, paged=False, bits=0):
    """The partitioned kernel under ``jax.vmap``: one call per mapped element, in sequence
    (``lax.map``), as the partitioning wrapper has no batching rule of its own."""
    call = _partitioned_kernel(sliding_window, logit_softcap, scale, paged, bits)

    @jax.custom_batching.custom_vmap
    def batchable(*args):
        return call(*args)

    @batchable.def_vmap
    def _rule(axis_size, in_batched, *args):
        mapped = tuple(x for x, b in zip(args, in_batched) if b)

        def one(slices):  # unmapped operands (a shared cache, say) are used as they are
            it = iter(slices)
            return batchable(*[next(it) if b else x for x, b in zip(args, in_batched)])

        return jax.lax.map(one, mapped), True

    return batchable


def _kernel_call(*operands, sliding_window, logit_softcap, scale, paged=False, bits=0):
    call = _batchable_kernel(
        sliding_window, None if logit_softcap is None else float(logit_softcap), float(scale), paged, bits
    )
    return call(*operands)


def _int32_indices(*indices):
    """Start indices for ``lax.dynamic_slice``, all int32: it needs one integer type, and
    with ``jax_enable_x64`` Python ints and loop counters would come as int64 beside an int32
    layer index."""
    return tuple(jnp.asarray(i, jnp.int32) for i in indices)


def _xla_loop(
    queries, keys, values, layer, q_pos, kv_len, *, sliding_window, logit_softcap, scale, block_size, kv_dtype=None
):
    """The blockwise loop in XLA ops (any platform, any dtype, differentiable forward)."""
    _, batch, num_kv_heads, num_slots, head_dim = keys.shape
    kv_dtype = keys.dtype if kv_dtype is None else kv_dtype

    def read_block(offset, size):
        start_idx = _int32_indices(layer, 0, 0, offset, 0)
        shape = (1, batch, num_kv_heads, size, head_dim)
        return tuple(from_bits(jax.lax.dynamic_slice(x, start_idx, shape)[0], kv_dtype) for x in (keys, values))

    return _blockwise_loop(
        queries, read_block, num_slots, num_kv_heads, q_pos, kv_len, sliding_window=sliding_window,
        logit_softcap=logit_softcap, scale=scale, block_size=block_size,
    )


#: Up to this many queries (a decode step, a verify chunk), the last partial block is read
#: at the smallest of 4 sizes that holds it; longer chunks read whole blocks.
PARTIAL_BLOCK_MAX_QUERIES = 16


def _blockwise_loop(
    queries, read_block, num_slots, num_kv_heads, q_pos, kv_len, *, sliding_window, logit_softcap, scale, block_size,
    whole_last_block: bool = True,
):
    """The online-softmax loop over blocks of slots; ``read_block(offset, size)`` returns the
    block's keys and values ``[B, H, size, D]`` (sliced from a buffer, or dequantized).
    With ``whole_last_block``, chunks of more than ``PARTIAL_BLOCK_MAX_QUERIES`` queries
    read the last partial block whole."""
    batch, num_q_heads, num_tokens, head_dim = queries.shape
    if num_tokens == 0 or batch == 0:  # nothing to attend (the kernel returns the empty array too)
        return jnp.zeros(queries.shape, queries.dtype)
    groups = num_q_heads // num_kv_heads
    block = min(block_size, num_slots)
    q = queries.reshape(batch, num_kv_heads, groups, num_tokens, head_dim)

    # Trip count from the data: blocks past every row's fill (and past every query) are
    # never read; with a window, blocks before every query's window are skipped too.
    # Lengths past the capacity read as the capacity (a block is never read twice), and a
    # query position is capped below S before the + 1 (2**31 - 1 would wrap to negative).
    kv_len = jnp.minimum(kv_len, num_slots)
    end = jnp.minimum(jnp.max(kv_len), jnp.minimum(jnp.max(q_pos), num_slots - 1) + 1)
    stop = (end + block - 1) // block
    start = jnp.int32(0)
    if sliding_window is not None:
        start = _window_start(jnp.min(q_pos), sliding_window) // block
    # Blocks that every query of every row sees in full (filled, not in the future, inside
    # the window) need no mask at all: they run a lighter loop body. Only the blocks at the
    # edges (the last, partly filled one, ragged rows, the window's start) pay for masks.
    full_end = jnp.minimum(jnp.min(kv_len), jnp.minimum(jnp.min(q_pos), num_slots - 1) + 1)
    fast_lo = start
    if sliding_window is not None:
        first = _window_start(jnp.max(q_pos), sliding_window)  # ceil(first / block) without first + block - 1
        fast_lo = jnp.maximum(start, first // block + (first % block != 0))
    fast_hi = jnp.clip(jnp.maximum(full_end, 0) // block, fast_lo, stop)
    fast_lo = jnp.minimum(fast_lo, fast_hi)

    def read(j, size, clamp):
        first = jnp.asarray(j, jnp.int32) * size  # int32 under x64 too (j may be a Python 0)
        # The last block may run past S: slice the final `size` slots instead (a clamped
        # read is harmless here) and mask out the slots an earlier block already covered.
        offset = jnp.minimum(first, num_slots - size) if clamp else first
        k_blk, v_blk = read_block(offset, size)  # [B, H, blk, D]
        # A slot with a non-finite key element gets a NaN logit (as its raw product would be
        # non-finite) from a product over zeroed elements: the derivatives then never meet
        # 0 * NaN from a slot the queries do not see (jax.grad was NaN everywhere).
        finite_keys = jnp.isfinite(k_blk)
        bad_keys = ~jnp.all(finite_keys, axis=-1)[:, :, :, None, None]  # [B, H, blk, 1, 1]
        k_blk = jnp.where(finite_keys, k_blk, jnp.zeros((), k_blk.dtype))
        # Slot-major logits [B, H, blk, G, T]: keys stream through as the row-major operand
        # of the product, which XLA:CPU runs several times faster than the transposed form.
        logits = jnp.einsum("bhsd,bhgtd->bhsgt", k_blk, q, preferred_element_type=jnp.float32) * scale
        return first, offset, jnp.where(bad_keys, jnp.nan, logits), v_blk

    def softcap(logits):
        return logits if logit_softcap is None else logit_softcap * jnp.tanh(logits / logit_softcap)

    def accumulate(carry, logits, v_blk, weights_fn):
        running_max, running_sum, acc = carry
        new_max = jnp.maximum(running_max, jnp.max(logits, axis=2))  # [B, H, G, T]
        safe_max = jnp.where(jnp.isfinite(new_max), new_max, 0.0)
        weights = weights_fn(jnp.exp(logits - safe_max[:, :, None]))
        correction = jnp.where(jnp.isfinite(running_max), jnp.exp(running_max - safe_max), 0.0)
        acc = acc * correction[..., None] + jnp.einsum(
            "bhsgt,bhsd->bhgtd", *pv_operands(weights, v_blk), preferred_element_type=jnp.float32
        )
        return new_max, running_sum * correction + jnp.sum(weights, axis=2), acc

    def masked_body(j, carry, size=block):
        first, offset, logits, v_blk = read(j, size, clamp=True)
        slots = offset + jnp.arange(size, dtype=jnp.int32)  # [blk]
        filled = (slots[None, :] < kv_len[:, None]) & (slots[None, :] >= first)  # [B, blk]
        visible = filled[:, :, None] & (slots[None, :, None] <= q_pos[:, None, :])  # [B, blk, T]
        if sliding_window is not None:
            visible = visible & (q_pos[:, None, :] - slots[None, :, None] <= window_reach(sliding_window))
        visible = visible[:, None, :, None, :]  # [B, 1, blk, 1, T]
        # Slots a query does not see may hold anything (NaN, inf): only the visible ones may
        # mark it. Non-finite values are zeroed, so 0 * NaN never enters another query's sum.
        finite_values = jnp.isfinite(v_blk)
        bad_slot = ~jnp.all(finite_values, axis=-1)[:, :, :, None, None] | ~jnp.isfinite(logits)  # [B, H, blk, G, T]
        marked = jnp.any(visible & bad_slot, axis=2)  # [B, H, G, T]
        keep = visible & ~bad_slot  # the soft cap sees only kept logits (tanh' of NaN is NaN)
        logits = jnp.where(keep, softcap(jnp.where(keep, logits, 0.0)), -jnp.inf)
        v_blk = jnp.where(finite_values & filled[:, None, :, None], v_blk, jnp.zeros((), v_blk.dtype))
        running_max, running_sum, acc = accumulate(carry, logits, v_blk, lambda w: jnp.where(visible, w, 0.0))
        return running_max, running_sum, jnp.where(marked[..., None], jnp.nan, acc)

    def full_body(j, carry):  # every slot of the block is filled and visible to every query
        _, _, logits, v_blk = read(j, block, clamp=False)
        # Every query sees every slot, so plain IEEE arithmetic marks the right rows: a
        # non-finite logit becomes NaN (a -inf one would otherwise just weigh 0) and NaN
        # stays in acc; an inf value leaves inf or NaN there. The end turns both into NaN rows.
        logits = softcap(jnp.where(jnp.isfinite(logits), logits, jnp.nan))
        return accumulate(carry, logits, v_blk, lambda w: w)

    stats_shape = (batch, num_kv_heads, groups, num_tokens)
    carry = (
        jnp.full(stats_shape, -jnp.inf, jnp.float32),
        jnp.zeros(stats_shape, jnp.float32),
        jnp.zeros(stats_shape + (head_dim,), jnp.float32),
    )
    if num_slots <= block:  # one block holds the whole buffer: no loops, one masked pass
        carry = masked_body(0, carry)
    else:
        if sliding_window is not None:  # without a window, fast_lo == start == 0: no blocks before
            carry = jax.lax.fori_loop(start, fast_lo, masked_body, carry)
        carry = jax.lax.fori_loop(fast_lo, fast_hi, full_body, carry)
        # Past the unmasked range: whole blocks that end at or before the last filled slot
        # (ragged rows), then the last partial block, if any. For a decode step or a short
        # verify chunk that block is read as the smallest of block, block/2, block/4, block/8
        # slots that holds its tokens: a step just past a block boundary reads a few slots,
        # not a whole, mostly empty block. A prefill chunk's queries outweigh a partial
        # block's read, so it reads whole blocks; each extra size is one more loop body to
        # compile per layer (seven bodies took ~0.5 s of XLA:CPU compile per layer of a
        # 32-token prefill; benchmarks/bench_first_call.py).
        mid = jnp.clip(end // block, fast_hi, stop)
        remaining = end - mid * block  # in [0, block)
        sizes = [block // d for d in (1, 2, 4, 8) if block % d == 0 and block // d >= 16] or [block]
        if whole_last_block and num_tokens > PARTIAL_BLOCK_MAX_QUERIES:
            sizes = [block]
        # One fori_loop of 0 or 1 trips per size, not lax.switch: a conditional's operands
        # (the whole stacked buffers) would be copied into it on every call. The full-size
        # one is the whole-block loop's last trip.
        pick = jnp.where(remaining > 0, sum((size >= remaining).astype(jnp.int32) for size in sizes), 0)
        carry = jax.lax.fori_loop(fast_hi, mid + (pick == 1).astype(jnp.int32), masked_body, carry)
        for i, size in enumerate(sizes[1:], start=2):
            first = mid * (block // size)
            trips = (pick == i).astype(jnp.int32)
            carry = jax.lax.fori_loop(first, first + trips, partial(masked_body, size=size), carry)
    _, total, acc = carry
    out = acc / jnp.where(total > 0, total, 1.0)[..., None]
    out = jnp.where(jnp.all(jnp.isfinite(out), axis=-1, keepdims=True), out, jnp.nan)
    return out.reshape(batch, num_q_heads, num_tokens, head_dim).astype(queries.dtype)


def quantized_blockwise_attend(
    queries: jax.Array,  # [B, Hq, T, D]
    view,  # jaxkv.caches.QuantizedView
    *,
    q_positions: jax.Array,  # [B, T] int
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    scale: float | None = None,
    block_size: int | None = None,
    implementation: str = "auto",
) -> jax.Array:  # [B, Hq, T, D]
    """:func:`blockwise_attend` over a quantized layer, dequantizing block by block.

    Two implementations, chosen by ``implementation`` as for :func:`blockwise_attend`:

    * On CPU, up to 16 queries, float32/bfloat16 queries and model dtype, float32/bfloat16
      scales: the native kernel reads the int8 codes (or the bytes of two int4 codes) and the
      per-token scales in place and dequantizes each row as it reads it: a key's scale
      multiplies its logit, a value's its weight; a slot the residual holds is read from the
      residual's exact token instead. It computes in float32 (the XLA loop rounds dequantized
      elements to the model dtype first, so bfloat16 results may differ in the last bits).
    * Otherwise the XLA loop: each block of codes and its scales is sliced from the stacked
      buffers and dequantized inside the loop (the whole layer is never materialised), and
      the tokens the view's full-precision residual holds replace their quantized copies in
      the block.

    Cost scales with tokens stored, like the contiguous path. Same contract, shapes and
    errors as :func:`blockwise_attend`.
    """
    if queries.ndim != 4:
        raise ValueError(f"quantized_blockwise_attend: expected queries [B, Hq, T, D], got shape {queries.shape}.")
    batch, num_q_heads, num_tokens, head_dim = queries.shape
    _, kv_batch, num_kv_heads, num_slots, stored = view.keys.shape
    if kv_batch != batch or num_q_heads % num_kv_heads or view.residual_keys.shape[-1] != head_dim:
        raise ValueError(
            f"quantized_blockwise_attend: queries {queries.shape} do not fit the quantized layer "
            f"{view.keys.shape} (same batch and head_dim; query heads a multiple of kv heads)."
        )
    if q_positions.shape != (batch, num_tokens):
        raise ValueError(f"quantized_blockwise_attend: q_positions must be [{batch}, {num_tokens}], got {q_positions.shape}.")
    check_view_lengths("quantized_blockwise_attend", view.lengths, batch)
    check_int_inputs("quantized_blockwise_attend", q_positions=q_positions, lengths=view.lengths,
                     residual_positions=view.residual_positions)
    block_size = _loop_options("quantized_blockwise_attend", num_tokens, sliding_window, logit_softcap, block_size)
    _check_implementation("quantized_blockwise_attend", implementation)
    scale = head_dim**-0.5 if scale is None else scale
    layer, layer_ok = _checked_layer(view.layer, view.keys.shape[0], "quantized_blockwise_attend")
    args = (queries, view.keys, view.values, view.key_scales, view.value_scales, view.residual_keys,
            view.residual_values, view.residual_positions.astype(jnp.int32), layer,
            q_positions.astype(jnp.int32), view.lengths.astype(jnp.int32))

    def xla(queries, keys, values, key_scales, value_scales, residual_keys, residual_values, residual_positions, layer,
            q_pos, kv_len):
        codes = view._replace(keys=keys, values=values, key_scales=key_scales, value_scales=value_scales,
                              residual_keys=residual_keys, residual_values=residual_values,
                              residual_positions=residual_positions, layer=layer, lengths=kv_len)
        return _quantized_loop(queries, codes, q_pos, sliding_window=sliding_window, logit_softcap=logit_softcap,
                               scale=scale, block_size=block_size)

    kernel = partial(_kernel_call, sliding_window=sliding_window, logit_softcap=logit_softcap, scale=scale,
                     bits=view.bits)
    why_not = None if implementation == "xla" else _quantized_kernel_unsuitable(queries, view)
    dense = dense_equivalent(  # args after the queries: the view's arrays, q_pos before the lengths
        lambda *rest: (view._replace(**dict(zip(_QUANTIZED_ARGS, rest[:-2] + rest[-1:]))), rest[-2]),
        sliding_window=sliding_window, logit_softcap=logit_softcap, scale=scale)
    return _nan_unless(layer_ok, _select("quantized_blockwise_attend", implementation, why_not, xla, kernel, args,
                                         scale=scale, dense=dense))


def _quantized_kernel_unsuitable(queries: jax.Array, view) -> str | None:
    if view.residual_keys.dtype != jnp.dtype(view.dtype):
        return f"residual tokens of dtype {view.residual_keys.dtype} in a {jnp.dtype(view.dtype)} view"
    if jnp.dtype(view.scale_dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        return f"scales of dtype {jnp.dtype(view.scale_dtype)}; the kernel reads float32 and bfloat16 scales"
    return _kernel_unsuitable(queries, jnp.dtype(view.dtype))


def _quantized_loop(queries, view, q_positions, *, sliding_window, logit_softcap, scale, block_size):
    """The XLA loop of :func:`quantized_blockwise_attend`."""
    from jaxkv.caches.quantized import dequantize  # the codec lives with its storage

    batch, _, _, _ = queries.shape
    _, _, num_kv_heads, num_slots, stored = view.keys.shape
    layer = jnp.asarray(view.layer, jnp.int32)
    rows = jnp.arange(batch, dtype=jnp.int32)[:, None]
    residual_used = view.residual_used()  # [B, R]

    def read_block(offset, size):
        codes_at = _int32_indices(layer, 0, 0, offset, 0)
        scales_at = codes_at[:4]
        codes_shape, scales_shape = (1, batch, num_kv_heads, size, stored), (1, batch, num_kv_heads, size)
        blocks = []
        for codes, scales, exact in (
            (view.keys, view.key_scales, view.residual_keys),
            (view.values, view.value_scales, view.residual_values),
        ):
            block_scales = from_bits(jax.lax.dynamic_slice(scales, scales_at, scales_shape)[0], view.scale_dtype)
            block = dequantize(
                jax.lax.dynamic_slice(codes, codes_at, codes_shape)[0], block_scales, view.bits, view.dtype
            )
            if exact.shape[2]:  # the residual's exact copies win over the quantized ones
                local = view.residual_positions - offset
                slot = jnp.where(residual_used & (local >= 0) & (local < size), local, size)  # `size`: dropped
                block = block.at[rows, :, slot].set(exact.transpose(0, 2, 1, 3).astype(block.dtype), mode="drop")
            blocks.append(block)
        return tuple(blocks)

    return _blockwise_loop(
        queries, read_block, num_slots, num_kv_heads, q_positions.astype(jnp.int32), view.lengths.astype(jnp.int32),
        sliding_window=sliding_window, logit_softcap=logit_softcap, scale=scale, block_size=block_size,
    )


def paged_blockwise_attend(
    queries: jax.Array,  # [B, Hq, T, D]
    view,  # jaxkv.caches.PagedView
    *,
    q_positions: jax.Array,  # [B, T] int
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    scale: float | None = None,
    block_size: int | None = None,
    implementation: str = "auto",
) -> jax.Array:  # [B, Hq, T, D]
    """:func:`blockwise_attend` over a paged layer, reading each slot through the block table.

    Two implementations, as for :func:`blockwise_attend` (``implementation`` chooses the
    same way):

    * On CPU, up to 16 queries, float32/bfloat16 queries and pages (or int8/int4 pages
      with float32/bfloat16 scales, dequantized in registers as for
      :func:`quantized_blockwise_attend`): the native kernel reads slot ``s`` of row ``b``
      at offset ``s % ps`` of page ``block_table[b, s // ps]`` in place, on all cores (the
      same loops as the contiguous kernel). Over a sharded cache each device runs it on its
      rows (the block table's split) and kv heads (the pool's), with every page of its heads.
    * Elsewhere: the XLA loop. A block of the loop is a run of
      whole pages (or a part of one page, for a last block smaller than a page): their ids
      are sliced from the block table and the pages gathered from the pool (and
      dequantized, for int8/int4 pages).

    Cost scales with tokens stored, like the contiguous path. Same contract, shapes and
    errors as :func:`blockwise_attend`; ``block_size`` (the XLA loop's) must be a power of two.
    """
    if queries.ndim != 4:
        raise ValueError(f"paged_blockwise_attend: expected queries [B, Hq, T, D], got shape {queries.shape}.")
    batch, num_q_heads, num_tokens, head_dim = queries.shape
    _, _, num_kv_heads, page_size, _ = view.keys.shape
    if view.block_table.shape[0] != batch or num_q_heads % num_kv_heads:
        raise ValueError(
            f"paged_blockwise_attend: queries {queries.shape} do not fit the paged layer (pool "
            f"{view.keys.shape}, block table {view.block_table.shape}): same batch, query heads a "
            "multiple of kv heads."
        )
    if q_positions.shape != (batch, num_tokens):
        raise ValueError(f"paged_blockwise_attend: q_positions must be [{batch}, {num_tokens}], got {q_positions.shape}.")
    check_view_lengths("paged_blockwise_attend", view.lengths, batch)
    check_int_inputs("paged_blockwise_attend", q_positions=q_positions, lengths=view.lengths,
                     block_table=view.block_table)
    block_size = _loop_options("paged_blockwise_attend", num_tokens, sliding_window, logit_softcap, block_size)
    if block_size & (block_size - 1):
        raise ValueError(f"paged_blockwise_attend: block_size must be a power of two (pages are), got {block_size}.")
    if page_size & (page_size - 1):  # PagedCache.init refuses them; a hand-built view is read block by page
        raise ValueError(
            f"paged_blockwise_attend: the view's page size must be a power of two, got {page_size} "
            "(a block would straddle two pages); build the cache with PagedCache.init(page_size=2**k)."
        )
    _check_implementation("paged_blockwise_attend", implementation)
    scale = head_dim**-0.5 if scale is None else scale
    scales = (view.key_scales, view.value_scales) if view.bits else ()
    layer, layer_ok = _checked_layer(view.layer, view.keys.shape[0], "paged_blockwise_attend")
    table = view.block_table
    if table.dtype != jnp.int32:  # e.g. int64 under x64: the kernel reads int32
        # Ids a cast would wrap (past int32's range: invalid page ids anyway) read as unmapped
        # (-1). Only bounds the dtype can pass are compared: a Python -1 or 2**31 - 1 would
        # itself wrap in an unsigned or a narrow table.
        info = jnp.iinfo(table.dtype)
        wraps = jnp.zeros(table.shape, bool)
        if info.max > _INT32_MAX:
            wraps = wraps | (table > jnp.asarray(_INT32_MAX, table.dtype))
        if info.min < -_INT32_MAX - 1:
            wraps = wraps | (table < jnp.asarray(-1, table.dtype))
        table = jnp.where(wraps, -1, table.astype(jnp.int32))
    args = (queries, view.keys, view.values, *scales, layer, q_positions.astype(jnp.int32),
            view.lengths.astype(jnp.int32), table)

    def xla(queries, keys, values, *rest):
        if view.bits:
            key_scales, value_scales, layer, q_pos, kv_len, table = rest
        else:
            (layer, q_pos, kv_len, table), key_scales, value_scales = rest, view.key_scales, view.value_scales
        pages = view._replace(keys=keys, values=values, key_scales=key_scales, value_scales=value_scales, layer=layer,
                              lengths=kv_len, block_table=table)

        def read_block(offset, size):
            # Offsets are multiples of `size`; sizes and pages are powers of two, so a block is
            # whole pages or lies inside one page.
            if size >= page_size:
                return pages.gather(jax.lax.dynamic_slice_in_dim(table, offset // page_size, size // page_size, axis=1))
            keys, values = pages.gather(jax.lax.dynamic_slice_in_dim(table, offset // page_size, 1, axis=1))
            within = offset % page_size
            return tuple(jax.lax.dynamic_slice_in_dim(x, within, size, axis=2) for x in (keys, values))

        # Whole last blocks made paged prefill chunks slower (a block is a gather of its
        # pages: 1.09x-1.45x for 128-token chunks ending inside a block, in four runs of
        # benchmarks/bench_first_call.py), so pages keep the four sizes for every chunk.
        return _blockwise_loop(
            queries, read_block, view.num_slots, num_kv_heads, q_pos, kv_len, sliding_window=sliding_window,
            logit_softcap=logit_softcap, scale=scale, block_size=block_size, whole_last_block=False,
        )

    why_not = None
    if implementation != "xla":
        if view.bits and jnp.dtype(view.scale_dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
            why_not = f"scales of dtype {jnp.dtype(view.scale_dtype)}; the kernel reads float32 and bfloat16 scales"
        else:
            why_not = _kernel_unsuitable(queries, jnp.dtype(view.dtype))
    kernel = partial(_kernel_call, sliding_window=sliding_window, logit_softcap=logit_softcap, scale=scale, paged=True,
                     bits=view.bits or 0)
    names = (("keys", "values", "key_scales", "value_scales") if view.bits else ("keys", "values")) + (
        "layer", "q_pos", "lengths", "block_table")

    def paged_view(*arrays):
        named = dict(zip(names, arrays))
        return view._replace(**{k: v for k, v in named.items() if k != "q_pos"}), named["q_pos"]

    dense = dense_equivalent(paged_view, sliding_window=sliding_window, logit_softcap=logit_softcap, scale=scale)
    return _nan_unless(layer_ok, _select("paged_blockwise_attend", implementation, why_not, xla, kernel, args,
                                         scale=scale, dense=dense))
