"""The embedded model's corpus: the CPython standard library's own sources, and its split.

Shared by ``train_embedded.py`` (what the model trains and validates on) and
``eval_embedded.py`` (held-out function headers come from the validation files only).
Training-only extras (stdlib subfolders such as ``test``, installed packages) pass
:func:`drop_overlapping` first, so that no copy of held-out code (``setuptools`` vendors
``distutils``, backports vendor ``importlib.metadata``) reaches training.
"""

from __future__ import annotations

import ast
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


def _parsing_sources(root: Path, rel_to: Path, prefix: str = ""):
    """``(name, text)`` for the ``.py`` files under ``root`` that meet the corpus's size and
    encoding rules and that ``ast.parse`` accepts."""
    import ast

    files = []
    for path in sorted(root.rglob("*.py")):
        if "__pycache__" in path.parts or (text := _read_source(path)) is None:
            continue
        try:
            ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        files.append((prefix + path.relative_to(rel_to).as_posix(), text))
    return files


def collect_packages(names):
    """Training-only sources from installed packages, and each package's version.

    ``names`` are import names (``numpy``, ``jax``); a name that is not installed, or is a
    single module rather than a package folder, is an error. File names are
    ``site-packages/<name>/...``. The versions go into the corpus record, since the text
    depends on them.
    """
    import importlib.metadata
    import importlib.util

    files, versions = [], {}
    for name in names:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            raise SystemExit(f"--extra-train-packages: {name!r} is not an installed package folder "
                             f"(install it, or drop it from the list)")
        root = Path(list(spec.submodule_search_locations)[0])
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
        files += _parsing_sources(root, root.parent, "site-packages/")
    return files, versions


def _shingles(text: str, width: int = 4) -> set[int]:
    """Hashes of every run of ``width`` consecutive non-blank lines, whitespace-stripped."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return {hash("\n".join(lines[i : i + width])) for i in range(len(lines) - width + 1)}


def drop_overlapping(files, held_out, max_shared: int = 2):
    """``files`` without those that share more than ``max_shared`` 4-line runs with
    ``held_out`` (the validation files), and the names of the dropped ones.

    Four stripped non-blank lines in a row rarely repeat by chance (license headers and
    ``if __name__ == "__main__":`` blocks do, hence the allowance), but a vendored or copied
    module shares hundreds.
    """
    seen = set().union(*(_shingles(t) for _, t in held_out)) if held_out else set()
    kept, dropped = [], []
    for name, text in files:
        (dropped if len(_shingles(text) & seen) > max_shared else kept).append((name, text))
    return kept, [n for n, _ in dropped]


def collect_extra(stdlib: Path, dirs):
    """Training-only sources from stdlib subfolders the base corpus leaves out (``test``).

    Only files that ``ast.parse`` accepts (the test suite also holds deliberately broken
    sources) and that meet the base corpus's size and encoding rules. They never enter the
    validation split or the tokenizer's training text, so both stay those of the base corpus.
    """
    files = []
    for top in dirs:
        root = stdlib / top
        if not root.is_dir():
            raise SystemExit(f"--extra-train-dirs: {root} is not a directory")
        files += _parsing_sources(root, stdlib)
    return files


def function_documents(files):
    """Every function of ``files`` (methods and nested functions too) as its own document:
    its source from the ``def`` line (decorators left out) to its last line, dedented by the
    ``def``'s column, ending in a newline.

    A method in a file sits indented inside its class, and a file goes on after it, so a
    model trained on whole files only seldom sees a function start at column 0 and end with
    the text. These documents are that shape: a ``def`` at column 0, its body, then the end of
    the text. A line indented less than its ``def`` (inside a multi-line string) is kept as is.
    Functions whose body starts on the ``def`` line are skipped, as are files that do not parse.
    """
    docs = []
    for _, source in files:
        try:
            tree = ast.parse(source)
        except (SyntaxError, ValueError):
            continue
        lines = source.splitlines(keepends=True)
        for node in multiline_functions(tree):
            text = dedent_lines(lines[node.lineno - 1 : node.end_lineno], node.col_offset)
            docs.append(text if text.endswith("\n") else text + "\n")
    return docs


def multiline_functions(tree):
    """The function definitions (``def`` and ``async def``, at any depth) in ``tree`` whose
    body starts on a later line than the ``def``: those a header can be cut from."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.body[0].lineno > node.lineno:
            yield node


def dedent_lines(lines, col: int) -> str:
    """``lines`` (with their line ends) less ``col`` leading columns: a blank line becomes
    ``"\\n"``, a line indented less than ``col`` (inside a multi-line string) stays as is."""
    return "".join("\n" if not ln.strip() else ln[col:] if ln[:col].isspace() else ln for ln in lines)
