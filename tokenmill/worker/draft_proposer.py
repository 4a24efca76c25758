"""The draft_model proposer: a smaller model, or a quantized copy of the target ("self"), drafts k tokens
for each decoding request after the step is scheduled, in k forward passes of its own.

Its KV cache is its own but indexed by the target's block tables: the scheduler reserved the draft
slots (placeholders) with the step's, so every position the draft writes lies in blocks the request
holds. Blocks shared by several requests (prefix-cache hits, forks) hold the same tokens at the same
positions for all of them, so the draft writes the same values there whoever writes them. A request
the draft has not seen (new, forked, or back from preemption) is caught up over its whole history;
after that only the tokens since its last draft are computed: the draft keeps, per request, how many
positions of its cache hold KV of real tokens, and extends that by the drafts the target kept.
A "self" draft instead shares the target's cache (shares_target_kv): the target's own KV for everything
the target has computed, no catching up, no memory of its own; the slots it writes for this step's
tokens and drafts are the slots the target's pass writes again after it.

The draft samples with the request's own parameters and random stream (seed, output index), so for a
sampling request it draws what the target is likely to draw; a draft that differs costs only its rows.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass, field, replace

import torch

from tokenmill.engine.messages import DRAFT_PLACEHOLDER, ScheduledChunk
from tokenmill.worker.batch import next_decode_batch
from tokenmill.worker.model_runner import ModelRunner


@dataclass
class _DraftState:
    valid_len: int = 0  # positions 0..valid_len-1 of the draft's cache hold KV of the request's real tokens
    pending: list[int] = field(default_factory=list)  # the draft tokens whose KV follows them (kept if the target kept them)

    def catch_up(self, chunk: ScheduledChunk) -> int:
        """valid_len once the drafts the target kept are counted."""
        real = _tokens(chunk, self.valid_len, self.valid_len + len(self.pending))
        for draft, token in zip(self.pending, real):
            if draft != token:
                break
            self.valid_len += 1
        self.pending = []
        return self.valid_len


def _tokens(chunk: ScheduledChunk, start: int, end: int) -> list[int]:
    """The request's tokens at positions [start, end) (prompt, then output)."""
    prompt, output = chunk.prompt_token_ids, chunk.output_token_ids
    num_prompt = len(prompt)
    return prompt[start:end] + output[max(0, start - num_prompt) : max(0, end - num_prompt)]


class RunnerBackedProposer:
    """What a proposer with a KV cache of its own (`runner`'s) and per-request state (`_states`) answers the
    worker: the draft model's, and the EAGLE head's (worker/eagle_proposer.py)."""

    runner: ModelRunner
    _states: dict

    def kv_bytes_per_block(self) -> int:
        return self.runner.kv_bytes_per_block()

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.runner.allocate_kv_cache(num_blocks)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        self.runner.copy_blocks(pairs)

    def forget(self, request_ids: Iterable[str]) -> None:
        """Drop what the draft knows of these requests (finished, aborted, or preempted: their blocks are gone)."""
        for request_id in request_ids:
            self._states.pop(request_id, None)

    def keep_only(self, request_ids: Collection[str]) -> None:
        """Drop what the draft knows of every request not among these (the engine's live ones)."""
        for request_id in [r for r in self._states if r not in request_ids]:
            del self._states[request_id]


class DraftModelProposer(RunnerBackedProposer):
    """shares_target_kv: the runner reads and writes the target's KV cache (ModelRunner.share_kv_cache; a
    quantized copy of the target, "self"), where every position before a chunk's start holds the
    target's own KV: no catching up, and a first pass of the chunk's real tokens alone."""

    def __init__(self, runner: ModelRunner, shares_target_kv: bool = False) -> None:
        self.runner = runner
        self.shares_target_kv = shares_target_kv
        self._states: dict[str, _DraftState] = {}

    @torch.inference_mode()
    def fill(self, chunks: list[ScheduledChunk]) -> None:
        """Write drafts into the reserved slots of every chunk that has them (token_ids and spec_token_ids)."""
        targets = [c for c in chunks if c.spec_token_ids and c.spec_token_ids[0] == DRAFT_PLACEHOLDER]
        if not targets:
            return
        drafts: list[list[int]] = [[] for _ in targets]
        # Pass 0: each request's tokens the draft has no KV for, up to its last token; the first draft.
        passes = []
        for chunk in targets:
            last = chunk.start_pos + len(chunk.token_ids) - len(chunk.spec_token_ids)  # real tokens, the last one included
            if self.shares_target_kv:
                start = chunk.start_pos
            else:
                state = self._states.setdefault(chunk.request_id, _DraftState())
                start = min(state.catch_up(chunk), last - 1)  # the last token is always computed: its logits give the first draft
                state.valid_len = last
            passes.append(replace(chunk, token_ids=_tokens(chunk, start, last), start_pos=start, spec_token_ids=[],
                                  sampling_params=_draft_params(chunk)))
        out = self.runner.execute(passes)
        for draft, tokens in zip(drafts, out.sampled_token_ids):
            draft.append(tokens[0])
        # Passes 1..k-1: one token per request. Where each of them samples greedily with nothing else
        # applied, the argmax of the logits is the draft, and each pass's inputs are the last one's a
        # position on: without the sampler and the inputs' numpy, ~0.5 ms less a pass (SmolLM2's int4
        # self-draft, one request, Zen 4: ~8% of a pass).
        greedy = all(c.greedy_after_drafts() for c in targets)
        rows, batch, last = [], None, None
        for i in range(1, max(len(c.spec_token_ids) for c in targets)):
            now = [j for j, c in enumerate(targets) if len(c.spec_token_ids) > i]
            if not greedy:
                passes = [replace(targets[j].after_drafts(drafts[j], i), sampling_params=_draft_params(targets[j])) for j in now]
                for j, tokens in zip(now, self.runner.execute(passes).sampled_token_ids):
                    drafts[j].append(tokens[0])
                continue
            batch = next_decode_batch(batch, last) if batch is not None and now == rows else None
            if batch is None:  # the first such pass, or fewer requests than the last one
                batch = self.runner.batch_inputs([targets[j].after_drafts(drafts[j], i) for j in now])
            rows, last = now, self.runner.greedy_decode(batch)
            for j, token in zip(rows, last.tolist()):
                drafts[j].append(token)
        for chunk, draft in zip(targets, drafts):
            k = len(chunk.spec_token_ids)
            chunk.spec_token_ids[:] = draft
            chunk.token_ids[len(chunk.token_ids) - k :] = draft
            if not self.shares_target_kv:
                self._states[chunk.request_id].pending = draft[:-1]  # their KV is in the draft's cache now


def _draft_params(chunk: ScheduledChunk):
    """The request's sampling parameters without what only the output needs (logprobs to report)."""
    params = chunk.sampling_params
    if params.logprobs is None and params.prompt_logprobs is None:
        return params
    return replace(params, logprobs=None, prompt_logprobs=None)
