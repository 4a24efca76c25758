"""AsyncLLMEngine: the engine loop on its own thread, each request's outputs streamed to an asyncio caller.

Three stages run at once (the pipeline of the PPL.LLM design), so the model never waits for text work:

1. tokenize: LLMEngine.make_request (tokenization, checks, grammar compilation) runs on a worker
   thread of the event loop's executor (requests with a grammar on threads of their own, since a
   compile may take seconds), not on the event loop and not on the engine thread;
2. compute: the engine thread runs LLMEngine.step_core back to back; between two steps it takes
   in new requests, aborts and stop orders, so requests join and leave the batch at every step;
3. detokenize: the output thread turns each step's tokens into RequestOutputs (OutputProcessor:
   detokenization, stop strings) while the engine thread runs the next forward pass (torch
   releases the GIL in its kernels), and hands them to the requests' streams on the event loop.

A stop string found in stage 3 reaches the engine thread as a stop order one step later; the token
made meanwhile is dropped by the output side. With pipeline=False the engine thread does all three
itself, one after the other (for measuring what the overlap saves). `tokenmill serve` runs the engine
loop on the main thread instead (start(own_engine_thread=False), then run_engine_loop()): torch's
OpenMP kernels run markedly slower on a secondary thread.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from tokenmill.config import EngineConfig
from tokenmill.engine.engine import EngineStats, LLMEngine, PromptInput
from tokenmill.engine.output_processor import CoreStep, StopOrder
from tokenmill.engine.request import Request
from tokenmill.errors import EngineDeadError, EngineOverloadedError, InvalidRequestError, RequestFailedError
from tokenmill.executor import ExecutorDiedError
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

ASYNC_ENGINE_READY = True


# Messages to the engine thread.
@dataclass
class _Add:
    request: Request


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Shutdown:
    pass


# Messages to the output thread (in the order the engine thread made them).
@dataclass
class _Register:
    request: Request


@dataclass
class _Failed:
    request_ids: list[str]
    error: BaseException


@dataclass(eq=False)
class _Stream:
    """One request's outputs as its caller sees them: the latest (cumulative) output, or an error."""

    event: asyncio.Event = field(default_factory=asyncio.Event)
    latest: RequestOutput | None = None
    error: BaseException | None = None


class AsyncLLMEngine:
    def __init__(self, config: EngineConfig, *, max_waiting_requests: int | None = None, pipeline: bool = True) -> None:
        if max_waiting_requests is not None and max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be >= 1, got {max_waiting_requests}")
        self.engine = LLMEngine(config)
        self.max_waiting_requests = max_waiting_requests
        self.pipeline = pipeline
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._outputs: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}  # event-loop thread only
        self._num_preparing = 0  # requests being tokenized (event-loop thread only)
        self._adds_sent = 0  # event-loop thread writes
        self._adds_taken = 0  # engine thread writes
        self._stats: EngineStats = self.engine.stats()
        self._grammar_threads = ThreadPoolExecutor(max_workers=4, thread_name_prefix="tokenmill-grammar")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._threads: list[threading.Thread] = []
        self._accepting = False
        self._dead: BaseException | None = None
        self.started = threading.Event()  # set once start() has run (a caller-run engine loop waits for it)

    # -- what the server reads ------------------------------------------------
    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def is_running(self) -> bool:
        return self._accepting and self._dead is None

    @property
    def errored(self) -> bool:
        return self._dead is not None

    def stats(self) -> EngineStats:
        """The engine's counters as of its last step (a snapshot: safe from any thread)."""
        return self._stats

    @property
    def num_waiting(self) -> int:
        """Requests not yet running: being tokenized, on their way to the engine thread, or queued there."""
        return self._num_preparing + (self._adds_sent - self._adds_taken) + self._stats.num_waiting

    # -- life cycle -----------------------------------------------------------
    async def start(self, own_engine_thread: bool = True) -> None:
        """Start the stages. With own_engine_thread=False the engine loop is left to the caller, who runs
        run_engine_loop() on a thread of its choice: the main thread, where torch's OpenMP kernels run
        markedly faster than on a secondary thread (measured 1.5-2x on small matmuls on 2 cores)."""
        if self._threads or self._loop is not None:
            return
        self._loop = asyncio.get_running_loop()
        if own_engine_thread:
            self._threads.append(threading.Thread(target=self._engine_loop, name="tokenmill-engine", daemon=True))
        if self.pipeline:
            self._threads.append(threading.Thread(target=self._output_loop, name="tokenmill-output", daemon=True))
        for thread in self._threads:
            thread.start()
        self._accepting = True
        self.started.set()

    async def shutdown(self, timeout: float = 0.0) -> None:
        """Stop taking requests; let in-flight ones finish for up to `timeout` seconds, then abort the rest."""
        self._accepting = False
        deadline = time.monotonic() + timeout
        while self._streams and time.monotonic() < deadline and self._dead is None:
            await asyncio.sleep(0.02)
        for request_id in list(self._streams):
            self._commands.put(_Abort(request_id))
        deadline = time.monotonic() + 2.0  # the aborts' final outputs reach their callers
        while self._streams and time.monotonic() < deadline and self._dead is None:
            await asyncio.sleep(0.02)
        self._commands.put(_Shutdown())
        for thread in self._threads:
            await asyncio.to_thread(thread.join, 10.0)
        self._threads.clear()
        self._grammar_threads.shutdown(wait=False, cancel_futures=True)
        if self._dead is None:
            self._dead = EngineDeadError("the engine is shut down")

    # -- requests -------------------------------------------------------------
    async def generate(self, prompt: PromptInput, params: SamplingParams, request_id: str) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs: cumulative RequestOutputs, at most one per step (the latest one if the
        caller is slower than the engine), the last with finished=True. Closing the iterator early (the client
        went away, a timeout) aborts the request; its KV blocks are freed at the engine's next step."""
        self._check_alive()
        if self.max_waiting_requests is not None and self.num_waiting >= self.max_waiting_requests:
            raise EngineOverloadedError(
                f"the server is overloaded: {self.num_waiting} requests are already waiting "
                f"(max_waiting_requests={self.max_waiting_requests}); try again later"
            )
        if request_id in self._streams:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        stream = _Stream()
        self._streams[request_id] = stream
        submitted = finished = False
        try:
            self._num_preparing += 1
            # Grammar compiles can take seconds: on their own threads, so they never hold up the
            # tokenization of other requests (which runs on the loop's default executor).
            executor = self._grammar_threads if params.structured_outputs is not None else None
            try:
                request = await asyncio.get_running_loop().run_in_executor(
                    executor, self.engine.make_request, prompt, params, request_id
                )
            finally:
                self._num_preparing -= 1
            self._check_alive()
            self._adds_sent += 1
            self._commands.put(_Add(request))
            submitted = True
            while True:
                await stream.event.wait()
                stream.event.clear()
                if stream.error is not None:
                    finished = True
                    raise stream.error
                output = stream.latest
                finished = output.finished
                yield output
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if submitted and not finished:
                self._commands.put(_Abort(request_id))

    async def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine is not running: {self._dead}")
        if not self._accepting:
            raise EngineDeadError("the engine is not running (not started, or shutting down)")

    # -- the engine thread ----------------------------------------------------
    def run_engine_loop(self) -> None:
        """The engine loop on the calling thread (after start(own_engine_thread=False)), until shutdown."""
        self._engine_loop()

    def _engine_loop(self) -> None:
        engine = self.engine
        try:
            while True:
                # Idle: wait until something arrives (waking now and then, so that signal handlers
                # run when this is the main thread). Busy: take whatever has arrived, then step.
                commands = engine.next_commands(self._commands)
                if commands is None:
                    continue
                for command in commands:
                    if isinstance(command, _Shutdown):
                        engine.shutdown()  # the model's other ranks, from the thread that runs its steps
                        self._send(_Shutdown())
                        return
                    self._handle_command(command)
                if engine.has_unfinished_requests():
                    self._run_step()
                self._stats = engine.stats()
        except BaseException as exc:  # a bug, or a rank of the model gone: every caller must hear of it, none may hang
            logger.exception("the engine loop failed")
            self._dead = exc
            engine.shutdown()
            self._loop.call_soon_threadsafe(self._fail_all, EngineDeadError(f"the engine loop failed: {exc!r}"))
            self._send(_Shutdown())

    def _handle_command(self, command) -> None:
        engine = self.engine
        if isinstance(command, _Add):
            self._adds_taken += 1
            request = command.request
            try:
                engine.submit(request)
            except ValueError as exc:
                self._send(_Failed([request.request_id], InvalidRequestError(str(exc))))
                return
            self._send(_Register(request))
        elif isinstance(command, _Abort):
            self._send(engine.abort_core(command.request_id))
        elif isinstance(command, StopOrder):
            engine.finish_sequence(command.seq_id, command.stop)

    def _run_step(self) -> None:
        try:
            step = self.engine.step_core()
        except ExecutorDiedError:
            raise  # the model is gone: the loop fails every request and the engine reports itself dead
        except RequestFailedError as exc:
            # The engine isolated the requests that failed (and aborted them); the rest go on.
            self._send(_Failed(exc.request_ids, exc))
            return
        except Exception as exc:
            # A step that fails leaves no trace: the requests in flight are aborted (their blocks freed) and
            # told why; the loop goes on serving new requests.
            logger.exception("an engine step failed; aborting the requests in flight")
            request_ids = self.engine.unfinished_request_ids()
            for request_id in request_ids:
                self.engine.abort_core(request_id)
            self._send(_Failed(request_ids, RuntimeError(f"the engine step failed: {exc!r}")))
            return
        self._send(step)

    def _send(self, item) -> None:
        """To the output stage: its own thread, or right here without the pipeline."""
        if self.pipeline:
            self._outputs.put(item)
        else:
            self._process_output(item)

    # -- the output thread ----------------------------------------------------
    def _output_loop(self) -> None:
        while True:
            item = self._outputs.get()
            if isinstance(item, _Shutdown):
                return
            try:
                self._process_output(item)
            except Exception as exc:  # never leave a caller waiting
                logger.exception("output processing failed")
                request_ids = [u.request_id for u in item.updates] if isinstance(item, CoreStep) else []
                for request_id in request_ids:
                    self._commands.put(_Abort(request_id))
                self._deliver_error(request_ids, RuntimeError(f"output processing failed: {exc!r}"))

    def _process_output(self, item) -> None:
        processor = self.engine.output_processor
        if isinstance(item, _Register):
            r = item.request
            processor.add_request(r.request_id, r.prompt, r.prompt_token_ids, r.sampling_params, r.arrival_time)
        elif isinstance(item, CoreStep):
            outputs, stops = processor.process(item)
            for order in stops:
                if self.pipeline:
                    self._commands.put(order)
                else:
                    self.engine.finish_sequence(order.seq_id, order.stop)
            if outputs:
                self._loop.call_soon_threadsafe(self._deliver, outputs)
        elif isinstance(item, _Failed):
            for request_id in item.request_ids:
                processor.drop(request_id)
            self._deliver_error(item.request_ids, item.error)

    def _deliver_error(self, request_ids: list[str], error: BaseException) -> None:
        if request_ids:
            self._loop.call_soon_threadsafe(self._deliver_failure, request_ids, error)

    # -- on the event loop ----------------------------------------------------
    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is not None:
                stream.latest = output
                stream.event.set()

    def _fail_all(self, error: BaseException) -> None:
        self._deliver_failure(list(self._streams), error)

    def _deliver_failure(self, request_ids: list[str], error: BaseException) -> None:
        for request_id in request_ids:
            stream = self._streams.get(request_id)
            if stream is not None:
                stream.error = error
                stream.event.set()
