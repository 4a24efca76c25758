"""Memory settings that keep a CPU forward pass from page-faulting (Linux, glibc).

A fresh page costs a fault and a zeroing on first touch, a few GB/s at best; a 2,048-token prefill
chunk wrote its K/V at 0.5 GB/s into never-touched cache pages, and every intermediate tensor over
glibc's mmap threshold was mapped, faulted in and unmapped again on every layer.

- tune_malloc: serve allocations up to 256 MB from the heap and never trim it (below 2 GB free), so freed activation
  buffers are reused warm (vLLM's CPU backend asks for tcmalloc for the same reason; this needs no
  preload). 256 MB holds a 7B model's dequantized gate-up (a quantized layer's prompt path): at
  glibc's documented maximum of 32 MB, a 1B Llama's 67 MB one was mapped and faulted in on every
  layer of every prompt chunk (dequantized at 1.5 G weights/s instead of 8.6). glibc 2.36 takes
  the larger value on the main arena (the engine's forward runs on the main thread, also in
  `serve`); one that refuses it gets 32 MB. Larger buffers (the KV cache) stay mapped lazily.
- zeros_huge_page_aligned: the KV cache starts on a 2 MB boundary (calloc's 16-byte offset made
  every 128-byte K/V row straddle three cache lines), in a mapping of its own, and lies in
  transparent huge pages (where THP is in "madvise" mode), so its first touch faults once per 2 MB
  instead of once per 4 KB.

- small_pages_where_heads_start: the first 2 MB of each KV head's blocks in 4 KB pages instead. The cache is
  [heads, blocks, block, dim] per layer, so a fresh engine's first request (the pool hands out low block
  ids first) writes into a different huge page per head, layer, K and V: SmolLM2's first prompt faulted
  180 fresh 2 MB pages (360 MB) at this VM's 0.4-0.9 GB/s first-touch rate, 0.7-1.0 s in its first step
  before the idle prefault could reach them; with these pages in 4 KB ones, 62-69 ms. Workload A, whose
  KV lies wholly in those first 2 MB, measured no slower with the whole cache in 4 KB pages (median 505
  against 464 output tok/s, five alternating pairs, within this VM's noise).

- move_weights_to_huge_pages: a built model's weights (parameters, buffers, the kernels' packed
  copies) copied once into one such region. A decode step streams every weight once; in 4 KB pages
  that is a TLB miss every 4 KB, and the hardware prefetchers stop at each page's end, so each
  page's first lines wait on memory. SmolLM2's 120 layers (benchmarks/huge_page_weights.py, Zen 4,
  alternating in one process, two runs): bf16 1.32-1.38x the speed at one row and 1.16-1.20x at 32
  rows, int4 1.14-1.21x at one row. WeightMove does it for a single-process engine's target without
  holding up the start: the copy on a background thread, the repointing between two passes.

- KVPrefault: faults the KV cache's pages in ahead of use, on a background thread at the lowest
  priority while the engine is idle, in the order the block pool hands blocks out: a first touch
  costs far more than the write itself (on the VMs measured here 0.4-0.9 GB/s, huge pages or not),
  and a never-used block is what a new request gets while the pool has any (freed blocks stay
  cached for prefix hits). Workload A on SmolLM2 bf16 ran 1.06x faster on a cache faulted in
  beforehand (README). madvise's MADV_POPULATE_WRITE (Linux 5.14) faults pages writable without
  writing them, so blocks the engine is already using keep their contents.

All are best effort: elsewhere they do nothing.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import ctypes.util
import functools
import logging
import mmap
import os
import threading
import time
import types
import weakref
from collections.abc import Iterator

import numpy as np
import psutil
import torch
from torch import nn

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
# mallopt's value is a C int: a larger Python int reaches it cut to its low 32 bits (1 << 40 became a
# trim threshold of 0, which gave every freed buffer at the heap's top back to the kernel, and a
# decode step of 64 requests faulted its 12 MB of logits in again, 3,000 page faults, 2.5 ms).
_INT_MAX = 2**31 - 1
_MADV_HUGEPAGE = 14
_MADV_NOHUGEPAGE = 15
_MADV_POPULATE_WRITE = 23
_PAGE = 4096
_HUGE_PAGE = 2 << 20


@functools.cache  # find_library runs ldconfig: once per process, not once per KV tensor
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name, use_errno=True) if name else None
    except OSError:
        return None
    if libc is not None and hasattr(libc, "madvise"):
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]  # once: addresses past 2^31
    return libc


def tune_malloc() -> None:
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt"):
        return
    ok = (libc.mallopt(_M_MMAP_THRESHOLD, 256 << 20) or libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20)) and libc.mallopt(_M_TRIM_THRESHOLD, _INT_MAX)
    if not ok:
        logger.debug("mallopt refused the CPU allocator settings")


def _madvise(libc: ctypes.CDLL, start: int, length: int, advice: int) -> bool:
    return libc.madvise(start, length, advice) == 0


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
    if not _madvise(libc, aligned, length, _MADV_HUGEPAGE):
        logger.debug("madvise(MADV_HUGEPAGE) failed: errno %d", ctypes.get_errno())


def zeros_huge_page_aligned(shape: tuple[int, ...], dtype: torch.dtype) -> np.ndarray:
    """A lazily zeroed buffer for a torch dtype (an anonymous mapping: pages are touched only when used),
    starting on a 2 MB boundary and advised into huge pages; viewed as that dtype by
    torch.from_numpy(...).view. A mapping of its own, not calloc: below tune_malloc's mmap threshold
    calloc may hand out heap memory already faulted in as 4 KB pages (freed weights), which the advice
    no longer turns into huge pages (a draft model's weights moved after the target's stayed in 4 KB
    pages). The mapping lives as long as the array (or a tensor made from it)."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    nbytes = int(np.prod(shape)) * itemsize
    raw = np.frombuffer(_anonymous_mapping(nbytes + _HUGE_PAGE), dtype=np.uint8)
    offset = -raw.ctypes.data % _HUGE_PAGE
    buf = raw[offset : offset + nbytes]
    advise_huge_pages(buf)
    return buf.view({1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}[itemsize]).reshape(shape)


def small_pages_where_heads_start(cache: np.ndarray) -> None:
    """madvise(MADV_NOHUGEPAGE) over the huge pages holding the first 2 MB of each head's part of a fresh
    KV cache buffer [heads, ...] (zeros_huge_page_aligned's): where the first requests write (module docstring)."""
    libc = _libc()
    if libc is None or not hasattr(libc, "madvise") or cache.ndim < 2:
        return
    head_bytes = cache.nbytes // cache.shape[0]
    for head in range(cache.shape[0]):
        start = cache.ctypes.data + head * head_bytes
        first = start // _HUGE_PAGE * _HUGE_PAGE
        end = -(-min(start + _HUGE_PAGE, start + head_bytes) // _HUGE_PAGE) * _HUGE_PAGE
        if not _madvise(libc, first, end - first, _MADV_NOHUGEPAGE):
            logger.debug("madvise(MADV_NOHUGEPAGE) failed: errno %d", ctypes.get_errno())
            return


def _anonymous_mapping(nbytes: int) -> mmap.mmap:
    """Private anonymous memory (Python's default, MAP_SHARED, is shared memory: no transparent huge pages there)."""
    if hasattr(mmap, "MAP_PRIVATE") and hasattr(mmap, "MAP_ANONYMOUS"):
        return mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return mmap.mmap(-1, nbytes)


# "0" leaves a model's weights where loading put them (move_weights_to_huge_pages does nothing).
HUGE_PAGE_WEIGHTS_ENV = "TOKENMILL_HUGE_PAGE_WEIGHTS"
_THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"
_ALIGN = 64  # each storage starts on a cache line


def move_weights_to_huge_pages(model: nn.Module) -> int:
    """Copy every CPU tensor the model holds (parameters, buffers, and the packed copies its layers keep
    as plain attributes: weight_tensors) into one 2 MB-aligned buffer advised into transparent huge
    pages, storage by storage, repointing each tensor in place (Tensor.set_: whoever holds it, a
    kernel call's bound arguments or a tied LM head, sees the new memory; views keep their offsets).
    Each old storage is freed as soon as it is copied, and the heap's free memory goes back to the
    system at the end (malloc_trim). Returns the bytes moved: 0 where transparent huge pages are off (nothing gained), with
    TOKENMILL_HUGE_PAGE_WEIGHTS=0, or without glibc."""
    return _move_at_once(_weight_storages(model)) if _weight_move_wanted() else 0


def _move_at_once(storages: dict[int, list[torch.Tensor]]) -> int:
    """move_weights_to_huge_pages for these storages (_weight_storages), the dict emptied once done."""
    slots, total = _weight_slots(storages)
    if total == 0:
        return 0
    arena = torch.from_numpy(zeros_huge_page_aligned((total,), torch.uint8))
    with torch.inference_mode():  # set_ on inference tensors (weights processed under inference mode) too
        for key, group in storages.items():
            old = torch.empty(0, dtype=torch.uint8).set_(group[0].untyped_storage())
            offset, size = slots[key]
            arena[offset : offset + size].copy_(old)
            del old
            _repoint(group, arena, offset)
    storages.clear()
    _trim_heap()
    return total


def _weight_move_wanted() -> bool:
    return os.environ.get(HUGE_PAGE_WEIGHTS_ENV, "1") != "0" and _huge_pages_possible()


def _weight_storages(model: nn.Module) -> dict[int, list[torch.Tensor]]:
    """The model's weight tensors (weight_tensors) grouped by the storage they lie in (its address)."""
    storages: dict[int, list[torch.Tensor]] = {}
    for tensor in weight_tensors(model):
        storages.setdefault(tensor.untyped_storage().data_ptr(), []).append(tensor)
    return storages


def _weight_slots(storages: dict[int, list[torch.Tensor]]) -> tuple[dict[int, tuple[int, int]], int]:
    """Each storage's (offset, bytes) in one region, every one starting on a cache line, and the region's size."""
    slots, total = {}, 0
    for key, group in storages.items():
        size = group[0].untyped_storage().nbytes()
        slots[key] = (total, size)
        total += -(-size // _ALIGN) * _ALIGN
    return slots, total


def _repoint(group: list[torch.Tensor], arena: torch.Tensor, offset: int) -> None:
    """The tensors of one storage onto its copy at arena[offset:], in place (each keeps its own offset, size and strides)."""
    for tensor in group:
        item = tensor.element_size()
        tensor.set_(arena.untyped_storage(), (offset + tensor.storage_offset() * item) // item, tensor.size(), tensor.stride())


def _trim_heap() -> None:
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)  # the heap's freed weights back to the system (tune_malloc turned trimming off)


@functools.cache
def _huge_pages_possible() -> bool:
    """Transparent huge pages on ("always" or "madvise") and madvise available."""
    libc = _libc()
    try:
        with open(_THP_SETTING) as f:
            setting = f.read()
    except OSError:
        return False
    return "[never]" not in setting and libc is not None and hasattr(libc, "madvise")


# The packages whose objects and closures hold weights (a layer's packed copy, a kernel call's bound
# arguments): weight_tensors looks inside those only. Not the communicator a layer holds for tensor
# parallelism: its buffers are memory shared with the other ranks, which a copy would cut off.
_WEIGHT_HOLDERS = ("tokenmill.layers.", "tokenmill.models.", "tokenmill.kernels.")


def weight_tensors(model: nn.Module) -> list[torch.Tensor]:
    """The distinct strided CPU tensors reachable from the model: its modules' parameters, buffers and
    attributes, through lists, tuples, dicts, functools.partial arguments, and the closures and the
    attributes (or slots) of the objects of _WEIGHT_HOLDERS (a layer's packed weight, a kernel call's
    bound arguments). Opaque tensors (oneDNN's reordered weights) have no storage to move."""
    found: dict[int, torch.Tensor] = {}
    seen: set[int] = set()
    stack: list[object] = [model]
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.device.type == "cpu" and obj.layout == torch.strided and not obj.is_mkldnn and obj.numel():
                found[id(obj)] = obj
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, functools.partial):
            stack.extend((obj.func, *obj.args, *obj.keywords.values()))
        elif isinstance(obj, types.FunctionType):
            if (obj.__module__ or "").startswith(_WEIGHT_HOLDERS):
                stack.extend(_cell_contents(obj))
        elif isinstance(obj, nn.Module) or type(obj).__module__.startswith(_WEIGHT_HOLDERS):
            stack.extend(vars(obj).values() if hasattr(obj, "__dict__") else ())
            stack.extend(getattr(obj, slot) for cls in type(obj).__mro__ for slot in getattr(cls, "__slots__", ()) if hasattr(obj, slot))
    return list(found.values())


def _cell_contents(function: types.FunctionType) -> list[object]:
    contents = []
    for cell in function.__closure__ or ():
        try:
            contents.append(cell.cell_contents)
        except ValueError:  # an empty cell
            pass
    return contents


# Disables the KV cache prefault (KVPrefault): "0" leaves the cache's pages to be faulted in by use.
KV_PREFAULT_ENV = "TOKENMILL_KV_PREFAULT"
# The prefault stops where the machine's available memory would fall below this (bytes, or this
# fraction of the total if more): a cache sized beyond the RAM (kv_cache_memory, num_kv_blocks) is
# left to fault in by use, as it was, rather than committed whole.
_PREFAULT_RESERVE, _PREFAULT_RESERVE_FRACTION = 1 << 30, 0.1
# Bytes one madvise call faults in (one huge page): a step that starts meanwhile waits for at most
# that call (a few ms at the slowest rate seen), and so does an munmap (the call holds the address
# space's lock for reading).
_PREFAULT_CHUNK = 2 << 20


class IdleWork:
    """Work done on a daemon thread while the engine is idle: no pass for IDLE_AFTER seconds (the runner
    wraps each pass in busy()), and before its first pass not until `start_after` seconds have passed (the
    engine's own start, a server's, is CPU work too). The thread runs at `niceness` and calls
    _wait_until_idle() between pieces of work (each a few ms at most). wait() lets it run regardless and
    blocks until it is done (the benchmarks call it, to time the engine as it runs once warm). stop() ends
    it after its current piece, and runs at the interpreter's exit: a daemon thread still in a call when
    Python finalizes is torn down mid-call, which aborted processes ("terminate called without an active
    exception", SIGABRT: a script or benchmark ending while a draft model's cache was still faulting in)."""

    IDLE_AFTER = 0.05  # seconds without a step before the engine counts as idle

    def __init__(self, name: str, niceness: int, start_after: float = 0.0) -> None:
        self._done = threading.Event()
        self._unhurried = threading.Event()  # set by wait(): work whether or not the engine is idle
        self._stopping = threading.Event()  # set by stop()
        self._thread: threading.Thread | None = None
        self._name, self._niceness = name, niceness
        self._steps = 0  # steps running (0 or 1)
        self._last_step = time.monotonic()
        self._not_before = self._last_step + start_after  # while no pass has run
        self.first_pass: float | None = None  # when the first pass started (time.monotonic)

    def _start(self, *args) -> None:
        """Run _work(*args) on the thread (a subclass's __init__ calls this, or sets _done: nothing to do)."""
        self._thread = threading.Thread(target=self._run, args=args, name=self._name, daemon=True)
        self._thread.start()
        atexit.register(_stop_at_exit, weakref.ref(self))

    def _work(self, *args) -> None:
        raise NotImplementedError

    def _run(self, *args) -> None:
        try:
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self._niceness)  # this thread only (Linux)
            except (AttributeError, OSError):
                pass
            self._work(*args)
        finally:
            self._done.set()

    def stop(self) -> None:
        """Stop working, and wait for the thread to finish its current piece."""
        self._stopping.set()
        self._unhurried.set()  # out of _wait_until_idle
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        """Around an engine step: no work while it runs, nor for IDLE_AFTER seconds after."""
        if self.first_pass is None:
            self.first_pass, self._not_before = time.monotonic(), 0.0
        self._steps += 1
        try:
            yield
        finally:
            self._steps -= 1
            self._last_step = time.monotonic()

    def _wait_until_idle(self) -> None:
        while not self._unhurried.is_set():
            now = time.monotonic()
            quiet = now - self._last_step
            if self._steps == 0 and quiet >= self.IDLE_AFTER and now >= self._not_before:
                return
            self._unhurried.wait(max(self.IDLE_AFTER - quiet, self.IDLE_AFTER / 2))

    def wait(self, timeout: float | None = None) -> bool:
        """Do the rest now, busy engine or not; True once done (or skipped, or stopped)."""
        self._unhurried.set()
        return self._done.wait(timeout)

    def done(self) -> bool:
        return self._done.is_set()


class KVPrefault(IdleWork):
    """Faults in the pages of KV cache tensors [num_kv_heads, num_blocks, block_size, head_dim] on a
    daemon thread at nice 19, block range by block range from block 0 (each range in every tensor and
    head), so the blocks handed out first are ready first. It works only while the engine is idle
    (IdleWork): a server fills its cache between requests, and a busy engine (an offline batch, a short
    script) is not slowed by it (nor does a short script fault in a cache it never uses); the benchmarks
    wait() for it, as the peers' engines fill their caches at start. It holds the tensors weakly and
    stops once they are freed."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        super().__init__("tokenmill-kv-prefault", niceness=19)
        libc = _libc()
        if (not tensors or os.environ.get(KV_PREFAULT_ENV, "1") == "0" or libc is None or not hasattr(libc, "madvise")
                or any(t.device.type != "cpu" or t.dim() != 4 or not t.is_contiguous() for t in tensors)):
            self._done.set()
            return
        self._start(libc, [weakref.ref(t) for t in tensors])

    def _work(self, libc: ctypes.CDLL, refs: list[weakref.ref]) -> None:
        # (heads, blocks, bytes a block of one head) of each tensor, read once while they are alive.
        shapes = [(t.shape[0], t.shape[1], t[0, 0].nbytes) for t in (ref() for ref in refs) if t is not None]
        if len(shapes) < len(refs):
            return
        num_blocks = max(blocks for _, blocks, _ in shapes)
        step = max(1, _PREFAULT_CHUNK // max(block for _, _, block in shapes))
        reserve = max(_PREFAULT_RESERVE, int(_PREFAULT_RESERVE_FRACTION * psutil.virtual_memory().total))
        per_range = _PREFAULT_CHUNK * sum(heads for heads, _, _ in shapes)  # what one range of blocks commits, at most
        for first in range(0, num_blocks, step):
            if psutil.virtual_memory().available < reserve + per_range:
                logger.debug("KV cache prefault stopped at block %d of %d: the machine's memory is running low", first, num_blocks)
                return
            for ref, (heads, blocks, block) in zip(refs, shapes):
                t = ref()
                if t is None:  # the cache was freed (its engine is gone)
                    return
                length = (min(first + step, blocks) - first) * block
                for head in range(heads):
                    self._wait_until_idle()
                    if self._stopping.is_set():
                        return
                    start = t.data_ptr() + (head * blocks + first) * block
                    aligned = start // _PAGE * _PAGE
                    if not _madvise(libc, aligned, start + length - aligned, _MADV_POPULATE_WRITE):
                        logger.debug("MADV_POPULATE_WRITE failed (errno %d): the KV cache faults in as it is used", ctypes.get_errno())
                        return
                del t


class WeightMove(IdleWork):
    """move_weights_to_huge_pages without holding up the start (defer=True). The model's weights are copied
    into the huge-page region a huge page at a time by a daemon thread while the engine is idle (IdleWork:
    not before its first pass or START_AFTER seconds: a server waiting for its first request), and
    before_pass(), on the thread that runs the model's passes, repoints the tensors onto the copy once it
    is whole. An engine busy for PATIENCE seconds since its first pass (an offline batch) finishes the copy
    itself before its next pass, the engine thread and the daemon thread copying together (a thread
    copying beside the forward pass slowed its OpenMP threads more than the copy costs). A fresh huge page
    costs a fault and a zeroing on first touch: on the VMs measured, 0.3-0.9 GB/s a thread, 0.3-0.6 s of
    `LLM()` for SmolLM2's weights, which a first token no longer waits for (README, "Start-up"). The copy
    holds the old storages weakly, and the repointing takes the tensors the model holds then
    (weight_tensors), so a view made meanwhile follows its base; one held elsewhere keeps the old memory
    alive and correct. Both copies are in memory until then: deferred only while the weights are at most
    DEFER_MAX_SHARE of the available memory, else moved at once (defer=False too), as
    move_weights_to_huge_pages does, storage by storage."""

    PATIENCE = 1.0
    START_AFTER = 2.0
    DEFER_MAX_SHARE = 0.25
    CHUNK = _HUGE_PAGE  # bytes copied at a time: one huge page's fault and zeroing, a few ms

    def __init__(self, model: nn.Module, defer: bool, enabled: bool = True) -> None:
        """enabled=False: nothing to move (a model on another device)."""
        super().__init__("tokenmill-weight-move", niceness=0, start_after=self.START_AFTER)
        self._model = weakref.ref(model)
        self._arena: np.ndarray | None = None  # the region, until the tensors are repointed onto it
        self._chunks: list[tuple[weakref.ref, int, int, int]] = []  # (a storage's first tensor, its offset, start, bytes)
        self._next = self._copied = 0  # chunks claimed, chunks copied
        self._lock = threading.Lock()
        self._whole = threading.Event()  # every chunk copied
        self.moved = 0  # bytes moved
        storages = _weight_storages(model) if enabled and _weight_move_wanted() else {}
        self._slots, total = _weight_slots(storages)
        if total == 0 or not defer or total > self.DEFER_MAX_SHARE * psutil.virtual_memory().available:
            self.moved = _move_at_once(storages)  # the storages found above: the model is walked once
            self._done.set()
            return
        self._arena = zeros_huge_page_aligned((total,), torch.uint8)  # lazily zeroed: touched as it is copied
        self._chunks = [(weakref.ref(group[0]), self._slots[key][0], start, min(self.CHUNK, self._slots[key][1] - start))
                        for key, group in storages.items() for start in range(0, self._slots[key][1], self.CHUNK)]
        self._start()

    def _work(self) -> None:
        while True:
            self._wait_until_idle()
            if self._stopping.is_set() or not self._copy_one():
                return

    def _copy_one(self) -> bool:
        """Copy the next chunk no thread has claimed; False once none is left (or the model is gone)."""
        with self._lock:
            index, self._next = self._next, self._next + 1
        if index >= len(self._chunks):
            return False
        ref, offset, start, size = self._chunks[index]
        tensor = ref()
        if tensor is None:  # the model is gone
            self._stopping.set()
            return False
        # ctypes releases the GIL for the call: the engine's threads run meanwhile.
        ctypes.memmove(self._arena.ctypes.data + offset + start, tensor.untyped_storage().data_ptr() + start, size)
        del tensor
        with self._lock:
            self._copied += 1
            if self._copied == len(self._chunks):
                self._whole.set()
        return True

    def before_pass(self) -> int:
        """On the thread that runs the model's passes, before one: repoint_if_copied(), after finishing the copy
        if the engine has been busy for PATIENCE seconds since its first pass."""
        if self._arena is None:  # the check before every pass: nothing else once moved
            return 0
        if not self._whole.is_set() and self.first_pass is not None and time.monotonic() - self.first_pass >= self.PATIENCE:
            self.finish_copy()
        return self.repoint_if_copied()

    def finish_copy(self) -> None:
        """Copy every chunk left now, this thread and the daemon thread together, until the copy is whole (or stopped)."""
        self._unhurried.set()
        while not self._stopping.is_set() and self._copy_one():
            pass
        while not self._whole.wait(0.01) and not self._stopping.is_set():
            pass

    def finish(self) -> int:
        """The move done now (on the thread that runs the passes, between two); the bytes moved."""
        if self._arena is not None:
            self.finish_copy()
            self.repoint_if_copied()
        return self.moved

    def repoint_if_copied(self) -> int:
        """Once the copy is whole, the model's tensors onto it (on the thread that runs the model's passes,
        between two: before one, or LLMEngine.idle); the bytes moved, 0 while not yet (or nothing to move)."""
        if self._arena is None or not self._whole.is_set():
            return 0
        arena, self._arena = self._arena, None
        model = self._model()
        if model is None:
            return 0
        region = torch.from_numpy(arena)
        with torch.inference_mode():  # set_ on inference tensors (weights processed under inference mode) too
            for key, group in _weight_storages(model).items():
                if key in self._slots:
                    _repoint(group, region, self._slots[key][0])
        self.moved = arena.nbytes
        del region, arena
        _trim_heap()
        return self.moved


def _stop_at_exit(work: weakref.ref) -> None:
    live = work()
    if live is not None:
        live.stop()
