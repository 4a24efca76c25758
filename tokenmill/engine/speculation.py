"""The engine's side of speculative decoding: after each step, the next step's drafts of every request
that will decode, within what the request may still generate. The ngram proposer drafts here at once;
for a draft model, slots are reserved here (placeholders) and the draft model fills them once the step
is scheduled (worker/draft_proposer.py). With a token tree (spec_decode/tree.py) the placeholders are
the tree's nodes, with their parents, cut to the depth the request has room for."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tokenmill.config import SpeculativeConfig
from tokenmill.engine.messages import DRAFT_PLACEHOLDER
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.spec_decode.ngram import NgramProposer
from tokenmill.spec_decode.tree import TokenTree


@dataclass
class DraftScheduler:
    proposer: NgramProposer | None  # None: a draft model fills reserved slots after scheduling
    num_speculative_tokens: int
    max_model_len: int
    disable_by_batch_size: int | None
    tree: TokenTree | None = None  # placeholders for a token tree's nodes instead of a chain
    _parents: list[int] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.tree is not None:
            self._parents = self.tree.parents()

    def propose(self, running: list[Request]) -> None:
        """Set spec_token_ids of each running request that decodes next step (none at or above disable_by_batch_size)."""
        if self.disable_by_batch_size is not None and len(running) >= self.disable_by_batch_size:
            return
        for request in running:
            room = self._room(request)
            if room <= 0:
                continue
            if self.proposer is None and self.tree is not None and request.sampling_params.structured_outputs is None:
                # (The grammar checks drafts as a chain: requests with structured output get the tree's top-1 chain.)
                # A tree node's slot is after the ones before it: all of them stay within the context.
                n = min(self.tree.num_nodes_within(room), self.max_model_len - request.num_tokens)
                request.spec_token_ids = [DRAFT_PLACEHOLDER] * n
                request.spec_parents = self._parents[:n]
            elif self.proposer is None:
                request.spec_token_ids, request.spec_parents = [DRAFT_PLACEHOLDER] * min(room, self.num_speculative_tokens), []
            else:
                token_ids = np.fromiter(request.all_token_ids, dtype=np.int64, count=request.num_tokens)
                request.spec_token_ids = self.proposer.propose(token_ids, room)

    def _room(self, request: Request) -> int:
        """How many drafts the request can take next step: 0 unless it decodes, and never past max_tokens
        or the context (the step samples 1 + drafts tokens)."""
        if request.status != RequestStatus.RUNNING or request.num_tokens - request.num_computed_tokens != 1:
            return 0
        group = request.group
        if group is not None and (group.kind != "sample" or not group.forked):
            return 0  # beams choose among candidates; an unforked n > 1 request splits before it decodes
        params = request.sampling_params
        if params.structured_outputs is not None and (params.ignore_eos or params.min_tokens):
            # The grammar may end inside a run that these keep going; the engine ends it one token at a time.
            return 0
        room = self.max_model_len - request.num_tokens - 1
        if params.max_tokens is not None:
            room = min(room, params.max_tokens - request.num_output_tokens - 1)
        return room


def make_proposer(config: SpeculativeConfig | None, max_model_len: int) -> DraftScheduler | None:
    if config is None:
        return None
    proposer = None
    if config.method == "ngram":
        proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max, config.num_speculative_tokens)
    return DraftScheduler(proposer, config.num_speculative_tokens, max_model_len, config.disable_by_batch_size, config.token_tree())
