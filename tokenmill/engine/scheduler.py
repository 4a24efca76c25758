"""Token-budget scheduler (vLLM v1 style): no prefill or decode phase, only a budget.

Each step hands out max_num_batched_tokens: first to running requests in order (a decode
costs one token, an unfinished prompt takes the next chunk), then to waiting requests in
FCFS order. When KV blocks run out, the running request admitted last is preempted: its
blocks are freed and it goes back to the front of the queue, to be recomputed later
(prompt + output so far), which gives the same tokens it would have produced.

With prefix caching, a waiting request that holds no KV (new, or preempted) is admitted
after its longest cached prefix of full blocks: it starts with num_computed_tokens past
them, and the blocks it reuses from the free list count against the free blocks. A
preempted request usually finds its own blocks again, if they were not evicted.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from tokenmill.config import SchedulerConfig
from tokenmill.engine.kv_cache import KVCacheManager
from tokenmill.engine.messages import ScheduledChunk, SchedulerOutput
from tokenmill.engine.request import Request, RequestStatus, sequence_seed
from tokenmill.spec_decode.metrics import SpecDecodeStats
from tokenmill.spec_decode.tree import tree_depth


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.spec_stats = SpecDecodeStats()

    # -- queue management -------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)
        if request.awaiting_fork and request.num_tokens - 1 <= request.num_computed_tokens:
            self._fork_sequences(request)  # a one-token prompt: nothing to prefill before the split

    # -- forked sequences (n > 1 / best_of, beam search) ------------------
    def fork_request(self, parent: Request, child: Request) -> None:
        """Add `child`, a copy of `parent`'s tokens, sharing the parent's KV blocks; it is queued right after the parent."""
        if child.request_id in self.requests:
            raise ValueError(f"request id {child.request_id!r} is already in use")
        self.kv_cache.fork(parent, child)
        child.num_computed_tokens = parent.num_computed_tokens
        self.requests[child.request_id] = child
        if parent.status == RequestStatus.RUNNING:
            child.status = RequestStatus.RUNNING
            self.running.insert(self.running.index(parent) + 1, child)
        else:
            child.status = parent.status
            self.waiting.insert(self.waiting.index(parent) + 1, child)

    def _fork_sequences(self, parent: Request) -> None:
        """Split an n > 1 / best_of request into its sequences; each gets its own random stream."""
        group = parent.group
        group.forked = True
        for index in range(group.size - 1, 0, -1):  # inserted right after the parent: last first keeps them in order
            child = parent.fork(group.child_id(index), index, sequence_seed(parent.sampling_seed, index))
            self.fork_request(parent, child)
            group.sequences.append(child)
        group.sequences[1:] = sorted(group.sequences[1:], key=lambda r: r.seq_index)

    def _last_idle(self) -> int | None:
        """Index in running of the last request with nothing to compute (a beam waiting for its siblings)."""
        for i in range(len(self.running) - 1, -1, -1):
            if self._num_new_tokens(self.running[i]) == 0:
                return i
        return None

    @staticmethod
    def _num_new_tokens(request: Request) -> int:
        """Tokens of the request without KV; a request about to fork holds its last prompt token back."""
        return request.num_tokens - request.num_computed_tokens - (1 if request.awaiting_fork else 0)

    def abort_request(self, request_id: str) -> Request | None:
        return self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    def finish_request(self, request_id: str, status: RequestStatus, stop_reason: int | str | None = None) -> Request | None:
        """End a request from outside a step (an abort, a stop string): free its blocks at once."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.kv_cache.free(request)
        request.status = status
        if stop_reason is not None:
            request.stop_reason = stop_reason
        return request

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # -- one step ---------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        preempted: list[Request] = []

        scheduled_drafts: dict[str, list[int]] = {}
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(self._num_new_tokens(request), budget)
            if num_new == 0:  # a beam waiting for its siblings' candidates
                index += 1
                continue
            # A decode verifies the request's drafts in the same pass: they take budget and KV slots too.
            # (A prefix of a tree's drafts is a tree: spec_decode/tree.py keeps parents before children.)
            drafts = request.spec_token_ids[: budget - 1] if num_new == 1 else []
            parents = request.spec_parents[: len(drafts)]
            request.spec_token_ids, request.spec_parents = [], []
            if drafts and self.kv_cache.allocate_slots(request, 1 + len(drafts)):
                scheduled.append((request, 1 + len(drafts)))
                scheduled_drafts[request.request_id] = (drafts, parents)
                budget -= 1 + len(drafts)
                index += 1
                continue
            while not self.kv_cache.allocate_slots(request, num_new):
                idle = self._last_idle()
                if idle is not None:  # a beam waiting for its siblings goes first (its group keeps its candidates)
                    victim = self.running.pop(idle)
                    index -= idle < index
                    self._preempt(victim, to_front=False)
                    preempted.append(victim)
                    continue
                victim = self.running.pop()  # lowest priority: admitted last
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            else:
                scheduled.append((request, num_new))
                budget -= num_new
                index += 1
                continue
            break  # the request itself was preempted: it was the last one running

        # New work only when nothing had to be preempted: memory is tight otherwise.
        if not preempted:
            while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
                request = self.waiting[0]
                # Prefix caching: a request without KV starts after its longest cached prefix
                # (looked up again on each try: what is cached changes while it waits).
                cached = self.kv_cache.get_computed_blocks(request)
                num_cached = len(cached) * self.kv_cache.block_size if cached else 0
                num_new = self._num_new_tokens(request) - num_cached
                if num_new > budget and not self.config.enable_chunked_prefill:
                    break
                num_new = min(num_new, budget)
                if not self.kv_cache.allocate_slots(request, num_new, cached):
                    idle = self._last_idle()
                    if scheduled or idle is None:
                        break
                    # Nothing runs but beams waiting for this one, and they hold the memory it needs:
                    # preempt one (its candidates are kept by its group) to the back of the queue.
                    victim = self.running.pop(idle)
                    self._preempt(victim, to_front=False)
                    preempted.append(victim)
                    continue
                self.waiting.popleft()
                request.num_computed_tokens += num_cached
                request.status = RequestStatus.RUNNING
                self.running.append(request)
                scheduled.append((request, num_new))
                budget -= num_new

        chunks = [self._make_chunk(request, num_new, *scheduled_drafts.get(request.request_id, ([], []))) for request, num_new in scheduled]
        return SchedulerOutput(
            chunks=chunks,
            preempted_request_ids=[r.request_id for r in preempted],
            block_copies=self.kv_cache.take_block_copies(),
        )

    def _make_chunk(self, request: Request, num_new: int, drafts: list[int], parents: list[int]) -> ScheduledChunk:
        start = request.num_computed_tokens
        end = start + num_new - len(drafts)
        return ScheduledChunk(
            request_id=request.request_id,
            token_ids=request.all_token_ids[start:end] + drafts,
            start_pos=start,
            block_ids=self.kv_cache.get_block_ids(request.request_id),
            sample=end == request.num_tokens,
            sampling_params=request.sampling_params,
            sampling_seed=request.sampling_seed,
            output_index=request.num_output_tokens,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=request.output_token_ids,
            banned_token_ids=self._banned_token_ids(request) if end == request.num_tokens else (),
            bad_words_token_ids=request.bad_words_token_ids,
            spec_token_ids=drafts,
            spec_parents=parents,
        )

    @staticmethod
    def _banned_token_ids(request: Request) -> tuple[int, ...]:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            return ()
        banned = set(params.stop_token_ids)
        if not params.ignore_eos:
            banned |= request.eos_token_ids
        return tuple(sorted(banned))

    def requeue_failed_step(self, output: SchedulerOutput) -> None:
        """Undo a step whose forward pass failed: its requests go back to the front of the queue, in
        order, to be recomputed (as a preemption), and the blocks it registered in the prefix cache
        for tokens it never computed leave the cache, so no later request reads unwritten KV."""
        scheduled = {c.request_id for c in output.chunks}
        for chunk in output.chunks:
            request = self.requests.get(chunk.request_id)
            if request is not None:
                self.kv_cache.uncache_from(request, chunk.start_pos)
        requeued = [r for r in self.running if r.request_id in scheduled]
        self.running = [r for r in self.running if r.request_id not in scheduled]
        for request in reversed(requeued):
            self._preempt(request)

    def _preempt(self, request: Request, to_front: bool = True) -> None:
        self.kv_cache.free(request)
        request.num_computed_tokens = 0
        request.spec_token_ids, request.spec_parents = [], []
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        if to_front:
            self.waiting.appendleft(request)
        else:
            self.waiting.append(request)

    def update(
        self,
        output: SchedulerOutput,
        sampled_token_ids: Sequence[list[int] | int | None],
        sampled_logprobs: Sequence[list[float]] | None = None,
    ) -> tuple[list[Request], list[Request]]:
        """Apply a step's results: per chunk, the tokens it sampled (a list, or one int, or None / [] for a
        chunk that samples nothing) and their raw logprobs. The one place a step changes request state.

        A chunk with drafts keeps only the KV of the drafts kept (num_computed_tokens stops after them;
        the slots of the others are overwritten later, and their blocks were never offered to the prefix
        cache, which registers only blocks of the request's real tokens). The tokens are appended one by
        one with a stop check after each, so a stop token or max_tokens inside a run ends the request there.
        Returns (requests that got tokens, each with num_new_output_tokens set; requests that finished).
        """
        if len(sampled_token_ids) != len(output.chunks):
            raise ValueError(f"got {len(sampled_token_ids)} sampled token lists for {len(output.chunks)} scheduled chunks")
        updated: list[Request] = []
        finished: list[Request] = []
        for i, chunk in enumerate(output.chunks):
            request = self.requests.get(chunk.request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            tokens = sampled_token_ids[i]
            tokens = [] if tokens is None else [tokens] if isinstance(tokens, int) else tokens
            num_drafts = len(chunk.spec_token_ids)
            num_rejected = num_drafts - (len(tokens) - 1) if num_drafts else 0
            request.num_computed_tokens += len(chunk.token_ids) - num_rejected
            if request.awaiting_fork and request.num_computed_tokens == request.num_tokens - 1:
                self._fork_sequences(request)
            if not chunk.sample:
                continue
            if not tokens:
                raise ValueError(f"no sampled token for request {chunk.request_id!r}, whose chunk samples")
            if num_drafts:
                request.num_draft_tokens += num_drafts
                request.num_accepted_tokens += num_drafts - num_rejected
                self.spec_stats.record(num_drafts, num_drafts - num_rejected, tree_depth(chunk.spec_parents))
            logprobs = sampled_logprobs[i] if sampled_logprobs is not None else None
            request.num_new_output_tokens = 0
            request.new_token_logprobs = []
            for j, token_id in enumerate(tokens):
                request.append_output_token(token_id)
                request.num_new_output_tokens += 1
                if logprobs:
                    request.cumulative_logprob += logprobs[j]
                    request.new_token_logprobs.append(logprobs[j])
                if request.check_stop():
                    finished.append(request)
                    break
            updated.append(request)
        if finished:
            for request in finished:
                self.kv_cache.free(request)
                del self.requests[request.request_id]
            self.running = [r for r in self.running if not r.is_finished]
        return updated, finished
