"""From token ids to RequestOutputs: detokenization, stop strings, n > 1 groups, request metrics.

This is the third stage of the pipeline (tokenize -> compute -> detokenize). The engine's
core step (LLMEngine.step_core) hands over a CoreStep: plain data about which sequences got
which tokens. The OutputProcessor turns it into the callers' RequestOutputs. It never touches
the scheduler, so the async engine runs it on its own thread while the next forward pass runs;
a stop string it finds is returned as a finish order for the engine to carry out (in the
async engine, one step later: the extra token is dropped here).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tokenmill.sampling_params import SamplingParams


@dataclass
class SequenceUpdate:
    """What one step did to one sequence of a request, as plain data (no live engine objects)."""

    request_id: str  # the user's request id
    seq_id: str  # the scheduler's id of the sequence (the request id for sequence 0)
    seq_index: int
    new_token_ids: list[int]
    cumulative_logprob: float
    new_token_logprobs: list[float] = field(default_factory=list)  # raw logprob of each new token (when known)
    finish_reason: str | None = None  # "stop" | "length" | "abort" once the sequence ended
    stop_reason: int | str | None = None
    new_logprobs: list | None = None  # one dict per new token when params.logprobs is set
    prompt_logprobs: list | None = None  # the whole list, sent with the first output token (or an abort)
    first_scheduled_time: float | None = None
    # Speculative decoding totals of the sequence: drafts verified, and kept.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


@dataclass
class CoreStep:
    """One engine step's results."""

    updates: list[SequenceUpdate] = field(default_factory=list)
    # Outputs the engine completes itself (beam search results, aborted beam searches).
    finished_outputs: list[RequestOutput] = field(default_factory=list)
    time: float = 0.0  # time.monotonic() when the step's tokens were ready


@dataclass
class StopOrder:
    """A sequence the output side ended with a stop string: the engine must finish it too."""

    seq_id: str
    stop: str


@dataclass
class _Sequence:
    index: int
    detokenizer: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    sequences: dict[int, _Sequence] = field(default_factory=dict)
    prompt_logprobs: list | None = None

    @property
    def finished(self) -> bool:
        return len(self.sequences) == self.params.num_sequences and all(
            s.finish_reason is not None for s in self.sequences.values()
        )


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._requests: dict[str, _RequestState] = {}

    def add_request(
        self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams, arrival_time: float
    ) -> None:
        self._requests[request_id] = _RequestState(
            request_id, prompt, prompt_token_ids, params, RequestMetrics(arrival_time=arrival_time)
        )

    def drop(self, request_id: str) -> None:
        """Forget a request that failed (its caller is told by other means)."""
        self._requests.pop(request_id, None)

    def process(self, step: CoreStep) -> tuple[list[RequestOutput], list[StopOrder]]:
        """Apply a step's updates; one output per request that changed, and the stop strings found."""
        touched: dict[str, _RequestState] = {}
        stops: list[StopOrder] = []
        for update in step.updates:
            state = self._requests.get(update.request_id)
            if state is None:
                continue  # finished here already (a stop string), the engine not yet told
            stop = self._apply(state, update, step.time)
            if stop is not None:
                stops.append(stop)
            touched[state.request_id] = state
        outputs = []
        for state in touched.values():
            aborted = any(s.finish_reason == "abort" for s in state.sequences.values())
            if aborted:  # an aborted request ends whole, even sequences not yet forked off
                for seq in state.sequences.values():
                    seq.finish_reason = seq.finish_reason or "abort"
            finished = aborted or state.finished
            state.metrics.num_draft_tokens = sum(s.num_draft_tokens for s in state.sequences.values())
            state.metrics.num_accepted_tokens = sum(s.num_accepted_tokens for s in state.sequences.values())
            if finished:
                state.metrics.finished_time = step.time
                del self._requests[state.request_id]
            outputs.append(self._make_output(state, finished))
        outputs.extend(step.finished_outputs)
        return outputs, stops

    def _apply(self, state: _RequestState, update: SequenceUpdate, now: float) -> StopOrder | None:
        seq = state.sequences.get(update.seq_index)
        if seq is None:
            detok = None
            if self.tokenizer is not None:
                detok = IncrementalDetokenizer(self.tokenizer, state.prompt_token_ids, state.params)
            seq = _Sequence(update.seq_index, detok, logprobs=[] if state.params.logprobs is not None else None)
            state.sequences[update.seq_index] = seq
        if seq.finish_reason is not None:
            return None  # ended by a stop string; the token the engine made meanwhile is dropped
        metrics = state.metrics
        if metrics.first_scheduled_time is None:
            metrics.first_scheduled_time = update.first_scheduled_time
        if update.prompt_logprobs is not None:
            state.prompt_logprobs = update.prompt_logprobs
        if update.new_token_ids:
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            metrics.last_token_time = now
            seq.token_ids.extend(update.new_token_ids)
            if seq.logprobs is not None and update.new_logprobs:
                seq.logprobs.extend(update.new_logprobs)
        seq.cumulative_logprob = update.cumulative_logprob
        seq.finish_reason, seq.stop_reason = update.finish_reason, update.stop_reason
        seq.num_draft_tokens, seq.num_accepted_tokens = update.num_draft_tokens, update.num_accepted_tokens
        if seq.detokenizer is None or not update.new_token_ids:
            return None
        consumed_before = seq.detokenizer.num_tokens
        stop = seq.detokenizer.add_tokens(update.new_token_ids)
        if stop is None:
            return None
        # Tokens after the one that completed the stop string (several new tokens come at once with
        # speculative decoding) are dropped, as if the sequence had ended there.
        dropped = len(update.new_token_ids) - (seq.detokenizer.num_tokens - consumed_before)
        if dropped:
            del seq.token_ids[-dropped:]
            if seq.logprobs is not None and update.new_logprobs:
                del seq.logprobs[-dropped:]
            seq.cumulative_logprob -= sum(update.new_token_logprobs[-dropped:])
        # A stop string ends the sequence; if the same token also hit max_tokens or EOS, the stop string wins, as in vLLM.
        already_finished = seq.finish_reason is not None
        seq.finish_reason, seq.stop_reason = "stop", stop
        return None if already_finished else StopOrder(update.seq_id, stop)

    def _make_output(self, state: _RequestState, finished: bool) -> RequestOutput:
        params = state.params
        sequences = [state.sequences[i] for i in sorted(state.sequences)]
        if len(sequences) > params.n:  # best_of: the n of highest cumulative logprob
            sequences = sorted(sequences, key=lambda s: -s.cumulative_logprob)[: params.n]
        completions = [
            CompletionOutput(
                index=index,
                text=seq.detokenizer.output_text(seq.finish_reason is not None) if seq.detokenizer is not None else "",
                token_ids=list(seq.token_ids),
                cumulative_logprob=seq.cumulative_logprob,
                logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
            )
            for index, seq in enumerate(sequences)
        ]
        prompt_logprobs = None
        if params.prompt_logprobs is not None:
            prompt_logprobs = list(state.prompt_logprobs) if state.prompt_logprobs else [None]
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=completions,
            finished=finished,
            prompt_logprobs=prompt_logprobs,
            metrics=RequestMetrics(**vars(state.metrics)),
        )
