"""The embedded model's corpus: the CPython standard library's own sources, and its split.

Shared by ``train_embedded.py`` (what the model trains and validates on) and
``eval_embedded.py`` (held-out function headers come from the validation files only).
"""

from __future__ import annotations

from pathlib import Path

# Path components that exclude a file: test suites, the IDE, GUI demos,
# installed third-party packages, bundled data and generated tables.
EXCLUDED_DIRS = {
    "test",
    "tests",
    "idlelib",
    "site-packages",
    "dist-packages",
    "turtledemo",
    "ensurepip",
    "encodings",  # mostly generated charmap tables
    "pydoc_data",  # one huge generated string literal
    "__pycache__",
    "lib-dynload",
}
EXCLUDED_PREFIXES = ("_sysconfigdata", "config-")
MAX_FILE_BYTES = 400_000



def _read_source(path: Path) -> str | None:
    """The file's text with LF line ends, or None when the corpus rules leave it out: not a
    regular file, over MAX_FILE_BYTES, not UTF-8, or under 64 non-blank characters."""
    if not path.is_file() or path.stat().st_size > MAX_FILE_BYTES:
        return None
    try:
        text = path.read_text(encoding="utf-8").replace("\r\n", "\n")
    except UnicodeDecodeError:
        return None
    return text if len(text.strip()) >= 64 else None


def collect_sources(stdlib: Path):
    files = []
    for path in sorted(stdlib.rglob("*.py")):
        rel = path.relative_to(stdlib)
        if any(part in EXCLUDED_DIRS for part in rel.parts[:-1]):
            continue
        if any(part.startswith(EXCLUDED_PREFIXES) for part in rel.parts):
            continue
        if (text := _read_source(path)) is not None:
            files.append((rel.as_posix(), text))
    return files


def split_files(files, every=50):
    train, val = [], []
    for i, item in enumerate(files):
        (val if i % every == every // 2 else train).append(item)
    return train, val


def collect_extra(stdlib: Path, dirs):
    """Training-only sources from stdlib subfolders the base corpus leaves out (``test``).

    Only files that ``ast.parse`` accepts (the test suite also holds deliberately broken
    sources) and that meet the base corpus's size and encoding rules. They never enter the
    validation split or the tokenizer's training text, so both stay those of the base corpus.
    """
    import ast

    files = []
    for top in dirs:
        root = stdlib / top
        if not root.is_dir():
            raise SystemExit(f"--extra-train-dirs: {root} is not a directory")
        for path in sorted(root.rglob("*.py")):
            if "__pycache__" in path.parts or (text := _read_source(path)) is None:
                continue
            try:
                ast.parse(text)
            except (SyntaxError, ValueError):
                continue
            files.append((path.relative_to(stdlib).as_posix(), text))
    return files
