"""Beam search on the paged KV cache: every beam is a request, and beams share their common prefix's blocks.

Each step every live beam runs as a plain greedy request that asks for the top 2 * beam_width
logprobs of its next token (log-softmax of the raw logits). Once every live beam of the group
has its candidates, the group keeps the beam_width best continuations by cumulative logprob:
each kept continuation is a new request forked off its beam (the beam's KV blocks shared,
the partly filled last block copied on write when the continuations diverge) and the old
beams are freed. A beam that waits for its siblings has no token to compute, so the
scheduler leaves it alone.

Semantics are vLLM's LLM.beam_search: a candidate that is EOS (unless ignore_eos) ends a
hypothesis; at the end the finished and live hypotheses are ranked by
cum_logprob / len(prompt + tokens) ** length_penalty (EOS not counted) and the best
beam_width returned. Without EOS this is HF transformers' num_beams search.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.engine.request import Request, RequestStatus, SequenceGroup
from tokenmill.sampling_params import BeamSearchParams, SamplingParams


@dataclass
class BeamHypothesis:
    token_ids: list[int]  # generated tokens (EOS included only with include_stop_str_in_output)
    cum_logprob: float
    finish_reason: str  # "stop" (EOS) | "length"
    stop_reason: int | None = None
    ended_with_eos: bool = False


def beam_sampling_params(params: BeamSearchParams) -> SamplingParams:
    """What each beam runs with: greedy, never stopped by the scheduler (the group decides), top 2k logprobs."""
    sp = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
    # Set after validation: beam search may ask for more alternatives than a user's logprobs may.
    sp.logprobs = 2 * params.beam_width
    return sp


def beam_score(num_prompt_tokens: int, hyp: BeamHypothesis, length_penalty: float) -> float:
    """vLLM's get_beam_search_score: the length counts the prompt, not a final EOS."""
    length = num_prompt_tokens + len(hyp.token_ids) - (1 if hyp.ended_with_eos and hyp.token_ids else 0)
    return hyp.cum_logprob / (max(length, 1) ** length_penalty)


class BeamSearchGroup(SequenceGroup):
    """The live beams of one beam-search request (`sequences`) and its finished hypotheses."""

    def __init__(self, request_id: str, root: Request, params: BeamSearchParams, max_tokens: int) -> None:
        super().__init__(request_id=request_id, size=params.beam_width, kind="beam", sequences=[root], forked=True)
        root.group = self
        self.root = root
        self.params = params
        self.max_tokens = max_tokens  # generated tokens at most (capped by the context length)
        self.num_prompt_tokens = root.num_prompt_tokens
        self.cum_logprobs: dict[str, float] = {root.request_id: 0.0}
        self.candidates: dict[str, list[tuple[int, float]]] = {}
        self.completed: list[BeamHypothesis] = []
        self.num_steps = 0
        self.finished = False
        self._next_id = 0

    def _new_id(self) -> str:
        self._next_id += 1
        return f"{self.request_id}#beam{self._next_id}"

    def take_candidates(self, beam: Request) -> None:
        """The beam got its step's token: keep its top-2k (token, logprob) and take the token back off it.

        With the token removed, every token of the beam has KV, so the scheduler gives it nothing
        to do until the group advances. A beam that was preempted while waiting computes its
        step again when readmitted; the repeated candidates are dropped.
        """
        token = beam.output_token_ids.pop()
        beam.all_token_ids.pop()
        entry = beam.output_logprobs.pop() if beam.output_logprobs else None
        beam.cumulative_logprob = self.cum_logprobs[beam.request_id]
        if beam.request_id in self.candidates:
            return
        if entry is None:
            raise RuntimeError(f"beam {beam.request_id} got token {token} without its logprobs")
        self.candidates[beam.request_id] = [(t, lp.logprob) for t, lp in entry.items()]

    def ready(self) -> bool:
        return not self.finished and all(b.request_id in self.candidates for b in self.sequences)

    def advance(self, scheduler, eos_token_ids: frozenset[int]) -> None:
        """Keep the beam_width best continuations: fork them off their beams, free the old beams."""
        params = self.params
        continuations: list[tuple[float, Request, int]] = []
        for beam in self.sequences:
            base = self.cum_logprobs[beam.request_id]
            for token, logprob in self.candidates[beam.request_id]:
                cum = base + logprob
                if token in eos_token_ids and not params.ignore_eos:
                    tokens = beam.output_token_ids + ([token] if params.include_stop_str_in_output else [])
                    self.completed.append(BeamHypothesis(tokens, cum, "stop", None, params.include_stop_str_in_output))
                else:
                    continuations.append((cum, beam, token))
        continuations.sort(key=lambda c: -c[0])  # stable: ties keep beam order, then logprob rank
        kept = continuations[: params.beam_width]
        self.candidates.clear()
        self.num_steps += 1
        old = self.sequences
        if self.num_steps >= self.max_tokens or not kept:
            self.completed.extend(BeamHypothesis(beam.output_token_ids + [token], cum, "length") for cum, beam, token in kept)
            self.sequences = []
            self.finished = True
        else:
            children = []
            for index, (cum, beam, token) in enumerate(kept):
                child = beam.fork(self._new_id(), index)
                child.append_output_token(token)
                child.output_logprobs = []
                child.cumulative_logprob = cum
                scheduler.fork_request(beam, child)
                self.cum_logprobs[child.request_id] = cum
                children.append(child)
            self.sequences = children
        for beam in old:  # after the forks, so the kept prefixes' blocks stay referenced
            scheduler.finish_request(beam.request_id, RequestStatus.FINISHED_ABORTED)
            self.cum_logprobs.pop(beam.request_id, None)

    def abort(self, scheduler) -> None:
        for beam in self.sequences:
            scheduler.finish_request(beam.request_id, RequestStatus.FINISHED_ABORTED)
        self.sequences = []
        self.finished = True

    def best(self) -> list[BeamHypothesis]:
        """The beam_width best finished hypotheses, best first."""
        ranked = sorted(
            self.completed, key=lambda h: -beam_score(self.num_prompt_tokens, h, self.params.length_penalty)
        )
        return ranked[: self.params.beam_width]
