"""Generation on a device mesh, on one process or several (JAX's own distributed runtime).

* Tensor parallelism: :func:`shard_params` places each parameter by the first rule whose
  name suffix matches its path (:data:`LLAMA_RULES`: q/k/v and gate/up projections split
  by output columns, o/down projections by input rows, on the ``"model"`` mesh axis; the
  rest replicated). A rule names the *trailing* axes only, so it fits a per-layer
  ``[in, out]`` kernel and a scan-stacked ``[L, in, out]`` one alike.
* The cache: rows on the ``"data"`` axis, kv heads on ``"model"``
  (``model.init_cache(..., sharding=NamedSharding(mesh, P("data", "model")))``).
* Data parallelism: the batch is split over ``"data"`` (each replica decodes its rows with
  its own copy of the weights' shards).

:func:`generate` is :func:`jaxkv.generate` on a mesh: the same tokens as one device (up
to the order of float sums, which tensor parallelism changes; greedy tokens agree unless
two logits are within rounding of each other).

Several processes (hosts) run the same program: each calls ``jax.distributed.initialize``,
sees the global device list, builds the same mesh over it and calls :func:`generate` with
the same inputs; XLA's collectives (gloo on CPU) carry the cross-process traffic. On one
machine::

    python -m jaxkv.distributed --num-processes 2 --local-devices 4 --model-parallel 2

starts 2 processes of 4 virtual CPU devices each (8 devices: data 4 x model 2), runs the
demo prompts on the tiny model and prints the tokens as JSON (``--single`` runs the same
on one device, for comparison).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxkv
from jaxkv.caches.container import check_auto_axes, spec_axis_devices
from jaxkv.generation import GenerateOutput

__all__ = [
    "LLAMA_RULES",
    "ShardedModel",
    "cache_sharding",
    "generate",
    "launch",
    "make_mesh",
    "param_shardings",
    "place",
    "shard_params",
    "sharded_model",
]

#: ``(path suffix, spec of the trailing axes)``; the first match wins, no match: replicated.
#: Kernels are ``[in, out]`` (an extra leading layer axis is allowed).
LLAMA_RULES: tuple[tuple[tuple[str, ...], tuple[Any, ...]], ...] = (
    (("q_proj", "kernel"), (None, "model")),
    (("k_proj", "kernel"), (None, "model")),
    (("v_proj", "kernel"), (None, "model")),
    (("q_proj", "bias"), ("model",)),
    (("k_proj", "bias"), ("model",)),
    (("v_proj", "bias"), ("model",)),
    (("o_proj", "kernel"), ("model", None)),
    (("gate_proj", "kernel"), (None, "model")),
    (("up_proj", "kernel"), (None, "model")),
    (("gate_proj", "bias"), ("model",)),
    (("up_proj", "bias"), ("model",)),
    (("down_proj", "kernel"), ("model", None)),
)

DEMO_PROMPTS = ((5, 6, 7, 8, 9), (10, 11, 12), (1, 2, 3, 4, 5, 6), (7, 7, 7, 7))


def make_mesh(data: int, model: int, devices: Sequence[Any] | None = None) -> Mesh:
    """A ``("data", "model")`` mesh over the first ``data * model`` devices.

    With several processes, ``jax.devices()`` lists process 0's devices first, so the
    model axis stays within a process and the data axis spans processes.

    Raises:
        ValueError: fewer devices than ``data * model``.
    """
    devices = list(jax.devices() if devices is None else devices)
    if data < 1 or model < 1 or data * model > len(devices):
        raise ValueError(
            f"make_mesh: data={data} x model={model} needs {data * model} devices, {len(devices)} available"
        )
    return Mesh(np.array(devices[: data * model]).reshape(data, model), ("data", "model"))


def _path_names(path: tuple[Any, ...]) -> tuple[str, ...]:
    names = []
    for key in path:
        name = getattr(key, "key", getattr(key, "name", getattr(key, "idx", None)))
        names.append(str(name))
    return tuple(names[:-1]) if names and names[-1] == "value" else tuple(names)


def _spec_for(names: tuple[str, ...], shape: tuple[int, ...], mesh: Mesh, rules) -> P:
    for suffix, trailing in rules:
        if names[-len(suffix):] != tuple(suffix) or len(trailing) > len(shape):
            continue
        spec = (None,) * (len(shape) - len(trailing)) + tuple(trailing)
        # An axis the mesh does not divide stays whole (correct, just not split).
        spec = tuple(a if a is None or shape[i] % spec_axis_devices(mesh, a) == 0 else None for i, a in enumerate(spec))
        return P(*spec)
    return P()


def param_shardings(state: nnx.State, mesh: Mesh, rules=LLAMA_RULES) -> Any:
    """A tree like ``state`` of ``NamedSharding``: each leaf by the first matching rule."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: NamedSharding(mesh, _spec_for(_path_names(path), x.shape, mesh, rules)), state
    )


def place(x: Any, sharding: NamedSharding) -> jax.Array:
    """``x`` (a host value, the same in every process) as a global array split by ``sharding``;
    each process fills only its own devices' shards."""
    if isinstance(x, jax.Array) and x.sharding.is_equivalent_to(sharding, x.ndim):
        return x  # placed already (a second call): copying every weight to the host and back was the cost (review 81)
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        # already global (a second call placing what the first placed): reshard on device,
        # np.asarray cannot read the other processes' shards
        return jax.jit(lambda a: a, out_shardings=sharding)(x)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def shard_params(model: nnx.Module, mesh: Mesh, rules=LLAMA_RULES) -> nnx.Module:
    """Places ``model``'s parameters on ``mesh`` by ``rules`` (in place); returns it.

    Every process must hold the same parameter values (same checkpoint or seed).
    """
    state = nnx.state(model)
    nnx.update(model, jax.tree.map(place, state, param_shardings(state, mesh, rules)))
    return model


def cache_sharding(mesh: Mesh, num_kv_heads: int, batch_size: int) -> NamedSharding:
    """One layer's ``[B, H, S, D]`` split: rows on ``"data"``, kv heads on ``"model"``.

    Raises:
        ValueError: the mesh axes do not divide the batch or the kv heads.
    """
    data, model = mesh.shape["data"], mesh.shape["model"]
    if batch_size % data:
        raise ValueError(f"batch size {batch_size} is not a multiple of the data axis ({data}); pad the batch")
    if num_kv_heads % model:
        raise ValueError(
            f"{num_kv_heads} kv heads do not split over a model axis of {model}; use a model axis dividing them"
        )
    return NamedSharding(mesh, P("data", "model"))


class ShardedModel(nnx.Module):
    """A decoder whose caches are sharded on ``mesh`` and whose batch is split on ``"data"``."""

    def __init__(self, model: nnx.Module, mesh: Mesh):
        check_auto_axes(mesh, "ShardedModel")
        self.model = model
        self.mesh = mesh

    @property
    def config(self):
        return self.model.config

    @property
    def cache_spec(self):
        return self.model.cache_spec

    def init_cache(self, batch_size: int, max_length: int, **kwargs: Any) -> Any:
        sharding = cache_sharding(self.mesh, self.model.cache_spec.num_kv_heads, batch_size)
        return self.model.init_cache(batch_size, max_length, sharding=sharding, **kwargs)

    def __call__(self, tokens: jax.Array, cache: Any = None, num_new: Any = None, **kwargs: Any):  # tokens [B, T]
        tokens = jax.lax.with_sharding_constraint(tokens, NamedSharding(self.mesh, P("data", None)))
        return self.model(tokens, cache, num_new, **kwargs)


def sharded_model(model: nnx.Module, mesh: Mesh, rules=LLAMA_RULES) -> ShardedModel:
    """``model`` with its parameters placed by ``rules``, wrapped so that
    :func:`jaxkv.generate` / :func:`jaxkv.stream` shard the cache and the batch on ``mesh``."""
    check_auto_axes(mesh, "sharded_model")  # before the parameters move
    return ShardedModel(shard_params(model, mesh, rules), mesh)


def _gathered(x: jax.Array) -> np.ndarray:
    if x.is_fully_addressable:
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _host_prompts(input_ids: Any, prompt_lengths: Any, model: nnx.Module) -> tuple[np.ndarray, np.ndarray]:
    """The prompts and their lengths as int32 host arrays, checked as :func:`jaxkv.generate`
    checks them (:func:`jaxkv.generation.check_prompts`, on the host) *before* the int32
    conversion: a cast first would truncate float ids and wrap ids or lengths beyond the
    int32 range onto valid-looking ones (then decoded)."""
    from jaxkv._checks import model_vocab_size
    from jaxkv.generation import check_prompts

    ids, lengths = check_prompts(
        np.asarray(input_ids), None if prompt_lengths is None else np.asarray(prompt_lengths),
        "jaxkv.distributed.generate", vocab_size=model_vocab_size(model),
    )
    return np.asarray(ids, np.int32), np.asarray(lengths, np.int32)


def generate(
    model: nnx.Module, input_ids: Any, max_new_tokens: int, *, mesh: Mesh, prompt_lengths: Any = None,
    rules=LLAMA_RULES, **kwargs: Any,
) -> GenerateOutput:
    """:func:`jaxkv.generate` on ``mesh``: tensor-parallel weights, sharded cache and batch.

    Every process calls it with the same arguments. The model's parameters are placed on
    the mesh (in place). Returns NumPy tokens and lengths, gathered from every process.

    Args:
        model: a decoder such as :class:`jaxkv.models.Llama`.
        input_ids: [B, P] prompt ids (host values, the same in every process); B must be a
            multiple of the mesh's data axis.
        max_new_tokens: N.
        mesh: a ``("data", "model")`` mesh (:func:`make_mesh`).
        prompt_lengths: [B] real prompt lengths, default P.
        rules: parameter placement rules, default :data:`LLAMA_RULES`.
        **kwargs: the other arguments of :func:`jaxkv.generate` (greedy decoding is what the
            tests cover across processes).

    Raises:
        ValueError / TypeError: what :func:`jaxkv.generate` refuses (non-integer ids or
            lengths, an id outside the vocabulary, a length outside ``[1, P]``), checked on
            the host before anything is cast to int32.
    """
    input_ids, prompt_lengths = _host_prompts(input_ids, prompt_lengths, model)
    replicated = NamedSharding(mesh, P())
    out = jaxkv.generate(
        sharded_model(model, mesh, rules), place(input_ids, replicated), max_new_tokens,
        prompt_lengths=place(prompt_lengths, replicated), **kwargs,
    )
    return GenerateOutput(tokens=_gathered(out.tokens), lengths=_gathered(out.lengths))


# --------------------------------------------------------------------------- command line


def demo_batch() -> tuple[np.ndarray, np.ndarray]:
    """The demo prompts, right-padded with 0: ``(ids [4, 6], lengths [4])``."""
    width = max(len(p) for p in DEMO_PROMPTS)
    ids = np.array([list(p) + [0] * (width - len(p)) for p in DEMO_PROMPTS], np.int32)
    return ids, np.array([len(p) for p in DEMO_PROMPTS], np.int32)


def _demo_model():
    from jaxkv.models import Llama, LlamaConfig

    return Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))


def _worker(args: argparse.Namespace) -> None:
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", args.local_devices)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if args.num_processes > 1:
        jax.distributed.initialize(
            coordinator_address=args.coordinator, num_processes=args.num_processes, process_id=args.process_id
        )
    ids, lengths = demo_batch()
    model = _demo_model()
    result = {"processes": jax.process_count(), "devices": 1}
    if args.single:
        out = jaxkv.generate(model, ids, args.max_new_tokens, prompt_lengths=lengths)
        tokens = np.asarray(out.tokens)
    else:
        count = jax.device_count()
        mesh = make_mesh(count // args.model_parallel, args.model_parallel)
        tokens = generate(model, ids, args.max_new_tokens, mesh=mesh, prompt_lengths=lengths).tokens
        # A second call on the placed model, and an eager call with a global cache: host
        # checks read only what this process holds (both raised on another process's shards).
        again = generate(model, ids, args.max_new_tokens, mesh=mesh, prompt_lengths=lengths).tokens
        sharded = ShardedModel(model, mesh)
        logits, _ = sharded.model(place(ids, NamedSharding(mesh, P())), sharded.init_cache(ids.shape[0], 16))
        result.update(second_call_equal=bool(np.array_equal(np.asarray(again), np.asarray(tokens))),
                      eager_logits_finite=bool(jax.jit(lambda x: jnp.isfinite(x).all())(logits)))
        # What the program ran on: how the weights and the cache were split.
        state = nnx.state(model)
        cache = ShardedModel(model, mesh).init_cache(ids.shape[0], 16)
        result.update(
            devices=count,
            mesh=dict(mesh.shape),
            param_specs={"/".join(_path_names(path)): list(x.sharding.spec)
                         for path, x in jax.tree_util.tree_flatten_with_path(state)[0]},
            cache_spec=list(cache.stores[0].keys.sharding.spec),
            cache_shard=list(cache.stores[0].keys.addressable_shards[0].data.shape),
            cache_repr=repr(cache),  # (a global cache's repr read other processes' shards: review 67)
        )
    if jax.process_index() == 0:
        print(json.dumps(result | {"tokens": tokens.tolist()}), flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _worker_env(environ: Mapping[str, str]) -> dict[str, str]:
    """A worker's environment: the caller's, on the CPU, without a forced host device count
    in ``XLA_FLAGS`` (``--local-devices`` sets the count); the other XLA flags stay."""
    env = dict(environ, JAX_PLATFORMS="cpu")
    flags = [f for f in env.pop("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    if flags:
        env["XLA_FLAGS"] = " ".join(flags)
    return env


def _wait_all(procs: Sequence[subprocess.Popen], timeout: float) -> list[tuple[str, str]]:
    """``(stdout, stderr)`` of every process once all have exited 0.

    The first to fail ends the wait: the others are killed (a worker whose peer died waits
    for it in ``jax.distributed.initialize`` or a collective until its own timeout), and the
    error carries the failed one's stderr. One deadline for all of them, not one each.

    Raises:
        RuntimeError: a process exited non-zero, or they had not all finished in ``timeout`` s.
    """
    outputs: list[Any] = [None] * len(procs)

    def collect(i: int, proc: subprocess.Popen) -> None:
        outputs[i] = proc.communicate()  # drains both pipes, so no process blocks on a full one

    readers = [threading.Thread(target=collect, args=(i, p), daemon=True) for i, p in enumerate(procs)]
    for reader in readers:
        reader.start()

    def stop_all() -> None:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        for reader in readers:
            reader.join(timeout=10)

    deadline = time.monotonic() + timeout
    while any(reader.is_alive() for reader in readers):
        failed = next((i for i, p in enumerate(procs) if p.poll() not in (None, 0)), None)
        if failed is not None:
            code = procs[failed].returncode
            readers[failed].join(timeout=10)
            stop_all()
            err = (outputs[failed] or ("", ""))[1] or ""
            raise RuntimeError(f"jaxkv.distributed: process {failed} exited with {code}:\n{err[-4000:]}")
        if time.monotonic() > deadline:
            running = [i for i, p in enumerate(procs) if p.poll() is None]
            stop_all()
            raise RuntimeError(
                f"jaxkv.distributed: workers did not finish within {timeout} s (still running: processes {running})"
            )
        time.sleep(0.05)
    failed = [(i, p.returncode, err) for i, (p, (_, err)) in enumerate(zip(procs, outputs)) if p.returncode]
    if failed:
        i, code, err = failed[0]
        raise RuntimeError(f"jaxkv.distributed: process {i} exited with {code}:\n{err[-4000:]}")
    return outputs


def launch(num_processes: int, local_devices: int, model_parallel: int, max_new_tokens: int, *,
           timeout: float = 300.0) -> dict:
    """Starts ``num_processes`` worker processes on this machine and returns process 0's result.

    Raises:
        RuntimeError: a worker failed or timed out (its output is in the message).
    """
    coordinator = f"localhost:{_free_port()}"
    env = _worker_env(os.environ)
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "jaxkv.distributed", "--worker", "--process-id", str(i),
             "--num-processes", str(num_processes), "--coordinator", coordinator,
             "--local-devices", str(local_devices), "--model-parallel", str(model_parallel),
             "--max-new-tokens", str(max_new_tokens)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        )
        for i in range(num_processes)
    ]
    outputs = _wait_all(procs, timeout)
    return json.loads(outputs[0][0].strip().splitlines()[-1])


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m jaxkv.distributed", description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-processes", type=int, default=2)
    parser.add_argument("--local-devices", type=int, default=4, help="virtual CPU devices per process")
    parser.add_argument("--model-parallel", type=int, default=2, help="size of the model (tensor-parallel) axis")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--single", action="store_true", help="one process, one device: the reference tokens")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--process-id", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--coordinator", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker or args.single:
        if args.single:
            args.num_processes, args.local_devices = 1, 1
        _worker(args)
        return
    print(json.dumps(launch(args.num_processes, args.local_devices, args.model_parallel, args.max_new_tokens)))


if __name__ == "__main__":
    main()
