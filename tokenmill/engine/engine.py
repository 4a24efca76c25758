"""LLMEngine: add requests, step, get outputs. The one loop everything else drives."""

from __future__ import annotations

import itertools
import logging
import queue
import random
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NoReturn

from tokenmill.config import EngineConfig, resolve_device, resolve_dtype
from tokenmill.engine.kv_cache import RESERVED_BLOCKS, BlockPool, KVCacheManager
from tokenmill.engine.logprobs import LogprobsProcessor, check_token_controls
from tokenmill.engine.output_processor import CoreStep, OutputProcessor, SequenceUpdate
from tokenmill.engine.beam_search import BeamSearchGroup, beam_sampling_params
from tokenmill.engine.request import Request, RequestStatus, SequenceGroup
from tokenmill.engine.messages import ModelRunnerOutput, ScheduledChunk, SchedulerOutput
from tokenmill.engine.scheduler import Scheduler
from tokenmill.engine.speculation import make_proposer
from tokenmill.engine.structured_output import StructuredOutputManager
from tokenmill.errors import InvalidRequestError, PromptTooLongError, RequestFailedError
from tokenmill.executor import Executor, ExecutorDiedError, make_executor
from tokenmill.loader import load_model_source
from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.sampling_params import BeamSearchParams, SamplingParams, check_text
from tokenmill.spec_decode.metrics import SpecDecodeStats

logger = logging.getLogger(__name__)

PromptInput = str | Sequence[int] | dict


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_free_blocks: int
    num_preemptions: int
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # of those, tokens found cached
    spec_decode: SpecDecodeStats | None = None  # speculative decoding counters, when it is on


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        if config.parallel.data_parallel_size > 1:
            raise ValueError("an LLMEngine is one replica: data_parallel_size > 1 runs several behind LLM(...) or `tokenmill serve`")
        self.config = config
        self.device = resolve_device(config.device)
        source = load_model_source(config.model)
        self.model_name = source.name
        self.hf_config = source.hf_config
        self.eos_token_ids = frozenset(source.eos_token_ids)
        self.vocab_size = int(self.hf_config.vocab_size)
        self.dtype = resolve_dtype(config.model.dtype, self.device, source.checkpoint_dtype)

        model_max = source.context_length
        max_model_len = config.model.max_model_len or model_max
        if max_model_len > model_max:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's context length {model_max}")

        block_size = config.cache.block_size
        self.executor: Executor = make_executor(config, source, self.device, self.dtype, max_model_len)
        try:
            num_blocks = self.executor.determine_num_blocks()
            self.executor.init_kv_cache(num_blocks)
        except BaseException:
            self.executor.shutdown()
            raise

        capacity = (num_blocks - 1) * block_size
        if capacity < max_model_len:
            if config.model.max_model_len is not None:
                raise ValueError(
                    f"max_model_len {max_model_len} needs more KV cache than the {capacity} tokens allocated; "
                    "raise kv_cache_memory or lower max_model_len"
                )
            logger.warning("KV cache holds %d tokens: max_model_len lowered from %d", capacity, max_model_len)
            max_model_len = capacity
        sched = config.scheduler
        if not sched.enable_chunked_prefill and sched.max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"without chunked prefill, max_num_batched_tokens ({sched.max_num_batched_tokens}) "
                f"must be >= max_model_len ({max_model_len})"
            )
        self.max_model_len = max_model_len
        try:
            self.tokenizer = source.tokenizer  # built in a thread while the executor loaded the weights
        except BaseException:
            self.executor.shutdown()
            raise
        kv_cache = KVCacheManager(BlockPool(num_blocks), block_size, config.cache.enable_prefix_caching, RESERVED_BLOCKS)
        self.scheduler = Scheduler(sched, kv_cache)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._rng = random.Random(config.model.seed)
        self._ids = itertools.count()
        self._logprobs = LogprobsProcessor(self.tokenizer)
        # n > 1 / best_of and beam-search requests, by the user's request id, until all their sequences end.
        self._groups: dict[str, SequenceGroup] = {}
        self._structured: StructuredOutputManager | None = None  # made for the first structured_outputs request
        self._structured_lock = threading.Lock()
        self._proposer = make_proposer(config.speculative, self.max_model_len)
        logger.info(
            "loaded %s (%s, %s on %s); KV cache: %d blocks of %d tokens",
            self.model_name, self.hf_config.architectures[0], self.dtype, self.device, num_blocks, block_size,
        )

    # -- requests ---------------------------------------------------------
    def tokenize_prompt(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._check_token_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise InvalidRequestError("a prompt dict needs a 'prompt' or a 'prompt_token_ids' key")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this model was loaded without a tokenizer: give prompt_token_ids instead of text")
            try:
                check_text("the prompt", prompt)
            except ValueError as exc:
                raise InvalidRequestError(str(exc)) from None
            return prompt, self.tokenizer.encode(prompt)
        return None, self._check_token_ids(prompt)

    def _check_token_ids(self, token_ids) -> list[int]:
        try:
            ids = [int(t) for t in token_ids]
        except (TypeError, ValueError):
            raise InvalidRequestError("prompt_token_ids must be a list of integers") from None
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(f"token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        return ids

    def _servable_prompt(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        """Tokenize a prompt and check that it fits the context with room for one generated token."""
        text, token_ids = self.tokenize_prompt(prompt)
        if not token_ids:
            raise InvalidRequestError("the prompt is empty")
        if len(token_ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"the prompt has {len(token_ids)} tokens, but the context length is {self.max_model_len} "
                "tokens, which must also hold at least one generated token"
            )
        return text, token_ids

    def make_request(self, prompt: PromptInput, params: SamplingParams | None = None, request_id: str | None = None) -> Request:
        """Tokenize and check a request, ready for submit(). Touches no engine state but the structured-output
        compile cache, so the async engine runs it on a worker thread while the engine loop runs."""
        params = params or SamplingParams()
        bad_words_token_ids = check_token_controls(params, self.tokenizer, self.vocab_size)
        compiled_grammar = None
        if params.structured_outputs is not None:  # compiled (or found in the cache) before anything runs
            compiled_grammar = self.structured_output_manager().compile(params.structured_outputs)
        text, token_ids = self._servable_prompt(prompt)
        request_id = str(next(self._ids)) if request_id is None else request_id
        seed = params.seed if params.seed is not None else self._rng.getrandbits(62)
        request = Request(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=params,
            sampling_seed=seed,
            eos_token_ids=self.eos_token_ids,
            max_model_len=self.max_model_len,
            prompt=text,
            bad_words_token_ids=bad_words_token_ids,
            compiled_grammar=compiled_grammar,
        )
        if params.num_sequences > 1:  # the scheduler forks the other sequences off it once the prompt is in
            request.group = SequenceGroup(request_id, params.num_sequences, sequences=[request])
        return request

    def submit(self, request: Request) -> None:
        """Queue a request made by make_request (the engine loop's side of add_request)."""
        self._check_id_free(request.request_id)
        self.scheduler.add_request(request)
        if request.group is not None:
            self._groups[request.request_id] = request.group

    def _check_id_free(self, request_id: str) -> None:
        if request_id in self._groups or request_id in self.scheduler.requests:
            raise ValueError(f"request id {request_id!r} is already in use")

    def add_request(self, prompt: PromptInput, params: SamplingParams | None = None, request_id: str | None = None,
                    arrival_time: float | None = None) -> str:
        """arrival_time: when the request arrived (time.monotonic()), if before this call: a data-parallel
        front end's, so that queue time and time to first token include the hop to the replica."""
        request = self.make_request(prompt, params, request_id)
        if arrival_time is not None:
            request.arrival_time = arrival_time
        self.submit(request)
        self.output_processor.add_request(
            request.request_id, request.prompt, request.prompt_token_ids, request.sampling_params, request.arrival_time
        )
        return request.request_id

    def add_beam_search_request(self, prompt: PromptInput, params: BeamSearchParams, request_id: str | None = None) -> str:
        """Start a beam search (LLM.beam_search): its result is one finished RequestOutput whose outputs are
        the beam_width best hypotheses, best first (token_ids, text, cumulative_logprob, finish_reason)."""
        text, token_ids = self._servable_prompt(prompt)
        request_id = str(next(self._ids)) if request_id is None else request_id
        self._check_id_free(request_id)
        root = Request(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=beam_sampling_params(params),
            eos_token_ids=self.eos_token_ids,
            max_model_len=self.max_model_len,
            prompt=text,
        )
        group = BeamSearchGroup(request_id, root, params, min(params.max_tokens, self.max_model_len - len(token_ids)))
        self.scheduler.add_request(root)
        self._groups[request_id] = group
        return request_id

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort a request now; its final output (finish_reason "abort"), or None if it is not running."""
        outputs, _ = self.output_processor.process(self.abort_core(request_id))
        return next((o for o in outputs if o.request_id == request_id), None)

    def abort_core(self, request_id: str) -> CoreStep:
        """Free every sequence of a request; the updates that tell the output side."""
        group = self._groups.pop(request_id, None)
        if isinstance(group, BeamSearchGroup):
            group.abort(self.scheduler)
            return CoreStep(finished_outputs=[self._make_beam_output(group)], time=time.monotonic())
        seq_ids = [s.request_id for s in group.sequences] if group is not None else [request_id]
        updates = []
        for seq_id in seq_ids:
            request = self.scheduler.abort_request(seq_id)
            if request is not None:
                updates.append(self._update_of(request, new_tokens=0))
        return CoreStep(updates=updates, time=time.monotonic())

    def finish_sequence(self, seq_id: str, stop: str) -> None:
        """End a sequence whose text reached a stop string (found by the output side)."""
        request = self.scheduler.finish_request(seq_id, RequestStatus.FINISHED_STOPPED, stop)
        if request is not None:
            self._release_group_if_done(request)

    def _release_group_if_done(self, request: Request) -> None:
        group = request.group
        if group is not None and group.kind == "sample" and all(s.is_finished for s in group.sequences):
            self._groups.pop(group.request_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def idle(self) -> None:
        """Called between steps when there is none to run (the serving loop, while it waits): work that must
        happen between two passes, on the thread that runs them (the weights onto their huge-page copy)."""
        self.executor.idle()

    def next_commands(self, inbox: queue.SimpleQueue, idle_wait: float = 0.2) -> list | None:
        """A serving loop's commands for its next turn, from its inbox: with requests in flight, whatever has
        arrived (maybe nothing: it steps on); idle, the first to arrive and any behind it, or None after
        idle_wait seconds of nothing, once idle() has run (the loop goes round again, so that signal handlers
        run when it is the main thread). The async engine's loop and a data-parallel replica's both take theirs so."""
        commands = []
        if not self.has_unfinished_requests():
            try:
                commands.append(inbox.get(timeout=idle_wait))
            except queue.Empty:
                self.idle()
                return None
        while True:
            try:
                commands.append(inbox.get_nowait())
            except queue.Empty:
                return commands

    def unfinished_request_ids(self) -> list[str]:
        """The user's ids of every request with a sequence in the scheduler."""
        ids = dict.fromkeys(self._groups)
        for request in self.scheduler.requests.values():
            ids[self._user_request_id(request)] = None
        return list(ids)

    def stats(self) -> EngineStats:
        pool = self.scheduler.kv_cache.pool
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=pool.usage(),
            num_free_blocks=pool.num_free_blocks,
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_queries=self.scheduler.kv_cache.prefix_cache_queries,
            prefix_cache_hits=self.scheduler.kv_cache.prefix_cache_hits,
            spec_decode=self.scheduler.spec_stats.snapshot() if self._proposer is not None else None,
        )

    # -- the loop ---------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward pass, and return an output for each request that got a token.

        RequestFailedError: the step failed for the requests it names (aborted and forgotten); the
        others stay queued, and the next step goes on with them."""
        try:
            core = self.step_core()
        except RequestFailedError as exc:
            for request_id in exc.request_ids:
                self.output_processor.drop(request_id)
            raise
        outputs, stops = self.output_processor.process(core)
        for order in stops:
            self.finish_sequence(order.seq_id, order.stop)
        return outputs

    def step_core(self) -> CoreStep:
        """One step up to the sampled tokens: schedule, forward, sample, update the requests.
        Everything that turns tokens into text is left to the OutputProcessor."""
        scheduled = self.scheduler.schedule()
        if scheduled.is_empty:
            if self.scheduler.num_waiting and not self.scheduler.num_running:
                # Every request fits the cache alone (max_model_len <= capacity), so this is a bug, not a wait.
                raise RuntimeError("the scheduler could not admit any waiting request into an empty batch")
            return CoreStep(time=time.monotonic())
        requests = self.scheduler.requests
        start = time.monotonic()
        for chunk in scheduled.chunks:
            request = requests[chunk.request_id]
            if request.first_scheduled_time is None:
                request.first_scheduled_time = start
        try:
            self.executor.prepare_step(scheduled)  # copy-on-write of blocks shared by forked sequences; drafts
            sampled = self._compute(scheduled.chunks)
        except ExecutorDiedError:
            raise  # no rank to retry on: the engine is done
        except Exception as exc:
            self._fail_step(scheduled, exc)
        updated, _ = self.scheduler.update(scheduled, sampled.sampled_token_ids, sampled.sampled_logprobs)
        self._logprobs.record(scheduled.chunks, sampled, updated, self.scheduler.requests)
        if self._structured is not None:
            self._accept_structured(updated)
        self.executor.keep_only(self.scheduler.requests.keys())
        if self._proposer is not None:
            self._proposer.propose(self.scheduler.running)
        step = CoreStep(time=time.monotonic())
        beam_groups: list[BeamSearchGroup] = []
        for request in updated:
            group = request.group
            if isinstance(group, BeamSearchGroup):
                group.take_candidates(request)
                if all(g is not group for g in beam_groups):
                    beam_groups.append(group)
                continue
            step.updates.append(self._update_of(request, new_tokens=request.num_new_output_tokens))
            if request.is_finished:
                self._release_group_if_done(request)
        for group in beam_groups:
            if group.ready():
                group.advance(self.scheduler, self.eos_token_ids)
                if group.finished:
                    step.finished_outputs.append(self._make_beam_output(group))
        return step

    def _compute(self, chunks: list[ScheduledChunk]) -> ModelRunnerOutput:
        """The step's tensor work: grammar masks, forward pass, sampling. It changes no request state
        (only KV slots the chunks own), so a failed step can be re-run on parts of its batch."""
        if self._structured is None:
            return self.executor.execute_model(chunks)
        bitmask = self._structured.bitmask(chunks, self.scheduler.requests)
        return self.executor.execute_model(chunks, grammar_bitmask=bitmask)

    def _failing_chunks(self, chunks: list[ScheduledChunk]) -> list[ScheduledChunk]:
        """The chunks of a failed batch that fail on their own, found by re-running halves (bisection:
        about 2 log2(B) small passes for one bad request). If each half passes alone, the failure
        belongs to the batch as a whole, and every chunk is blamed."""
        if len(chunks) == 1:
            return chunks
        half = len(chunks) // 2
        failing: list[ScheduledChunk] = []
        for part in (chunks[:half], chunks[half:]):
            try:
                self._compute(part)
            except ExecutorDiedError:
                raise
            except Exception:  # noqa: BLE001 - a probe: the failure is what we are looking for
                failing.extend(self._failing_chunks(part))
        return failing or chunks

    def _fail_step(self, scheduled: SchedulerOutput, exc: Exception) -> NoReturn:
        """A step whose tensor work raised: fail only the requests that fail on their own, recompute the rest.

        Every request of the step goes back to the front of the queue to be recomputed (the failed
        pass may have left the blocks it registered in the prefix cache unwritten, and the probes
        wrote their slots with partial batches), then the failing requests are aborted and
        RequestFailedError names them. The others' outputs stay exactly what they would have been.
        """
        failing = self._failing_chunks(scheduled.chunks)
        requests = self.scheduler.requests
        request_ids = list(dict.fromkeys(self._user_request_id(requests[c.request_id]) for c in failing if c.request_id in requests))
        logger.error("an engine step failed; failing requests %s and recomputing the other %d of the step",
                     request_ids, len(scheduled.chunks) - len(failing), exc_info=exc)
        self.scheduler.requeue_failed_step(scheduled)
        self.executor.forget(c.request_id for c in scheduled.chunks)
        for request_id in request_ids:
            self.abort_core(request_id)
        raise RequestFailedError(request_ids, exc) from exc

    @staticmethod
    def _user_request_id(request: Request) -> str:
        return request.group.request_id if request.group is not None else request.request_id

    @staticmethod
    def _update_of(request: Request, new_tokens: int) -> SequenceUpdate:
        """A request's last `new_tokens` tokens (and its state) as plain data for the output side."""
        params = request.sampling_params
        new_ids = request.output_token_ids[len(request.output_token_ids) - new_tokens :] if new_tokens else []
        first_output = new_tokens and request.num_output_tokens == new_tokens
        return SequenceUpdate(
            request_id=LLMEngine._user_request_id(request),
            seq_id=request.request_id,
            seq_index=request.seq_index,
            new_token_ids=new_ids,
            cumulative_logprob=request.cumulative_logprob,
            new_token_logprobs=request.new_token_logprobs[-new_tokens:] if new_tokens else [],
            finish_reason=request.status.finish_reason,
            stop_reason=request.stop_reason,
            new_logprobs=request.output_logprobs[-new_tokens:] if new_tokens and params.logprobs is not None else None,
            prompt_logprobs=(
                list(request.prompt_logprobs)
                if params.prompt_logprobs is not None and (first_output or request.is_finished)
                else None
            ),
            first_scheduled_time=request.first_scheduled_time,
            num_draft_tokens=request.num_draft_tokens,
            num_accepted_tokens=request.num_accepted_tokens,
        )

    def shutdown(self) -> None:
        """Stop the model's other ranks, if it has any (with one rank there is nothing to stop)."""
        self.executor.shutdown()

    def _make_beam_output(self, group: BeamSearchGroup) -> RequestOutput:
        self._groups.pop(group.request_id, None)
        completions = []
        for index, hyp in enumerate(group.best()):
            text = self.tokenizer.decode(hyp.token_ids, skip_special_tokens=True) if self.tokenizer is not None else ""
            completions.append(
                CompletionOutput(
                    index=index,
                    text=text,
                    token_ids=list(hyp.token_ids),
                    cumulative_logprob=hyp.cum_logprob,
                    finish_reason=hyp.finish_reason,
                    stop_reason=hyp.stop_reason,
                )
            )
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.root.prompt,
            prompt_token_ids=group.root.prompt_token_ids,
            outputs=completions,
            finished=True,
        )

    def structured_output_manager(self) -> StructuredOutputManager:
        with self._structured_lock:  # make_request may run on several worker threads at once
            if self._structured is None:
                so = self.config.structured_outputs
                self._structured = StructuredOutputManager(
                    self.tokenizer, self.vocab_size, sorted(self.eos_token_ids),
                    compile_timeout=so.grammar_compile_timeout, cache_bytes=so.grammar_cache_bytes,
                )
            return self._structured

    def _accept_structured(self, updated: list[Request]) -> None:
        """Advance each constrained request's grammar by its new tokens; one whose grammar has ended (took EOS) stops."""
        for request in updated:
            if request.sampling_params.structured_outputs is None:
                continue
            new_tokens = request.output_token_ids[request.num_output_tokens - request.num_new_output_tokens :]
            if not any([self._structured.accept(request, token) for token in new_tokens]):
                continue
            if not request.is_finished:  # ignore_eos or min_tokens kept it going: the grammar ends it
                self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
            elif request.status == RequestStatus.FINISHED_LENGTH:  # the last allowed token also hit max_tokens
                request.status = RequestStatus.FINISHED_STOPPED
