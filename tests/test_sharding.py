"""Sharding: on 8 virtual CPU devices every op keeps the input's sharding."""

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from jaxkv import StaticCache

    assert jax.device_count() == 8, jax.devices()
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    layer_spec = NamedSharding(mesh, P("data", "model"))
    cache = StaticCache.init(num_layers=2, batch_size=4, num_kv_heads=2, head_dim=8,
                             max_length=32, sharding=layer_spec)
    buf = NamedSharding(mesh, P(None, "data", "model", None, None))
    rows = NamedSharding(mesh, P(None, "data"))

    def check(c, what):
        assert c.keys.sharding.is_equivalent_to(buf, 5), (what, c.keys.sharding)
        assert c.values.sharding.is_equivalent_to(buf, 5), (what, c.values.sharding)
        assert c.lengths.sharding.is_equivalent_to(rows, 2), (what, c.lengths.sharding)
        # Each device holds a quarter of the rows and one of the two kv heads.
        shard = (2, c.batch_size // 4, 1, 32, 8)
        assert {s.data.shape for s in c.keys.addressable_shards} == {shard}, what

    check(cache, "init")
    k = jax.device_put(jnp.ones((4, 2, 3, 8)), layer_spec)
    num_new = jnp.array([3, 1, 2, 0], jnp.int32)
    ops = {
        "update": lambda c: c.update(k, k, 1, num_new=num_new)[0],
        "crop": lambda c: c.crop(jnp.array([1, 2, 0, 3], jnp.int32)),
        "reorder": lambda c: c.reorder_cache(jnp.array([3, 2, 1, 0], jnp.int32)),
        "select": lambda c: c.batch_select_indices(jnp.array([1, 0, 3, 2], jnp.int32)),
        "repeat": lambda c: c.batch_repeat_interleave(2),
        "reset": lambda c: c.reset(),
    }
    filled = ops["update"](cache)
    for name, op in ops.items():
        eager = op(filled)
        check(eager, name + " eager")
        jitted = jax.jit(op)(filled)
        check(jitted, name + " jit")
        np.testing.assert_array_equal(eager.lengths, jitted.lengths)
    odd = filled.batch_select_indices(jnp.array([2, 0, 1], jnp.int32))  # 3 rows on a 4-way axis
    assert odd.keys.sharding.is_equivalent_to(NamedSharding(mesh, P(None, None, "model")), 5)
    np.testing.assert_array_equal(odd.seq_lengths(1), [2, 3, 1])
    donated = jax.jit(lambda c: c.update(k, k, 0)[0], donate_argnums=0)(filled)
    check(donated, "donated update")
    np.testing.assert_array_equal(donated.seq_lengths(1), [3, 1, 2, 0])
    print("ok")
    """
)


def test_sharding_preserved_on_eight_virtual_devices():
    env = dict(os.environ)
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    env["JAX_PLATFORMS"] = "cpu"
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600
    )
    assert result.returncode == 0 and "ok" in result.stdout, result.stdout + result.stderr


ATTENTION = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from jaxkv import StaticCache
    from jaxkv.attention import cache_attention

    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    rng = np.random.default_rng(0)
    k = rng.standard_normal((4, 2, 5, 16)).astype(np.float32)
    v = rng.standard_normal((4, 2, 5, 16)).astype(np.float32)
    q = rng.standard_normal((4, 4, 5, 16)).astype(np.float32)
    num_new = np.array([5, 3, 1, 4], np.int32)

    def run(cache, q, k, v):
        positions = jnp.broadcast_to(jnp.arange(5, dtype=jnp.int32), (4, 5))
        out, cache = cache_attention(q, k, v, cache, 1, positions=positions, num_new=jnp.asarray(num_new))
        return out, cache

    plain = StaticCache.init(num_layers=2, batch_size=4, num_kv_heads=2, head_dim=16, max_length=64)
    want, _ = jax.jit(run)(plain, q, k, v)
    sharded = StaticCache.init(num_layers=2, batch_size=4, num_kv_heads=2, head_dim=16, max_length=64,
                               sharding=NamedSharding(mesh, P("data", "model")))
    put = lambda x: jax.device_put(jnp.asarray(x), NamedSharding(mesh, P("data", "model")))
    got, cache = jax.jit(run)(sharded, put(q), put(k), put(v))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    assert cache.keys.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "data", "model")), 5)
    # Each device attends over its own rows and kv heads: the kernel sees local shapes and
    # nothing gathers the cache; the output stays sharded like the queries.
    hlo = jax.jit(run).lower(sharded, put(q), put(k), put(v)).compile().as_text()
    calls = [line for line in hlo.splitlines() if 'custom_call_target="jaxkv_decode_attention"' in line]
    assert calls and all("f32[1,2,5,16]" in line.split("custom-call")[0] for line in calls), calls
    assert not [line for line in hlo.splitlines() if "all-gather" in line and ",64,16]" in line]
    assert got.sharding.is_equivalent_to(NamedSharding(mesh, P("data", "model")), 4), got.sharding
    # Rows past num_new are padding: not attended to, not stored.
    np.testing.assert_array_equal(cache.seq_lengths(1), num_new)
    print("ok")
    """
)


def test_attention_over_a_sharded_cache_equals_unsharded():
    """Decode attention (the native kernel on CPU) over a cache sharded by rows and kv heads
    gives the unsharded result, runs on each device's own shard (no gathered cache) and
    leaves the cache sharded."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    env["JAX_PLATFORMS"] = "cpu"
    result = subprocess.run([sys.executable, "-c", ATTENTION], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0 and "ok" in result.stdout, result.stdout + result.stderr
