"""The package's environment switches, read one way (core: no dependency beyond the stdlib).

An unset or empty variable takes its default; ``1``/``true``/``on``/``yes`` and
``0``/``false``/``off``/``no`` (any case) are the on/off spellings; anything else is a
``ValueError`` naming the variable and what it takes (``JAXKV_CPU_KERNEL=off`` used to be read
as "on" and ``JAXKV_PALLAS_GPU=`` as an error).
"""

from __future__ import annotations

import os

_ON, _OFF = ("1", "true", "on", "yes"), ("0", "false", "off", "no")


def switch(name: str, default: str, extra: tuple[str, ...] = ()) -> str:
    """``"1"``, ``"0"`` or one of ``extra`` (e.g. ``"auto"``) for the variable ``name``."""
    raw = os.environ.get(name, "")
    value = raw.strip().lower()
    if not value:
        return default
    if is_on(value):
        return "1"
    if is_off(value):
        return "0"
    if value in extra:
        return value
    takes = ", ".join(repr(v) for v in (*extra, "1", "0"))
    raise ValueError(f"{name} must be one of {takes} (or true/on/yes, false/off/no, or unset), got {raw!r}.")


def is_off(value: str) -> bool:
    """Whether ``value`` is one of the off spellings (for a variable that is also a path)."""
    return value.strip().lower() in _OFF


def is_on(value: str) -> bool:
    """Whether ``value`` is one of the on spellings (for a variable that is also a path)."""
    return value.strip().lower() in _ON


def off(name: str) -> bool:
    """Whether an on/off variable (default on) is set to off."""
    return switch(name, "1") == "0"


def home_cache(*parts: str) -> str | None:
    """``$XDG_CACHE_HOME`` or ``~/.cache``, joined with ``parts``; None when neither gives an
    absolute directory (no HOME and no passwd entry: ``~`` stays ``~``, a directory of that
    name relative to wherever the program runs)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    if not os.path.isabs(base):
        return None
    return os.path.join(base, *parts)
