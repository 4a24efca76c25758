"""What the engine hands back to callers, shaped like vLLM's RequestOutput."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """A token's logprob, its rank among all tokens (1 = most likely) and its text, as vLLM's Logprob."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated token: the sampled token and the top-k alternatives.
SampleLogprobs = list[dict[int, Logprob]]
# None for the first prompt token, then one dict per prompt token: the actual token and the top-k.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """When things happened to a request (time.monotonic() seconds), as vLLM's RequestMetrics.

    Filled by the engine; the server's Prometheus histograms (queue time, time to first token,
    inter-token latency, end-to-end latency) are computed from them.
    """

    arrival_time: float
    first_scheduled_time: float | None = None  # first step that computed any of its tokens
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    # Speculative decoding, over the request's sequences: draft tokens verified, and kept.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    prompt_logprobs: list | None = None
    metrics: RequestMetrics | None = None


@dataclass
class BeamSearchSequence:
    """One hypothesis of LLM.beam_search, as vLLM's: tokens and text include the prompt."""

    tokens: list[int]
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (EOS) | "length"
    stop_reason: int | str | None = None
    logprobs: list = field(default_factory=list)


@dataclass
class BeamSearchOutput:
    """LLM.beam_search's result for one prompt: the best beam_width sequences, best first."""

    sequences: list[BeamSearchSequence] = field(default_factory=list)
