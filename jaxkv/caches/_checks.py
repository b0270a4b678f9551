"""Input checks and flag rules shared by every cache kind (one implementation each)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array

_INT32_MAX = int(np.iinfo(np.int32).max)

#: Flag bit: a write fell past ``max_length`` and was dropped.
OVERFLOW = 1
#: Flag bit: a traced row/layer index or ``num_new`` was out of range.
INVALID = 2
#: Flag bit: a paged cache's pool had no free page for a write; the row stored none of it.
OUT_OF_PAGES = 4


class CacheError(ValueError):
    """Raised on the host by ``StaticCache.check`` when a traced operation set a flag."""


# --------------------------------------------------------------------------- helpers


def _is_traced(*xs: Any) -> bool:
    """Whether any of ``xs`` cannot be read on this host: a tracer, or a global array with
    shards on other processes (``np.asarray`` of it raises there); the checks that need
    values then take the traced path (flags, poisoned rows) instead."""
    return any(isinstance(x, jax.core.Tracer) or (isinstance(x, jax.Array) and not x.is_fully_addressable)
               for x in xs)


def _static_int(x: Any) -> int | None:
    """Returns ``x`` as a Python int when it is a concrete integer scalar, else None."""
    if isinstance(x, bool):
        return None
    if isinstance(x, (int, np.integer)):
        return int(x)
    if isinstance(x, (np.ndarray, jax.Array)) and not _is_traced(x):
        if x.ndim == 0 and jnp.issubdtype(x.dtype, jnp.integer):
            return int(x)
    return None


def _flag(condition: Array, bit: int) -> Array:
    # Explicit int32 operands: a weak-typed int64 under jax_enable_x64 OR-ed into an int32
    # array crashes jaxlib 0.10.2 on CPU (segfault), and flags must stay int32 anyway.
    return jnp.where(condition, jnp.int32(bit), jnp.int32(0))


def _as_array(x: Any, name: str, who: str) -> Array:
    if x is None:  # JAX's "None is not a valid value for jnp.array" named no argument (review 84)
        raise TypeError(f"{who}: {name} is None; pass a [batch, kv_heads, new_tokens, head_dim] float array.")
    if getattr(x, "requires_grad", False) and hasattr(x, "detach"):
        x = x.detach()  # a torch tensor out of a forward pass without no_grad: its values, as they are
    try:
        return jnp.asarray(x)
    except (TypeError, RuntimeError) as err:  # e.g. a torch bfloat16 or CUDA tensor, which NumPy cannot hold
        raise TypeError(
            f"{who}: {name} ({type(x).__name__}) could not be read as an array: {err}. A torch bfloat16 tensor: "
            "pass tensor.float(), or jax.dlpack.from_dlpack(tensor); a CUDA tensor: tensor.cpu()."
        ) from None


def _check_states(key_states: Any, value_states: Any, who: str, *, abstract: bool = False) -> tuple[Array, Array]:
    """Rank-4 float states of one shape (keys and values may differ in float dtype, as in
    transformers' DynamicCache); ``abstract``: ``jax.ShapeDtypeStruct`` states are checked
    as they are."""
    if not (abstract and isinstance(key_states, jax.ShapeDtypeStruct)):
        key_states = _as_array(key_states, "key_states", who)
    if not (abstract and isinstance(value_states, jax.ShapeDtypeStruct)):
        value_states = _as_array(value_states, "value_states", who)
    for name, x in (("key_states", key_states), ("value_states", value_states)):
        if x.ndim != 4:
            raise ValueError(
                f"{who}: {name} must have rank 4 [batch, kv_heads, new_tokens, head_dim], "
                f"got shape {x.shape}. Transpose or reshape your states to that layout."
            )
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(
                f"{who}: {name} has dtype {x.dtype}, which a key/value cache cannot store; "
                "expected a floating dtype (float32, bfloat16, float16). Cast the states "
                "with .astype(...) first."
            )
    if key_states.shape != value_states.shape:
        raise ValueError(
            f"{who}: key_states and value_states must have the same shape, got "
            f"{key_states.shape} and {value_states.shape}."
        )
    return key_states, value_states


def _check_layout(states: Array, expected: tuple[int, int, int], who: str) -> None:
    batch, heads, head_dim = expected
    got = (states.shape[0], states.shape[1], states.shape[3])
    for name, e, g in zip(("batch", "kv_heads", "head_dim"), expected, got):
        if e != g:
            raise ValueError(
                f"{who}: states have {name}={g} but the cache holds {name}={e} "
                f"(states shape {states.shape}, expected [{batch}, {heads}, T, {head_dim}])."
            )


def _check_row_indices(indices: Any, batch: int, who: str) -> Array:
    # Concrete indices are read on the host in their own dtype (jnp.asarray would narrow
    # an int64 2**32 + 1 to row 1 before the range check); traced ones are range-checked
    # in their own dtype too, and a bad one becomes -1, which every row op treats as out of
    # range (the row is emptied and flagged INVALID).
    traced = _is_traced(indices)
    if not traced and not hasattr(indices, "dtype") and np.shape(indices) == (0,):
        indices = np.zeros((0,), np.int32)  # an empty list: no rows (NumPy would call it float64)
    indices = indices if traced else np.asarray(indices)
    if indices.ndim != 1 or not jnp.issubdtype(indices.dtype, jnp.integer):
        raise ValueError(
            f"{who}: indices must be a 1-D integer array of batch rows, got shape "
            f"{indices.shape} and dtype {indices.dtype}."
        )
    if not traced:
        bad = (indices < 0) | (indices >= batch)
        if bad.any():
            raise ValueError(
                f"{who}: row index {int(indices[bad][0])} (position {int(np.argmax(bad))}) is out "
                f"of range for a cache with batch size {batch}; valid rows are 0..{batch - 1}."
            )
        return indices.astype(np.int32)  # in range, so narrowing cannot wrap
    return _narrow_in_range(indices, batch)


def _distinct_entries(idx: Any, batch: int, who: str, padding: str) -> Array:
    """``idx`` (int[N]; entries ``>= batch`` are padding or skipped) with each row named
    once: a row named again is a ValueError when ``idx`` is concrete; traced, its entries
    after the first become padding (``batch``), so the first wins on every backend (a
    scatter of two entries onto one row lands either, leaf by leaf)."""
    if not _is_traced(idx):
        host = np.asarray(idx).reshape(-1)
        values, counts = np.unique(host[(host >= 0) & (host < batch)], return_counts=True)
        if (counts > 1).any():
            raise ValueError(
                f"{who}: rows {values[counts > 1].tolist()} appear more than once in {host.tolist()}; name each "
                f"row once ({padding})."
            )
        return jnp.asarray(idx)
    n = idx.shape[0]
    earlier = jnp.arange(n)[None, :] < jnp.arange(n)[:, None]
    repeat = jnp.any((idx[:, None] == idx[None, :]) & earlier, axis=1) & (idx < batch)
    return jnp.where(repeat, jnp.asarray(batch, idx.dtype), idx)


def _widen(x: Any) -> Any:
    """A traced integer array narrower than 32 bits as int32, which holds each of its values;
    any other array as it is. JAX converts a Python bound to the array's own dtype, wrapping
    it: ``uint8 < 256`` is ``uint8 < 0``, false for every value, and ``int8 >= -1`` ... so
    a range test of a narrow array refused valid values (review 77). Test ranges on this."""
    dtype = jnp.dtype(x.dtype)
    if jnp.issubdtype(dtype, jnp.integer) and dtype.itemsize < 4:
        return x.astype(jnp.int32)
    return x


def _narrow_in_range(x: Array, stop: int) -> Array:
    """A traced integer array as int32, with every value outside ``[0, stop)`` -> -1.

    The range is tested in ``x``'s own dtype, so a wide value (int64 under x64, uint32)
    is never wrapped into range by the narrowing (a narrow one is widened first)."""
    if jnp.dtype(x.dtype) == jnp.int32:
        return x
    x = _widen(x)
    ok = (x >= 0) & (x < stop)
    return jnp.where(ok, x.astype(jnp.int32), jnp.int32(-1))


def _check_num_tokens(num_tokens: Any, who: str) -> int:
    """``positions``' token count: a static int >= 0 (it is the width of the result)."""
    n = _static_int(num_tokens)
    if n is None or not 0 <= n <= _INT32_MAX:  # positions are int32: a wider count would wrap
        raise ValueError(
            f"{who}: num_tokens must be an int >= 0 and <= 2**31 - 1 (the number of new tokens, a static "
            f"shape; positions are int32), got {num_tokens!r}."
        )
    return n


def _check_repeats(repeats: Any, who: str) -> int:
    r = _static_int(repeats)
    if r is None:
        raise TypeError(
            f"{who}: repeats must be a Python int (it sets the new batch size, which is a "
            f"static shape), got {type(repeats).__name__}."
        )
    if r < 1:
        raise ValueError(f"{who}: repeats must be >= 1, got {r}.")
    if r > 2**31 - 1:  # a batch size: JAX's own error named an argument 'a' of a jitted computation
        raise ValueError(f"{who}: repeats must be < 2**31 (it multiplies the batch size), got {r}.")
    return r


# Shared by every per-row cache kind (StaticCache here; the ring, quantized and hybrid
# caches import them): one implementation of each check and rule.


def _layer_index(layer_idx: Any, num_layers: int, who: str, *, allow_traced: bool = True) -> Any:
    """A static int in range, or (``allow_traced``) a traced int32 scalar."""
    i = _static_int(layer_idx)
    if i is not None:
        if not 0 <= i < num_layers:
            raise ValueError(
                f"{who}: layer_idx {i} is out of range for a cache with {num_layers} layers; "
                f"valid indices are 0..{num_layers - 1}."
            )
        return i
    if (
        allow_traced
        and isinstance(layer_idx, jax.Array)
        and layer_idx.ndim == 0
        and jnp.issubdtype(layer_idx.dtype, jnp.integer)
    ):
        return _narrow_in_range(layer_idx, num_layers)
    raise TypeError(
        f"{who}: layer_idx must be an int{' or a traced int32 scalar' if allow_traced else ''}, "
        f"got {layer_idx!r}."
    )


def _write_target(layer: Any, num_layers: int) -> tuple[Any, Any, Any]:
    """``(layer_ok, read_layer, write_layer)``; a bad traced layer writes out of bounds."""
    if isinstance(layer, int):
        return True, layer, layer
    ok = (layer >= 0) & (layer < num_layers)
    return ok, jnp.where(ok, layer, 0), jnp.where(ok, layer, num_layers)


def _num_new_shape_error(shape: tuple, dtype: Any, batch: int, who: str) -> TypeError:
    return TypeError(
        f"{who}: num_new must be an integer array of shape [{batch}] (or a scalar), "
        f"got shape {shape} and dtype {dtype}."
    )


def _host_counts(num_new: Any, batch: int, new_tokens: int, who: str) -> np.ndarray:
    """A concrete ``num_new`` (default: all T tokens) checked on the host: int32[B].

    The range is checked before narrowing to int32, so a wide value is refused, never wrapped.
    """
    if num_new is None:
        return np.full((batch,), new_tokens, np.int32)
    host = np.asarray(num_new)
    if host.ndim == 0:
        host = np.broadcast_to(host, (batch,))
    if host.shape != (batch,) or not np.issubdtype(host.dtype, np.integer):
        raise _num_new_shape_error(host.shape, host.dtype, batch, who)
    bad = (host < 0) | (host > new_tokens)
    if bad.any():
        row = int(np.argmax(bad))
        raise ValueError(
            f"{who}: num_new[{row}]={int(host[row])} is outside [0, {new_tokens}] "
            f"(the states carry {new_tokens} new tokens)."
        )
    return host.astype(np.int32)


def _new_counts(num_new: Any, batch: int, new_tokens: int, who: str) -> tuple[Array, Array]:
    """``(count int32[B], invalid bool[B])`` for ``num_new`` (default: all T tokens)."""
    if not _is_traced(num_new):
        return jnp.asarray(_host_counts(num_new, batch, new_tokens, who)), jnp.zeros((batch,), bool)
    count = jnp.asarray(num_new)
    if count.ndim == 0:
        count = jnp.broadcast_to(count, (batch,))
    if count.shape != (batch,) or not jnp.issubdtype(count.dtype, jnp.integer):
        raise _num_new_shape_error(count.shape, count.dtype, batch, who)
    count = _widen(count)
    invalid = (count < 0) | (count > new_tokens)  # in num_new's own dtype: never wrapped
    return jnp.where(invalid, 0, count).astype(jnp.int32), invalid


def _crop_amounts(max_length: Any, batch: int, who: str) -> Array:
    """int32[B]: ``max_length`` per row, clamped to the int32 range (never wrapped).

    The meaning (shared by every kind, see ``crop_lengths``): > 0 keep at most that many,
    < 0 drop that many off the end, 0 drop nothing.
    """
    if isinstance(max_length, bool):
        raise TypeError(f"{who}: max_length must be an int or an int array [{batch}], got a bool.")
    if isinstance(max_length, int):  # a Python int of any size: clamp on the host
        max_length = np.int64(max(-_INT32_MAX, min(_INT32_MAX, max_length)))
    # Concrete values are checked and clamped in NumPy (no small programs to compile eagerly).
    m = max_length if _is_traced(max_length) else np.asarray(max_length)
    if not jnp.issubdtype(m.dtype, jnp.integer) or m.ndim not in (0, 1):
        raise TypeError(
            f"{who}: max_length must be an int or an int array [{batch}], "
            f"got shape {m.shape} and dtype {m.dtype}."
        )
    if m.ndim == 1 and m.shape[0] != batch:
        raise ValueError(f"{who}: per-row max_length needs {batch} entries, got {m.shape[0]}.")
    if isinstance(m, np.ndarray):  # clip in the source dtype: a uint64 2**64 - 1 cast first is -1
        if np.issubdtype(m.dtype, np.unsignedinteger):
            m = np.minimum(m, np.uint64(_INT32_MAX))
        m = np.clip(m.astype(np.int64), -_INT32_MAX, _INT32_MAX)
    else:  # a wide traced/device integer: clamp before narrowing (astype would wrap)
        m = _widen(m)
        if jnp.iinfo(m.dtype).bits > 32 or jnp.dtype(m.dtype) == jnp.uint32:
            m = jnp.clip(m, -_INT32_MAX if jnp.issubdtype(m.dtype, jnp.signedinteger) else 0, _INT32_MAX)
    if isinstance(m, np.ndarray):
        return np.broadcast_to(m.astype(np.int32), (batch,))
    return jnp.broadcast_to(jnp.asarray(m).astype(jnp.int32), (batch,))


def crop_lengths(lengths: Array, amounts: Array) -> Array:
    """New lengths after ``crop``: ``lengths`` [..., B], ``amounts`` int32[B].

    One rule for every kind: a positive amount keeps at most that many tokens, a negative one drops that many off
    the end of each layer's own length (floored at 0), and 0 drops nothing — so the
    speculative idiom ``crop(-num_rejected)`` leaves rows with nothing rejected alone.
    Empty a cache with ``reset``.
    """
    a = jnp.broadcast_to(amounts, lengths.shape)
    return jnp.where(a > 0, jnp.minimum(lengths, a), jnp.where(a < 0, jnp.maximum(lengths + a, 0), lengths))


def _check_reset_rows(rows: Any, batch: int, who: str) -> Array:
    rows = jnp.asarray(rows)
    if rows.shape != (batch,) or rows.dtype != jnp.bool_:
        raise TypeError(
            f"{who}: rows must be a bool array of shape [{batch}], got shape {rows.shape} "
            f"and dtype {rows.dtype}."
        )
    return rows


def _check_beam_idx(beam_idx: Any, batch: int, who: str) -> Array:
    idx = _check_row_indices(beam_idx, batch, who)
    if idx.shape[0] != batch:
        raise ValueError(
            f"{who}: beam_idx must have one entry per row ({batch}), got {idx.shape[0]}. "
            "To change the batch size use batch_select_indices."
        )
    return idx


def _raise_on_flags(flags: Array, who: str, overflow: str, invalid: str, out_of_pages: str = "") -> None:
    """Turns set flag bits into a ``CacheError`` naming the rows.

    ``flags`` is int32[B], or [..., B] for a stack of caches (``vmap``): rows are then
    named by their full index.
    """
    flags = np.asarray(flags)
    if not flags.any():
        return

    def rows(bit: int) -> list:
        where = np.argwhere((flags & bit) != 0)
        return [int(i[0]) if flags.ndim == 1 else tuple(int(j) for j in i) for i in where]

    what = []
    over, bad, pages = rows(OVERFLOW), rows(INVALID), rows(OUT_OF_PAGES)
    if over:
        what.append(f"rows {over} {overflow}")
    if bad:
        what.append(f"rows {bad} {invalid}")
    if pages:
        what.append(f"rows {pages} {out_of_pages or 'ran out of pages (their write was dropped)'}")
    raise CacheError(f"{who}: " + "; ".join(what) + ". reset() clears the flags.")


def _check_sizes(who: str, **sizes: Any) -> None:
    # Lengths, slots and positions are int32: a size past its range would wrap them.
    for name, value in sizes.items():
        if _static_int(value) is None or not 1 <= value <= _INT32_MAX:
            raise ValueError(f"{who}: {name} must be an int >= 1, got {value!r} (and <= 2**31 - 1: lengths are int32).")


def _check_extra(value: Any, name: str, who: str, base: int = 0) -> int:
    """A static int ``>= 0`` that, added to ``base``, still fits int32 (slots are int32)."""
    v = _static_int(value)
    if v is None or v < 0 or base + v > _INT32_MAX:
        raise ValueError(f"{who}: {name} must be an int >= 0, got {value!r} (and {base} + {name} must be <= 2**31 - 1).")
    return v


def _floating_dtype(dtype: Any, who: str) -> jnp.dtype:
    """The dtype the buffers really get: float64 is float32 unless ``jax_enable_x64`` is on
    (as for every JAX array), so the cache reports and casts to what it stores."""
    dtype = jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"{who}: dtype must be floating (float32, bfloat16, float16), got {dtype}.")
    return jnp.dtype(jax.dtypes.canonicalize_dtype(dtype))


