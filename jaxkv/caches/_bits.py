"""16-bit floats kept as their bits, so XLA:CPU can update them in place.

XLA:CPU cannot write into a bf16/f16 array in place: it converts the whole array to f32
and back around every dynamic-update-slice or scatter (measured on jax 0.10.2: one token
written into a 32K-slot bf16 cache layer costs about 150x one written into a 1K-slot
layer, against 1x for f32). Integer arrays are updated in place. So storages keep 16-bit
float buffers as uint16 bit patterns and turn them back into floats one block at a time
where they are read. Other dtypes are stored as they are.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

Array = jax.Array


def stored_dtype(dtype: Any) -> jnp.dtype:
    """The dtype a buffer of ``dtype`` is stored in (float64 is float32 without x64, as in JAX)."""
    dtype = jnp.dtype(jax.dtypes.canonicalize_dtype(dtype))
    return jnp.dtype(jnp.uint16) if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize == 2 else dtype


def to_bits(x: Array, dtype: Any) -> Array:
    """``x`` cast to ``dtype``, in its stored form."""
    x = x.astype(dtype)
    if stored_dtype(dtype) == x.dtype:
        return x
    x = not_differentiable(x, f"a write into a {jnp.dtype(dtype).name} cache buffer (kept as integer bits so that the "
                              "CPU updates it in place; no gradient flows through them, it would be 0)")
    return jax.lax.bitcast_convert_type(x, jnp.uint16)


@partial(jax.custom_jvp, nondiff_argnums=(1,))
def not_differentiable(x: Array, what: str) -> Array:
    """``x``; differentiating through it raises a ``TypeError`` naming ``what`` (where JAX's own
    rule would give a zero gradient, or fail with an internal primitive's name)."""
    return x


@not_differentiable.defjvp
def _refuse(what, primals, tangents):
    raise TypeError(
        f"jax.grad / jvp through {what} is not supported. Differentiate through a float32 StaticCache, a "
        "DynamicCache or SlidingWindowCache, or attention with cache=None; or, if the gradient need not "
        "flow through the cache, wrap the keys and values written with jax.lax.stop_gradient."
    )


def from_bits(stored: Array, dtype: Any) -> Array:
    """Inverse of :func:`to_bits`: the buffer (or a block of it) as ``dtype``."""
    return jax.lax.bitcast_convert_type(stored, dtype) if stored.dtype != jnp.dtype(dtype) else stored
