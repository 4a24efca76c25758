"""AsyncDataParallelEngine: AsyncLLMEngine's interface over N replica processes (`tokenmill serve -dp N`).

generate() sends the request to the replica the router picks (fewest outstanding requests, then the
replica that last took the same first KV block of prompt tokens) and streams its cumulative outputs;
closing the stream early aborts the request on that replica. A collector loop (the main thread under
`tokenmill serve`, as the single engine's loop is) waits on every replica's pipe and process at once and
hands what arrives to the event loop, which alone keeps the book.

The replica's LLMEngine checks each request as it does on one engine (make_request): a request it
refuses fails its stream with the same InvalidRequestError, before any output, so the server answers the
same 400. A replica that dies fails the requests it held with EngineDeadError (503), and the front end
stops taking requests (/health answers 503); requests on the other replicas run to their end.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from tokenmill.config import EngineConfig
from tokenmill.engine.dp.front_end import DataParallelFrontEnd
from tokenmill.engine.dp.messages import ReplicaDied, ReplicaFatal, ReplicaUpdate
from tokenmill.engine.engine import EngineStats, PromptInput
from tokenmill.errors import EngineDeadError, EngineOverloadedError, InvalidRequestError
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Seconds the collector waits for the replicas before it looks at its stop flag again.
_POLL_S = 0.2


@dataclass(eq=False)
class _Stream:
    """One request's outputs as its caller sees them: the latest (cumulative) output, or an error."""

    event: asyncio.Event = field(default_factory=asyncio.Event)
    latest: RequestOutput | None = None
    error: BaseException | None = None


class AsyncDataParallelEngine:
    def __init__(self, config: EngineConfig, *, max_waiting_requests: int | None = None) -> None:
        if max_waiting_requests is not None and max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be >= 1, got {max_waiting_requests}")
        self.front = DataParallelFrontEnd(config)
        self.max_waiting_requests = max_waiting_requests
        self._streams: dict[str, _Stream] = {}  # event-loop thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop = threading.Event()
        self._collecting = threading.Event()  # run_engine_loop has begun (on whichever thread)
        self._collected = threading.Event()  # ... and ended
        self._accepting = False
        self.started = threading.Event()  # set once start() has run (a caller-run collector loop waits for it)

    # -- what the server reads ------------------------------------------------------------------
    @property
    def model_name(self) -> str:
        return self.front.model_name

    @property
    def tokenizer(self):
        return self.front.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.front.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.front.vocab_size

    @property
    def num_replicas(self) -> int:
        return self.front.num_replicas

    @property
    def is_running(self) -> bool:
        return self._accepting and not self.front.errored

    @property
    def errored(self) -> bool:
        return self.front.errored

    def stats(self) -> EngineStats:
        """The replicas' stats together (see DataParallelFrontEnd.stats)."""
        return self.front.stats()

    def replica_stats(self) -> list[EngineStats]:
        return self.front.replica_stats()

    def replica_alive(self) -> list[bool]:
        return self.front.replica_alive()

    @property
    def num_waiting(self) -> int:
        """Requests not yet running: on their way to a replica, or queued there."""
        return self.front.num_in_transit + self.front.stats().num_waiting

    # -- life cycle -----------------------------------------------------------------------------
    async def start(self, own_engine_thread: bool = True) -> None:
        """Start taking requests. With own_engine_thread=False the collector loop is left to the caller,
        who runs run_engine_loop() (AsyncLLMEngine's spelling, so `tokenmill serve` drives both alike)."""
        if self._loop is not None:
            return
        self._loop = asyncio.get_running_loop()
        if own_engine_thread:
            self._collecting.set()
            threading.Thread(target=self.run_engine_loop, name="tokenmill-dp-collector", daemon=True).start()
        self._accepting = True
        self.started.set()

    def run_engine_loop(self) -> None:
        """Wait on the replicas and hand what they send to the event loop, until shutdown."""
        self._collecting.set()
        try:
            while not self._stop.is_set():
                events = self.front.pool.poll(timeout=_POLL_S)
                if events:
                    self._loop.call_soon_threadsafe(self._take, events)
        except BaseException as exc:  # a bug: every caller must hear of it, none may hang
            logger.exception("the data-parallel collector failed")
            self._loop.call_soon_threadsafe(self._fail_everything, f"the data-parallel collector failed: {exc!r}")
        finally:
            self._collected.set()

    async def shutdown(self, timeout: float = 0.0) -> None:
        """Stop taking requests; let in-flight ones finish for up to `timeout` seconds, then abort the rest."""
        self._accepting = False
        deadline = time.monotonic() + timeout
        while self._streams and time.monotonic() < deadline and not self.front.errored:
            await asyncio.sleep(0.02)
        for request_id in list(self._streams):
            self.front.abort(request_id)
        deadline = time.monotonic() + 2.0  # the aborts' final outputs reach their callers
        while self._streams and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        self._stop.set()
        if self._collecting.is_set():  # the pipes stay open until the collector has stopped reading them
            await asyncio.to_thread(self._collected.wait, 10.0)
        await asyncio.to_thread(self.front.shutdown)
        self._fail_everything("the engine is shut down")

    # -- requests -------------------------------------------------------------------------------
    async def generate(self, prompt: PromptInput, params: SamplingParams, request_id: str) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs: cumulative RequestOutputs, at most one per step (the latest one if the
        caller is slower than the replica), the last with finished=True. Closing the iterator early aborts
        the request on its replica."""
        self._check_alive()
        if self.max_waiting_requests is not None and self.num_waiting >= self.max_waiting_requests:
            raise EngineOverloadedError(
                f"the server is overloaded: {self.num_waiting} requests are already waiting "
                f"(max_waiting_requests={self.max_waiting_requests}); try again later"
            )
        if request_id in self._streams:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        self.front.new_request_id(request_id)  # refuses an id a replica still holds
        stream = _Stream()
        self._streams[request_id] = stream
        submitted = finished = False
        try:
            self.front.dispatch(prompt, params, request_id, stream=True)
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
                self.front.abort(request_id)

    async def abort(self, request_id: str) -> None:
        self.front.abort(request_id)

    def _check_alive(self) -> None:
        self.front.check_alive()
        if not self._accepting:
            raise EngineDeadError("the engine is not running (not started, or shutting down)")

    # -- on the event loop ----------------------------------------------------------------------
    def _take(self, events: list[tuple[int, object]]) -> None:
        for replica, message in events:
            if isinstance(message, ReplicaUpdate):
                taken = self.front.take_update(replica, message)
                for output in taken.outputs:
                    stream = self._streams.get(output.request_id)
                    if stream is not None:
                        stream.latest = output
                        stream.event.set()
                self._fail(taken.errors.items())
            elif isinstance(message, (ReplicaDied, ReplicaFatal)):
                reason = message.reason if isinstance(message, ReplicaDied) else f"its engine failed: {message.error!r}"
                lost, error = self.front.take_death(replica, reason)
                self._fail((request_id, error) for request_id in lost)

    def _fail(self, failures) -> None:
        for request_id, error in failures:
            stream = self._streams.get(request_id)
            if stream is not None:
                stream.error = error
                stream.event.set()

    def _fail_everything(self, reason: str) -> None:
        """No replica will answer any more: every waiting caller is told."""
        self.front.stop_serving(reason)
        error = EngineDeadError(f"the engine is not running: {reason}")
        self._fail((request_id, error) for request_id in list(self._streams))
