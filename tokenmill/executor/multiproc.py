"""MultiprocExecutor: tensor parallelism over processes on this machine, one spawned process per rank > 0.

On a CPU the ranks split this process's cores evenly and each pins its threads to its share (on a
two-socket server, launch with one socket's worth of cores per rank: e.g. `numactl` or taskset over
both sockets and --tensor-parallel-size 2, so each rank's share is one socket's cores).
"""

from __future__ import annotations

import multiprocessing
import weakref
from multiprocessing.connection import wait

from tokenmill.executor.tensor_parallel import TensorParallelExecutor, follower_main
from tokenmill.worker.worker import WorkerSpec


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

    def wait_for_followers(self, timeout_s: float) -> None:
        wait([p.sentinel for p in self.processes], timeout=timeout_s)

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
