"""tokenmill's CPU kernels: compiled once per machine with torch.utils.cpp_extension, then loaded directly.

The build is for this machine's instruction set (-march=native; TOKENMILL_CPU_MARCH=<target>, e.g.
x86-64-v3 for the AVX2 code or x86-64 for the scalar loops, builds for that target instead), so the
kernels' name carries a hash of the sources, the flags (the target included), the CPU's flags and
torch's version: a cache shared between machines never loads a binary built for another CPU or
target. Each hash has one directory of its own,
`<TORCH_EXTENSIONS_DIR, or ~/.cache/torch_extensions>/tokenmill/<name>/`:

    build.lock   our build lock, held with fcntl.flock: the kernel drops it when its holder dies
    build/       torch's build directory (ninja file, objects, torch's own `lock` file)
    <name>.so    the finished library, published by an atomic rename once the build is done

A start loads `<name>.so` straight with torch.ops.load_library when it exists (no cpp_extension,
no ninja). Otherwise it takes build.lock, builds, and publishes. torch's own lock is a file whose
mere existence is the lock, so a build killed mid-way leaves it behind and every later build waits
on it forever; as every tokenmill build goes through build.lock first, a torch `lock` found while
holding build.lock is stale and is removed (and a killed start's ninja and compilers, which
outlive it, are waited for before a second ninja runs there). A start that finds build.lock held
by another process waits at most TOKENMILL_KERNEL_BUILD_TIMEOUT seconds (300 by default), then
runs the plain PyTorch paths. Without a C++ compiler, or with TOKENMILL_CPU_KERNELS=0, the engine
runs the PyTorch paths too.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_DIR = Path(__file__).parent / "cpu"
_SOURCES = [_DIR / name for name in ("paged_attention.cpp", "prefill_attention.cpp", "sampling.cpp", "pointwise.cpp", "int8_gemm.cpp", "gguf_linear.cpp", "decode_linear.cpp", "decode_program.cpp")]
_HEADERS = [_DIR / name for name in ("vec.h", "quant_rows.h", "norm_rows.h")]
# -ffp-contract=off: no fused multiply-adds the source does not write, so the pointwise ops round as torch does.
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-ffp-contract=off"]
_LDFLAGS = ["-lmvec"]
# The -march target in place of native: vec.h picks the AVX-512, AVX2 or scalar code from it.
MARCH_ENV = "TOKENMILL_CPU_MARCH"
_MARCH_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]*")


def _cflags() -> list[str]:
    """_CFLAGS with -march=$TOKENMILL_CPU_MARCH (native when unset; a value that is no -march name is refused)."""
    march = os.environ.get(MARCH_ENV, "").strip() or "native"
    if not _MARCH_RE.fullmatch(march):
        logger.warning("%s=%r is not a -march target; building for native", MARCH_ENV, march)
        march = "native"
    return [f"-march={march}" if flag == "-march=native" else flag for flag in _CFLAGS]

BUILD_TIMEOUT_ENV = "TOKENMILL_KERNEL_BUILD_TIMEOUT"
_DEFAULT_BUILD_TIMEOUT_S = 300.0
_LOCK_POLL_S = 0.1
# Serializes loading within one process: two threads loading two copies of the library (the build
# directory's and the published one) would register the tokenmill_cpu ops twice, which torch refuses.
_LOAD_LOCK = threading.Lock()


@dataclass(frozen=True)
class KernelLoad:
    """What loading the CPU kernels came to in this process."""

    path: Path | None  # the published library; None when the kernels are not available
    compiled: bool = False  # this process built them, rather than loading a finished build
    seconds: float = 0.0  # spent building or loading, waiting for another process's build included
    error: str | None = None  # why they are not available

    @property
    def available(self) -> bool:
        return self.path is not None


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def vector_flags() -> str:
    """This CPU's vector-extension flags (avx*, amx*, fma), sorted: what a benchmark prints beside its figures."""
    names = _cpu_flags().split(":", 1)[-1].split()
    return " ".join(sorted({f for f in names if f.startswith(("avx", "amx")) or f == "fma"}))


def kernel_name() -> str:
    """The kernels' name: a hash of everything that makes a build differ, so a stale one is never loaded."""
    digest = hashlib.sha256()
    for source in _SOURCES + _HEADERS:
        digest.update(source.read_bytes())
    digest.update(" ".join(_cflags() + _LDFLAGS).encode() + _cpu_flags().encode() + torch.__version__.encode())
    return f"tokenmill_cpu_{digest.hexdigest()[:16]}"


def kernel_dir(name: str | None = None) -> Path:
    """The directory of one build: lock, torch's build directory, published library.

    Under torch's extension root (TORCH_EXTENSIONS_DIR, or ~/.cache/torch_extensions), computed here
    rather than asked of torch, so a warm start need not import cpp_extension."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "torch_extensions"
    )
    return Path(root) / "tokenmill" / (name or kernel_name())


def _build_timeout() -> float:
    raw = os.environ.get(BUILD_TIMEOUT_ENV, "").strip()
    if not raw:
        return _DEFAULT_BUILD_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value >= 0:  # also false for nan
        logger.warning("%s=%r is not a number of seconds >= 0; waiting up to %.0f s", BUILD_TIMEOUT_ENV, raw, _DEFAULT_BUILD_TIMEOUT_S)
        return _DEFAULT_BUILD_TIMEOUT_S
    return value


def _try_flock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


@contextlib.contextmanager
def _build_lock(path: Path, deadline: float) -> Iterator[bool]:
    """Hold an exclusive flock on path; yields False when another process still held it at `deadline` (time.monotonic).

    The lock file is never deleted: a waiter may hold an fd of it, and a new file would let two
    processes hold "the" lock at once. Its existence means nothing; only the flock does."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        if not _try_flock(fd):
            logger.warning("waiting for another process to finish building tokenmill's CPU kernels (lock held at %s)", path)
            while not _try_flock(fd):
                if time.monotonic() >= deadline:
                    yield False
                    return
                time.sleep(_LOCK_POLL_S)
        try:
            yield True
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _publish(built: Path, published: Path) -> None:
    """Copy the finished library to its final name through a temporary one and os.replace, so a
    start sees the whole file or none (a copy, not a move, so ninja finds its output up to date)."""
    tmp = published.with_name(f".{published.name}.{os.getpid()}.tmp")
    try:
        with open(built, "rb") as src, open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst)
            dst.flush()
            os.fsync(dst.fileno())
        shutil.copymode(built, tmp)
        os.replace(tmp, published)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    with contextlib.suppress(OSError):  # make the rename itself durable, where the filesystem allows
        dir_fd = os.open(published.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


# What a torch build runs, as /proc/<pid>/comm names them (cut at 15 characters): other processes
# that happen to sit in the build directory (a shell cd'ed there) are not waited for.
_BUILD_TOOLS = frozenset({"ninja", "c++", "g++", "gcc", "cc", "cc1plus", "cc1", "as", "collect2", "ld", "lto1", "lto-wrapper", "clang", "clang++"})


def _leftover_builders(build_dir: Path) -> list[int]:
    """Build tools still running in build_dir although we hold build.lock: a killed start's ninja
    and compilers outlive it, and a second ninja run beside them could link half-written objects."""
    target = os.path.realpath(build_dir)
    pids = []
    with contextlib.suppress(OSError):  # no /proc (not Linux): nothing to find
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                if os.readlink(f"/proc/{entry}/cwd") == target and Path(f"/proc/{entry}/comm").read_text().strip() in _BUILD_TOOLS:
                    pids.append(int(entry))
            except OSError:  # gone, or another user's
                continue
    return pids


def _wait_for_leftover_builders(build_dir: Path, deadline: float) -> None:
    pids = _leftover_builders(build_dir)
    if not pids:
        return
    logger.warning("waiting for the build tools of an interrupted start to exit (pids %s, in %s)", pids, build_dir)
    while pids := _leftover_builders(build_dir):
        if time.monotonic() >= deadline:
            raise TimeoutError(f"build tools of an interrupted start (pids {pids}) still run in {build_dir}")
        time.sleep(_LOCK_POLL_S)


def _build_and_publish(name: str, directory: Path, published: Path, deadline: float) -> None:
    """Build with cpp_extension (which also loads the build into this process), then publish it. Needs build.lock held."""
    from torch.utils import cpp_extension

    build_dir = directory / "build"
    build_dir.mkdir(exist_ok=True)
    _wait_for_leftover_builders(build_dir, deadline)
    torch_lock = build_dir / "lock"
    if torch_lock.exists():  # every builder holds build.lock, which we hold: its owner is dead
        logger.info("removing %s, left behind by an interrupted build", torch_lock)
        torch_lock.unlink(missing_ok=True)
    for leftover in directory.glob(f".{published.name}.*.tmp"):  # from a process killed while publishing
        leftover.unlink(missing_ok=True)
    built = build_dir / f"{name}.so"
    if not built.exists():  # a warning, as the CLI shows no info by default
        logger.warning("building tokenmill's CPU kernels for this machine (once; about half a minute)")
    cpp_extension.load(
        name=name,
        sources=[str(s) for s in _SOURCES],
        extra_cflags=_cflags(),
        extra_ldflags=list(_LDFLAGS),  # a copy: cpp_extension appends torch's libraries to it, which changed kernel_name()
        build_directory=str(build_dir),
        is_python_module=False,
        verbose=False,
    )
    _publish(built, published)


def _failure_reason(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines() or [type(exc).__name__]
    reason = next((line for line in lines if "error" in line.lower() and line is not lines[0]), lines[0])
    return reason[:300]


def load_cpu_kernels() -> KernelLoad:
    """Load the CPU kernels once per process, building them first if no process has; never raises."""
    with _LOAD_LOCK:
        return _load_once()


@functools.cache
def _load_once() -> KernelLoad:
    if os.environ.get("TOKENMILL_CPU_KERNELS", "1") == "0":
        return KernelLoad(None, error="turned off by TOKENMILL_CPU_KERNELS=0")
    start = time.perf_counter()
    try:
        name = kernel_name()
        directory = kernel_dir(name)
        published = directory / f"{name}.so"
    except OSError as exc:  # unreadable sources: an installation problem, but the torch paths still work
        logger.warning("tokenmill's CPU kernels could not be built; using the PyTorch paths (%s)", exc)
        return KernelLoad(None, error=str(exc))
    if published.exists():  # published by an atomic rename: complete, whoever built it
        try:
            torch.ops.load_library(str(published))
        except Exception as exc:
            reason = _failure_reason(exc)
            logger.warning("tokenmill's CPU kernels at %s could not be loaded (delete it to rebuild); using the PyTorch paths (%s)", published, reason)
            return KernelLoad(None, seconds=time.perf_counter() - start, error=reason)
        return KernelLoad(published, seconds=time.perf_counter() - start)
    timeout = _build_timeout()
    deadline = time.monotonic() + timeout  # for all waits on other processes' builds together
    try:
        directory.mkdir(parents=True, exist_ok=True)
        lock_path = directory / "build.lock"
        with _build_lock(lock_path, deadline) as held:
            if not held:
                reason = f"another process held {lock_path} for over {timeout:g} s"
                logger.warning(
                    "gave up waiting for another process to build tokenmill's CPU kernels (%s); using the PyTorch paths. "
                    "Set %s to wait longer, or run `tokenmill build-kernels` first",
                    reason, BUILD_TIMEOUT_ENV,
                )
                return KernelLoad(None, seconds=time.perf_counter() - start, error=reason)
            compiled = not published.exists()  # else another process built it while we waited
            if compiled:
                _build_and_publish(name, directory, published, deadline)
            else:
                torch.ops.load_library(str(published))
    except Exception as exc:  # no compiler, no ninja, a failed build: the torch paths still work
        reason = _failure_reason(exc)
        logger.warning("tokenmill's CPU kernels could not be built; using the PyTorch paths (%s)", reason)
        logger.debug("CPU kernel build failure", exc_info=True)
        return KernelLoad(None, seconds=time.perf_counter() - start, error=reason)
    return KernelLoad(published, compiled=compiled, seconds=time.perf_counter() - start)


@functools.cache
def cpu_kernels_available() -> bool:
    """Build (or load the finished build of) the CPU kernels once per process; True when their ops are registered."""
    return load_cpu_kernels().available


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
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    prefix: tuple[int, torch.Tensor, torch.Tensor] | None = None,
    tree_start: torch.Tensor | None = None,
    tree_mask: torch.Tensor | None = None,
) -> None:
    """out[token_rows] := each decode token's attention over its paged context (see paged_attention.cpp).

    k_scale / v_scale: a quantized cache's scales (int8: [Hkv, blocks, block_size]; fp8: [1]), see layers/kv_quant.py.
    prefix: cascade attention's (prefix_len, o, lse) from cascade_prefix_attention: the tokens attend to positions
    prefix_len .. their own and merge that with the shared prefix's part.
    tree_start / tree_mask: token trees ([B] int64 each): row b sees its context before slot tree_start[b] and the
    tree slots tree_start[b] + j whose bit j is set in tree_mask[b] (0: a plain row)."""
    prefix_len, prefix_o, prefix_lse = prefix if prefix is not None else (0, None, None)
    torch.ops.tokenmill_cpu.paged_decode_attention(
        out, q, k_cache, v_cache, token_rows, block_table, positions, sliding_window or 0, scale, k_scale, v_scale,
        prefix_len, prefix_o, prefix_lse, tree_start, tree_mask,
    )


def cascade_prefix_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    token_rows: torch.Tensor,
    prefix_blocks: torch.Tensor,
    prefix_len: int,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    rows_per_task: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode tokens q[token_rows] attended over a prefix their contexts share (positions 0 .. prefix_len - 1 in
    the blocks prefix_blocks), each shared block read once per group of requests (see prefill_attention.cpp):
    (normalized output [B, H, D], log-sum-exp [B, H]), float32."""
    return torch.ops.tokenmill_cpu.cascade_prefix_attention(
        q, k_cache, v_cache, token_rows, prefix_blocks, prefix_len, scale, k_scale, v_scale, rows_per_task
    )


def paged_prefill_attention(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    first_rows: torch.Tensor,
    starts: torch.Tensor,
    lens: torch.Tensor,
    block_table: torch.Tensor,
    sliding_window: int | None,
    scale: float,
    rows_per_task: int = 0,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """out[first_rows[b] + i] := attention of prompt chunk b's query row i (position starts[b] + i) over its
    paged context, causal, tiled flash-attention style (see prefill_attention.cpp); rows_per_task 0: the default tile.
    k_scale / v_scale: a quantized (int8 / fp8) cache's scales, as paged_decode_attention takes them."""
    torch.ops.tokenmill_cpu.paged_prefill_attention(
        out, q, k_cache, v_cache, first_rows, starts, lens, block_table, sliding_window or 0, scale, rows_per_task, k_scale, v_scale
    )


def argmax_logsumexp(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's argmax (first index of the maximum) and logsumexp, in one pass (see sampling.cpp)."""
    return torch.ops.tokenmill_cpu.argmax_logsumexp(logits)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Each new token's K/V [T, Hkv, D] into its slot of the head-major caches (see paged_attention.cpp)."""
    torch.ops.tokenmill_cpu.write_kv(k_cache, v_cache, k, v, slot_mapping)


def write_kv_quantized(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor,
    k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
) -> None:
    """write_kv into an int8 / fp8 cache: each (token, head) row quantized as layers/kv_quant.py's quantize does
    (int8 also stores the row's scale in k_scale / v_scale at its slot)."""
    torch.ops.tokenmill_cpu.write_kv_quantized(k_cache, v_cache, k_scale, v_scale, k, v, slot_mapping)


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


def dense_pack(w: torch.Tensor) -> torch.Tensor:
    """A float weight [N, K] in dense_linear's layout (tiles of output rows side by side; see decode_linear.cpp)."""
    return torch.ops.tokenmill_cpu.dense_pack(w)


def dense_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ W^T + bias for a decode step's few rows, W [out_features, K] packed by dense_pack in x's dtype."""
    return torch.ops.tokenmill_cpu.dense_linear(x, packed, out_features, bias)


def int8_pack(q: torch.Tensor) -> torch.Tensor:
    """An int8 weight [N, K] in int8_linear's layout (tiles of output rows side by side; see decode_linear.cpp)."""
    return torch.ops.tokenmill_cpu.int8_pack(q)


def int8_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ (q [out_features, K] int8 * scale)^T + bias in x's dtype, q packed by int8_pack (see decode_linear.cpp)."""
    return torch.ops.tokenmill_cpu.int8_linear(x, packed, scale, out_features, bias)


def int8_group_linear(x: torch.Tensor, tiles: torch.Tensor, scale: torch.Tensor, super_scale: torch.Tensor | None, group_size: int,
                      out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ W^T + bias, W int8 (int8_pack's tiles) times a scale per row and group of inputs ([tiles, groups, 32]
    float32 or fp16; or int8 times super_scale, fp16 [tiles, supers, 32] per run of groups: GGUF's Q6_K; see decode_linear.cpp)."""
    return torch.ops.tokenmill_cpu.int8_group_linear(x, tiles, scale, super_scale, group_size, out_features, bias)


def int8_group_dequantize(tiles: torch.Tensor, scale: torch.Tensor, super_scale: torch.Tensor | None, group_size: int, out_features: int,
                          dtype: torch.dtype) -> torch.Tensor:
    """The float [N, K] weight of int8_group_linear's, in dtype (a transposed view of [K, N])."""
    return torch.ops.tokenmill_cpu.int8_group_dequantize(tiles, scale, super_scale, group_size, out_features, torch.empty(0, dtype=dtype)).t()


def int4_pack(packed: torch.Tensor, scale: torch.Tensor, min_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """quant_utils' int4 (packed [N, K / 2], scale and min [N, groups]) in int4_linear's layout: (tiles, scale, min)."""
    tiles, scale, min_ = torch.ops.tokenmill_cpu.int4_pack(packed, scale, min_)
    return tiles, scale, min_


def int4_linear(x: torch.Tensor, tiles: torch.Tensor, scale: torch.Tensor, min_: torch.Tensor, group_size: int, out_features: int,
                bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ W^T + bias with W [out_features, K] int4 with group-wise scale and min, packed by int4_pack (see decode_linear.cpp)."""
    return torch.ops.tokenmill_cpu.int4_linear(x, tiles, scale, min_, group_size, out_features, bias)


def int4_linear_a8(x: torch.Tensor, tiles: torch.Tensor, scale: torch.Tensor, min_: torch.Tensor, group_size: int, out_features: int,
                   bias: torch.Tensor | None) -> torch.Tensor:
    """int4_linear with x quantized to int8 per row and block of 32 input features, as llama.cpp computes
    GGUF's Q4_0 / Q4_1 (in_features and group_size multiples of 32; see decode_linear.cpp)."""
    return torch.ops.tokenmill_cpu.int4_linear_a8(x, tiles, scale, min_, group_size, out_features, bias)


def int8_dequantize(tiles: torch.Tensor, scale: torch.Tensor, out_features: int, dtype: torch.dtype) -> torch.Tensor:
    """The float [N, K] weight of an int8 one packed by int8_pack, in dtype (a transposed view of [K, N]: see decode_linear.cpp)."""
    return torch.ops.tokenmill_cpu.int8_dequantize(tiles, scale, out_features, torch.empty(0, dtype=dtype)).t()


def int4_dequantize(tiles: torch.Tensor, scale: torch.Tensor, min_: torch.Tensor, group_size: int, out_features: int,
                    dtype: torch.dtype) -> torch.Tensor:
    """The float [N, K] weight of an int4 one packed by int4_pack, in dtype (a transposed view of [K, N])."""
    return torch.ops.tokenmill_cpu.int4_dequantize(tiles, scale, min_, group_size, out_features, torch.empty(0, dtype=dtype)).t()


def gguf_linear(x: torch.Tensor, w: torch.Tensor, ggml_type: int, in_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ W^T + bias with W a GGUF tensor's packed rows [N, K / QK * bytes] of ggml_type (see gguf_linear.cpp)."""
    return torch.ops.tokenmill_cpu.gguf_linear(x, w, ggml_type, in_features, bias)


def gguf_dequantize(w: torch.Tensor, ggml_type: int, in_features: int, dtype: torch.dtype) -> torch.Tensor:
    """The float [N, K] weight of a GGUF tensor's packed rows, in dtype (gguf's dequantize, value for value)."""
    return torch.ops.tokenmill_cpu.gguf_dequantize(w, ggml_type, in_features, torch.empty(0, dtype=dtype))


def w8a8_pack(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An int8 weight [N, K] (-127..127) in the W8A8 GEMM's panel layout, and each channel's sum per
    activation group of group_size inputs ([groups, N]; 0: one group, per token) (see int8_gemm.cpp)."""
    return torch.ops.tokenmill_cpu.w8a8_pack(w, group_size)


def w8a8_quantize(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 of x [M, K] per row and group of group_size (0: the whole row): (q int8 [M, K],
    scale float32 [M, groups]), absmax / 127 per group."""
    return torch.ops.tokenmill_cpu.w8a8_quantize(x, group_size)


def w8a8_linear(x: torch.Tensor, packed: torch.Tensor, colsum: torch.Tensor, w_scale: torch.Tensor,
                bias: torch.Tensor | None, group_size: int) -> torch.Tensor:
    """x [M, K] quantized per row and group, times the packed int8 weight (w8a8_pack with the same
    group_size), rescaled: [M, N] in x's dtype (see int8_gemm.cpp)."""
    return torch.ops.tokenmill_cpu.w8a8_linear(x, packed, colsum, w_scale, bias, group_size)


def w8a8_rms_norm_quant(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                        group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """rms_norm(x) (add_rms_norm(residual, x) with a residual, updated in place) quantized per row and group
    as w8a8_linear quantizes its input, in one pass: (q uint8 [M, padded K] in the GEMM's own format,
    scales float32 [M, groups]) for w8a8_linear_quantized (see int8_gemm.cpp)."""
    return torch.ops.tokenmill_cpu.w8a8_rms_norm_quant(x, residual, weight, eps, group_size)


def w8a8_linear_quantized(q: torch.Tensor, scales: torch.Tensor, packed: torch.Tensor, colsum: torch.Tensor, w_scale: torch.Tensor,
                          bias: torch.Tensor | None, group_size: int, dtype: torch.dtype) -> torch.Tensor:
    """w8a8_linear of activations w8a8_rms_norm_quant already quantized: [M, N] in dtype, the same bits
    as w8a8_linear of the norm's output."""
    return torch.ops.tokenmill_cpu.w8a8_linear_quantized(q, scales, packed, colsum, w_scale, bias, group_size, dtype)


def w8a8_isa() -> str:
    """The integer dot product the W8A8 GEMM runs: "avx512_vnni", "avx512bw", "avx2" or "scalar"."""
    return torch.ops.tokenmill_cpu.w8a8_isa()


@functools.cache  # a fact of the loaded build
def bf16_pairs() -> bool:
    """Whether bf16 activations multiply by pairs with vdpbf16ps in the decode kernels (AVX512-BF16; see decode_linear.cpp)."""
    return bool(torch.ops.tokenmill_cpu.bf16_pairs())


def vector_isa() -> str:
    """The vector code the loaded kernels run: "avx512", "avx2" or "scalar" (see cpu/vec.h)."""
    return torch.ops.tokenmill_cpu.vector_isa()
