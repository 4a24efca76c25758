"""The eagle proposer: an EAGLE draft head (models/eagle.py) drafts a chain of k tokens per request
from the target's final hidden states, in k passes of its own small layer stack.

Draft row i pairs the target's state at position i with the token at i + 1 (EAGLE's own indexing), so
its KV lives at slot i of the request's blocks (the target's block tables; the scheduler reserved the
step's slots, and a row index is always below the position whose token it reads). After every
target pass the runner hands the proposer (observe) the states of the rows it kept, each with the
token that follows it (the next prompt token, a kept draft, or the newly sampled token): they are
pending rows of the request, real ones. When the request next decodes with drafts (fill), pass 1
computes its pending rows (whose states are the target's, so the draft's KV of kept tokens is always
computed from real states, whatever the draft guessed there) and its last row's guess gives draft 1;
pass i + 1 reads draft i and the guessed state of pass i at the next slot, k - 1 single-row passes.
Those speculative rows' KV is overwritten by the real rows of the next fill before any later row
reads it (attention is causal), so rejections leave nothing stale behind.

Drafts are greedy (the LM head's top-1, over the head's draft vocabulary if it has one: those rows of
the LM head, prepacked once like the target's own): any draft is safe (verification keeps only what the target
samples), so sampling requests are exact too, only less often accepted.

A token tree (speculative_config's "tree_width", or a "tree" whose paths branch only off the top-1
chain) takes, at each depth, the next candidates of the same pass's guess beside the chain's top-1: the
node at path [0] * d + [r] is candidate r of pass d + 1. The passes still run along the top-1 chain only
(one row per request per pass), so a tree costs the target's verification rows, not extra draft passes.
After verification the runner moves the kept path's rows to a chain's places, and observe() reads the
kept tokens themselves (not the tree's node order) as the tokens that follow each kept row.

With confidence (min_draft_probability / stop_draft_probability), each pass also gives its candidates'
draft probabilities: a request's passes stop once its top-1 chain is less probable than the stop
threshold, and only the reserved nodes whose path is at least min_draft_probability probable are
written; the chunk drops the others (spec_decode/tree.py: confident_nodes), so the target verifies
fewer rows where the draft is unsure (EAGLE-2's dynamic trees, cut to a chain-plus-siblings shape).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch

from tokenmill.engine.messages import DRAFT_PLACEHOLDER, ScheduledChunk
from tokenmill.layers.quantization.quant_utils import quantize_int8
from tokenmill.layers.quantization.unquantized import PackedCPUWeight, cpu_packed_weights_supported
from tokenmill.layers.quantization.weight_only import store_int8
from tokenmill.models.eagle import EagleDraftModel
from tokenmill.spec_decode.tree import TokenTree, confident_nodes, subtree_parents
from tokenmill.worker.batch import build_batch_inputs, next_rows_batch
from tokenmill.worker.draft_proposer import RunnerBackedProposer, _tokens
from tokenmill.worker.model_runner import ModelRunner

# Pending rows kept per request at most (a request that never drafts, e.g. a beam, would otherwise grow
# them without end): the oldest go first; their draft KV then stays stale, which costs acceptance only.
_MAX_PENDING = 4096


@dataclass
class _Pending:
    """A request's draft rows not computed yet: row `start + j` reads tokens[j] and features[j]."""

    start: int
    tokens: list[int] = field(default_factory=list)
    features: list[torch.Tensor] = field(default_factory=list)  # pieces of [rows, hidden], in order

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)  # one past the last row

    def trim(self) -> None:
        drop = len(self.tokens) - _MAX_PENDING
        if drop <= 0:
            return
        states = torch.cat(self.features)[drop:]
        self.start, self.tokens, self.features = self.start + drop, self.tokens[drop:], [states]


class EagleProposer(RunnerBackedProposer):
    def __init__(self, draft: EagleDraftModel, target: torch.nn.Module, runner: ModelRunner, num_speculative_tokens: int,
                 tree: TokenTree | None = None, min_probability: float = 0.0, stop_probability: float = 0.0) -> None:
        """target: the target model, whose input embedding and LM head the draft uses; runner: the draft's
        own (its paged KV cache, indexed by the target's block tables); tree: a token tree (None: a chain);
        min_probability, stop_probability: SpeculativeConfig's min_draft_probability and stop_draft_probability."""
        embed = getattr(getattr(target, "model", None), "embed_tokens", None)
        if embed is None or not hasattr(target, "compute_logits"):
            raise ValueError(f"speculative method \"eagle\" needs a Llama-family model (token embedding and LM head), "
                             f"not {type(target).__name__}")
        self.draft = draft
        self.embed = embed
        self.target = target
        self.runner = runner
        self.k = num_speculative_tokens
        self._states: dict[str, _Pending] = {}
        self._vocab_head = _vocab_head(target, draft.draft_vocab, int8=draft.quantization == "int8")
        # Each tree node's pass (depth - 1) and candidate rank; how many candidates a pass keeps (1: a chain).
        self._node_pass, self._node_rank = tree.heads_and_ranks() if tree is not None else (np.zeros(0, np.int64),) * 2
        self.width = int(self._node_rank.max()) + 1 if tree is not None else 1
        self.min_probability, self.stop_probability = min_probability, stop_probability
        self.confidence = bool(min_probability or stop_probability)  # whether drafts need their probabilities

    # -- after each target pass: the rows it kept become pending draft rows ---------------------------
    def observe(self, chunks: list[ScheduledChunk], hidden: torch.Tensor, sampled: list[list[int]]) -> None:
        """hidden [tokens, hidden size] of the whole batch (chunk rows in order); each chunk's kept tokens
        (empty for chunks that did not sample)."""
        firsts, counts, owners = [], [], []
        offset = 0
        for chunk, kept in zip(chunks, sampled):
            length = len(chunk.token_ids)
            if chunk.sample and kept:
                # The real tokens' rows and the kept drafts' rows; each reads the token after it (the kept
                # tokens themselves: a tree's nodes are not in path order in token_ids).
                real = length - len(chunk.spec_token_ids)
                count = real + len(kept) - 1
                following = chunk.token_ids[1:real] + kept
            elif chunk.sample:
                count, following = 0, []  # no token came out (cannot happen for a sampling chunk; be safe)
            else:
                count = length  # a prompt chunk before the last: every row, and the next prompt token after it
                following = chunk.token_ids[1:] + _tokens(chunk, chunk.start_pos + length, chunk.start_pos + length + 1)
            if count and len(following) == count:
                firsts.append(offset)
                counts.append(count)
                owners.append((chunk.request_id, chunk.start_pos, following))
            offset += length
        if not owners:
            return
        counts_np = np.asarray(counts, dtype=np.int64)
        index = np.repeat(np.asarray(firsts, dtype=np.int64) - np.cumsum(counts_np) + counts_np, counts_np) + np.arange(int(counts_np.sum()))
        states = hidden.index_select(0, torch.from_numpy(index).to(hidden.device))
        for (request_id, start, following), piece in zip(owners, states.split(counts)):
            pending = self._states.get(request_id)
            if pending is None or pending.end != start:
                # First rows, or not contiguous with the earlier ones (a recompute): start over from here.
                pending = self._states[request_id] = _Pending(start)
            pending.tokens += following
            pending.features.append(piece)
            pending.trim()

    # -- before the step's target pass: drafts into the reserved slots ---------------------------------
    @torch.inference_mode()
    def fill(self, chunks: list[ScheduledChunk]) -> None:
        targets, passes, states = [], [], []
        for chunk in chunks:
            k = len(chunk.spec_token_ids)
            if not k or chunk.spec_token_ids[0] != DRAFT_PLACEHOLDER:
                continue
            newest = chunk.start_pos + len(chunk.token_ids) - k - 1  # the position of the request's last token
            pending = self._states.pop(chunk.request_id, None)
            if pending is None or pending.end != newest:
                # No rows up to the last token (a fork's first step): the last token repeated is a safe draft.
                self._write(chunk, [chunk.token_ids[-k - 1]] * k)
                continue
            targets.append(chunk)
            passes.append(replace(chunk, token_ids=pending.tokens, start_pos=pending.start, spec_token_ids=[], spec_parents=[], sample=True))
            states.append(torch.cat(pending.features) if len(pending.features) > 1 else pending.features[0])
        if not targets:
            return
        # Passes each request needs: k for a chain, its first k tree nodes' depth for a tree.
        needed = [int(self._node_pass[: len(c.spec_token_ids)].max()) + 1 if c.spec_parents else len(c.spec_token_ids)
                  for c in targets]
        candidates: list[list[np.ndarray]] = [[] for _ in targets]  # per request, per pass: [width] token ids
        probabilities: list[list[np.ndarray]] = [[] for _ in targets]  # and their draft probabilities (with confidence)
        chain = np.ones(len(targets))  # the draft's probability of each request's top-1 chain so far
        rows = list(range(len(targets)))  # the requests (indices into targets) in this pass
        features = torch.cat(states)
        batch = build_batch_inputs(passes, self.runner.block_size, self.runner.device, self.runner.cascade_attention)
        for i in range(max(needed)):
            out = self.draft(self.embed(batch.input_ids), features, batch.positions, batch)
            guesses = out[batch.logits_indices]  # each pass's last row: the guessed state after it
            tops, probs = self._top(guesses)
            for n, j in enumerate(rows):
                candidates[j].append(tops[n])
                if probs is not None:
                    probabilities[j].append(probs[n])
                    chain[j] *= probs[n, 0]
            # The next pass: one row per request that needs more (and, with confidence, whose chain is still
            # probable enough), reading its newest top-1 draft and guessed state.
            keep = [n for n, j in enumerate(rows) if needed[j] > i + 1 and chain[j] >= self.stop_probability]
            if not keep:
                break  # every chain is done, or stopped early
            rows, features = [rows[n] for n in keep], guesses[keep]
            # Made with a few tensor ops from this pass's batch, not with build_batch_inputs' numpy from chunks.
            device = batch.positions.device
            batch = next_rows_batch(batch, torch.tensor(keep, device=device), torch.from_numpy(tops[keep, 0]).to(device))
        for chunk, found, probs in zip(targets, candidates, probabilities):
            per_pass = np.stack(found)  # [passes run, width]
            k = len(chunk.spec_token_ids)
            # Each reserved node's pass and candidate rank (the tree's first k nodes, or a chain's).
            node_pass, node_rank = (self._node_pass[:k], self._node_rank[:k]) if chunk.spec_parents else (np.arange(k), np.zeros(k, np.int64))
            if not self.confidence:
                self._write(chunk, per_pass[node_pass, node_rank].tolist())
                continue
            keep = confident_nodes(node_pass, node_rank, np.stack(probs), self.min_probability)
            self._write_kept(chunk, per_pass[node_pass[keep], node_rank[keep]].tolist(), keep)

    def _top(self, guesses: torch.Tensor) -> tuple[np.ndarray, np.ndarray | None]:
        """Each guessed state's `width` most likely tokens, most likely first ([rows, width]), and with
        confidence their draft probabilities (a softmax over the draft's vocabulary; else None)."""
        if self._vocab_head is None:
            logits, vocab = self.target.compute_logits(guesses), None
        else:
            logits, vocab = self._vocab_head(guesses), self.draft.draft_vocab
        probs = None
        if self.confidence:
            values, top = logits.topk(self.width, dim=-1)
            probs = (values.float() - logits.float().logsumexp(dim=-1, keepdim=True)).exp().cpu().numpy()
        else:
            top = logits.argmax(dim=-1, keepdim=True) if self.width == 1 else logits.topk(self.width, dim=-1).indices
        return (top if vocab is None else vocab[top]).cpu().numpy(), probs

    @staticmethod
    def _write(chunk: ScheduledChunk, drafts: list[int]) -> None:
        k = len(chunk.spec_token_ids)
        chunk.spec_token_ids[:] = drafts
        chunk.token_ids[len(chunk.token_ids) - k :] = drafts

    @classmethod
    def _write_kept(cls, chunk: ScheduledChunk, drafts: list[int], keep: np.ndarray) -> None:
        """Write the drafts of the reserved nodes kept (keep: a mask over them, closed under parents) and
        drop the others: the chunk verifies fewer rows (their reserved slots stay unused this step; the
        scheduler counts the drafts the chunk holds when the step returns)."""
        if chunk.spec_parents:
            parents = subtree_parents(chunk.spec_parents, keep)
            chunk.spec_parents[:] = [] if parents == list(range(-1, len(parents) - 1)) else parents  # a chain stays a chain
        k = len(chunk.spec_token_ids)
        del chunk.token_ids[len(chunk.token_ids) - k + len(drafts) :]
        del chunk.spec_token_ids[len(drafts) :]
        cls._write(chunk, drafts)


def _vocab_head(target: torch.nn.Module, draft_vocab: torch.Tensor | None, int8: bool = False):
    """The draft vocabulary's rows of the target's LM head as a matmul (None: the whole LM head), in int8 (a
    scale per row) with an int8 head. Only a full-precision LM head has rows to take; a quantized one is used whole."""
    weight = getattr(getattr(target, "lm_head", None), "weight", None)
    if draft_vocab is None or weight is None or not weight.is_floating_point() or weight.dim() != 2 or weight.shape[0] <= int(draft_vocab.max()):
        return None
    rows = weight.detach().index_select(0, draft_vocab).contiguous()
    if int8:
        head = torch.nn.Module()
        store_int8(head, *quantize_int8(rows))
        return lambda hidden: head.linear_call(hidden, None)
    if cpu_packed_weights_supported(rows.device, rows.dtype):
        return PackedCPUWeight(rows, dense_only=True)
    return lambda hidden: torch.nn.functional.linear(hidden, rows)
