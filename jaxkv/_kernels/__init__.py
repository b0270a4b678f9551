"""Native kernels, built on first use with the machine's C++ compiler.

``decode_attention.cc`` holds four XLA:CPU FFI handlers running the same loops: decode
attention that reads a stacked ``StaticCache`` buffer in place, the same over a
``PagedCache`` pool read through the block table, and both again over int8/int4 codes and
their per-token scales (a ``QuantizedCache``, int8/int4 pages), dequantized in registers (see
its header comment and :mod:`jaxkv.attention.blockwise`). It is compiled once per (source,
jaxlib, compiler, CPU) into a cache directory, loaded with ctypes and registered as the FFI
targets ``jaxkv_decode_attention``, ``jaxkv_paged_decode_attention``,
``jaxkv_quantized_decode_attention`` and ``jaxkv_paged_quantized_decode_attention`` for the
CPU platform.

Nothing here is needed for correctness: without a compiler, or with ``JAXKV_CPU_KERNEL=0``,
:func:`available` is False and attention runs the pure-XLA blockwise loop (one warning says
why when a build fails). ``JAXKV_KERNEL_CACHE`` overrides the cache directory (default
``$XDG_CACHE_HOME/jaxkv`` or ``~/.cache/jaxkv``; a temporary directory if that cannot be
written).

The build takes 25-45 s of one core on a 2-core machine. A library call waits for it (the
first attention traced for CPU); the CLI does not: :func:`start_background_build` starts it
in a detached process and that first run uses the XLA loop, so a new user's first
``jaxkv generate`` prints its first token in seconds, not after the compiler.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.metadata
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

import jax

from jaxkv import _env

__all__ = [
    "available", "build", "built", "start_background_build", "PAGED_QUANTIZED_TARGET", "PAGED_TARGET",
    "QUANTIZED_TARGET", "TARGET",
]

TARGET = "jaxkv_decode_attention"
PAGED_TARGET = "jaxkv_paged_decode_attention"
QUANTIZED_TARGET = "jaxkv_quantized_decode_attention"
PAGED_QUANTIZED_TARGET = "jaxkv_paged_quantized_decode_attention"
SOURCE = Path(__file__).with_name("decode_attention.cc")
FLAGS = [
    "-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-pthread",
    # Lets the compiler reorder the dot products' sums into vector lanes; infinities and
    # NaN keep their meaning (no -ffinite-math-only).
    "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math",
]

_lock = threading.Lock()
_state: dict[str, object] = {}


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


def _jaxlib_version() -> str:
    try:
        return importlib.metadata.version("jaxlib")
    except importlib.metadata.PackageNotFoundError:
        return ""


def _cache_dir() -> Path:
    explicit = os.environ.get("JAXKV_KERNEL_CACHE")
    if explicit:
        return Path(explicit)
    home = _env.home_cache("jaxkv")
    # No home directory: the temp-directory fallback (a relative "~" put the library in
    # whatever directory the program ran from, and loaded one found there).
    return Path(home) if home is not None else _fallback_dir()


def _plan(compiler: str | None = None) -> tuple[str, str, list[Path]]:
    """``(compiler, file name of this build, directories to look in / write to)``.

    Raises:
      RuntimeError: no C++ compiler.
    """
    compiler = compiler or os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not compiler:
        raise RuntimeError("no C++ compiler found (looked for $CXX, g++, c++)")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(
        "\0".join(
            [SOURCE.read_text(), " ".join(FLAGS), jax.__version__, _jaxlib_version(), version, _cpu_signature(),
             platform.machine()]
        ).encode()
    ).hexdigest()[:16]
    name = f"decode_attention-{key}.so"
    candidates = [_cache_dir(), _fallback_dir()]
    return compiler, name, candidates


def _fallback_dir() -> Path:
    """Where builds go when the cache directory cannot be written: a per-user directory under
    the shared temp directory (a predictable name others could create first)."""
    return Path(tempfile.gettempdir()) / f"jaxkv-{os.getuid() if hasattr(os, 'getuid') else 'user'}"


def built(compiler: str | None = None) -> Path | None:
    """The up-to-date build's path, or None when it has not been built (builds nothing).

    Raises:
      RuntimeError: no C++ compiler.
    """
    _, name, candidates = _plan(compiler)
    return _existing(name, candidates)


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _trusted(directory: Path) -> bool:
    """Whether builds in ``directory`` may be loaded. The user's cache directory (or
    ``JAXKV_KERNEL_CACHE``, a team's shared one included) is the user's choice. The fallback
    under the shared temp directory has a predictable name, and a library another user
    planted there would run in this process: on POSIX it must be owned by this user and
    writable by no one else."""
    if directory != _fallback_dir() or not hasattr(os, "getuid"):
        return True
    try:
        st = directory.stat()
    except OSError:
        return False
    return st.st_uid == os.getuid() and not st.st_mode & 0o022


def _existing(name: str, candidates: list[Path]) -> Path | None:
    """The first complete build of ``name``: in a trusted directory, with the digest its build
    wrote beside it (a truncated or damaged library crashed the process with SIGBUS when
    loaded; one without a digest is rebuilt)."""
    for directory in candidates:
        path = directory / name
        digest = directory / f"{name}.sha256"
        try:
            if path.is_file() and _trusted(directory) and digest.read_text().strip() == _digest(path):
                return path
        except OSError:
            continue
    return None


def _failed(name: str, candidates: list[Path]) -> Path | None:
    """The note a failed build of ``name`` left (the compiler's message), if any."""
    for directory in candidates:
        note = directory / f"{name}.failed"
        try:
            if note.is_file() and _trusted(directory):
                return note
        except OSError:
            continue
    return None


def _writable(candidates: list[Path]) -> Path:
    for directory in candidates:  # the first one we can write to (a read-only home falls back to /tmp)
        try:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            if os.access(directory, os.W_OK) and _trusted(directory):
                return directory
        except OSError:
            continue
    raise RuntimeError(f"no writable directory for the kernel build among {[str(c) for c in candidates]} "
                       "(the temp-directory fallback must be owned by this user and writable by no one else)")


def build(compiler: str | None = None) -> Path:
    """Compiles the kernel library if no up-to-date build is cached; returns its path.

    Raises:
      RuntimeError: no C++ compiler, or the compiler failed (its message included).
    """
    compiler, name, candidates = _plan(compiler)
    if (found := _existing(name, candidates)) is not None:
        return found
    if (failed := _failed(name, candidates)) is not None:
        # The same source, flags and compiler failed before: say so again at once (the
        # CLI's background builder retried, silently, on every run).
        raise RuntimeError(f"{failed.read_text()[-2000:]}\n(this build failed before; delete {failed} to try again)")
    out = _writable(candidates) / name
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        partial = Path(tmp) / out.name
        cmd = [compiler, *FLAGS, "-isystem", jax.ffi.include_dir(), str(SOURCE), "-o", str(partial)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            message = f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}"
            note = Path(tmp) / f"{out.name}.failed"
            note.write_text(message)
            os.replace(note, out.parent / note.name)
            raise RuntimeError(message)
        digest = Path(tmp) / f"{out.name}.sha256"
        digest.write_text(_digest(partial) + "\n")
        os.replace(partial, out)  # atomic: a concurrent build finds a whole file or none
        os.replace(digest, out.parent / digest.name)  # after the library: a digest always names a whole file
    return out


#: A builder younger than this is taken to be still running (its marker file's age).
BUILDING_MARKER_SECONDS = 600


def switched_off() -> bool:
    """Whether ``JAXKV_CPU_KERNEL`` turns the kernel off (ValueError for a value that is no
    on/off spelling)."""
    return _env.off("JAXKV_CPU_KERNEL")


def start_background_build() -> bool:
    """For a program that should not wait for the compiler (the CLI's first run on a machine):
    when the kernel is not built yet, starts its build in a detached process and makes this
    process use the XLA loop (``available()`` is then False here); a later process finds the
    build. Returns True when this process will not use the kernel because it is being built
    (a build started now, or one another process started less than
    ``BUILDING_MARKER_SECONDS`` ago); False when the kernel is built (or already loaded), is
    off (``JAXKV_CPU_KERNEL=0``), or cannot be built here (no compiler, no writable
    directory: ``available()`` then warns as usual).
    """
    if switched_off():
        return False
    with _lock:
        if "ok" in _state:
            return False
        try:
            compiler, name, candidates = _plan()
            if _existing(name, candidates) is not None or _failed(name, candidates) is not None:
                return False  # built, or this build failed before: available() loads it or says why
            directory = _writable(candidates)
        except (RuntimeError, OSError):
            return False
        marker = directory / f"{name}.building"
        try:
            fresh = time.time() - marker.stat().st_mtime < BUILDING_MARKER_SECONDS
        except OSError:
            fresh = False
        if not fresh:
            marker.write_text(str(os.getpid()))
            # The builder removes the marker when it ends, built or not (a killed one leaves
            # it, which ages out). Its own session: it outlives this process.
            script = (
                "import os, sys\n"
                "from jaxkv import _kernels\n"
                "try:\n    _kernels.build(sys.argv[1])\n"
                "finally:\n    os.unlink(sys.argv[2])\n"
            )
            subprocess.Popen(
                [sys.executable, "-c", script, compiler, str(marker)], stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
            )
        _state["ok"] = False  # this process: the XLA loop, without a warning
        return True


def available() -> bool:
    """True when the CPU decode-attention kernel is built, loaded and registered.

    The first call compiles it if needed (about 45 s on a 2-core machine, once per machine); later calls are
    free. False when ``JAXKV_CPU_KERNEL=0``, the build failed (warned once), or
    :func:`start_background_build` left the build to another process.
    """
    if switched_off():
        return False
    with _lock:
        if "ok" not in _state:
            try:
                library = ctypes.cdll.LoadLibrary(str(build()))
                jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(library.JaxkvDecodeAttention), platform="cpu")
                jax.ffi.register_ffi_target(
                    PAGED_TARGET, jax.ffi.pycapsule(library.JaxkvPagedDecodeAttention), platform="cpu"
                )
                jax.ffi.register_ffi_target(
                    QUANTIZED_TARGET, jax.ffi.pycapsule(library.JaxkvQuantizedDecodeAttention), platform="cpu"
                )
                jax.ffi.register_ffi_target(
                    PAGED_QUANTIZED_TARGET, jax.ffi.pycapsule(library.JaxkvPagedQuantizedDecodeAttention),
                    platform="cpu",
                )
                _state["library"] = library
                _state["ok"] = True
            except Exception as err:  # noqa: BLE001 - any failure means: use the XLA path
                _state["ok"] = False
                warnings.warn(
                    f"jaxkv: the CPU decode-attention kernel is unavailable ({err}); attention runs the "
                    "pure-XLA blockwise loop instead (same results, slower on CPU). Set JAXKV_CPU_KERNEL=0 "
                    "to silence this.",
                    RuntimeWarning,
                    stacklevel=2,
                )
        return bool(_state["ok"])
