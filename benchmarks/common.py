"""Small timing helpers shared by the benchmark scripts."""

from __future__ import annotations

import json
import os
import platform
import time

import jax


def time_calls(fn, *, repeats: int, warmup: int = 3) -> float:
    """Median wall time of ``fn()`` in seconds; ``fn`` must block on its own result."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    samples.sort()
    return samples[len(samples) // 2]


def machine() -> dict:
    return {
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
    }


def write_json(path: str, payload: dict) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
    print(f"wrote {path}")


def print_table(headers: list[str], rows: list[list]) -> None:
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    for n, row in enumerate(cells):
        print("| " + " | ".join(c.rjust(w) for c, w in zip(row, widths)) + " |")
        if n == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")


def op_times(fn, *, calls: int = 5, top: int = 12, trace_dir: str | None = None) -> list[tuple[str, float, float]]:
    """Where a jitted computation's time goes: XLA:CPU per-op times from a profiler trace.

    Runs ``fn()`` (which must block on its result) twice to warm up, then ``calls`` times
    under ``jax.profiler`` with a Perfetto trace, and returns the ``top`` ops by total time
    as ``(name, ms per call, times run per call)``. Names are the compiled program's
    instructions (``dynamic-slice_bitcast_fusion`` is a materialised slice, ``ynn_fusion``
    a YNNPACK kernel, ``dot`` an Eigen matmul); the runtime's own wrappers are left out.
    """
    import collections
    import glob
    import gzip
    import shutil
    import tempfile

    directory = trace_dir or tempfile.mkdtemp(prefix="jaxkv-trace-")
    for _ in range(2):
        fn()
    jax.profiler.start_trace(directory, create_perfetto_trace=True)
    for _ in range(calls):
        fn()
    jax.profiler.stop_trace()
    path = sorted(glob.glob(os.path.join(directory, "**", "*.json.gz"), recursive=True))[-1]
    with gzip.open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    total, count = collections.Counter(), collections.Counter()
    for event in events:
        name = event.get("name", "")
        if event.get("ph") != "X" or "::" in name or name.startswith(("$", "Pjit", "ParseArguments", "while")):
            continue
        total[name] += event.get("dur", 0)
        count[name] += 1
    if trace_dir is None:
        shutil.rmtree(directory, ignore_errors=True)
    return [(name, us / calls / 1e3, count[name] / calls) for name, us in total.most_common(top)]
