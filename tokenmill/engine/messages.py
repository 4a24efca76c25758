"""The plain messages of one engine step, between the scheduler and the model runner.

A leaf module: it imports nothing of the engine, so the worker (and any process that runs a
model for the engine) depends on these messages only, never on the scheduler itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from tokenmill.sampling_params import SamplingParams


# A draft slot reserved for a proposer that drafts after the step is scheduled (a draft model): the
# scheduler gives it budget and a KV slot, and the proposer writes the draft into it before the forward pass.
DRAFT_PLACEHOLDER = -1


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
    # Speculative decoding: draft tokens to verify, the last len(spec_token_ids) of token_ids. The chunk
    # samples 1 + k tokens (one after each of its last k + 1 tokens); the runner keeps the drafts the
    # model agrees with, and the token it samples after the last one kept.
    spec_token_ids: list[int] = field(default_factory=list)
    # A token tree instead of a chain (spec_decode/tree.py): the parent of each draft, an earlier draft's
    # index or -1 for the last real token. Empty: the drafts are a chain.
    spec_parents: list[int] = field(default_factory=list)
    _rows: list["ScheduledChunk"] | None = field(default=None, init=False, repr=False, compare=False)

    def sampling_rows(self) -> list["ScheduledChunk"]:
        """The rows this chunk samples, as chunks: itself alone, or with k drafts, 1 + k rows where row i
        samples as after_drafts(spec_token_ids, i) says (in a tree, row 1 + i as after the path to node
        i). Made once, so the grammar mask and the sampler see the same row objects."""
        if self._rows is None:
            if self.spec_parents:
                self._rows = [self] + [self.after_drafts(path, len(path)) for path in self.draft_paths()]
            else:
                self._rows = [self] + [self.after_drafts(self.spec_token_ids, i) for i in range(1, len(self.spec_token_ids) + 1)]
        return self._rows

    def draft_paths(self) -> list[list[int]]:
        """Each draft's tokens from the root down to it (a tree's parents precede their children)."""
        paths: list[list[int]] = []
        for token, parent in zip(self.spec_token_ids, self.spec_parents):
            paths.append((paths[parent] if parent >= 0 else []) + [token])
        return paths

    def greedy_after_drafts(self) -> bool:
        """Whether each row after_drafts(drafts, i >= 1) samples the argmax of the raw logits: greedy, with
        nothing that may change a greedy choice (allowed tokens, logit bias, penalties, bad words, a
        min_tokens ban past this row), so a proposer may take that argmax without the sampler."""
        params = self.sampling_params
        return (params.is_greedy and params.allowed_token_ids is None and not params.logit_bias and not params.uses_penalties
                and not self.bad_words_token_ids and self.output_index + 1 >= params.min_tokens)

    def after_drafts(self, drafts: list[int], i: int) -> "ScheduledChunk":
        """This decode chunk as it would be once drafts[:i] are generated: drafts[i - 1] at the next
        position, sampling output token output_index + i (its random stream, its min_tokens ban, and the
        history its penalties and bad words read)."""
        params = self.sampling_params
        reads_history = bool(self.bad_words_token_ids) or params.uses_penalties
        return replace(
            self,
            token_ids=[drafts[i - 1]],
            start_pos=self.start_pos + len(self.token_ids) - len(self.spec_token_ids) - 1 + i,
            output_index=self.output_index + i,
            output_token_ids=self.output_token_ids + drafts[:i] if reads_history else self.output_token_ids,
            banned_token_ids=self.banned_token_ids if self.output_index + i < params.min_tokens else (),
            spec_token_ids=[],
            spec_parents=[],
        )


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
    """One step's results, one entry per scheduled chunk (an empty list or None where it does not apply).

    A sampling chunk gets one token, or with k drafts 1 to k + 1: the drafts the model agreed with, then
    the token it sampled after them (in order, as if generated one by one)."""

    sampled_token_ids: list[list[int]]
    sampled_logprobs: list[list[float]]  # raw logprob of each sampled token, always
    logprobs: list[list[PositionLogprobs] | None]  # one per sampled token, only for requests with params.logprobs
    prompt_logprobs: list[PromptLogprobsChunk | None]  # only for requests with params.prompt_logprobs

    @classmethod
    def empty(cls, n: int) -> "ModelRunnerOutput":
        return cls([[] for _ in range(n)], [[] for _ in range(n)], [None] * n, [None] * n)
