"""MultiprocExecutor: tensor parallelism over processes on this machine, one spawned process per rank > 0.

On a CPU the ranks split this process's cores evenly and each pins its threads to its share (on a
two-socket server, launch with one socket's worth of cores per rank: e.g. `numactl` or taskset over
both sockets and --tensor-parallel-size 2, so each rank's share is one socket's cores).
"""

from __future__ import annotations

import multiprocessing
import threading
import weakref
from multiprocessing.connection import wait

import torch

from tokenmill.distributed.communicator import TPCommunicator, join_tensor_parallel
from tokenmill.executor.base import ExecutorDiedError
from tokenmill.executor.tensor_parallel import COLLECTIVE_TIMEOUT_S, TensorParallelExecutor, follower_main
from tokenmill.worker.worker import WorkerSpec

# Seconds the ranks have to meet (spawn and import: a few seconds; a rank that dies first is noticed at once).
RENDEZVOUS_TIMEOUT_S = 300.0


class MultiprocExecutor(TensorParallelExecutor):
    same_machine = True

    def start_followers(self, spec: WorkerSpec, host: str, port: int, cores: list[list[int]] | None) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.processes = []
        for rank in range(1, self.size):
            process = ctx.Process(
                target=follower_main, args=(rank, self.size, host, port, spec, cores[rank] if cores else None, True),
                name=f"tokenmill-tp-rank{rank}", daemon=True,
            )
            process.start()
            self.processes.append(process)
        # An engine dropped without shutdown() must not leave its ranks waiting forever.
        weakref.finalize(self, _kill, list(self.processes))

    def join(self, host: str, port: int, device: torch.device) -> TPCommunicator:
        """Meet the followers; if one dies before it joins, fail now rather than wait out the timeout."""
        result: dict[str, object] = {}

        def meet() -> None:
            try:
                result["comm"] = join_tensor_parallel(0, self.size, host, port, device, COLLECTIVE_TIMEOUT_S, self.same_machine)
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                result["error"] = exc

        thread = threading.Thread(target=meet, name="tokenmill-tp-rendezvous", daemon=True)
        thread.start()
        waited = 0.0
        while thread.is_alive() and waited < RENDEZVOUS_TIMEOUT_S:
            wait([p.sentinel for p in self.processes], timeout=0.2)
            waited += 0.2
            failure = self.follower_failure()
            if failure is not None:
                raise ExecutorDiedError(f"tensor parallelism could not start: {failure}")
        if thread.is_alive():
            raise ExecutorDiedError(f"tensor parallelism could not start: the ranks did not meet within {RENDEZVOUS_TIMEOUT_S:.0f} s")
        if "error" in result:
            raise ExecutorDiedError(f"tensor parallelism could not start: {result['error']}")
        return result["comm"]

    def follower_failure(self) -> str | None:
        for rank, process in enumerate(getattr(self, "processes", []), start=1):
            if process.exitcode is not None:
                return f"tensor-parallel rank {rank} exited with code {process.exitcode} (its log says why)"
        return None

    def stop_followers(self) -> None:
        for process in getattr(self, "processes", []):
            process.join(timeout=5.0)
            if process.is_alive():
                process.kill()
                process.join(timeout=5.0)


def _kill(processes: list) -> None:
    for process in processes:
        if process.is_alive():
            process.kill()
