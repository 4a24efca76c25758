"""The plain messages of one engine step, between the scheduler and the model runner.

A leaf module: it imports nothing of the engine, so the worker (and any process that runs a
model for the engine) depends on these messages only, never on the scheduler itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.sampling_params import SamplingParams


@dataclass
class ScheduledChunk:
    """One request's share of a step, as plain data for the model runner."""

    request_id: str
    token_ids: list[int]  # the tokens whose KV is computed this step
    start_pos: int  # position of token_ids[0] (= tokens already in the cache)
    block_ids: list[int]  # the request's whole block table
    sample: bool  # the chunk reaches the request's last token, so a new token is sampled
    sampling_params: SamplingParams
    sampling_seed: int
    output_index: int  # index of the output token being sampled (keys the random stream)
    # The request's token history (shared lists, not copies): penalties and bad words read them.
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    # Tokens the sampler must not pick for this sample: EOS (unless ignore_eos) and the stop
    # token ids while fewer than min_tokens tokens are out, as vLLM's min_tokens does.
    banned_token_ids: tuple[int, ...] = ()
    # bad_words as token-id sequences: the sampler bans a word's last token when the rest ends the output.
    bad_words_token_ids: list[list[int]] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)
    # Copy-on-write of KV blocks shared by forked sequences: (src, dst) block ids, to copy in
    # every layer before the forward pass.
    block_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass
class PositionLogprobs:
    """One position's logprobs: token_ids[0] is the actual token (its rank in rank), then the top-k, most likely first."""

    token_ids: list[int]
    logprobs: list[float]
    rank: int


@dataclass
class PromptLogprobsChunk:
    first_index: int  # prompt index of the token positions[0] scores
    positions: list[PositionLogprobs]


@dataclass
class ModelRunnerOutput:
    """One step's results, one entry per scheduled chunk (None where it does not apply)."""

    sampled_token_ids: list[int | None]
    sampled_logprobs: list[float | None]  # raw logprob of each sampled token, always
    logprobs: list[PositionLogprobs | None]  # only for requests with params.logprobs
    prompt_logprobs: list[PromptLogprobsChunk | None]  # only for requests with params.prompt_logprobs

    @classmethod
    def empty(cls, n: int) -> "ModelRunnerOutput":
        return cls([None] * n, [None] * n, [None] * n, [None] * n)
