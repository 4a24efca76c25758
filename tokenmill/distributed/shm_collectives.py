"""Collectives through shared memory, for tensor-parallel ranks on one machine.

gloo sends every collective through TCP sockets; on the VMs measured here one all-reduce of a single
row costs about 1.0-1.5 ms, and a decode step runs two per layer, so two ranks would spend far longer
waiting than computing. Ranks on one machine can instead meet in a shared file under /dev/shm (as
vLLM's and SGLang's CPU backends do in C++): each rank copies its tensor into its own slot, raises
its flag to the collective's sequence number, and waits for every flag to reach it; then each rank
reads the slots it needs. Every rank sums the slots in rank order, so all hold bit-identical results.

Two buffers alternate by sequence number: a rank writes collective n's slot only after it has seen
every flag of collective n - 1, and a peer raises that flag only after it finished reading collective
n - 2, the last one to use this buffer. x86's store ordering makes a flag seen imply its slot's
contents are seen (the slots are written before the flag, by the same thread).

A wait that lasts checks now and then that the peers are still alive, so a rank that dies is an
error within a second, never a hang.
"""

from __future__ import annotations

import mmap
import os
import time
from collections.abc import Callable

import numpy as np
import psutil
import torch

_FLAG_STRIDE = 8  # int64s between flags: one 64-byte cache line per rank
_ALIGN = 64
_SPINS_BEFORE_SLEEP = 20000  # busy waiting while a collective's peers are computing, then sleeping (an idle engine)
_MAX_SLEEP_S = 0.001
_LIVENESS_EVERY_S = 0.5


class PeerGoneError(RuntimeError):
    """A rank of the group died while this one waited for it."""


def _round_up(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class SharedMemoryCollectives:
    def __init__(self, path: str, rank: int, size: int, slot_bytes: int, create: bool, timeout_s: float) -> None:
        self.path = path
        self.rank = rank
        self.size = size
        self.slot_bytes = _round_up(slot_bytes)
        self.timeout_s = timeout_s
        self.header_bytes = _round_up(size * _FLAG_STRIDE * 8)
        total = self.header_bytes + 2 * size * self.slot_bytes
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, total)
            self._map = mmap.mmap(fd, total)
        finally:
            os.close(fd)
        raw = np.frombuffer(self._map, dtype=np.uint8)
        self._flags = raw[: self.header_bytes].view(np.int64)[:: _FLAG_STRIDE][:size]
        self._data = torch.from_numpy(raw[self.header_bytes :])
        self.seq = 0
        self.peer_pids: dict[int, int] = {}
        # Why a peer is gone, if one is (None while all run), asked with the pids: a Ray actor's process
        # outlives a rank that failed (its task ended, the actor idles), so its pid alone never tells;
        # the executor knows (its follower_failure).
        self.peer_failure: Callable[[], str | None] | None = None

    def unlink(self) -> None:
        """Remove the file's name (the mappings stay valid): once every rank has mapped it."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        self._flags = None
        self._data = None
        try:
            self._map.close()
        except BufferError:  # a tensor view still alive somewhere: the OS unmaps at exit
            pass

    # -- the protocol ---------------------------------------------------------------------------
    def _slot(self, rank: int, seq: int, nbytes: int) -> torch.Tensor:
        start = (seq % 2 * self.size + rank) * self.slot_bytes
        return self._data[start : start + nbytes]

    def _arrive_and_wait(self, seq: int) -> None:
        self._flags[self.rank] = seq
        flags = self._flags
        spins = 0
        while flags.min() < seq:
            spins += 1
            if spins > _SPINS_BEFORE_SLEEP:
                self._wait_slowly(seq)
                return

    def _wait_slowly(self, seq: int) -> None:
        start = last_check = time.monotonic()
        sleep = 1e-5
        while self._flags.min() < seq:
            time.sleep(sleep)
            sleep = min(sleep * 2, _MAX_SLEEP_S)
            now = time.monotonic()
            if now - last_check > _LIVENESS_EVERY_S:
                last_check = now
                self._check_peers(seq)
                if now - start > self.timeout_s:
                    raise PeerGoneError(f"tensor-parallel ranks did not reach a collective within {self.timeout_s:.0f} s")

    def _check_peers(self, seq: int) -> None:
        failure = self.peer_failure() if self.peer_failure is not None else None
        if failure is not None:
            raise PeerGoneError(failure)
        for rank, pid in self.peer_pids.items():
            if self._flags[rank] >= seq:
                continue
            try:
                alive = psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                alive = False
            if not alive:
                raise PeerGoneError(f"tensor-parallel rank {rank} (pid {pid}) is gone")

    def _exchange(self, payload: torch.Tensor | None) -> int:
        """One collective: this rank's bytes (if any) into its slot, then wait for every rank's. Returns its seq."""
        self.seq += 1
        if payload is not None:
            self._slot(self.rank, self.seq, payload.numel()).copy_(payload)
        self._arrive_and_wait(self.seq)
        return self.seq

    # -- the collectives ----------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks, in place (x contiguous), in rank order on every rank."""
        flat = x.view(-1)
        per_chunk = self.slot_bytes // x.element_size()
        for lo in range(0, flat.numel(), per_chunk):
            part = flat[lo : lo + per_chunk]
            nbytes = part.numel() * x.element_size()
            seq = self._exchange(part.view(torch.uint8))
            part.copy_(self._slot(0, seq, nbytes).view(x.dtype))
            for rank in range(1, self.size):
                part.add_(self._slot(rank, seq, nbytes).view(x.dtype))
        return x

    def gather(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's x (all of one shape and dtype), on rank 0; None on the others."""
        flat = x.contiguous().view(-1)
        pieces = [torch.empty_like(flat) for _ in range(self.size)] if self.rank == 0 else None
        per_chunk = self.slot_bytes // x.element_size()
        for lo in range(0, flat.numel(), per_chunk):
            part = flat[lo : lo + per_chunk]
            nbytes = part.numel() * x.element_size()
            seq = self._exchange(part.view(torch.uint8))
            if pieces is not None:
                for rank, piece in enumerate(pieces):
                    piece[lo : lo + part.numel()].copy_(self._slot(rank, seq, nbytes).view(x.dtype))
        return [p.view(x.shape) for p in pieces] if pieces is not None else None

    def broadcast_bytes(self, payload: bytes | None) -> bytes:
        """Rank 0's bytes on every rank: the length first, then the bytes in slot-sized pieces."""
        header = torch.tensor([len(payload) if payload is not None else 0], dtype=torch.int64)
        seq = self._exchange(header.view(torch.uint8) if self.rank == 0 else None)
        length = int(self._slot(0, seq, 8).view(torch.int64)[0])
        if self.rank == 0:
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if length else torch.empty(0, dtype=torch.uint8)
            for lo in range(0, length, self.slot_bytes):
                self._exchange(data[lo : lo + self.slot_bytes])
            return payload
        out = bytearray(length)
        view = memoryview(out)
        for lo in range(0, length, self.slot_bytes):
            n = min(self.slot_bytes, length - lo)
            seq = self._exchange(None)
            view[lo : lo + n] = self._slot(0, seq, n).numpy().tobytes()
        return bytes(out)
