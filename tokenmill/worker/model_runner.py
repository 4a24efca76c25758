"""ModelRunner: owns the model and its KV memory; turns scheduled chunks into sampled tokens."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import numpy as np
import torch
from torch import nn

from tokenmill.distributed.communicator import TPCommunicator
from tokenmill.engine.messages import ModelRunnerOutput, PositionLogprobs, PromptLogprobsChunk, ScheduledChunk
from tokenmill.layers.attention import Attention, GatherWorkspace, attention_backend
from tokenmill.layers.attention_metadata import BatchInputs
from tokenmill.layers.kv_quant import KVScales, kv_storage_dtype, scale_bytes_per_block
from tokenmill.spec_decode.verify import draft_rows, kept_tree_rows, num_kept
from tokenmill.worker.batch import build_batch_inputs
from tokenmill.worker.cpu_memory import (KVPrefault, WeightMove, small_pages_where_heads_start, tune_malloc,
                                         zeros_huge_page_aligned)
from tokenmill.worker.sampler import LogprobsTensors, Sampler, SamplingMetadata, argmax_and_logsumexp, compute_logprobs


class Followers:
    """Rank 0's line to the other tensor-parallel ranks: each announced operation is broadcast to them."""

    def __init__(self, comm: TPCommunicator) -> None:
        self.comm = comm

    def announce(self, op: tuple) -> None:
        self.comm.broadcast_object(op)


class ModelRunner:
    """followers: with tensor parallelism, on rank 0, the other ranks: every operation that runs the
    model or touches its KV cache is announced to them first (as ("op", name, args)), so they run the
    same one on their shards in step; `name` tells them which model (the target's or the draft's).

    defer_weight_move: on the CPU, the weights move into huge pages in the background (WeightMove) and the
    runner repoints them before a pass once copied, instead of before its first pass (only for a runner
    whose every pass goes through forward())."""

    def __init__(self, model: nn.Module, device: torch.device, dtype: torch.dtype, block_size: int,
                 followers: "Followers | None" = None, name: str = "target", kv_cache_dtype: str = "auto",
                 cascade_attention: bool = True, defer_weight_move: bool = False) -> None:
        self.model = model
        self.followers = followers
        self.name = name
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.cascade_attention = cascade_attention  # decodes over a shared prefix read it once (worker/batch.py)
        # What the KV cache stores (layers/kv_quant.py): the model's dtype, or int8 / fp8 with scales.
        self.kv_dtype = kv_storage_dtype(kv_cache_dtype, dtype)
        if kv_cache_dtype != "auto" and device.type != "cpu":
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} runs on CPU only (the C++ kernel, or the PyTorch reference); "
                             f"on {device.type} use kv_cache_dtype='auto'")
        self.attn_layers = [m for m in model.modules() if isinstance(m, Attention)]
        self.sampler = Sampler()
        self.num_blocks = 0
        self.kv_prefault = KVPrefault([])  # done at once; allocate_kv_cache starts the CPU cache's
        # Called after each pass with (chunks, hidden states of the batch, each chunk's kept tokens, empty
        # where it did not sample): the medusa proposer drafts from the rows that sampled
        # (worker/medusa_proposer.py), the eagle proposer keeps every kept row's state
        # (worker/eagle_proposer.py), and train-medusa / train-eagle keep every row.
        self.hidden_observer: Callable[[list[ScheduledChunk], torch.Tensor, list[list[int]]], None] | None = None
        # Medusa heads that share the target's LM head: rows_for_logits(hidden of the sampling rows) gives
        # rows appended to the target's logits matmul (its weight read once for all), and their logits go
        # to logits_observer(chunks, each chunk's kept tokens, those logits) after sampling.
        self.extra_logits_rows: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.extra_logits_observer: Callable[[list[ScheduledChunk], list[list[int]], torch.Tensor], None] | None = None
        if device.type == "cpu":
            tune_malloc()
        self.weight_move = WeightMove(model, defer=defer_weight_move, enabled=device.type == "cpu")

    def finish_weight_move(self) -> int:
        """The weights' move into huge pages done now (a deferred one: copied, then repointed), on the thread that
        runs the passes, between two; the bytes moved."""
        return self.weight_move.finish()

    def kv_bytes_per_block(self) -> int:
        """Bytes one block takes in every layer: K and V rows in the cache's dtype, plus int8's per-row scales."""
        elem = torch.empty(0, dtype=self.kv_dtype).element_size()
        return sum(2 * self.block_size * a.num_kv_heads * a.head_dim * elem
                   + scale_bytes_per_block(self.kv_dtype, a.num_kv_heads, self.block_size) for a in self.attn_layers)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Allocate every layer's K and V once: [num_kv_heads, num_blocks, block_size, head_dim].

        Head-major, so that gathering a request's blocks gives each KV head's context as one
        contiguous matrix for the attention matmuls (no copy between the gather and the bmm).

        Zeroed, so never-written slots (the null block, a block's unfilled tail) hold finite
        values: attention masks them, and 0 * garbage could otherwise be NaN.
        """
        self._announce("init_kv", num_blocks)
        workspace = GatherWorkspace()
        backend = attention_backend(self.device)
        for layer in self.attn_layers:
            layer.workspace = workspace
            layer.backend = backend
            shape = (layer.num_kv_heads, num_blocks, self.block_size, layer.head_dim)
            layer.k_cache = self._zeros(shape)
            layer.v_cache = self._zeros(shape)
            layer.kv_scales = KVScales.allocate(self.kv_dtype, shape, self.device)
        self.num_blocks = num_blocks
        if self.device.type == "cpu":  # see _zeros: the pages are faulted in ahead while the engine is idle
            self.kv_prefault = KVPrefault([t for layer in self.attn_layers for t in (layer.k_cache, layer.v_cache)])

    def share_kv_cache(self, owner: "ModelRunner") -> None:
        """Read and write owner's KV cache instead of a cache of its own: a quantized copy of owner's model (a
        "self" draft) has the same attention layers, so each takes the matching layer's cache (and its
        prefault, which its passes then pause as owner's do). Owner allocates first."""
        if [(a.num_kv_heads, a.head_dim) for a in self.attn_layers] != [(a.num_kv_heads, a.head_dim) for a in owner.attn_layers]:
            raise ValueError(f"the {self.name} model's attention layers differ from the {owner.name}'s: it cannot share their KV cache")
        for mine, theirs in zip(self.attn_layers, owner.attn_layers):
            mine.workspace, mine.backend = theirs.workspace, theirs.backend
            mine.k_cache, mine.v_cache, mine.kv_scales = theirs.k_cache, theirs.v_cache, theirs.kv_scales
        self.num_blocks, self.kv_prefault = owner.num_blocks, owner.kv_prefault

    def _zeros(self, shape: tuple[int, ...]) -> torch.Tensor:
        if self.device.type != "cpu":
            return torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        # numpy's zeros comes from calloc: the OS hands out zero pages lazily, so a large cache
        # costs no start-up time; KVPrefault then faults them in while the engine is idle.
        cache = zeros_huge_page_aligned(shape, self.kv_dtype)
        small_pages_where_heads_start(cache)  # the first requests' blocks: no 2 MB first touch per head
        return torch.from_numpy(cache).view(self.kv_dtype)

    @torch.inference_mode()
    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write of shared KV blocks: block dst := block src in every layer's K and V, all pairs at once.

        The sources are gathered before any destination is written, so a block freed and reused in
        the same step (a source that is also a destination) still gives its old contents.
        """
        if not pairs:
            return
        self._announce("copy_blocks", pairs)
        src = torch.tensor([a for a, _ in pairs], dtype=torch.int64, device=self.device)
        dst = torch.tensor([b for _, b in pairs], dtype=torch.int64, device=self.device)
        for layer in self.attn_layers:
            # int8's per-row scales go with their blocks; fp8 is copied as bytes (torch has no float8 index_copy_ on CPU).
            scales = (layer.kv_scales.k, layer.kv_scales.v) if layer.kv_scales is not None and layer.kv_scales.k.dim() == 3 else ()
            for cache in (layer.k_cache, layer.v_cache, *scales):
                if cache.dtype.itemsize == 1:
                    cache = cache.view(torch.uint8)
                cache.index_copy_(1, dst, cache.index_select(1, src))

    def execute(self, chunks: list[ScheduledChunk], grammar_bitmask: torch.Tensor | None = None) -> "ModelRunnerOutput":
        """One step (see _execute); the KV cache's prefault and the weights' move wait while it runs."""
        with self._pass():
            return self._execute(chunks, grammar_bitmask)

    @contextlib.contextmanager
    def _pass(self) -> Iterator[None]:
        with self.kv_prefault.busy(), self.weight_move.busy():
            yield

    @torch.inference_mode()
    def _execute(self, chunks: list[ScheduledChunk], grammar_bitmask: torch.Tensor | None = None) -> "ModelRunnerOutput":
        """One forward pass over the mixed batch; for each chunk that ends its request's tokens, the sampled
        token (or, with drafts, the drafts kept and the token after them: spec_decode/verify.py) with logprobs,
        and the logprobs asked for (of sampled tokens, of prompt tokens).

        grammar_bitmask: structured output's allowed tokens, one row per sampling row (ScheduledChunk.sampling_rows, in order).
        """
        batch = self.batch_inputs(chunks)
        hidden = self.forward(batch)
        result = ModelRunnerOutput.empty(len(chunks))
        self._prompt_logprobs(chunks, hidden, result)
        sampling = [i for i, c in enumerate(chunks) if c.sample]
        if not sampling:
            if self.hidden_observer is not None:  # prompt chunks' states too (EAGLE's draft reads every position)
                self.hidden_observer(chunks, hidden, result.sampled_token_ids)
            return result
        rows = [row for i in sampling for row in chunks[i].sampling_rows()]
        extra = None if self.extra_logits_rows is None else self.extra_logits_rows(hidden[batch.logits_indices])
        logits = self.compute_logits(hidden, batch.logits_indices, extra)
        extra_logits = None
        if extra is not None:
            logits, extra_logits = logits[: len(rows)], logits[len(rows) :]
        meta = SamplingMetadata.from_chunks(rows, self.device)
        if grammar_bitmask is not None:
            meta.grammar_bitmask = grammar_bitmask.to(self.device)
        out = self.sampler.sample(logits, meta)
        tokens = out.token_ids.tolist()
        token_logprobs = out.logprobs.token_logprobs.tolist()
        wanted = [j for j, row in enumerate(rows) if row.sampling_params.logprobs is not None]
        row_logprobs = dict(zip(wanted, _logprobs_lists(out.token_ids, out.logprobs, wanted)))
        rows_per_chunk = np.fromiter((len(chunks[i].spec_token_ids) + 1 for i in sampling), dtype=np.int64, count=len(sampling))
        starts = np.cumsum(rows_per_chunk) - rows_per_chunk
        if len(rows) == len(sampling):  # no drafts: one token per chunk
            kept_rows = [[int(f)] for f in starts]
        elif any(chunks[i].spec_parents for i in sampling):  # token trees
            local = kept_tree_rows(np.asarray(tokens, dtype=np.int64), [chunks[i].spec_token_ids for i in sampling],
                                   [chunks[i].spec_parents for i in sampling])
            kept_rows = [[f + r for r in path] for f, path in zip(starts.tolist(), local)]
            self._gather_tree_paths([chunks[i] for i in sampling], local, hidden, extra_logits, len(rows))
        else:
            kept = num_kept(np.asarray(tokens, dtype=np.int64), draft_rows([chunks[i].spec_token_ids for i in sampling]), rows_per_chunk)
            kept_rows = [list(range(f, f + n)) for f, n in zip(starts.tolist(), kept.tolist())]
        for i, path in zip(sampling, kept_rows):
            result.sampled_token_ids[i] = [tokens[j] for j in path]
            result.sampled_logprobs[i] = [token_logprobs[j] for j in path]
            if chunks[i].sampling_params.logprobs is not None:
                result.logprobs[i] = [row_logprobs[j] for j in path]
        if self.hidden_observer is not None:
            self.hidden_observer(chunks, hidden, result.sampled_token_ids)
        if extra_logits is not None:
            self.extra_logits_observer(chunks, result.sampled_token_ids, extra_logits)
        return result

    def batch_inputs(self, chunks: list[ScheduledChunk]) -> BatchInputs:
        return build_batch_inputs(chunks, self.block_size, self.device, self.cascade_attention)

    def greedy_decode(self, batch: BatchInputs) -> torch.Tensor:
        """Each sampled row's argmax over the raw logits, as the sampler picks a plain greedy row (ties
        too): a forward pass and its logits without the sampler's metadata and outputs, for a proposer's
        passes where nothing else applies (ScheduledChunk.greedy_after_drafts)."""
        with self._pass(), torch.inference_mode():
            hidden = self.forward(batch)
            return argmax_and_logsumexp(self.compute_logits(hidden, batch.logits_indices))[0]

    def _gather_tree_paths(self, chunks: list[ScheduledChunk], paths: list[list[int]], hidden: torch.Tensor,
                           extra_logits: torch.Tensor | None, num_rows: int) -> None:
        """A tree's kept path as if it had been a chain: each kept node's KV moves to the slot after the one
        before it (the request's next positions), and its rows of the hidden states and of the heads' extra
        logits move to its depth's row, where the observers (the proposers) read a chain's. The slots of
        the nodes not kept are past num_computed_tokens after the step: overwritten later, never cached."""
        src_slots, dst_slots, src_rows, dst_rows, src_sampled, dst_sampled = [], [], [], [], [], []
        token_first = sampled_first = 0
        for chunk, path in zip(chunks, paths):
            k = len(chunk.spec_token_ids)
            root_pos = chunk.start_pos + len(chunk.token_ids) - k - 1
            root_row = token_first + len(chunk.token_ids) - k - 1
            for depth, row in enumerate(path[1:], start=1):
                if row != depth:  # node row - 1 sits at slot root + row; its depth's slot is root + depth
                    src_slots.append(_slot(chunk.block_ids, root_pos + row, self.block_size))
                    dst_slots.append(_slot(chunk.block_ids, root_pos + depth, self.block_size))
                    src_rows.append(root_row + row)
                    dst_rows.append(root_row + depth)
                    src_sampled.append(sampled_first + row)
                    dst_sampled.append(sampled_first + depth)
            token_first += len(chunk.token_ids)
            sampled_first += k + 1
        if not src_slots:
            return
        self.move_kv(src_slots, dst_slots)
        hidden[dst_rows] = hidden[src_rows]
        if extra_logits is not None:  # [heads * sampling rows, vocab], head-major
            view = extra_logits.view(-1, num_rows, extra_logits.shape[-1])
            view[:, dst_sampled] = view[:, src_sampled]

    @torch.inference_mode()
    def move_kv(self, src_slots: list[int], dst_slots: list[int]) -> None:
        """Cache slot dst := slot src in every layer's K and V (and int8's scales); all sources are read first."""
        self._announce("move_kv", src_slots, dst_slots)
        src = torch.tensor(src_slots, dtype=torch.int64, device=self.device)
        dst = torch.tensor(dst_slots, dtype=torch.int64, device=self.device)
        for layer in self.attn_layers:
            scales = (layer.kv_scales.k, layer.kv_scales.v) if layer.kv_scales is not None and layer.kv_scales.k.dim() == 3 else ()
            for cache in (layer.k_cache, layer.v_cache, *scales):
                if cache.dtype.itemsize == 1:
                    cache = cache.view(torch.uint8)
                flat = cache.view(cache.shape[0], cache.shape[1] * cache.shape[2], *cache.shape[3:])  # [Hkv, slots, ...]
                flat.index_copy_(1, dst, flat.index_select(1, src))

    def forward(self, batch: BatchInputs) -> torch.Tensor:
        """The hidden states of the batch's tokens (every rank's forward pass: the layers all-reduce)."""
        self.weight_move.before_pass()  # the weights onto their huge-page copy, once made (nothing runs on them now)
        self._announce("forward", batch if self.device.type == "cpu" else batch.to(torch.device("cpu")))
        return self.model(batch.input_ids, batch.positions, batch)

    def compute_logits(self, hidden: torch.Tensor, rows: torch.Tensor, extra: torch.Tensor | None = None) -> torch.Tensor | None:
        """Float32 logits of the given rows of hidden, then of the extra rows if any (on rank 0; the other
        ranks compute their vocabulary slices: the extra rows are sent to them)."""
        self._announce("logits", rows.cpu(), None if extra is None else extra.cpu())
        selected = hidden[rows]
        return self.model.compute_logits(selected if extra is None else torch.cat([selected, extra.to(selected.dtype)]))

    def _announce(self, op: str, *args) -> None:
        if self.followers is not None:
            self.followers.announce((op, self.name, *args))

    def _prompt_logprobs(self, chunks: list[ScheduledChunk], hidden: torch.Tensor, result: "ModelRunnerOutput") -> None:
        """Logprobs of the prompt tokens this step's chunks predict, for requests with prompt_logprobs.

        A chunk over positions [start, end) predicts the tokens at start + 1 .. end; those that are prompt
        tokens (index < num_prompt_tokens) are scored. The engine keeps each index once, so a recomputed
        (preempted) request adds nothing twice.
        """
        offset = 0
        jobs = []  # (chunk index, first hidden row, first prompt index predicted, count)
        for i, c in enumerate(chunks):
            k = c.sampling_params.prompt_logprobs
            count = min(c.start_pos + len(c.token_ids), len(c.prompt_token_ids) - 1) - c.start_pos
            if k is not None and count > 0:
                jobs.append((i, offset, c.start_pos + 1, count))
            offset += len(c.token_ids)
        if not jobs:
            return
        max_k = max(chunks[i].sampling_params.prompt_logprobs for i, *_ in jobs)
        rows = torch.from_numpy(np.concatenate([np.arange(r, r + n) for _, r, _, n in jobs])).to(self.device)
        targets = torch.tensor(
            [t for i, _, first, n in jobs for t in chunks[i].prompt_token_ids[first : first + n]], dtype=torch.int64, device=self.device
        )
        pieces = []
        for lo in range(0, len(rows), _PROMPT_LOGPROBS_ROWS):  # bounded [rows, vocab] logits at a time
            logits = self.compute_logits(hidden, rows[lo : lo + _PROMPT_LOGPROBS_ROWS])
            pieces.append(compute_logprobs(logits, targets[lo : lo + _PROMPT_LOGPROBS_ROWS], max_k))
        lp = LogprobsTensors(*(torch.cat([getattr(p, f) for p in pieces]) for f in ("token_logprobs", "ranks", "topk_ids", "topk_logprobs")))
        flat = _logprobs_lists(targets, lp, range(len(targets)))
        lo = 0
        for i, _, first, n in jobs:
            result.prompt_logprobs[i] = PromptLogprobsChunk(first_index=first, positions=flat[lo : lo + n])
            lo += n


def _slot(block_ids: list[int], position: int, block_size: int) -> int:
    return block_ids[position // block_size] * block_size + position % block_size


# Prompt positions whose logits are materialized at once for prompt_logprobs.
_PROMPT_LOGPROBS_ROWS = 512


def _logprobs_lists(token_ids: torch.Tensor, lp: LogprobsTensors, rows) -> list[PositionLogprobs]:
    """PositionLogprobs for the given rows, with one transfer to Python lists."""
    rows = list(rows)
    if not rows:
        return []
    index = torch.tensor(rows, dtype=torch.int64, device=token_ids.device)
    ids = torch.cat([token_ids[index, None], lp.topk_ids[index]], dim=1).tolist()
    values = torch.cat([lp.token_logprobs[index, None], lp.topk_logprobs[index]], dim=1).tolist()
    ranks = lp.ranks[index].tolist()
    return [PositionLogprobs(i, v, r) for i, v, r in zip(ids, values, ranks)]
