"""tokenmill's CPU kernels, compiled on first use with torch.utils.cpp_extension.

The build is for this machine's instruction set (-march=native), so the build directory's name
carries a hash of the sources and the CPU's flags: a cache shared between machines never loads a
binary built for another CPU. The first build takes about half a minute; later processes load it
from torch's extension cache. Without a C++ compiler, or with TOKENMILL_CPU_KERNELS=0, the
engine runs the plain PyTorch paths instead.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCES = [Path(__file__).parent / "cpu" / name for name in ("paged_attention.cpp", "sampling.cpp")]
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno"]


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


@functools.cache
def cpu_kernels_available() -> bool:
    """Build (or load the cached build of) the CPU kernels once per process; True when their ops are registered."""
    if os.environ.get("TOKENMILL_CPU_KERNELS", "1") == "0":
        return False
    from torch.utils import cpp_extension

    digest = hashlib.sha256()
    for source in _SOURCES:
        digest.update(source.read_bytes())
    digest.update(" ".join(_CFLAGS).encode() + _cpu_flags().encode() + torch.__version__.encode())
    name = f"tokenmill_cpu_{digest.hexdigest()[:16]}"
    try:
        cpp_extension.load(
            name=name,
            sources=[str(s) for s in _SOURCES],
            extra_cflags=_CFLAGS,
            extra_ldflags=["-lmvec"],
            is_python_module=False,
            verbose=False,
        )
    except Exception as exc:  # no compiler, no ninja, a failed build: the torch paths still work
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        logger.warning("tokenmill's CPU kernels could not be built; using the PyTorch paths (%s)", first_line)
        logger.debug("CPU kernel build failure", exc_info=True)
        return False
    return True


def paged_decode_attention(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    token_rows: torch.Tensor,
    block_table: torch.Tensor,
    positions: torch.Tensor,
    sliding_window: int | None,
    scale: float,
) -> None:
    """out[token_rows] := each decode token's attention over its paged context (see paged_attention.cpp)."""
    torch.ops.tokenmill_cpu.paged_decode_attention(out, q, k_cache, v_cache, token_rows, block_table, positions, sliding_window or 0, scale)


def argmax_logsumexp(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's argmax (first index of the maximum) and logsumexp, in one pass (see sampling.cpp)."""
    return torch.ops.tokenmill_cpu.argmax_logsumexp(logits)
