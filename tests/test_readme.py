"""Every ```python block of README.md runs, in order, as one script.

The blocks share one namespace from the top of the file down, the way a reader follows
them (a later section uses the ``loaded`` model of "Generation"). A block whose first line
is the marker comment below needs several devices: it runs alone in a subprocess with
8 virtual CPU devices, as ``tests/test_sharding.py`` does.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
SUBPROCESS_MARKER = "# Needs 8 devices"
_FENCE = re.compile(r"^```python\n(.*?)^```$", re.DOTALL | re.MULTILINE)


def _blocks() -> list[tuple[int, str]]:
    """``(first code line, source)`` of each python block, in README order."""
    text = README.read_text()
    return [(text.count("\n", 0, m.start(1)) + 1, m.group(1)) for m in _FENCE.finditer(text)]


BLOCKS = _blocks()


def _run_blocks(blocks: list[tuple[int, str]], namespace: dict) -> None:
    """Runs the blocks in order: in-process ones in ``namespace``, marked ones in a subprocess."""
    for line, source in blocks:
        if source.startswith(SUBPROCESS_MARKER):
            _run_in_subprocess(line, source)
        else:
            # Blank lines up front make tracebacks point at README.md's own line numbers.
            exec(compile("\n" * (line - 1) + source, str(README), "exec"), namespace)


def _run_in_subprocess(line: int, source: str) -> None:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    script = "\n" * (line - 1) + source
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    if result.returncode != 0:
        pytest.fail(f"README.md block at line {line} failed in its subprocess:\n{result.stderr}")


def test_readme_has_python_blocks():
    assert len(BLOCKS) >= 8
    assert sum(source.startswith(SUBPROCESS_MARKER) for _, source in BLOCKS) == 1


@pytest.mark.slow
def test_readme_blocks_run_in_order():
    # One test for every block, so that one worker runs them in order, once each. (Per-block
    # tests grouped with pytest-xdist's xdist_group did not stay on one worker: with pytest
    # 9.2 the group suffix xdist 3.8 writes into the node id is ignored, and a worker that got
    # a later block ran every block above it again.) A failing block's traceback and message
    # name its README.md line.
    _run_blocks(BLOCKS, {"__name__": "readme"})


def test_a_raising_block_fails_its_test():
    blocks = [(1, "x = 1\n"), (3, "y = x + 1\n1 / 0\n"), (6, "z = 3\n")]
    namespace = {}
    with pytest.raises(ZeroDivisionError) as info:
        _run_blocks(blocks, namespace)
    assert info.traceback[-1].lineno + 1 == 4  # README line of the raising statement
    assert namespace["y"] == 2 and "z" not in namespace
    with pytest.raises(pytest.fail.Exception, match="block at line 2 failed"):
        _run_in_subprocess(2, SUBPROCESS_MARKER + "\nraise SystemExit(3)\n")
