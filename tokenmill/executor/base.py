"""Executor: what the engine asks of the ranks that hold the model. The engine talks to nothing else
of the worker side: it gets the number of KV blocks, has the caches allocated, and runs each step.

- "uni": rank 0 alone, in this process (the default: a direct call, nothing added to a step);
- "mp": tensor parallelism, rank 0 in this process and one spawned process per other rank;
- "ray": the same with the other ranks as Ray actors (on a Ray cluster's machines).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

import torch

from tokenmill.config import EngineConfig
from tokenmill.engine.messages import ModelRunnerOutput, ScheduledChunk, SchedulerOutput
from tokenmill.errors import EngineDeadError
from tokenmill.loader import ModelSource
from tokenmill.worker.worker import Worker, WorkerSpec


class ExecutorDiedError(EngineDeadError, RuntimeError):
    """A rank of the model is gone (its process died, or a collective failed): the engine cannot go on
    (an EngineDeadError: the server answers 503, the command line prints one line)."""


class Executor:
    """Rank 0's worker in this process; subclasses add the other ranks."""

    def __init__(self, spec: WorkerSpec, source: ModelSource) -> None:
        self.spec = spec
        self.worker = self._make_driver_worker(spec, source)

    def _make_driver_worker(self, spec: WorkerSpec, source: ModelSource) -> Worker:
        return Worker(spec, source=source)

    def determine_num_blocks(self) -> int:
        """The KV blocks every rank can hold (the least of the ranks' own counts)."""
        return self.worker.num_kv_blocks()

    def init_kv_cache(self, num_blocks: int) -> None:
        self.worker.init_kv_cache(num_blocks)

    def prepare_step(self, scheduled: SchedulerOutput) -> None:
        """Copy-on-write copies, and a draft model's drafts into the slots reserved for them (before the
        grammar masks are made: they depend on the drafts)."""
        self.worker.prepare_step(scheduled)

    def execute_model(self, chunks: list[ScheduledChunk], grammar_bitmask: torch.Tensor | None = None) -> ModelRunnerOutput:
        """One forward pass and the sampling of its chunks (on rank 0)."""
        return self.worker.execute_model(chunks, grammar_bitmask)

    def idle(self) -> None:
        """Between steps, with none to run (rank 0's worker: Worker.idle)."""
        self.worker.idle()

    def forget(self, request_ids: Iterable[str]) -> None:
        """Drop per-request state kept between steps (the draft model's) for these requests."""
        self.worker.forget(request_ids)

    def keep_only(self, request_ids: Collection[str]) -> None:
        """Drop per-request state of every request not among these (the live ones)."""
        self.worker.keep_only(request_ids)

    def shutdown(self) -> None:
        """Stop the other ranks (nothing to stop with one)."""

    @property
    def driver_runner(self):
        """Rank 0's model runner (for tests and introspection)."""
        return self.worker.runner


def make_executor(config: EngineConfig, source: ModelSource, device: torch.device, dtype: torch.dtype, max_model_len: int) -> Executor:
    spec = WorkerSpec(config, device, dtype, max_model_len)
    backend = config.parallel.executor_backend
    if backend == "uni" or config.parallel.tensor_parallel_size == 1:
        return Executor(spec, source)  # one rank: nothing to spawn or place, whatever backend is named
    if backend == "mp":
        from tokenmill.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(spec, source)
    from tokenmill.executor.ray_executor import RayExecutor

    return RayExecutor(spec, source)
