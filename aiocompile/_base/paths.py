"""Where aiocompile keeps what it writes for the user by default."""

from __future__ import annotations

import os


def user_cache(name: str) -> str:
    """``aiocompile/NAME`` in the user's cache directory (``$XDG_CACHE_HOME``, else
    ``~/.cache``)."""
    base = os.environ.get("XDG_CACHE_HOME", "").strip() or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "aiocompile", name)
