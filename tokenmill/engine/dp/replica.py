"""A data-parallel replica: a spawned process with its share of the cores, one LLMEngine, and a loop.

The loop takes the front end's commands (add a request, abort one, shut down), steps the engine while
it has work, and sends back after each turn one ReplicaUpdate: the outputs (every step's for streamed
requests, only the final one otherwise), the requests refused or failed, and the engine's stats.
A thread reads the command pipe into a queue, so the front end's sends never wait on a step, and a
front end that goes away (its end of the pipe closes) shuts the replica down. Anything the loop cannot
recover from is sent as ReplicaFatal before the process exits; a replica that dies without a word is
noticed by the front end through its process sentinel.
run_replica and ReplicaLoop know nothing of pipes: ray_pool.py runs them in a Ray actor, over its methods.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection

from tokenmill.config import EngineConfig
from tokenmill.engine.dp.messages import (
    AbortRequest,
    AddRequest,
    ReplicaFatal,
    ReplicaReady,
    ReplicaUpdate,
    Shutdown,
    portable_error,
)
from tokenmill.engine.engine import LLMEngine
from tokenmill.errors import InvalidRequestError, RequestFailedError
from tokenmill.executor import ExecutorDiedError

logger = logging.getLogger(__name__)


@dataclass
class ReplicaSpec:
    index: int
    config: EngineConfig  # data_parallel_size 1: an LLMEngine is one replica
    cores: list[int] | None  # CPU cores to run on (None: leave the affinity alone)
    log_level: int


def replica_main(spec: ReplicaSpec, commands: Connection, results: Connection) -> None:
    """The spawned process's entry point."""
    # Ctrl-C reaches the whole process group: the front end decides what it means (a graceful server
    # shutdown sends Shutdown once in-flight requests are done), so the replica must not die of it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=spec.log_level, format=f"%(levelname)s replica{spec.index} %(name)s: %(message)s")
    if spec.cores is not None:
        from tokenmill.executor.tensor_parallel import pin_process

        pin_process(spec.cores)  # every thread onto this replica's cores, torch's pool sized to them
    # A thread reads the pipe into a queue, so the front end's sends never wait on a step.
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=_read_commands, args=(commands, inbox), name="tokenmill-dp-commands", daemon=True).start()
    if not run_replica(spec.index, spec.config, inbox, results.send):
        sys.exit(1)


def run_replica(index: int, config: EngineConfig, inbox: queue.SimpleQueue, send: Callable[[object], None]) -> bool:
    """A replica's life over any transport (a process's pipes, a Ray actor's methods): build the engine, send
    ReplicaReady, then run the loop on the commands that arrive in `inbox` until Shutdown. Anything it
    cannot recover from is sent as ReplicaFatal; False then (the caller ends its process)."""
    engine = None
    try:
        engine = LLMEngine(config)
        pool = engine.scheduler.kv_cache.pool
        send(ReplicaReady(engine.max_model_len, pool.num_usable_blocks, engine.dtype, engine.device, engine.stats()))
        ReplicaLoop(engine, inbox, send).run()
        return True
    except BaseException as exc:  # noqa: BLE001 - the front end must hear of anything, then the replica ends
        logger.exception("data-parallel replica %d failed", index)
        try:
            send(ReplicaFatal(portable_error(exc)))
        except Exception:  # noqa: BLE001 - the front end is gone too
            pass
        return False
    finally:
        if engine is not None:
            engine.shutdown()


class ReplicaLoop:
    """Steps one engine on the commands of `inbox` (filled by whoever carries them here), sending one
    ReplicaUpdate per turn through `send`; returns at Shutdown."""

    def __init__(self, engine: LLMEngine, inbox: queue.SimpleQueue, send: Callable[[object], None]) -> None:
        self.engine = engine
        self.send = send
        self._inbox = inbox
        self._streamed: dict[str, bool] = {}  # request id -> whether every step's output is sent
        self._adds_taken = 0

    def run(self) -> None:
        engine = self.engine
        while True:
            # Idle: wait for a command (between waits, LLMEngine.idle). Busy: take whatever has arrived, then step.
            commands = engine.next_commands(self._inbox)
            if commands is None:
                continue
            update = ReplicaUpdate()
            for command in commands:
                if isinstance(command, Shutdown):
                    logger.info("shutting down: %s", command.reason)
                    return
                self._handle(command, update)
            if engine.has_unfinished_requests():
                self._step(update)
            update.stats = engine.stats()
            update.adds_taken = self._adds_taken
            self.send(update)

    def _handle(self, command, update: ReplicaUpdate) -> None:
        engine = self.engine
        if isinstance(command, AddRequest):
            self._adds_taken += 1
            try:
                if command.beam_search:
                    engine.add_beam_search_request(command.prompt, command.params, command.request_id)
                else:
                    engine.add_request(command.prompt, command.params, command.request_id, arrival_time=command.arrival_time)
            except ValueError as exc:  # InvalidRequestError, or an id already in use
                error = exc if isinstance(exc, InvalidRequestError) else InvalidRequestError(str(exc))
                update.rejected.append((command.request_id, portable_error(error)))
                return
            self._streamed[command.request_id] = command.stream
        elif isinstance(command, AbortRequest):
            output = engine.abort_request(command.request_id)
            if output is not None:
                self._streamed.pop(output.request_id, None)
                update.outputs.append(output)
        else:
            raise TypeError(f"unknown command {type(command).__name__}")

    def _step(self, update: ReplicaUpdate) -> None:
        engine = self.engine
        try:
            outputs = engine.step()
        except ExecutorDiedError:
            raise  # the model is gone: fatal
        except RequestFailedError as exc:
            # The engine isolated the requests that failed (and aborted them); the rest go on.
            self._forget(exc.request_ids)
            update.failed.append((list(exc.request_ids), str(exc)))
            return
        except Exception as exc:  # noqa: BLE001 - as the async engine does: fail the step's requests, go on
            logger.exception("an engine step failed; aborting the requests in flight")
            request_ids = engine.unfinished_request_ids()
            for request_id in request_ids:
                engine.abort_request(request_id)
            self._forget(request_ids)
            update.failed.append((request_ids, f"the engine step failed: {exc!r}"))
            return
        update.num_outputs += len(outputs)
        for output in outputs:
            streamed = self._streamed.get(output.request_id, True)
            if output.finished:
                self._streamed.pop(output.request_id, None)
            if streamed or output.finished:
                update.outputs.append(output)

    def _forget(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._streamed.pop(request_id, None)


def _read_commands(commands: Connection, inbox: queue.SimpleQueue) -> None:
    while True:
        try:
            command = commands.recv()
        except (EOFError, OSError):
            inbox.put(Shutdown(f"the front end is gone (pid {os.getppid()})"))
            return
        inbox.put(command)
        if isinstance(command, Shutdown):
            return
