"""Review findings in offload, the Flax modules and serialization: each test failed before its fix.

References are independent of the code under test: NumPy values, a plain StaticCache doing the
same operations.
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxkv.nnx  # noqa: F401  (registers the kinds with flax.serialization)
from jaxkv import DynamicCache, HybridCache, SlidingWindowCache, StaticCache
from jaxkv.offload import OffloadedCache, offload_model, step_copy_bytes
from jaxkv.serialization import from_state_dict, to_state_dict

SIZES = dict(num_layers=2, batch_size=2, num_kv_heads=1, head_dim=2, max_length=4)


def _filled(cache, value=1.5):
    k = jnp.full((cache.batch_size, 1, 2, 2), value, jnp.float32)
    for layer in range(cache.num_layers):
        cache, _, _ = cache.update(k * (layer + 1), k, layer, num_new=jnp.array([2, 1], jnp.int32))
    return cache


@pytest.mark.parametrize("kind", [StaticCache, OffloadedCache])
def test_restore_refuses_another_16_bit_dtype(kind):
    """bf16 and f16 buffers are both stored as uint16 bits: an f16 state restored into a bf16
    target was accepted and read 1.5 as 0.125. Now the dtype is part of the state."""
    from flax import serialization

    saved = _filled(kind.init(**SIZES, dtype=jnp.float16))
    for restore in (lambda t: from_state_dict(t, to_state_dict(saved)),
                    lambda t: serialization.from_bytes(t, serialization.to_bytes(saved))):
        with pytest.raises(ValueError, match="dtype was saved as float16, the target has bfloat16"):
            restore(kind.init(**SIZES, dtype=jnp.bfloat16))
        back = restore(kind.init(**SIZES, dtype=jnp.float16))  # the same dtype still round-trips
        want = np.zeros((2, 2, 1, 4, 2), np.float16)
        want[0, 0, :, :2], want[0, 1, :, :1] = 1.5, 1.5  # independent reference: what was written
        want[1, 0, :, :2], want[1, 1, :, :1] = 3.0, 3.0
        np.testing.assert_array_equal(np.asarray(back.keys), want)
        np.testing.assert_array_equal(np.asarray(back.lengths), [[2, 1], [2, 1]])
        if kind is OffloadedCache:
            assert back.stores[0].keys.sharding.memory_kind == "pinned_host"
    # A state saved before static facts were written (arrays only) still restores.
    arrays = {jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(saved)[0]}
    legacy = {k: v for k, v in to_state_dict(saved).items() if k in arrays}
    np.testing.assert_array_equal(np.asarray(from_state_dict(kind.init(**SIZES, dtype=jnp.float16), legacy).keys),
                                  np.asarray(saved.keys))


def test_restore_refuses_another_window_or_layer_order():
    """Arrays of equal shapes, other static layout: a ring of window 4 restored as window 2
    (+2 extra slots), and a hybrid cache whose sliding and full layers are swapped, which put
    layer 1's keys under layer 0's length. Both were accepted silently."""
    sizes = dict(batch_size=1, num_kv_heads=1, head_dim=2)
    ring = SlidingWindowCache.init(num_layers=1, window=4, **sizes)
    with pytest.raises(ValueError, match="window was saved as 4, the target has 2"):
        from_state_dict(SlidingWindowCache.init(num_layers=1, window=2, extra_slots=2, **sizes), to_state_dict(ring))
    hybrid = HybridCache.init(layer_types=["sliding_attention", "full_attention"], max_length=8, window=4, **sizes)
    swapped = HybridCache.init(layer_types=["full_attention", "sliding_attention"], max_length=8, window=4, **sizes)
    with pytest.raises(ValueError, match="groups was saved as"):
        from_state_dict(swapped, to_state_dict(hybrid))
    from_state_dict(hybrid, to_state_dict(hybrid))  # the same layout restores


def test_dynamic_cache_restore_refuses_a_target_with_more_layers():
    """A saved 2-layer DynamicCache restored into DynamicCache(num_layers=3) came back with an
    empty third layer: a 3-layer model would attend there to nothing of the history."""
    k = jnp.ones((1, 1, 2, 2))
    saved = DynamicCache.from_legacy_cache([(k, k + 1)] * 2)
    with pytest.raises(ValueError, match="layers#len was saved as 2, the target has 3"):
        from_state_dict(DynamicCache(num_layers=3), to_state_dict(saved))
    back = from_state_dict(DynamicCache(num_layers=2), to_state_dict(saved))
    for layer in range(2):
        np.testing.assert_array_equal(np.asarray(back[layer][1]), np.full((1, 1, 2, 2), 2.0))


# OffloadedCache.init(device=d) with d not the default device: tests/test_review_sharding.py
# (its one multi-device subprocess).


def test_step_copy_bytes_of_a_device_cache_and_bad_counts():
    class DeviceMemoryOnly:
        def addressable_memories(self):
            return [jax.devices()[0].default_memory()]

    with pytest.warns(UserWarning):
        kept = OffloadedCache.init(**SIZES, device=DeviceMemoryOnly(), fallback=True)
    assert step_copy_bytes(kept) == {"to_device": 0, "to_host": 0}  # nothing crosses a link
    cache = OffloadedCache.init(**SIZES)
    assert step_copy_bytes(cache, 2) == {"to_device": 2 * 2 * 2 * 1 * 4 * 2 * 4, "to_host": 2 * 2 * 2 * 1 * 2 * 2 * 4}
    with pytest.raises(ValueError, match="num_tokens"):
        step_copy_bytes(cache, -1)


def test_offload_model_refuses_a_sharding_it_would_drop():
    from jaxkv.models import Llama, LlamaConfig

    wrapped = offload_model(Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0)))
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    with pytest.raises(ValueError, match="cannot be sharded"):
        wrapped.init_cache(1, 8, sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data")))
    assert isinstance(wrapped.init_cache(1, 8), OffloadedCache)


def test_modules_refuse_a_non_cache_and_float_positions():
    """The documented TypeError for a non-cache was an AttributeError from deep inside; float
    positions were accepted (truncated by the masks)."""
    from jaxkv.linen import KVSelfAttention
    from jaxkv.nnx import KVAttention

    attn = KVAttention(8, 2, 1, 4, layer_idx=0, rngs=nnx.Rngs(0))
    cache = StaticCache.init(num_layers=1, batch_size=1, num_kv_heads=1, head_dim=4, max_length=4)
    x, pos = jnp.ones((1, 1, 8)), jnp.zeros((1, 1), jnp.int32)
    with pytest.raises(TypeError, match="must be a jaxkv cache"):
        attn(x, (cache.keys, cache.values), positions=pos)
    with pytest.raises(TypeError, match="positions must be an integer"):
        attn(x, cache, positions=pos.astype(jnp.float32))
    linen = KVSelfAttention(num_heads=2, num_kv_heads=1, head_dim=4, layer_idx=0)
    with pytest.raises(TypeError, match="must be a jaxkv cache"):
        linen.init(jax.random.key(0), x, {"keys": cache.keys}, positions=pos)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        KVSelfAttention(num_heads=3, num_kv_heads=2, head_dim=4, layer_idx=0).init(jax.random.key(0), x, None,
                                                                                 positions=pos)
    # A 2-D x, zero kv heads (linen) and an x of another width (nnx) were JAX's axis /
    # ZeroDivisionError / dot_general messages naming neither module nor width (review 63).
    with pytest.raises(ValueError, match=r"KVSelfAttention: x must be \[batch, tokens, embed_dim\], got shape \[1, 8\]"):
        linen.init(jax.random.key(0), x[0], None, positions=pos)
    with pytest.raises(ValueError, match=r"KVSelfAttention: num_kv_heads must be an int >= 1, got 0"):
        KVSelfAttention(num_heads=2, num_kv_heads=0, head_dim=4).init(jax.random.key(0), x, None, positions=pos)
    with pytest.raises(ValueError, match=r"KVAttention: x must be .* the module's embed_dim 8, got shape \[1, 1, 6\]"):
        attn(jnp.ones((1, 1, 6)), cache, positions=pos)


def test_gradients_through_a_cache_are_true_or_a_clear_error():
    """16-bit StaticCache / PagedCache buffers are kept as integer bits: jax.grad through a
    write gave k_proj / v_proj a gradient of exactly 0, silently. A float32 cache and a
    DynamicCache give the cache=None gradient; 16-bit and quantized writes are a TypeError
    (the quantized one was JAX's 'nextafter' NotImplementedError)."""
    from jaxkv.caches import DynamicCache, PagedCache, QuantizedCache, StaticCache
    from jaxkv.nnx import KVAttention

    batch, tokens, embed = 1, 4, 16
    attn = KVAttention(embed, 4, 2, 8, layer_idx=0, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (batch, tokens, embed))
    positions = jnp.arange(tokens, dtype=jnp.int32)[None]

    def grads(make_cache):
        def loss(model):
            y, _ = model(x, make_cache(), positions=positions)
            return jnp.sum(y.astype(jnp.float32) ** 2)

        g = nnx.grad(loss)(attn)
        return [np.asarray(getattr(g, n).kernel[...]) for n in ("q_proj", "k_proj", "v_proj")]

    shape = dict(num_layers=1, batch_size=batch, num_kv_heads=2, head_dim=8, max_length=8)
    want = grads(lambda: None)
    assert all(np.abs(w).sum() > 0 for w in want)
    for make in (lambda: StaticCache.init(**shape), lambda: DynamicCache()):
        for got, ref in zip(grads(make), want):
            np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
    for dtype in (jnp.bfloat16, jnp.float16):
        with pytest.raises(TypeError, match=f"through a write into a {jnp.dtype(dtype).name} cache buffer"):
            grads(lambda: StaticCache.init(**shape, dtype=dtype))
    with pytest.raises(TypeError, match="through a write into a bfloat16 cache buffer"):
        grads(lambda: PagedCache.init(**shape, page_size=4, dtype=jnp.bfloat16))
    with pytest.raises(TypeError, match="through quantization"):
        grads(lambda: QuantizedCache.init(**shape))


def test_gradients_through_two_paged_layers_and_a_copy_on_write():
    """jax.grad through a float32 PagedCache of two or more layers was JAX's "reverse-mode
    differentiation does not work for lax.while_loop" (review 68): from the second layer on,
    the write's page-plan loop carries pools that hold the first layer's keys. A prompt
    written into both layers, its rows forked (shared pages), then one token per row (the
    shared partial page copied on write): the gradient of a static cache, under jit. Also
    with each attention call under jax.checkpoint (nnx.remat / nn.remat) and with the layers
    as a lax.scan: the plan's derivative rule closed over the write's arrays, which leaked
    there (UnexpectedTracerError; review 80)."""
    from jaxkv.attention import cache_attention
    from jaxkv.caches import PagedCache, StaticCache

    rng = np.random.default_rng(3)
    base, new, q = (jnp.asarray(rng.standard_normal(shape), jnp.float32)
                    for shape in ((1, 2, 5, 8), (2, 2, 1, 8), (2, 4, 1, 8)))
    shape = dict(num_layers=2, batch_size=1, num_kv_heads=2, head_dim=8, max_length=12)

    def loss_with(make, how="loop"):
        def attend(cache, layer, w, positions):
            return cache_attention(q, new * w, new + w, cache, layer, positions=positions)

        def loss(w):
            cache = make()
            for layer in range(2):  # layer 1's keys depend on w as layer 0's do
                cache, _, _ = cache.update(base * w * (layer + 1), base * w - layer, layer)
            cache = cache.batch_repeat_interleave(2)  # both rows hold the prompt's pages
            positions = cache.positions(1, 0)
            if how == "scan":
                def body(cache, layer):
                    out, cache = attend(cache, layer, w, positions)
                    return cache, jnp.sum(out * jnp.arange(8.0))

                return jnp.sum(jax.lax.scan(body, cache, jnp.arange(2))[1])
            step = jax.checkpoint(attend, static_argnums=1) if how == "remat" else attend
            total = 0.0
            for layer in range(2):
                out, cache = step(cache, layer, w, positions)
                total = total + jnp.sum(out * jnp.arange(8.0))
            return total
        return loss

    w = jnp.float32(0.7)
    want = jax.jit(jax.grad(loss_with(lambda: StaticCache.init(**shape))))(w)
    for how in ("loop", "remat", "scan"):
        paged = loss_with(lambda: PagedCache.init(**shape, page_size=4), how)
        # Under jit (eagerly the same rule runs op by op, several seconds of small compiles).
        np.testing.assert_allclose(float(jax.jit(jax.grad(paged))(w)), float(want), rtol=1e-5, err_msg=how)


def test_gradients_under_jit_through_caches_longer_than_one_loop_block():
    """jax.grad under jit through a StaticCache or PagedCache of more than 512 slots (128 for
    longer chunks) failed: the blockwise loop's while loops have traced trip counts, which
    reverse mode cannot transpose (review 57). Derivatives now come from the same attention
    over the layer read whole: the cache=None gradient under jit, at 513 slots, for a
    20-token chunk (the XLA loop) into a static and a paged cache."""
    from jaxkv.attention import cache_attention
    from jaxkv.caches import PagedCache, StaticCache

    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 2, 20, 8)), jnp.float32) for _ in range(3))
    positions = jnp.broadcast_to(jnp.arange(20, dtype=jnp.int32), (2, 20))

    def loss_with(cache):
        def loss(q, k, v):
            out = cache_attention(q, k[:, :1], v[:, :1], cache, 0, positions=positions) if cache is not None else \
                cache_attention(q, k[:, :1], v[:, :1], None, 0, positions=positions)
            return jnp.sum(out[0] * jnp.arange(8.0))
        return loss

    want = jax.grad(loss_with(None), argnums=(0, 1, 2))(q, k, v)
    for slots in (513,):
        for cache in (StaticCache.init(num_layers=1, batch_size=2, num_kv_heads=1, head_dim=8, max_length=slots),
                      PagedCache.init(num_layers=1, batch_size=2, num_kv_heads=1, head_dim=8, max_length=slots,
                                      page_size=16)):
            grad = jax.jit(jax.grad(loss_with(cache), argnums=(0, 1, 2)))  # eager grads take the same rule
            for got, ref in zip(grad(q, k, v), want):
                np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-6)


def test_kvattention_checks_num_new_without_a_cache_and_its_own_arguments():
    """cache=None took any num_new: [-2, 3] gave row 0 zeros, a scalar named kv_lengths; a
    list of positions, an x of rank 2 and num_kv_heads=0 failed deep inside (AttributeError,
    unpacking, ZeroDivisionError)."""
    from jaxkv.nnx import KVAttention

    attn = KVAttention(16, 4, 2, 8, layer_idx=0, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(0), (2, 3, 16))
    positions = jnp.broadcast_to(jnp.arange(3, dtype=jnp.int32), (2, 3))
    for bad in ([-2, 3], [5, 3]):
        with pytest.raises(ValueError, match=rf"cache_attention: num_new\[0\]={bad[0]} is outside \[0, 3\]"):
            attn(x, None, positions=positions, num_new=jnp.array(bad))
    full, _ = attn(x, None, positions=positions)
    scalar, _ = attn(x, None, positions=positions, num_new=3)
    np.testing.assert_array_equal(np.asarray(scalar), np.asarray(full))
    traced, _ = nnx.jit(lambda m, n: m(x, None, positions=positions, num_new=n))(attn, jnp.array([-1, 3]))
    assert np.isnan(np.asarray(traced[0])).all() and np.isfinite(np.asarray(traced[1])).all()
    np.testing.assert_allclose(np.asarray(traced[1]), np.asarray(full[1]), rtol=1e-6, atol=1e-6)
    listed, _ = attn(x, None, positions=positions.tolist())
    np.testing.assert_array_equal(np.asarray(listed), np.asarray(full))
    with pytest.raises(ValueError, match=r"x must be \[batch, tokens, embed_dim\], got shape \[3, 16\]"):
        attn(x[0], None, positions=positions)
    with pytest.raises(ValueError, match="num_kv_heads must be an int >= 1, got 0"):
        KVAttention(16, 4, 0, 8, rngs=nnx.Rngs(0))


def test_a_cache_kind_defined_after_registration_serializes_with_flax():
    """flax.serialization finds classes by exact type: a StaticCache subclass defined after
    jaxkv registered its kinds raised "can not serialize"."""
    from flax import serialization

    class MyCache(StaticCache):
        pass

    cache = MyCache.init(num_layers=1, batch_size=1, num_kv_heads=1, head_dim=2, max_length=2)
    cache = cache.update(jnp.ones((1, 1, 1, 2)), jnp.full((1, 1, 1, 2), 2.0), 0)[0]
    back = serialization.from_bytes(MyCache.init(num_layers=1, batch_size=1, num_kv_heads=1, head_dim=2, max_length=2),
                                    serialization.to_bytes(cache))
    assert type(back) is MyCache
    np.testing.assert_array_equal(np.asarray(back.lengths), np.asarray(cache.lengths))
    np.testing.assert_array_equal(np.asarray(back.values[0, 0, :, :1]), np.asarray(cache.values[0, 0, :, :1]))
    assert float(back.values[0, 0, 0, 0, 0]) == 2.0


def test_inputs_that_were_truncated_or_dropped_are_named_errors():
    """Review 84: a float logits_at was truncated (1.7 read as 1); an offloaded model's
    init_cache dropped another kind's options (bits=4: a float cache, silently);
    token_positions returned [rows, T] for a batch_size the cache does not hold."""
    from jaxkv.attention import token_positions
    from jaxkv.models import Llama, LlamaConfig

    model = Llama(LlamaConfig.tiny(num_layers=1), rngs=nnx.Rngs(0))
    tokens = jnp.array([[1, 2, 3], [4, 5, 6]])
    with pytest.raises(TypeError, match=r"logits_at must be an integer array of shape \[2\] .* got float32\[2\]"):
        model(tokens, None, logits_at=jnp.array([1.7, 1.2]))
    with pytest.raises(TypeError, match=r"got int32\[\]"):
        model(tokens, None, logits_at=jnp.int32(2))
    with pytest.raises(ValueError, match=r"float cache in host memory: bits, page_size .*cannot apply"):
        offload_model(model).init_cache(2, 8, bits=4, page_size=16)
    cache = StaticCache.init(num_layers=1, batch_size=1, num_kv_heads=1, head_dim=2, max_length=4)
    with pytest.raises(ValueError, match=r"batch_size=3, but the cache holds 1 rows"):
        token_positions(cache, 3, 2)
    assert token_positions(cache, 1, 2).shape == (1, 2)
