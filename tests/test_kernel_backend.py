"""The native CPU kernel is built and registered only for computations that run on CPU:
tracing attention for a GPU or TPU default device never runs the C++ compiler."""

import jax
import jax.numpy as jnp
import pytest

from jaxkv import _kernels
from jaxkv.attention.blockwise import blockwise_attend

ARGS = (jnp.ones((1, 2, 1, 16)), jnp.ones((1, 1, 8, 16)), jnp.ones((1, 1, 8, 16)))
KW = dict(q_positions=jnp.array([[4]], jnp.int32), kv_lengths=jnp.array([5], jnp.int32))


@pytest.fixture
def builds(monkeypatch):
    """Forgets any earlier build and records each call of the builder (which then fails,
    as a build without a compiler would)."""
    calls = []

    def build(*args, **kwargs):
        calls.append(args)
        raise RuntimeError("test builder: no compiler here")

    monkeypatch.setattr(_kernels, "_state", {})
    monkeypatch.setattr(_kernels, "build", build)
    monkeypatch.delenv("JAXKV_CPU_KERNEL", raising=False)
    return calls


@pytest.mark.parametrize("platform", ["gpu", "tpu"])
def test_other_backends_never_build_the_kernel(platform, builds, monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: platform)
    jaxpr = jax.make_jaxpr(lambda *a: blockwise_attend(*a, **KW))(*ARGS)
    assert builds == []
    assert _kernels.TARGET not in str(jaxpr)  # the XLA loop alone, no custom call
    with pytest.raises(ValueError, match=f"default device is a {platform} device"):
        blockwise_attend(*ARGS, implementation="kernel", **KW)
    assert builds == []


def test_cpu_backend_builds_the_kernel(builds, monkeypatch):
    """The control: the same patched builder is reached when the backend is CPU."""
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    with pytest.warns(RuntimeWarning, match="kernel is unavailable"):
        jax.make_jaxpr(lambda *a: blockwise_attend(*a, **KW))(*ARGS)
    assert len(builds) == 1


def _fake_compiler(tmp_path, monkeypatch):
    """$CXX: a stand-in compiler that writes "built" to its output path (the last argument)
    and logs each run; returns the log's path."""
    import stat

    fake, log = tmp_path / "fake-cxx", tmp_path / "runs"
    fake.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = "--version" ]; then echo fake-cxx 1.0; exit 0; fi\n'
        f'echo run >> "{log}"\n'
        'while [ "$#" -gt 1 ]; do shift; done\n'
        'echo built > "$1"\n'
    )
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("CXX", str(fake))
    return log


def test_background_build_leaves_this_process_on_xla_and_a_later_one_finds_the_build(tmp_path, monkeypatch):
    """The CLI's first run on a machine does not wait for the compiler: a detached process
    builds (here a stand-in compiler that writes a file), this process traces the XLA loop,
    a second call while the builder's marker is fresh starts no second builder, and once the
    build is there nothing starts again."""
    import subprocess
    import sys
    import time

    log = _fake_compiler(tmp_path, monkeypatch)
    monkeypatch.setenv("JAXKV_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("JAXKV_CPU_KERNEL", raising=False)
    monkeypatch.setattr(_kernels, "_state", {})
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    spawned = []  # the builders (Python processes; `--version` runs of the compiler are not counted)
    popen = subprocess.Popen

    def count_builders(args, *rest, **kwargs):
        process = popen(args, *rest, **kwargs)
        if args[0] == sys.executable:
            spawned.append(process)
        return process

    monkeypatch.setattr(subprocess, "Popen", count_builders)
    assert _kernels.built() is None

    assert _kernels.start_background_build() is True
    assert _kernels.available() is False  # no waiting, no warning: this process uses the XLA loop
    jaxpr = jax.make_jaxpr(lambda *a: blockwise_attend(*a, **KW))(*ARGS)
    assert _kernels.TARGET not in str(jaxpr)

    monkeypatch.setattr(_kernels, "_state", {})  # another process, while the builder may still run
    deadline = time.monotonic() + 60
    while _kernels.built() is None and time.monotonic() < deadline:
        _kernels.start_background_build()  # the marker is fresh: no second builder (the log below)
        monkeypatch.setattr(_kernels, "_state", {})
        time.sleep(0.2)
    path = _kernels.built()
    assert path is not None and path.read_text() == "built\n"
    while any(path.parent.glob("*.building")) and time.monotonic() < deadline:
        time.sleep(0.1)  # the builder removes its marker after the build
    assert not any(path.parent.glob("*.building"))
    assert len(spawned) == 1 and spawned[0].wait(timeout=60) == 0  # one builder, and it succeeded
    assert log.read_text() == "run\n"  # the compiler ran once
    assert _kernels.start_background_build() is False  # built: the next process loads it


def test_background_build_is_off_with_the_kernel_switched_off(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXKV_CPU_KERNEL", "0")
    monkeypatch.setenv("JAXKV_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(_kernels, "_state", {})
    assert _kernels.start_background_build() is False
    assert list(tmp_path.iterdir()) == []


def test_a_damaged_or_untrusted_build_is_never_loaded(tmp_path, monkeypatch):
    """A build is used only with the digest its build wrote beside it. A truncated library (it
    crashed the process with SIGBUS in ctypes) or one without a digest is rebuilt. The cache
    directory is the user's choice (a group-writable team cache too); the fallback under the
    shared temp directory has a predictable name, so a library there is loaded only when this
    user owns the directory and no one else can write to it."""
    import os
    import stat
    import tempfile

    log = _fake_compiler(tmp_path, monkeypatch)
    cache, shared_tmp = tmp_path / "cache", tmp_path / "tmp"
    shared_tmp.mkdir()
    monkeypatch.setenv("JAXKV_KERNEL_CACHE", str(cache))
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(shared_tmp))

    first = _kernels.build()
    assert first.parent == cache and stat.S_IMODE(cache.stat().st_mode) == 0o700
    assert _kernels.built() == first and log.read_text().count("run") == 1
    first.write_bytes(b"bui")  # truncated
    assert _kernels.built() is None
    assert _kernels.build() == first and first.read_text() == "built\n" and log.read_text().count("run") == 2
    (cache / f"{first.name}.sha256").unlink()  # a build from before digests were written
    assert _kernels.built() is None
    assert _kernels.build() == first and log.read_text().count("run") == 3

    cache.chmod(0o2775)  # a team's shared cache (group-writable) stays the user's choice
    assert _kernels.built() == first
    cache.chmod(0o500)  # not writable: the build goes to the private fallback under the temp directory
    first.unlink()
    if not os.access(cache, os.W_OK):  # (root writes anyway)
        fallback = _kernels.build()
        assert fallback.parent.parent == shared_tmp and stat.S_IMODE(fallback.parent.stat().st_mode) == 0o700
    cache.chmod(0o700)
    fallback_dir = _kernels._fallback_dir()
    fallback_dir.mkdir(mode=0o700, exist_ok=True)
    planted = fallback_dir / first.name  # a library with its digest, in the fallback
    planted.write_text("planted\n")
    (fallback_dir / f"{first.name}.sha256").write_text(_kernels._digest(planted) + "\n")
    if (cache / first.name).exists():
        (cache / first.name).unlink()
    assert _kernels.built() == planted  # this user's own private fallback: trusted
    fallback_dir.chmod(0o777)  # writable by others: nothing in it is loaded
    assert _kernels.built() is None
    if hasattr(os, "getuid") and os.getuid() == 0:  # only root can give a directory to another user
        fallback_dir.chmod(0o700)
        os.chown(fallback_dir, 12345, -1)
        assert _kernels.built() is None


def test_a_failed_build_is_remembered_and_said_at_once(tmp_path, monkeypatch):
    """A compiler that runs but fails (too old, headers missing): the CLI's background
    builder retried at every run, silently (stderr to /dev/null), ~45 s each (review 66).
    The failure is noted beside the build: later builds raise its message without running
    the compiler, and the background build starts none (available() then says why)."""
    import stat

    fake, log = tmp_path / "bad-cxx", tmp_path / "runs"
    fake.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = "--version" ]; then echo bad-cxx 1.0; exit 0; fi\n'
        f'echo run >> "{log}"\n'
        'echo "error: C++17 not supported" >&2; exit 1\n'
    )
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("CXX", str(fake))
    monkeypatch.setenv("JAXKV_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("JAXKV_CPU_KERNEL", raising=False)
    monkeypatch.setattr(_kernels, "_state", {})
    with pytest.raises(RuntimeError, match="C\\+\\+17 not supported"):
        _kernels.build()
    with pytest.raises(RuntimeError, match=r"(?s)C\+\+17 not supported.*this build failed before; delete .*\.failed"):
        _kernels.build()
    assert _kernels.start_background_build() is False
    with pytest.warns(RuntimeWarning, match="C\\+\\+17 not supported"):
        assert _kernels.available() is False
    assert log.read_text() == "run\n"  # the compiler ran once


def test_no_home_directory_puts_builds_in_the_private_fallback(tmp_path, monkeypatch):
    """Without HOME and a passwd entry, "~" stays "~": the kernel cache was ./~/.cache/jaxkv
    in whatever directory the program ran from (review 66)."""
    import os
    import tempfile

    from jaxkv.cli import compilation_cache_dir

    monkeypatch.delenv("JAXKV_KERNEL_CACHE", raising=False)
    monkeypatch.delenv("JAXKV_COMPILATION_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setattr(os.path, "expanduser", lambda path: path)
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    assert _kernels._cache_dir() == _kernels._fallback_dir() and _kernels._cache_dir().is_absolute()
    assert compilation_cache_dir() is None  # no caching rather than a relative directory


@pytest.mark.parametrize("value,want", [("", "1"), ("1", "1"), ("TRUE", "1"), ("yes", "1"), ("0", "0"), (" false ", "0"), ("Off", "0")])
def test_environment_switches_read_one_way(value, want, monkeypatch):
    from jaxkv import _env

    monkeypatch.setenv("JAXKV_CPU_KERNEL", value)
    assert _env.switch("JAXKV_CPU_KERNEL", "1") == want
    if want == "0":
        assert _kernels.available() is False


@pytest.mark.parametrize("name,value", [("JAXKV_CPU_KERNEL", "maybe"), ("JAXKV_PALLAS_GPU", "gpu")])
def test_a_bad_switch_value_is_an_error_naming_it(name, value, monkeypatch):
    """JAXKV_CPU_KERNEL=off was read as on (it is off now, as no is); JAXKV_PALLAS_GPU= (empty) was an error while the
    others took empty as unset (review 66)."""
    from jaxkv import _env
    from jaxkv.attention import pallas_gpu

    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=rf"^{name} must be one of .*got '{value}'"):
        _env.switch(name, "1", ("auto",) if name == "JAXKV_PALLAS_GPU" else ())
    monkeypatch.setenv("JAXKV_PALLAS_GPU", "")
    assert pallas_gpu.use_pallas(jnp.ones((1, 2, 1, 16)), None) is False  # empty: auto (no GPU here)
