"""DataParallelFrontEnd: what the offline and the serving front ends share.

It loads only the model's tokenizer and metadata (load_model_source builds no model), starts the
replicas, and keeps the book: which replica holds each request, the router's loads, each replica's
latest stats, and which replicas are gone. It is not thread-safe: each front end calls it from one
thread (the caller's, or the event loop's).
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from tokenmill.config import EngineConfig
from tokenmill.engine.dp.messages import AbortRequest, AddRequest, ReplicaUpdate
from tokenmill.engine.dp.pool import ReplicaPool
from tokenmill.engine.dp.routing import Router
from tokenmill.engine.engine import EngineStats
from tokenmill.errors import EngineDeadError, InvalidRequestError, RequestFailedError
from tokenmill.loader import load_model_source
from tokenmill.outputs import RequestOutput
from tokenmill.spec_decode.metrics import SpecDecodeStats

if TYPE_CHECKING:
    from tokenmill.engine.dp.ray_pool import RayReplicaPool

logger = logging.getLogger(__name__)


@dataclass
class TakenUpdate:
    """A replica's update as the front end's callers see it: outputs, and each failed request's error."""

    outputs: list[RequestOutput] = field(default_factory=list)
    errors: dict[str, BaseException] = field(default_factory=dict)


class DataParallelFrontEnd:
    def __init__(self, config: EngineConfig) -> None:
        size = config.parallel.data_parallel_size
        if size < 2:
            raise ValueError(f"a data-parallel front end needs data_parallel_size >= 2, got {size}; one engine is an LLMEngine")
        self.config = config
        source = load_model_source(config.model)  # the tokenizer and the model's metadata, no weights
        self.model_name = source.name
        self.tokenizer = source.tokenizer
        self.eos_token_ids = frozenset(source.eos_token_ids)
        self.vocab_size = int(source.hf_config.vocab_size)
        self.pool = make_replica_pool(config)
        ready = self.pool.wait_ready()
        self.num_replicas = size
        self.max_model_len = min(r.max_model_len for r in ready)
        self.dtype = ready[0].dtype
        self.device = ready[0].device
        self._usable_blocks = [r.num_usable_blocks for r in ready]
        self._stats: list[EngineStats] = [r.stats for r in ready]
        self.router = Router(size, config.cache.block_size)
        self._owner: dict[str, int] = {}  # request id -> the replica that holds it
        self._adds_sent = [0] * size
        self._adds_taken = [0] * size
        self._ids = itertools.count()
        self._death: str | None = None  # why the front end stopped serving (a replica died)

    # -- requests -------------------------------------------------------------------------------
    def new_request_id(self, request_id: str | None) -> str:
        if request_id is None:
            request_id = str(next(self._ids))
            while request_id in self._owner:
                request_id = str(next(self._ids))
        elif request_id in self._owner:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        return request_id

    def check_alive(self) -> None:
        if self._death is not None:
            raise EngineDeadError(f"the engine is not running: {self._death}")

    def dispatch(self, prompt: Any, params: Any, request_id: str, *, stream: bool, beam_search: bool = False,
                 replica: int | None = None) -> int:
        """Send a request to `replica`, or to the one the router picks; the replica's index."""
        self.check_alive()
        if replica is None:
            replica = self.router.choose(prompt, [i for i in range(self.num_replicas) if self.pool.is_alive(i)])
        command = AddRequest(request_id, prompt, params, time.monotonic(), stream=stream, beam_search=beam_search)
        if not self.pool.send(replica, command):
            raise EngineDeadError(f"the engine is not running: data-parallel replica {replica} is gone")
        self._owner[request_id] = replica
        self._adds_sent[replica] += 1
        self.router.started(replica, prompt)
        logger.debug("request %s to data-parallel replica %d (outstanding: %s)", request_id, replica, self.router.load)
        return replica

    def abort(self, request_id: str) -> None:
        """Ask the request's replica to abort it; its final output (finish_reason "abort") comes back."""
        replica = self._owner.get(request_id)
        if replica is not None:
            self.pool.send(replica, AbortRequest(request_id))

    def _done(self, request_id: str) -> None:
        replica = self._owner.pop(request_id, None)
        if replica is not None:
            self.router.finished(replica)

    # -- what the replicas send -----------------------------------------------------------------
    def take_update(self, replica: int, update: ReplicaUpdate) -> TakenUpdate:
        taken = TakenUpdate(outputs=update.outputs)
        for output in update.outputs:
            if output.finished:
                self._done(output.request_id)
        for request_id, error in update.rejected:
            self._done(request_id)
            taken.errors[request_id] = error
        for request_ids, message in update.failed:
            error = RequestFailedError(request_ids, RuntimeError(f"on data-parallel replica {replica}: {message}"))
            for request_id in request_ids:
                self._done(request_id)
                taken.errors[request_id] = error
        if update.stats is not None:
            self._stats[replica] = update.stats
        self._adds_taken[replica] = update.adds_taken
        return taken

    def take_death(self, replica: int, reason: str) -> tuple[list[str], EngineDeadError]:
        """A replica is gone: the front end stops serving; its requests (returned) fail with the error returned."""
        message = f"data-parallel replica {replica} died: {reason}"
        self.stop_serving(message)
        lost = [request_id for request_id, owner in self._owner.items() if owner == replica]
        for request_id in lost:
            self._done(request_id)
        # Its gauges no longer hold anything; its counters keep their last values.
        self._stats[replica] = replace(self._stats[replica], num_running=0, num_waiting=0, kv_cache_usage=0.0)
        return lost, EngineDeadError(f"{message}; its requests failed")

    # -- state ------------------------------------------------------------------------------------
    @property
    def errored(self) -> bool:
        return self._death is not None

    def replica_stats(self) -> list[EngineStats]:
        """Each replica's stats as of its last update (a dead one's with nothing running)."""
        return list(self._stats)

    def replica_alive(self) -> list[bool]:
        return [self.pool.is_alive(i) for i in range(self.num_replicas)]

    def stats(self) -> EngineStats:
        """The replicas' stats together: running, waiting, free blocks and counters summed; KV usage as the
        fraction of all replicas' blocks in use (the block-weighted mean of theirs)."""
        return aggregate_stats(self._stats, self._usable_blocks)

    @property
    def num_in_transit(self) -> int:
        """Requests sent that their replica has not taken yet."""
        return sum(sent - taken for sent, taken in zip(self._adds_sent, self._adds_taken))

    def has_unfinished_requests(self) -> bool:
        return bool(self._owner)

    def stop_serving(self, reason: str) -> None:
        """Take no more requests (the first reason given is the one callers hear)."""
        if self._death is None:
            self._death = reason

    def shutdown(self) -> None:
        self.pool.shutdown()
        self.stop_serving("the engine is shut down")


def make_replica_pool(config: EngineConfig) -> ReplicaPool | RayReplicaPool:
    """The replicas: Ray actors on a Ray cluster's nodes with the "ray" backend, else processes on this machine."""
    if config.parallel.executor_backend == "ray":
        from tokenmill.engine.dp.ray_pool import RayReplicaPool

        return RayReplicaPool(config)
    return ReplicaPool(config)


def aggregate_stats(stats: list[EngineStats], usable_blocks: list[int]) -> EngineStats:
    total_blocks = sum(usable_blocks)
    used = sum(s.kv_cache_usage * n for s, n in zip(stats, usable_blocks))
    spec = [s.spec_decode for s in stats if s.spec_decode is not None]
    return EngineStats(
        num_running=sum(s.num_running for s in stats),
        num_waiting=sum(s.num_waiting for s in stats),
        kv_cache_usage=used / total_blocks if total_blocks else 0.0,
        num_free_blocks=sum(s.num_free_blocks for s in stats),
        num_preemptions=sum(s.num_preemptions for s in stats),
        prefix_cache_queries=sum(s.prefix_cache_queries for s in stats),
        prefix_cache_hits=sum(s.prefix_cache_hits for s in stats),
        spec_decode=_sum_spec_stats(spec) if spec else None,
    )


def _sum_spec_stats(parts: list[SpecDecodeStats]) -> SpecDecodeStats:
    per_pos = [0] * max(len(p.accepted_per_pos) for p in parts)
    for part in parts:
        for position, count in enumerate(part.accepted_per_pos):
            per_pos[position] += count
    return SpecDecodeStats(
        num_drafts=sum(p.num_drafts for p in parts),
        num_draft_tokens=sum(p.num_draft_tokens for p in parts),
        num_accepted_tokens=sum(p.num_accepted_tokens for p in parts),
        accepted_per_pos=per_pos,
    )
