"""Where tokenmill keeps what it derives from model files (converted GGUFs, resolved configs)."""

from __future__ import annotations

import os


def cache_root() -> str:
    """$TOKENMILL_CACHE_DIR, else $XDG_CACHE_HOME/tokenmill, else ~/.cache/tokenmill."""
    return os.environ.get("TOKENMILL_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tokenmill"
    )
