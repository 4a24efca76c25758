"""ReplicaPool: the front end's side of the replica processes (no knowledge of requests).

Each replica is spawned with two one-way pipes (commands in, results out) and, on a CPU, an even
contiguous share of this process's cores (OMP_NUM_THREADS set to its size in the child's environment,
so torch starts with that many threads; the child pins itself at start). On CUDA each replica sees
only its own GPUs (tensor_parallel_size of them) through CUDA_VISIBLE_DEVICES.

poll() waits on every live replica's result pipe and process sentinel at once, so a replica that is
killed or crashes is reported (ReplicaDied) as soon as its pipe is drained: nothing waits on a dead one.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing
import os
import signal
import time
import weakref
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection, wait

from tokenmill.config import EngineConfig, resolve_device
from tokenmill.engine.dp.messages import ReplicaDied, ReplicaFatal, ReplicaReady, Shutdown
from tokenmill.engine.dp.replica import ReplicaSpec, replica_main
from tokenmill.errors import EngineDeadError

logger = logging.getLogger(__name__)

# Messages taken from one replica per poll(), so that a busy replica cannot starve the others.
_MAX_MESSAGES_PER_POLL = 64

# Seconds replicas left running get to stop when their front end is dropped or the interpreter exits.
_EXIT_TIMEOUT_S = 5.0


@dataclass
class ReplicaHandle:
    index: int
    process: multiprocessing.process.BaseProcess
    commands: Connection  # write end
    results: Connection  # read end
    cores: list[int] | None
    death: str | None = None  # why it is gone, once it is


def replica_config(config: EngineConfig, index: int, shares_memory: bool) -> EngineConfig:
    """Replica `index`'s engine config: one replica (an LLMEngine refuses data_parallel_size > 1), its own
    seed for the random draws of unseeded requests (else every replica would draw the same ones), and, when
    the replicas share one machine's RAM (CPU), 1/N of the KV budget that one engine would take from it, so
    that -dp N uses the memory -dp 1 does (they start together: each sees the same free memory)."""
    size = config.parallel.data_parallel_size
    cache = replace(config.cache, memory_share=config.cache.memory_share / size) if shares_memory else config.cache
    return replace(
        config,
        parallel=replace(config.parallel, data_parallel_size=1),
        model=replace(config.model, seed=config.model.seed + index),
        cache=cache,
    )


def split_evenly(items: list, index: int, count: int) -> list:
    """Part `index` of `count` even, contiguous parts of items (all of them when there are fewer than count)."""
    per_part = len(items) // count
    if per_part == 0:
        return list(items)
    return items[index * per_part : (index + 1) * per_part]


class ReplicaPool:
    def __init__(self, config: EngineConfig) -> None:
        self.size = config.parallel.data_parallel_size
        device = resolve_device(config.device)
        cores = sorted(os.sched_getaffinity(0))
        gpus = _visible_gpus(config) if device.type == "cuda" else None
        if gpus is None and len(cores) < self.size:
            logger.warning("%d data-parallel replicas share %d cores: each runs on all of them", self.size, len(cores))
        cache = config.cache
        if cache.kv_cache_memory is None and cache.num_kv_blocks is None:
            where = "split the KV budget one engine would take from this machine's RAM" if gpus is None else \
                "size their KV caches from their own GPUs' memory"
            logger.info("the %d replicas %s; kv_cache_memory (--kv-cache-memory) sets each one's size", self.size, where)
        ctx = multiprocessing.get_context("spawn")
        log_level = logging.getLogger("tokenmill").getEffectiveLevel()
        self.replicas: list[ReplicaHandle] = []
        try:
            for index in range(self.size):
                env: dict[str, str] = {}
                share = None
                if gpus is not None:
                    env["CUDA_VISIBLE_DEVICES"] = ",".join(split_evenly(gpus, index, self.size))
                else:
                    share = split_evenly(cores, index, self.size)
                    env["OMP_NUM_THREADS"] = str(len(share))
                commands_read, commands_write = ctx.Pipe(duplex=False)
                results_read, results_write = ctx.Pipe(duplex=False)
                spec = ReplicaSpec(index, replica_config(config, index, shares_memory=gpus is None), share, log_level)
                # Not daemonic: a replica may spawn processes of its own (its tensor-parallel ranks).
                process = ctx.Process(target=replica_main, args=(spec, commands_read, results_write),
                                      name=f"tokenmill-dp-replica{index}")
                with _environment(env):  # spawn hands the child this process's environment as it is at start()
                    process.start()
                # The child's ends belong to the child: closed here, so a dead child reads as EOF.
                commands_read.close()
                results_write.close()
                self.replicas.append(ReplicaHandle(index, process, commands_write, results_read, share))
        except BaseException:
            self.shutdown(timeout=0.0)
            raise
        # A front end dropped without shutdown() must not leave its replicas running; nor may the interpreter's
        # exit wait for them (multiprocessing joins non-daemonic children at exit; this hook, registered
        # after multiprocessing's own, runs before it).
        weakref.finalize(self, _stop, self.replicas, _EXIT_TIMEOUT_S)
        atexit.register(_stop, self.replicas, _EXIT_TIMEOUT_S)

    # -- start ----------------------------------------------------------------------------------
    def wait_ready(self) -> list[ReplicaReady]:
        """Every replica's ReplicaReady, once each has built its engine. A replica that fails to start raises
        its error (the same a one-engine LLM would raise) and every replica is stopped."""
        ready: dict[int, ReplicaReady] = {}
        try:
            while len(ready) < self.size:
                for index, message in self.poll(timeout=1.0):
                    if isinstance(message, ReplicaReady):
                        ready[index] = message
                    elif isinstance(message, ReplicaFatal):
                        raise message.error
                    elif isinstance(message, ReplicaDied):
                        raise EngineDeadError(f"data-parallel replica {index} could not start: {message.reason}")
        except BaseException:
            self.shutdown(timeout=0.0)
            raise
        for index in range(self.size):
            cores = self.replicas[index].cores
            logger.info("data-parallel replica %d (pid %d) ready%s", index, self.replicas[index].process.pid,
                        f" on cores {cores}" if cores is not None else "")
        return [ready[i] for i in range(self.size)]

    # -- talk -----------------------------------------------------------------------------------
    def send(self, index: int, command) -> bool:
        """Send a command to a replica; False if it is gone (poll() reports why)."""
        replica = self.replicas[index]
        if replica.death is not None:
            return False
        try:
            replica.commands.send(command)
            return True
        except (OSError, ValueError):  # its pipe is closed: it died, which poll() will report
            return False

    def poll(self, timeout: float | None) -> list[tuple[int, object]]:
        """(replica index, message) for what the replicas sent, waiting up to `timeout` seconds for the first;
        a replica whose process is gone gives a ReplicaDied after its last messages, once."""
        live = [r for r in self.replicas if r.death is None]
        if not live:
            if timeout:
                time.sleep(timeout)
            return []
        ready = set(wait([r.results for r in live] + [r.process.sentinel for r in live], timeout))
        events: list[tuple[int, object]] = []
        for replica in live:
            exited = replica.process.sentinel in ready
            if replica.results not in ready and not exited:
                continue
            try:
                closed = self._drain(replica, events)
            except Exception as exc:  # noqa: BLE001 - a message that cannot be read: the replica is unusable
                logger.exception("could not read a message of data-parallel replica %d", replica.index)
                replica.process.kill()
                self._mark_dead(replica, f"its message could not be read ({exc!r})", events)
                continue
            if closed or (exited and not replica.results.poll()):
                replica.process.join(timeout=1.0)
                self._mark_dead(replica, _exit_reason(replica.process), events)
        return events

    @staticmethod
    def _drain(replica: ReplicaHandle, events: list) -> bool:
        """Take a replica's waiting messages (a bounded number); True once its pipe has closed."""
        try:
            for _ in range(_MAX_MESSAGES_PER_POLL):
                if not replica.results.poll():
                    break
                events.append((replica.index, replica.results.recv()))
        except (EOFError, OSError):  # the process is gone: the pipe's writer closed (perhaps mid-message)
            return True
        return False

    def _mark_dead(self, replica: ReplicaHandle, reason: str, events: list) -> None:
        replica.death = reason
        logger.error("data-parallel replica %d (pid %s) is gone: %s", replica.index, replica.process.pid, reason)
        events.append((replica.index, ReplicaDied(reason)))

    def is_alive(self, index: int) -> bool:
        return self.replicas[index].death is None

    def pid(self, index: int) -> int | None:
        return self.replicas[index].process.pid

    # -- stop -----------------------------------------------------------------------------------
    def shutdown(self, timeout: float = 10.0) -> None:
        """Ask every replica to stop, wait up to `timeout` seconds for them, then kill what is left."""
        _stop(self.replicas, timeout)


def _exit_reason(process: multiprocessing.process.BaseProcess) -> str:
    code = process.exitcode
    if code is None:
        return "its process stopped answering"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"its process (pid {process.pid}) was killed by {name}"
    return f"its process (pid {process.pid}) exited with code {code} (its log above says why)"


def _visible_gpus(config: EngineConfig) -> list[str]:
    """This process's GPUs, in order; each replica gets tensor_parallel_size of them."""
    import torch

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = [g for g in visible.split(",") if g] if visible is not None else [str(i) for i in range(torch.cuda.device_count())]
    needed = config.parallel.data_parallel_size * config.parallel.tensor_parallel_size
    if len(gpus) < needed:
        raise ValueError(
            f"data_parallel_size {config.parallel.data_parallel_size} x tensor_parallel_size "
            f"{config.parallel.tensor_parallel_size} needs {needed} GPUs; {len(gpus)} are visible"
        )
    return gpus[:needed]


@contextlib.contextmanager
def _environment(values: dict[str, str]):
    """os.environ with these values for the duration (for a child process started meanwhile)."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _stop(replicas: list[ReplicaHandle], timeout: float) -> None:
    """Shutdown to every replica (each stops its engine, tensor-parallel ranks included), up to `timeout`
    seconds for them to exit, then a kill for what is left. Safe to call again."""
    for replica in replicas:
        with contextlib.suppress(OSError, ValueError):  # gone already, or its pipe closed by an earlier stop
            replica.commands.send(Shutdown())
    deadline = time.monotonic() + timeout
    for replica in replicas:
        replica.process.join(timeout=max(0.0, deadline - time.monotonic()))
        if replica.process.is_alive():
            replica.process.kill()
            replica.process.join(timeout=5.0)
        replica.death = replica.death or "shut down"
        replica.commands.close()
        replica.results.close()
