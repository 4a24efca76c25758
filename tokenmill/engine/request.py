"""A request's state as the scheduler sees it: token ids and how many of them have KV
(a prefix-cache hit starts a request with num_computed_tokens > 0)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from tokenmill.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def is_finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)

    @property
    def finish_reason(self) -> str | None:
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
        }.get(self)


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    # The seed of this request's random stream: the user's seed, or one drawn by the engine,
    # so sampling never depends on what else is in the batch.
    sampling_seed: int = 0
    eos_token_ids: frozenset[int] = frozenset()
    max_model_len: int = 1 << 30
    prompt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None  # when a step first computed any of its tokens (queue time ends)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    # bad_words as token-id sequences (tokenized by the engine at add_request, as vLLM does).
    bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False)
    # Logprobs (vLLM's shapes): the sum of the sampled tokens' logprobs (always kept); one dict
    # token id -> Logprob per output token when params.logprobs is set; [None] + one dict per
    # later prompt token when params.prompt_logprobs is set.
    cumulative_logprob: float = 0.0
    output_logprobs: list = field(default_factory=list, repr=False)
    prompt_logprobs: list = field(default_factory=list, repr=False)
    # The grammar matcher of a structured_outputs request (engine/structured_output.py), made on first use.
    structured_output: Any = field(default=None, repr=False)
    # Its compiled grammar, from make_request: held here so the engine loop never compiles.
    compiled_grammar: Any = field(default=None, repr=False)
    # Parallel sampling / beam search: the group this sequence belongs to and its index in it.
    group: "SequenceGroup | None" = field(default=None, repr=False)
    seq_index: int = 0
    # Prefix caching: the chained hash of each full block of all_token_ids hashed so far
    # (KVCacheManager computes them as blocks are looked up or filled; a fork copies them).
    block_hashes: list[int] = field(default_factory=list, repr=False)
    # Speculative decoding: the drafts proposed for the next step (used only if that step is a decode),
    # the output tokens the last step appended (one, or several when drafts were kept), and totals.
    spec_token_ids: list[int] = field(default_factory=list, repr=False)
    spec_parents: list[int] = field(default_factory=list, repr=False)  # a token tree's parents (empty: a chain)
    num_new_output_tokens: int = 0
    new_token_logprobs: list[float] = field(default_factory=list, repr=False)  # their raw logprobs (when known)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def __post_init__(self) -> None:
        self.all_token_ids: list[int] = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def awaiting_fork(self) -> bool:
        """The first sequence of an n > 1 / best_of group before it splits: its prompt is prefilled
        up to the last token, which each sequence then computes (and samples after) on its own."""
        group = self.group
        return group is not None and group.kind == "sample" and not group.forked

    def fork(self, request_id: str, seq_index: int, sampling_seed: int | None = None) -> "Request":
        """A new sequence with this one's tokens (the KV blocks are shared by KVCacheManager.fork)."""
        child = Request(
            request_id=request_id,
            prompt_token_ids=self.prompt_token_ids,
            sampling_params=self.sampling_params,
            sampling_seed=self.sampling_seed if sampling_seed is None else sampling_seed,
            eos_token_ids=self.eos_token_ids,
            max_model_len=self.max_model_len,
            prompt=self.prompt,
            arrival_time=self.arrival_time,
            output_token_ids=list(self.output_token_ids),
            num_computed_tokens=self.num_computed_tokens,
            status=self.status,
            bad_words_token_ids=self.bad_words_token_ids,
            cumulative_logprob=self.cumulative_logprob,
            output_logprobs=list(self.output_logprobs),
            prompt_logprobs=self.prompt_logprobs,
            group=self.group,
            seq_index=seq_index,
            compiled_grammar=self.compiled_grammar,
        )
        child.all_token_ids = list(self.all_token_ids)
        child.block_hashes = list(self.block_hashes)
        return child

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def check_stop(self) -> bool:
        """Set a finished status if the last token ends the request; True if it did."""
        params = self.sampling_params
        last = self.output_token_ids[-1]
        if self.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and last in self.eos_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                self.stop_reason = None
                return True
            if last in params.stop_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                self.stop_reason = last
                return True
        if (params.max_tokens is not None and self.num_output_tokens >= params.max_tokens) or (
            self.num_tokens >= self.max_model_len
        ):
            self.status = RequestStatus.FINISHED_LENGTH
            return True
        return False


@dataclass(eq=False)
class SequenceGroup:
    """The sequences one user request becomes: n > 1 / best_of samples (kind "sample"), or beams.

    A "sample" group starts as one request (sequence 0); once its prompt is in the cache up to
    the last token, the scheduler forks the other sequences off it, sharing its KV blocks.
    """

    request_id: str  # the user's request id (sequence 0 has it too)
    size: int  # sequences generated
    kind: str = "sample"  # "sample" | "beam"
    sequences: list[Request] = field(default_factory=list)  # by sequence index
    forked: bool = False

    def child_id(self, index: int) -> str:
        return f"{self.request_id}#{index}"


_SEED_MASK = (1 << 63) - 1


def sequence_seed(seed: int, index: int) -> int:
    """The random stream of sequence `index` of a group: sequence 0 keeps the request's seed, the
    others get distinct seeds derived from it (splitmix64), so a seeded request stays reproducible."""
    if index == 0:
        return seed
    z = (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return (z ^ (z >> 31)) & _SEED_MASK
