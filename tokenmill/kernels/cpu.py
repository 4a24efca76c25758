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

_DIR = Path(__file__).parent / "cpu"
_SOURCES = [_DIR / name for name in ("paged_attention.cpp", "sampling.cpp", "pointwise.cpp")]
_HEADERS = [_DIR / "vec.h"]
# -ffp-contract=off: no fused multiply-adds the source does not write, so the pointwise ops round as torch does.
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-ffp-contract=off"]


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
    for source in _SOURCES + _HEADERS:
        digest.update(source.read_bytes())
    digest.update(" ".join(_CFLAGS).encode() + _cpu_flags().encode() + torch.__version__.encode())
    name = f"tokenmill_cpu_{digest.hexdigest()[:16]}"
    try:  # a private helper of torch's: only used to say why the first start pauses
        cached = Path(cpp_extension._get_build_directory(name, verbose=False), f"{name}.so").exists()
    except Exception:
        cached = True
    if not cached:  # a warning, as the CLI shows no info by default
        logger.warning("building tokenmill's CPU kernels for this machine (once; about half a minute)")
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
        lines = str(exc).strip().splitlines() or [type(exc).__name__]
        reason = next((line for line in lines if "error" in line.lower() and line is not lines[0]), lines[0])
        logger.warning("tokenmill's CPU kernels could not be built; using the PyTorch paths (%s)", reason[:300])
        logger.debug("CPU kernel build failure", exc_info=True)
        return False
    return True


def use_cpu_kernels(x: torch.Tensor) -> bool:
    """Whether ops on x can run in these kernels: a CPU tensor, and the kernels built."""
    return x.device.type == "cpu" and cpu_kernels_available()


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


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Each new token's K/V [T, Hkv, D] into its slot of the head-major caches (see paged_attention.cpp)."""
    torch.ops.tokenmill_cpu.write_kv(k_cache, v_cache, k, v, slot_mapping)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm of each row of x ([rows, hidden], contiguous rows) in one op (see pointwise.cpp)."""
    return torch.ops.tokenmill_cpu.rms_norm(x, weight, eps)


def add_rms_norm(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """residual += x (in place, rounded to its dtype), then the RMSNorm of residual, in one op."""
    return torch.ops.tokenmill_cpu.add_rms_norm(residual, x, weight, eps)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[rows, 2I] (gate | up) -> silu(gate) * up, in one op."""
    return torch.ops.tokenmill_cpu.silu_and_mul(x)


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotary embedding (neox halves) applied in place to q [T, H, D] and k [T, Hkv, D]; cos/sin [T, D]."""
    torch.ops.tokenmill_cpu.rotary(q, k, cos, sin)
