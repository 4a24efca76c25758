"""The collectives of one tensor-parallel group, over torch.distributed's process groups (gloo on
CPU, NCCL on CUDA).

The group is a process-group object of our own (on its own TCP store), not torch.distributed's
global default group: an engine's group lives and dies with the engine, and a process can hold
several engines one after another (or at once). Layers hold a TPCommunicator through their build
context; with one rank every collective is the identity, so the single-process path runs exactly
the code it ran before.
"""

from __future__ import annotations

import datetime
import os
import pickle
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from tokenmill.distributed.shm_collectives import SharedMemoryCollectives

# Bytes of one rank's slot in the shared-memory collectives (a larger tensor goes through in pieces).
SHM_SLOT_BYTES = 16 << 20


@dataclass(frozen=True)
class TPCommunicator:
    """This rank's place in its tensor-parallel group, and the group's collectives."""

    rank: int = 0
    size: int = 1
    group: Any = None  # a torch.distributed ProcessGroup (gloo or NCCL); None with one rank
    store: Any = None  # the TCP store the group met on (rank 0 hosts it: kept alive with the group)
    shm: SharedMemoryCollectives | None = None  # ranks on one machine's CPU: the collectives go through shared memory

    @property
    def is_driver(self) -> bool:
        """Rank 0: it runs in the engine's process, samples, and tells the other ranks what to run."""
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of x over the ranks (in place; x must be contiguous)."""
        if self.shm is not None:
            return self.shm.all_reduce(x)
        if self.size > 1:
            self.group.allreduce([x]).wait()
        return x

    def gather_to_driver(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
        """Every rank's x (all of one shape) concatenated along dim, on rank 0; None on the others."""
        if self.size == 1:
            return x
        x = x.contiguous()
        if self.shm is not None:
            gathered = self.shm.gather(x)
            return torch.cat(gathered, dim=dim) if gathered is not None else None
        pieces = [[torch.empty_like(x) for _ in range(self.size)]] if self.is_driver else []
        options = dist.GatherOptions()
        options.rootRank = 0
        self.group.gather(pieces, [x], options).wait()
        return torch.cat(pieces[0], dim=dim) if self.is_driver else None

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's obj on every rank (pickled: its length, then its bytes)."""
        payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if self.is_driver else b""
        if self.shm is not None:
            received = self.shm.broadcast_bytes(payload if self.is_driver else None)
            return obj if self.is_driver else pickle.loads(received)
        length = torch.tensor([len(payload)], dtype=torch.int64)
        self._broadcast(length)
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if self.is_driver else torch.empty(int(length), dtype=torch.uint8)
        self._broadcast(data)
        return obj if self.is_driver else pickle.loads(data.numpy().tobytes())

    def _broadcast(self, t: torch.Tensor) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        options.rootTensor = 0
        self.group.broadcast([t], options).wait()

    def close(self) -> None:
        """End the group's connections now (not at interpreter exit, where a live group aborts the process)."""
        if self.shm is not None:
            self.shm.close()
        if self.group is not None:
            try:
                self.group.shutdown()
            except RuntimeError:  # already broken: a rank died
                pass

    def min_int(self, value: int) -> int:
        """The smallest of every rank's value."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MIN
        self.group.allreduce([t], options).wait()
        return int(t.item())


def join_tensor_parallel(rank: int, size: int, host: str, port: int, device: torch.device, timeout_s: float,
                         same_machine: bool = False) -> TPCommunicator:
    """Meet the group's other ranks at host:port (rank 0 hosts the store there) and make the group.
    same_machine (CPU ranks on one host): the collectives go through shared memory, the group stays for
    the rest (setup, and the rare min)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, size, rank == 0, timeout=timeout)
    prefixed = dist.PrefixStore("tokenmill-tp", store)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        group = dist.ProcessGroupNCCL(prefixed, rank, size, options)
    else:
        group = dist.ProcessGroupGloo(prefixed, rank, size, timeout)
    shm = None
    if same_machine and device.type == "cpu":
        if rank == 0:
            path = f"/dev/shm/tokenmill-tp-{os.getpid()}-{port}"
            shm = SharedMemoryCollectives(path, rank, size, SHM_SLOT_BYTES, create=True, timeout_s=timeout_s)
            prefixed.set("shm_path", path)
        else:
            path = prefixed.get("shm_path").decode()
            shm = SharedMemoryCollectives(path, rank, size, SHM_SLOT_BYTES, create=False, timeout_s=timeout_s)
        prefixed.set(f"pid{rank}", str(os.getpid()))  # after the file is open: rank 0 reads it as "attached"
        try:
            shm.peer_pids = {r: int(prefixed.get(f"pid{r}")) for r in range(size) if r != rank}
        finally:
            if rank == 0:
                # Every rank has mapped the file (or never will): its name can go now, the mappings stay.
                # Nothing is left in /dev/shm however the ranks end, killed or dropped without close().
                shm.unlink()
    return TPCommunicator(rank, size, group, store, shm)
