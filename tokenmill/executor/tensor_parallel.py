"""TensorParallelExecutor: rank 0 in the engine's process, the other ranks elsewhere (spawned processes
or Ray actors: the subclasses), all in one tensor-parallel group.

Every call the engine makes runs on rank 0, which announces to the other ranks what to run (worker.py).
A failure during a step leaves the ranks out of step with each other (one may be waiting in a
collective the others will never reach), so any error there is fatal: the engine fails with
ExecutorDiedError naming the cause, and no request waits for a rank that is gone.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import replace
from typing import TypeVar

import torch

from tokenmill.distributed.communicator import TPCommunicator, join_tensor_parallel
from tokenmill.engine.messages import ModelRunnerOutput, ScheduledChunk, SchedulerOutput
from tokenmill.executor.base import Executor, ExecutorDiedError
from tokenmill.errors import TokenmillError
from tokenmill.layers.linear import HeadPartition
from tokenmill.loader import ModelSource
from tokenmill.worker.worker import Worker, WorkerSpec

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Seconds a collective may wait for a rank before the group gives up (a first start that builds the
# CPU kernels can hold one rank for minutes; a dead rank is noticed at once, by its closed connection).
COLLECTIVE_TIMEOUT_S = 1800.0

# Seconds the ranks have to meet (start and import: a few seconds; a rank that fails first is noticed at once).
RENDEZVOUS_TIMEOUT_S = 300.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def rank_spec(spec: WorkerSpec, rank: int) -> WorkerSpec:
    """A rank's spec: on CUDA, rank r runs on GPU r."""
    if spec.device.type == "cuda":
        return replace(spec, device=torch.device("cuda", rank))
    return spec


def cpu_share(rank: int, size: int, cores: list[int] | None = None) -> list[int]:
    """The cores rank `rank` of `size` runs on: an even, contiguous share of this process's cores (all of them
    for every rank when there are fewer cores than ranks)."""
    cores = sorted(cores if cores is not None else os.sched_getaffinity(0))
    per_rank = len(cores) // size
    if per_rank == 0:
        return cores
    return cores[rank * per_rank : (rank + 1) * per_rank]


def pin_process(cores: list[int]) -> None:
    """Every thread of this process onto these cores, and torch's thread pool sized to them."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except OSError:  # a thread that just ended
            pass
    torch.set_num_threads(len(cores))


def run_follower(rank: int, size: int, host: str, port: int, spec: WorkerSpec, same_machine: bool = False) -> None:
    """A rank > 0 (spec: already this rank's): join the group, build this rank's shards, run what rank 0
    announces until it says stop. Raises whatever failed; the group's connections are closed either way,
    so rank 0 notices at once."""
    comm = join_tensor_parallel(rank, size, host, port, spec.device, COLLECTIVE_TIMEOUT_S, same_machine)
    try:
        Worker(spec, comm).follow()
    finally:
        comm.close()


def follower_main(rank: int, size: int, host: str, port: int, spec: WorkerSpec, cores: list[int] | None,
                  same_machine: bool = False) -> None:
    """A spawned rank > 0 (the "mp" backend). Any failure ends the process, which rank 0 notices at once
    (the group's connections close)."""
    try:
        if cores is not None and spec.device.type == "cpu":
            pin_process(cores)
        run_follower(rank, size, host, port, rank_spec(spec, rank), same_machine)
    except TokenmillError as exc:  # a clear error (a model that cannot be split, a missing file): its line is enough
        logger.error("tensor-parallel rank %d failed: %s", rank, exc)
        os._exit(1)
    except BaseException:  # noqa: BLE001 - anything else: log it where the operator sees it, then go
        logger.exception("tensor-parallel rank %d failed", rank)
        os._exit(1)


def check_head_split(hf_config, size: int) -> None:
    """The ModelLoadError a model whose attention heads cannot be split over `size` ranks gives, raised
    before any rank starts: each rank would fail on its own, and rank 0 could see a follower's exit
    (an ExecutorDiedError) before its own clear error."""
    heads = getattr(hf_config, "num_attention_heads", None)
    if heads is None:
        return
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    for rank in range(size):
        HeadPartition.of(int(heads), int(kv_heads), rank, size)


class TensorParallelExecutor(Executor):
    def __init__(self, spec: WorkerSpec, source: ModelSource) -> None:
        self.size = spec.config.parallel.tensor_parallel_size
        check_head_split(source.hf_config, self.size)
        self.comm: TPCommunicator | None = None
        host, port = self.rendezvous_address(), self.rendezvous_port()
        cores = None
        if spec.device.type == "cpu":
            cores = [cpu_share(r, self.size) for r in range(self.size)]
        self.start_followers(spec, host, port, cores)
        # This process's cores and threads before rank 0 took its share (given back at shutdown).
        self._saved_cpu = (sorted(os.sched_getaffinity(0)), torch.get_num_threads())
        try:
            if cores is not None and self.same_machine:  # ranks on other machines leave this one's cores to rank 0
                pin_process(cores[0])
            self.comm = self.join(host, port, spec.device)
            if self.comm.shm is not None:
                self.comm.shm.peer_failure = self.follower_failure
            super().__init__(spec, source)
        except BaseException:
            self.stop_followers()
            if self.comm is not None:  # joined, then the model failed to build: free the group and its /dev/shm file
                self.comm.close()
                self.comm = None
            cores_before, threads = self._saved_cpu
            pin_process(cores_before)
            torch.set_num_threads(threads)
            raise

    # -- what the subclasses provide --------------------------------------------------------------
    def rendezvous_address(self) -> str:
        return "127.0.0.1"

    def start_followers(self, spec: WorkerSpec, host: str, port: int, cores: list[list[int]] | None) -> None:
        raise NotImplementedError

    def rendezvous_port(self) -> int:
        return free_port()

    def wait_for_followers(self, timeout_s: float) -> None:
        """Block up to timeout_s, or until a follower's state changes (it may have ended)."""
        raise NotImplementedError

    def join(self, host: str, port: int, device: torch.device) -> TPCommunicator:
        """Rank 0's side of the rendezvous, watching the followers while it waits: if one fails before it
        joins, fail now with its error rather than wait out the timeout."""
        result: dict[str, object] = {}

        def meet() -> None:
            try:
                result["comm"] = join_tensor_parallel(0, self.size, host, port, device, COLLECTIVE_TIMEOUT_S, self.same_machine)
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                result["error"] = exc

        thread = threading.Thread(target=meet, name="tokenmill-tp-rendezvous", daemon=True)
        thread.start()
        deadline = time.monotonic() + RENDEZVOUS_TIMEOUT_S
        while thread.is_alive() and time.monotonic() < deadline:
            self.wait_for_followers(0.2)
            failure = self.follower_failure()
            if failure is not None:
                # A follower that joined and then failed building its model (a checkpoint this layout cannot
                # split, say) may be seen here before the rendezvous thread ends: then this rank goes on to
                # build its own and meets the same error, with its message, rather than "rank 1 exited".
                thread.join(1.0)
                if "comm" in result:
                    break
                raise ExecutorDiedError(f"tensor parallelism could not start: {failure}")
        if thread.is_alive():
            raise ExecutorDiedError(f"tensor parallelism could not start: the ranks did not meet within {RENDEZVOUS_TIMEOUT_S:.0f} s")
        if "error" in result:
            raise ExecutorDiedError(f"tensor parallelism could not start: {result['error']}")
        return result["comm"]

    # Whether every rank runs on this machine (then CPU collectives go through shared memory).
    same_machine = False

    def follower_failure(self) -> str | None:
        """Why a follower is gone, if one is (None while all run)."""
        return None

    def stop_followers(self) -> None:
        raise NotImplementedError

    # -- the executor's calls, each fatal on failure ---------------------------------------------
    def _make_driver_worker(self, spec: WorkerSpec, source: ModelSource) -> Worker:
        return Worker(spec, self.comm, source)

    def _guarded(self, call: Callable[[], T]) -> T:
        try:
            return call()
        except Exception as exc:
            gone = self.follower_failure()
            cause = gone or f"{type(exc).__name__}: {exc}"
            self.stop_followers()
            raise ExecutorDiedError(f"tensor parallelism stopped: {cause}") from exc

    def determine_num_blocks(self) -> int:
        def run() -> int:
            self.comm.broadcast_object(("num_kv_blocks",))
            return self.comm.min_int(self.worker.num_kv_blocks())

        return self._guarded(run)

    def init_kv_cache(self, num_blocks: int) -> None:
        self._guarded(lambda: self.worker.init_kv_cache(num_blocks))

    def prepare_step(self, scheduled: SchedulerOutput) -> None:
        self._guarded(lambda: self.worker.prepare_step(scheduled))

    def execute_model(self, chunks: list[ScheduledChunk], grammar_bitmask: torch.Tensor | None = None) -> ModelRunnerOutput:
        return self._guarded(lambda: self.worker.execute_model(chunks, grammar_bitmask))

    def forget(self, request_ids: Iterable[str]) -> None:
        self.worker.forget(request_ids)

    def keep_only(self, request_ids: Collection[str]) -> None:
        self.worker.keep_only(request_ids)

    def shutdown(self) -> None:
        if self.comm is not None and self.follower_failure() is None:
            try:
                self.comm.broadcast_object(("stop",))
            except Exception:  # noqa: BLE001 - a follower already gone: stopping is all that is left
                pass
        self.stop_followers()
        if self.comm is not None:
            self.comm.close()
            cores, threads = self._saved_cpu
            pin_process(cores)
            torch.set_num_threads(threads)
        self.comm = None
