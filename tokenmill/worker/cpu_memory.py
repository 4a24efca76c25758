"""Memory settings that keep a CPU forward pass from page-faulting (Linux, glibc).

A fresh page costs a fault and a zeroing on first touch, a few GB/s at best; a 2,048-token prefill
chunk wrote its K/V at 0.5 GB/s into never-touched cache pages, and every intermediate tensor over
glibc's mmap threshold was mapped, faulted in and unmapped again on every layer.

- tune_malloc: serve allocations up to 256 MB from the heap and never trim it, so freed activation
  buffers are reused warm (vLLM's CPU backend asks for tcmalloc for the same reason; this needs no
  preload). 256 MB holds a 7B model's dequantized gate-up (a quantized layer's prompt path): at
  glibc's documented maximum of 32 MB, a 1B Llama's 67 MB one was mapped and faulted in on every
  layer of every prompt chunk (dequantized at 1.5 G weights/s instead of 8.6). glibc 2.36 takes
  the larger value on the main arena (the engine's forward runs on the main thread, also in
  `serve`); one that refuses it gets 32 MB. Larger buffers (the KV cache) stay mapped lazily.
- zeros_huge_page_aligned: the KV cache starts on a 2 MB boundary (calloc's 16-byte offset made
  every 128-byte K/V row straddle three cache lines) and lies in transparent huge pages (where THP
  is in "madvise" mode), so its first touch faults once per 2 MB instead of once per 4 KB.

Both are best effort: elsewhere they do nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

import numpy as np
import torch

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MADV_HUGEPAGE = 14
_HUGE_PAGE = 2 << 20


@functools.cache  # find_library runs ldconfig: once per process, not once per KV tensor
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name, use_errno=True) if name else None
    except OSError:
        return None


def tune_malloc() -> None:
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt"):
        return
    ok = (libc.mallopt(_M_MMAP_THRESHOLD, 256 << 20) or libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20)) and libc.mallopt(_M_TRIM_THRESHOLD, 1 << 40)
    if not ok:
        logger.debug("mallopt refused the CPU allocator settings")


def advise_huge_pages(array: np.ndarray) -> None:
    """madvise(MADV_HUGEPAGE) over the 2 MB-aligned part of a not yet touched buffer."""
    libc = _libc()
    if libc is None or not hasattr(libc, "madvise"):
        return
    start = array.ctypes.data
    end = start + array.nbytes
    aligned = -(-start // _HUGE_PAGE) * _HUGE_PAGE
    if end - aligned < _HUGE_PAGE:
        return
    length = (end - aligned) // _HUGE_PAGE * _HUGE_PAGE
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if libc.madvise(aligned, length, _MADV_HUGEPAGE) != 0:
        logger.debug("madvise(MADV_HUGEPAGE) failed: errno %d", ctypes.get_errno())


def zeros_huge_page_aligned(shape: tuple[int, ...], dtype: torch.dtype) -> np.ndarray:
    """A lazily zeroed buffer (calloc: pages are touched only when used) for a torch dtype, starting
    on a 2 MB boundary and advised into huge pages; viewed as that dtype by torch.from_numpy(...).view."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    nbytes = int(np.prod(shape)) * itemsize
    raw = np.zeros(nbytes + _HUGE_PAGE, dtype=np.uint8)
    offset = -raw.ctypes.data % _HUGE_PAGE
    buf = raw[offset : offset + nbytes]
    advise_huge_pages(buf)
    return buf.view({1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}[itemsize]).reshape(shape)
